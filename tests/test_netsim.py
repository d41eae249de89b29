"""The network simulator (ringcoll.netsim): closed-form agreement, determinism, real results,
contention, errors, and the 1,024-rank ring's wall time.

The closed forms are ringcoll.algorithms.CostModel's (the docstrings' alpha-beta-gamma costs);
they hold where the simulator's model has no contention: one flat level, full bisection,
every block one message (NO_SEGMENTS).
"""

import time

import numpy as np
import pytest

from ringcoll.errors import CollectiveMismatchError, CollectiveTimeoutError
from ringcoll.netsim import (NO_SEGMENTS, Cluster, Simulator, expected_sum, formula, record,
                             record_rotated, replay)

ALPHA, BANDWIDTH, GAMMA = 5e-6, 10e9, 1e-10  # 5 us, 10 GB/s, reductions at 10 GB/s
FLAT_ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "bruck")


@pytest.fixture(scope="module")
def sim():
    return Simulator(segment_bytes=NO_SEGMENTS)


def flat(p):
    return Cluster.flat(p, ALPHA, BANDWIDTH, GAMMA)


@pytest.mark.parametrize("algorithm", FLAT_ALGORITHMS)
@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_matches_the_closed_form_without_contention(sim, algorithm, p):
    for nbytes in (8, 4 * 1001, 64 << 10, 1 << 20, 8 << 20):
        if algorithm == "recursive_doubling" and p == 3 and nbytes < 1 << 20:
            continue  # the fold's overlap: test_recursive_doubling_fold_overlaps_the_core
        predicted = sim.allreduce(flat(p), algorithm, nbytes).seconds
        closed = formula(flat(p), algorithm, nbytes)
        assert predicted == pytest.approx(closed, rel=0.05), (algorithm, p, nbytes)


@pytest.mark.parametrize("p", [3, 5, 6, 12])
def test_recursive_doubling_fold_overlaps_the_core(sim, p):
    """Where the closed form is off, and by how much: it adds the fold (2 messages) to the
    log2(p') exchanges, but a core rank that did not fold sends its first exchange at once,
    so for tiny messages the real schedule saves exactly one latency."""
    predicted = sim.allreduce(flat(p), "recursive_doubling", 8).seconds
    assert predicted == pytest.approx(formula(flat(p), "recursive_doubling", 8) - ALPHA,
                                      rel=0.01)


def test_segments_pipeline_the_ring(sim):
    """With 4 MiB segments a 64 MiB ring at p=4 overlaps reduction with transfer: faster than
    the (unsegmented) closed form, never slower than its bandwidth term."""
    cluster, nbytes = flat(4), 64 << 20
    segmented = Simulator().allreduce(cluster, "ring", nbytes).seconds
    whole = sim.allreduce(cluster, "ring", nbytes).seconds
    bandwidth_term = 2 * 3 / 4 * nbytes / BANDWIDTH
    assert bandwidth_term < segmented < 0.95 * whole


def test_deterministic_and_order_independent(sim):
    cluster = Cluster(nodes=4, devices_per_node=4)
    for algorithm in ("ring", "hierarchical", "rabenseifner"):
        a = Simulator().allreduce(cluster, algorithm, 3 << 20)
        b = Simulator().allreduce(cluster, algorithm, 3 << 20)
        assert a.finish == b.finish and a.messages == b.messages
    # the ring's ports each carry one sender, so replay may skip global time order: same answer
    fast = sim.allreduce(cluster, "ring", 1 << 20)
    timed = sim.allreduce(cluster, "ring", 1 << 20, ordered=True)
    assert not fast.ordered and timed.ordered and fast.finish == timed.finish
    # where some ports are shared, ranks run ahead of the heap up to their next shared send:
    # the same answer as booking every message in virtual-time order
    for algorithm in ("hierarchical", "rabenseifner", "recursive_doubling"):
        ahead = sim.allreduce(cluster, algorithm, 1 << 20)
        strict = sim.allreduce(cluster, algorithm, 1 << 20, ordered=True)
        assert ahead.finish == strict.finish, algorithm


@pytest.mark.parametrize("algorithm", [*FLAT_ALGORITHMS, "hierarchical"])
@pytest.mark.parametrize("nodes,devices", [(1, 3), (1, 5), (2, 3), (3, 2), (2, 4)])
def test_payload_results_are_correct_and_timed_the_same(algorithm, nodes, devices):
    """payload=True runs the same functions on threads with real data: every rank gets the
    exact sum, and the logs (so the predicted time) equal the payload-free run's."""
    cluster = Cluster(nodes=nodes, devices_per_node=devices)
    sim = Simulator(segment_bytes=1 << 10)  # several segments per block: the pipelined path
    count = 1001
    real = sim.allreduce(cluster, algorithm, 4 * count, payload=True)
    free = sim.allreduce(cluster, algorithm, 4 * count)
    want = expected_sum(count, cluster.size)
    for rank, got in enumerate(real.results):
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}")
    assert real.finish == free.finish and real.messages == free.messages


def test_scaled_payload_free_run_matches_the_exact_one():
    """Above max_elems the arrays shrink to a multiple of every partition and byte counts are
    scaled back up: the same prediction as running the full count."""
    cluster = Cluster(nodes=2, devices_per_node=3)
    nbytes = 4 * 6 * 5000
    for algorithm in ("ring", "rabenseifner", "hierarchical", "recursive_doubling"):
        exact = Simulator(max_elems=1 << 20).allreduce(cluster, algorithm, nbytes)
        scaled = Simulator(max_elems=600).allreduce(cluster, algorithm, nbytes)
        assert scaled.count < exact.count
        assert scaled.seconds == pytest.approx(exact.seconds, rel=1e-3), algorithm


def test_shared_nic_breaks_the_formula_where_rails_keep_it(sim):
    """4 nodes x 4 devices. With a NIC per device (rails) hierarchical's cross-node step has
    the links the formula assumes; with one NIC per node its 4 cross-node rings share it and
    the bandwidth term is ~4x the formula's. The flat ring crosses each NIC with one flow
    either way, so at large sizes it stays near its formula."""
    nbytes = 64 << 20
    rails = Cluster(nodes=4, devices_per_node=4, nics_per_node=4)
    shared = Cluster(nodes=4, devices_per_node=4, nics_per_node=1)
    assert sim.allreduce(rails, "hierarchical", nbytes).seconds == pytest.approx(
        formula(rails, "hierarchical", nbytes), rel=0.05)
    assert sim.allreduce(shared, "hierarchical", nbytes).seconds > 2.5 * formula(
        shared, "hierarchical", nbytes)
    assert sim.allreduce(shared, "ring", nbytes).seconds == pytest.approx(
        formula(shared, "ring", nbytes), rel=0.05)


@pytest.mark.parametrize("algorithm", ["ring", "bruck"])
@pytest.mark.parametrize("nodes,devices", [(1, 1), (1, 2), (1, 3), (1, 5), (1, 7), (2, 3),
                                           (3, 4), (2, 8)])
def test_recording_one_rank_predicts_what_recording_all_does(algorithm, nodes, devices):
    """The fast path (record rank 0 and a few check ranks, derive the rest by renaming peers)
    gives the full recording's prediction bit for bit, at p = 1 .. 16, counts that split
    evenly and counts that do not (the ring then records every rank), whole blocks and
    several segments per block."""
    cluster = Cluster(nodes=nodes, devices_per_node=devices)
    p = cluster.size
    for segment_bytes in (NO_SEGMENTS, 1 << 10):
        for count in (1, 7, 1001, 48 * 35, 1 << 20):
            fast = Simulator(segment_bytes=segment_bytes).allreduce(cluster, algorithm,
                                                                    4 * count)
            full = Simulator(segment_bytes=segment_bytes, symmetry=False).allreduce(
                cluster, algorithm, 4 * count)
            case = (segment_bytes, count)
            assert full.ranks_recorded == p, case
            assert fast.finish == full.finish and fast.messages == full.messages, case
            assert (fast.bytes_intra, fast.bytes_inter) == (full.bytes_intra,
                                                            full.bytes_inter), case
            even = algorithm == "bruck" or fast.count % p == 0
            assert fast.ranks_recorded == (min(p, 4) if even else p), case


def test_rotation_check_rejects_a_schedule_that_is_not_a_rotation():
    """record_rotated compares the ranks it records with what renaming rank 0's peers gives
    them: an exchange with rank r XOR 1 is not a rotation, so it says no; a shift along the
    ring is, and the derived logs are the ones recording every rank gives."""
    def pairs(t):
        buf = np.zeros(4, np.float32)
        t.sendrecv(buf, t.rank ^ 1, buf, t.rank ^ 1, 5)

    def shift(t):
        buf = np.zeros(4 + t.size, np.float32)
        t.sendrecv(buf, (t.rank + 1) % t.size, buf, (t.rank - 1) % t.size, 5)

    assert record_rotated(8, pairs) is None
    logs, peers, recorded = record_rotated(8, shift)
    assert recorded == 4 and peers == [{(r + 1) % 8} for r in range(8)]
    assert logs == [t.ops for t in record(8, shift)[0]]


def test_size_mismatch_and_deadlock_are_reported():
    cluster = Cluster.flat(2, ALPHA, BANDWIDTH)

    def mismatch(t):
        buf = np.zeros(4 + t.rank, np.float32)
        t.sendrecv(buf, 1 - t.rank, buf, 1 - t.rank, 99)

    logs, _ = record(2, mismatch)
    with pytest.raises(CollectiveMismatchError, match="20-byte receive for a 16-byte"):
        replay(cluster, [t.ops for t in logs])

    def both_receive_first(t):
        buf = np.zeros(4, np.float32)
        t.recv(buf, 1 - t.rank, 7)
        t.send(buf, 1 - t.rank, 7)

    logs, _ = record(2, both_receive_first)
    with pytest.raises(CollectiveTimeoutError, match="rank 0 waits for rank 1"):
        replay(cluster, [t.ops for t in logs])


def test_1024_rank_ring_wall_time():
    """SPEED CHECK (not a correctness test): a payload-free ring all-reduce on 128 x 8 = 1,024
    simulated ranks. It runs ring.allreduce itself on rank 0 and 3 check ranks, derives the
    other logs by renaming peers (the ring is rotation-symmetric), then replays 2 million
    messages. About 2 s on the 2-core development machine (docs/simulator.md); the bound
    leaves room for a loaded machine (recording every rank would add about 5 s). Its
    prediction is the bandwidth term 2 (p-1)/p n / B of the NIC plus a little latency: one
    flow per NIC, no contention."""
    cluster, nbytes = Cluster(nodes=128, devices_per_node=8), 256 << 20
    start = time.perf_counter()
    pred = Simulator().allreduce(cluster, "ring", nbytes)
    wall = time.perf_counter() - start
    print(f"\n1,024-rank ring all-reduce: {wall:.1f} s wall (record {pred.record_seconds:.1f} s, "
          f"replay {pred.replay_seconds:.1f} s), {pred.messages} messages")
    assert pred.messages == 2 * 1023 * 1024 and pred.ranks_recorded == 4
    bandwidth_term = 2 * 1023 / 1024 * nbytes / cluster.inter_bandwidth
    assert bandwidth_term < pred.seconds < 1.05 * bandwidth_term
    assert wall < 10, f"1,024-rank ring took {wall:.1f} s (target ~3 s)"
