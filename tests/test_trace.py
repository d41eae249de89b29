"""Traces: every collective's messages, checked against the schedule in its module docstring.

For every algorithm at p = 1..16 and awkward sizes, each rank's traced bytes and messages sent
and received must equal a closed form derived from the docstring's schedule and the block sizes
(Partition.even: the first n % p blocks get one more element). Also: tracing changes no result
bit, names the collective and its sequence number, and the replay fast path and the cached
hierarchical schedules are rebuilt on the right transport when tracing starts and stops.
With payloads, each message's copy and offset match the buffer the docstring says it is sent
from; events order each rank's sends and receives; the watch hook runs before each message.
"""

import math

import numpy as np
import pytest

import ringcoll
from ringcoll.arrays import Partition
from ringcoll.collectives.allgather import META
from ringcoll.collectives.allreduce import pick_inner
from ringcoll.runner import NO_REPLAY
from ringcoll.transport.trace import TracingTransport

TIMEOUT = 20
HEADER = 48  # the ring's neighbour check: 6 int64 (checks._header), one message to the right
PS = list(range(1, 17))
SEG = 24  # a small segment_bytes: 3 float64 per pipeline segment, so blocks split into several


def simulate(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.simulate(p, fn, **options)


def sizes(p):
    """n = 0, n < p, n divisible by p, n not divisible by p, and one odd size."""
    return sorted({0, max(p - 1, 1), 4 * p, 4 * p + 3, 37})


def even(n, p):
    base, extra = divmod(n, p)
    return [base + (1 if b < extra else 0) for b in range(p)]


def segs(count, seg_elems):
    """Pipeline segments of a block (ringcoll.arrays.segments): none for an empty block."""
    return -(-count // seg_elems)


class Cost:
    """What one rank sends and receives: bytes and messages."""

    def __init__(self, sent=0, recv=0, nsent=0, nrecv=0):
        self.sent, self.recv, self.nsent, self.nrecv = sent, recv, nsent, nrecv

    def __add__(self, other):
        return Cost(self.sent + other.sent, self.recv + other.recv, self.nsent + other.nsent,
                    self.nrecv + other.nrecv)

    def __eq__(self, other):
        return vars(self) == vars(other)

    def __repr__(self):
        return "Cost(sent={sent}, recv={recv}, nsent={nsent}, nrecv={nrecv})".format(**vars(self))


def traced(trace, rank):
    return Cost(trace.bytes_sent(rank), trace.bytes_received(rank),
                sum(m.src == rank for m in trace.messages),
                sum(r.dst == rank for r in trace.receives))


# -- closed forms, from each module's docstring ----------------------------------------------
# counts: the block sizes in elements; w: bytes per element; S: elements per pipeline segment.
def ring_reduce_scatter(counts, r, w, S):
    """Rank r sends every block but its own ((r-1) first, then each it reduced) and receives
    every block but (r-1)'s (it sends that one first): (n - c_r) and (n - c_{r-1}) elements."""
    p = len(counts)
    if p == 1:
        return Cost()
    out = [b for b in range(p) if b != r]
    into = [b for b in range(p) if b != (r - 1) % p]
    return Cost(sum(counts[b] for b in out) * w, sum(counts[b] for b in into) * w,
                sum(segs(counts[b], S) for b in out), sum(segs(counts[b], S) for b in into))


def ring_allgather(counts, r, w, S):
    """Rank r sends its block and each it receives but the last, block (r+1): (n - c_{r+1});
    receives every block but its own: (n - c_r)."""
    p = len(counts)
    if p == 1:
        return Cost()
    out = [b for b in range(p) if b != (r + 1) % p]
    into = [b for b in range(p) if b != r]
    return Cost(sum(counts[b] for b in out) * w, sum(counts[b] for b in into) * w,
                sum(segs(counts[b], S) for b in out), sum(segs(counts[b], S) for b in into))


def ring(p, n, r, w, S):
    """2n - c_r - c_{r+1} sent, 2n - c_{r-1} - c_r received: 2(p-1)/p n when p divides n."""
    counts = even(n, p)
    return ring_reduce_scatter(counts, r, w, S) + ring_allgather(counts, r, w, S)


def _fold(p, r, n, w):
    """(core p', rem, this rank's core number or -1, the fold's own Cost for this rank):
    an even rank below 2 rem sends n and receives the result n back; the odd one above it
    receives n and sends n back."""
    core = 1 << (p.bit_length() - 1)
    rem = p - core
    if r < 2 * rem:
        return core, rem, (r // 2 if r % 2 else -1), Cost(n * w, n * w, 1, 1)
    return core, rem, r - rem, Cost()


def recursive_doubling(p, n, r, w, S=None):
    """log2(p') exchanges of the whole buffer (n each way), plus the fold."""
    if p == 1:
        return Cost()
    core, _, me, cost = _fold(p, r, n, w)
    if me < 0:
        return cost
    steps = core.bit_length() - 1
    return cost + Cost(steps * n * w, steps * n * w, steps, steps)


def rabenseifner(p, n, r, w, S=None):
    """Core rank me, blocks C = even(n, p'): halving gives away every block but C_me and
    receives the aligned group of 2^k blocks around me at k = L-1 .. 0; doubling sends those
    groups back and receives n - C_me. Both ways sum_k C(group_k(me)) + n - C_me, which is
    2 (p'-1)/p' n when p' divides n. Plus the fold."""
    if p == 1:
        return Cost()
    core, _, me, cost = _fold(p, r, n, w)
    if me < 0:
        return cost
    C = even(n, core)
    steps = core.bit_length() - 1
    groups = sum(sum(C[me & ~((1 << k) - 1):(me & ~((1 << k) - 1)) + (1 << k)])
                 for k in range(steps))
    both = (n - C[me] + groups) * w
    return cost + Cost(both, both, 2 * steps, 2 * steps)


def bruck(p, n, r, w, S=None):
    """ceil(log2 p) steps moving min(d, p - have) buffers each: (p - 1) n both ways."""
    if p == 1:
        return Cost()
    steps = math.ceil(math.log2(p))
    return Cost((p - 1) * n * w, (p - 1) * n * w, steps, steps)


FLAT = {"ring": ring, "recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner,
        "bruck": bruck}


def hierarchical(p, n, r, w, S, k, inner):
    """Nodes of k consecutive ranks (the last smaller), L = the largest node, blocks
    even(n, L); local rank i of a node of kn owns blocks [i L / kn, (i+1) L / kn): its shard.
    The reduce-scatter and all-gather of the shards in the node go through the node tier's
    shared memory (no message: threads share one), and for each owned block b, `inner`
    all-reduce of block b among the N ranks owning b (group rank = node index)."""
    nodes = [list(range(s, min(s + k, p))) for s in range(0, p, k)]
    big = max(len(m) for m in nodes)
    part = even(n, big)
    j = r // k
    node = nodes[j]
    kn, i = len(node), node.index(r)
    owned = [(a * big // kn, (a + 1) * big // kn) for a in range(kn)]
    cost = Cost()
    for b in range(*owned[i]):
        cost = cost + FLAT[inner](len(nodes), part[b], j, w, S)
    return cost


def with_header(cost, p):
    """The ring and hierarchical all-reduce and the reduce-scatter first check the call with
    the right neighbour: one 48-byte sendrecv (none at p = 1)."""
    return cost + Cost(HEADER, HEADER, 1, 1) if p > 1 else cost


def check_costs(trace, p, expect, what):
    for r in range(p):
        got, want = traced(trace, r), expect(r)
        assert got == want, f"{what}, rank {r}: traced {got}, formula {want}"
    assert len(trace.messages) == sum(expect(r).nsent for r in range(p)), what
    assert len(trace.receives) == len(trace.messages), what
    check_matched(trace, what)


def check_matched(trace, what):
    """Every message has exactly one receive of its size, and it completed (t_end set)."""
    recvs = {(x.src, x.dst, x.tag, x.order): x for x in trace.receives}
    assert len(recvs) == len(trace.receives), what
    for m in trace.messages:
        rec = recvs.get((m.src, m.dst, m.tag, m.order))
        assert rec is not None and rec.nbytes == m.nbytes, f"{what}: {m} unmatched"
        assert m.t_end is not None and m.t_end >= m.t_start and rec.t_end == m.t_end, what


# -- all-reduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algorithm", list(FLAT))
def test_allreduce_flat(p, algorithm):
    segment = SEG if algorithm == "ring" and p % 2 else None  # segmented at odd p

    def body(comm):
        for n in sizes(p):
            comm.allreduce(np.ones(n), algorithm=algorithm)

    _, trace = simulate(p, body, segment_bytes=segment)
    S = (segment or ringcoll.config.DEFAULT_SEGMENT_BYTES) // 8
    assert [c[1:] for c in trace.collectives()] == [("allreduce", algorithm)] * len(
        trace.collectives())
    for seq, n in enumerate(sizes(p), start=1):
        part = trace.select(seq=seq)
        formula = FLAT[algorithm]

        def expect(r):
            cost = formula(p, n, r, 8, S)
            return with_header(cost, p) if algorithm == "ring" else cost

        check_costs(part, p, expect, f"{algorithm} p={p} n={n}")


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("local_size", [2, 3])
def test_allreduce_hierarchical(p, local_size):
    segment = SEG if p % 3 == 0 else None

    def body(comm):
        inner = []
        for n in sizes(p):
            comm.allreduce(np.ones(n, np.float32), algorithm="hierarchical")
            inner.append(pick_inner(comm._g, 4 * n))
        return inner

    results, trace = simulate(p, body, local_size=local_size, segment_bytes=segment)
    S = (segment or ringcoll.config.DEFAULT_SEGMENT_BYTES) // 4
    for seq, (n, inner) in enumerate(zip(sizes(p), results[0]), start=1):
        def expect(r):
            return with_header(hierarchical(p, n, r, 4, S, local_size, inner), p)

        check_costs(trace.select(seq=seq), p, expect,
                    f"hierarchical local_size={local_size} inner={inner} p={p} n={n}")


@pytest.mark.parametrize("inner", list(FLAT))
def test_hierarchical_every_inner(inner):
    """Each flat algorithm as the cross-node step (the cost model picks it by size)."""
    p, k, n = 10, 3, 41

    def body(comm):
        comm._g.choices.put(("inner", 8 * n), inner)  # what pick_inner would have cached
        comm.allreduce(np.ones(n), algorithm="hierarchical")

    _, trace = simulate(p, body, local_size=k)
    S = ringcoll.config.DEFAULT_SEGMENT_BYTES // 8
    check_costs(trace, p, lambda r: with_header(hierarchical(p, n, r, 8, S, k, inner), p),
                f"hierarchical inner={inner}")
    assert any("sub-group 2" in m.tag for m in trace.messages)


def test_docstring_formulas_in_the_even_case():
    """The closed forms reduce to the docstrings' costs when p (or p') divides n."""
    for p in PS[1:]:
        core = 1 << (p.bit_length() - 1)
        n = 4 * p * core
        for r in range(p):
            assert ring(p, n, r, 1, 1 << 30).sent == 2 * (p - 1) * n // p
            if p == core:
                assert recursive_doubling(p, n, r, 1).sent == int(math.log2(p)) * n
                assert rabenseifner(p, n, r, 1).sent == 2 * (p - 1) * n // p
            assert bruck(p, n, r, 1).sent == (p - 1) * n


# -- step numbers follow the docstrings' schedules -------------------------------------------
def test_steps_follow_the_schedules():
    p, n = 8, 16

    def body(comm):
        for algorithm in ("ring", "recursive_doubling", "bruck"):
            comm.allreduce(np.ones(n), algorithm=algorithm)

    _, trace = simulate(p, body)
    steps = trace.by_step()
    blocks = even(n, p)
    for (seq, tag, step), msgs in steps.items():
        assert sorted(m.src for m in msgs) == list(range(p))
        for m in msgs:
            r = m.src
            if tag == "ring_reduce_scatter":  # step s: block (r - s - 1) to r + 1
                assert (m.dst, m.nbytes) == ((r + 1) % p, 8 * blocks[(r - step - 1) % p])
            elif tag == "ring_allgather":  # step s: block (r - s) to r + 1
                assert (m.dst, m.nbytes) == ((r + 1) % p, 8 * blocks[(r - step) % p])
            elif tag == "rd_exchange":  # step k: the whole buffer with r XOR 2^k
                assert (m.dst, m.nbytes) == (r ^ (1 << step), 8 * n)
            elif tag == "bruck":  # step k: 2^k buffers to r - 2^k
                assert (m.dst, m.nbytes) == ((r - (1 << step)) % p, 8 * n << step)
    assert [key[1:] for key in steps if key[0] == 2] == [("rd_exchange", k) for k in range(3)]
    assert [key[1:] for key in steps if key[0] == 1] == (
        [("header", 0)] + [("ring_reduce_scatter", s) for s in range(p - 1)]
        + [("ring_allgather", s) for s in range(p - 1)])


# -- the other collectives ----------------------------------------------------------------------
def children(v, p):
    """Binomial tree (tree.py): v's children are v + 2^j for 2^j below v's lowest set bit."""
    low = v & -v if v else 1 << p.bit_length()
    return [v + (1 << j) for j in range(p.bit_length()) if (1 << j) < low and v + (1 << j) < p]


@pytest.mark.parametrize("p", PS)
def test_other_collectives(p):
    cols, w = 3, 8
    root = p // 2
    rows = [(3 * r + 1) % 4 for r in range(p)]  # allgather: 0..3 rows, different per rank
    S = SEG // w

    def body(comm):
        r = comm.rank
        comm.reduce_scatter(np.ones((2 * p + 1, cols)))  # seq 1
        comm.allgather(np.full((rows[r], cols), r, dtype=np.float64))  # seq 2
        comm.broadcast(np.ones(5 * cols), root=root)  # seq 3
        comm.reduce(np.ones(5 * cols), root=root)  # seq 4
        comm.alltoall(np.ones((2 * p, cols)))  # seq 5
        comm.barrier()  # seq 6
        comm.broadcast(np.ones(0))  # seq 7: empty messages still go

    _, trace = simulate(p, body, segment_bytes=SEG)
    assert [c[:2] for c in trace.collectives()] == (
        [] if p == 1 else [(1, "reduce_scatter"), (2, "allgather"), (3, "broadcast"),
                           (4, "reduce"), (5, "alltoall"), (6, "barrier"), (7, "broadcast")])

    rs = even(2 * p + 1, p)
    check_costs(trace.select(seq=1), p, lambda r: with_header(
        ring_reduce_scatter([c * cols for c in rs], r, w, S), p), f"reduce_scatter p={p}")

    # allgather: first every rank's META int64 of metadata (row counts...), then the rows
    check_costs(trace.select(seq=2), p, lambda r: (
        ring_allgather([META] * p, r, 8, S) + ring_allgather([c * cols for c in rows], r, w, S)),
        f"allgather p={p}")

    def tree(r, n, up, root=root):
        v = (r - root) % p
        kids = len(children(v, p))
        parent = 1 if v else 0
        sent, recv = (parent, kids) if up else (kids, parent)
        return Cost(sent * n * w, recv * n * w, sent, recv)

    check_costs(trace.select(seq=3), p, lambda r: tree(r, 5 * cols, False), f"broadcast p={p}")
    check_costs(trace.select(seq=4), p, lambda r: tree(r, 5 * cols, True), f"reduce p={p}")
    assert len(trace.select(seq=3)) == p - 1

    block = 2 * cols * w  # every rank exchanges one block with every other: (p-1)/p n each way
    check_costs(trace.select(seq=5), p,
                lambda r: Cost((p - 1) * block, (p - 1) * block, p - 1, p - 1),
                f"alltoall p={p}")

    rounds = math.ceil(math.log2(p)) if p > 1 else 0  # dissemination: a 1-byte token per round
    check_costs(trace.select(seq=6), p, lambda r: Cost(rounds, rounds, rounds, rounds),
                f"barrier p={p}")
    check_costs(trace.select(seq=7), p, lambda r: tree(r, 0, False, 0), f"empty broadcast p={p}")


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_debug_fingerprints(p):
    """Debug mode's Bruck all-gather of 256-byte fingerprints: (p-1) records in
    ceil(log2 p) messages per rank, before the collective's own messages."""

    def body(comm):
        comm.allreduce(np.ones(4), algorithm="recursive_doubling")

    _, trace = simulate(p, body, debug=True)
    prints = trace.select(tag="fingerprint")
    steps = math.ceil(math.log2(p))
    check_costs(prints, p, lambda r: Cost(256 * (p - 1), 256 * (p - 1), steps, steps),
                f"fingerprints p={p}")
    check_costs(trace.select(tag=lambda t: t != "fingerprint"), p,
                lambda r: recursive_doubling(p, 4, r, 8), f"rd after fingerprints p={p}")
    assert all(m.index < steps for m in prints.messages)


# -- tracing changes nothing ------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", list(FLAT) + ["hierarchical", "auto"])
def test_tracing_changes_no_bit(algorithm):
    p, n = 6, 1001

    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        y = np.empty_like(x)
        comm.allreduce(x, algorithm=algorithm, out=y)
        return [comm.allreduce(x, algorithm=algorithm), comm.allreduce(x, op="max",
                                                                       algorithm=algorithm),
                y, comm.allreduce(x, algorithm=algorithm, out=y).copy()]

    plain = ringcoll.run_threads(p, body, local_size=4, timeout=TIMEOUT)
    traced_results, trace = simulate(p, body, local_size=4)
    for a, b in zip(plain, traced_results):
        for u, v in zip(a, b):
            assert u.tobytes() == v.tobytes()
    assert len(trace) > 0


def test_collective_names_and_seq():
    def body(comm):
        comm.barrier()
        comm.allreduce(np.ones(3), algorithm="recursive_doubling")
        with comm.trace() as t:
            comm.allreduce(np.ones(3), algorithm="rabenseifner")
            comm.broadcast(np.ones(3))
            req = comm.iallreduce(np.ones(3), algorithm="bruck")
            req.wait()
        return t

    traces = ringcoll.run_threads(4, body, timeout=TIMEOUT)
    for rank, t in enumerate(traces):
        assert t.collectives() == [(3, "allreduce", "rabenseifner"), (4, "broadcast", "tree"),
                                   (5, "allreduce", "bruck")]
        assert all(m.src == rank for m in t.messages)  # a rank's own trace: its own sends
        assert all(x.dst == rank for x in t.receives)


def test_gather_collects_every_rank():
    p, n = 5, 23

    def body(comm):
        with comm.trace() as t:
            comm.allreduce(np.ones(n), algorithm="ring")
            comm.alltoall(np.ones(2 * p))
        return t.gather(comm)

    gathered = ringcoll.run_threads(p, body, timeout=TIMEOUT)
    _, shared = simulate(p, lambda comm: (comm.allreduce(np.ones(n), algorithm="ring"),
                                          comm.alltoall(np.ones(2 * p))))
    for t in gathered:
        assert len(t) == len(shared) and len(t.receives) == len(shared.receives)
        for r in range(p):
            assert traced(t, r) == traced(shared, r)
        check_matched(t, "gathered")  # t_end comes from the receiver's own record


# -- the transport swap: replay plans and cached schedules ---------------------------------------
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "bruck",
                                       "hierarchical"])
def test_replay_and_cached_schedules_across_trace(algorithm):
    p, n = 4, 12

    def body(comm):
        x = np.arange(n, dtype=np.float64) + comm.rank
        y = np.empty_like(x)
        original = comm._g.t
        comm.allreduce(x, algorithm=algorithm, out=y)  # builds the replay plan (and views)
        comm.allreduce(x, algorithm=algorithm, out=y)  # replays it
        assert comm._runner._replay is not NO_REPLAY
        with comm.trace() as t:
            assert isinstance(comm._g.t, TracingTransport) and comm._runner._replay is NO_REPLAY
            comm.allreduce(x, algorithm=algorithm, out=y)  # built anew on the tracer
            first = len(t)
            comm.allreduce(x, algorithm=algorithm, out=y)  # replayed, and traced
            assert len(t) == 2 * first > 0
        assert comm._g.t is original and comm._runner._replay is NO_REPLAY
        y[...] = 0
        comm.allreduce(x, algorithm=algorithm, out=y)  # after: built on the real transport
        comm.allreduce(x, algorithm=algorithm, out=y)  # replayed, not traced
        assert len(t) == 2 * first
        assert t.collectives() == [(3, "allreduce", algorithm), (4, "allreduce", algorithm)]
        return y

    for y in ringcoll.run_threads(p, body, local_size=2, timeout=TIMEOUT):
        np.testing.assert_array_equal(y, p * np.arange(n) + p * (p - 1) / 2)


def test_error_inside_trace_restores_the_transport():
    def body(comm):
        original = comm._g.t
        with pytest.raises(ValueError):
            with comm.trace():
                raise ValueError("on purpose")
        assert comm._g.t is original
        return comm.allreduce(np.ones(2))

    [y] = ringcoll.run_threads(1, body, timeout=TIMEOUT)
    np.testing.assert_array_equal(y, [1, 1])


def test_split_inside_trace_is_not_traced():
    def body(comm):
        with comm.trace() as t:
            sub = comm.split(comm.rank % 2)
            comm.allreduce(np.ones(2), algorithm="recursive_doubling")
        sub.allreduce(np.ones(2), algorithm="recursive_doubling")
        return t

    for t in ringcoll.run_threads(4, body, timeout=TIMEOUT):
        assert {c[1] for c in t.collectives()} == {"allreduce"} and len(t) == 2


def test_summary_and_readme_example():
    results, trace = ringcoll.simulate(4, lambda c: c.allreduce(np.arange(8.0),
                                                                algorithm="ring"))
    np.testing.assert_array_equal(results[0], 4 * np.arange(8.0))
    assert [trace.bytes_sent(r) for r in range(4)] == [144] * 4
    assert trace.summary().splitlines()[1].split() == ["0", "7", "144", "7", "144"]


# -- payloads, addresses, the event order and the watch hook ---------------------------------
def test_payloads_and_offsets():
    """Each message keeps a copy of what it carried and says where it came from: the ring's
    first reduce-scatter block from x (docstring: rank r sends block (r - 1) % p first), every
    later block from out, where the ring reduces; Rabenseifner's second halving from scratch."""
    p, n = 4, 10
    part = Partition.even(n, p)
    xs = [np.arange(n, dtype=np.int64) + 100 * r for r in range(p)]
    outs = [np.full(n, -1, dtype=np.int64) for _ in range(p)]

    def body(comm):
        return comm.allreduce(xs[comm.rank], algorithm="ring", out=outs[comm.rank])

    _, trace = simulate(p, body, payloads=True)
    for r in range(p):
        mine = sorted(trace.select(src=r, tag="ring_reduce_scatter"), key=lambda m: m.index)
        first = part.slices[(r - 1) % p]
        assert mine[0].offset_in(xs[r]) == first.start and mine[0].offset_in(outs[r]) is None
        np.testing.assert_array_equal(mine[0].payload, xs[r][first])
        for s, m in enumerate(mine[1:], start=1):  # block (r - s - 1) % p, reduced into out
            block = part.slices[(r - s - 1) % p]
            assert m.offset_in(outs[r]) == block.start and m.offset_in(xs[r]) is None
            assert m.payload.dtype == np.int64 and m.payload.size == block.stop - block.start
        got = [x for x in trace.receives if x.dst == r and x.tag == "ring_reduce_scatter"]
        assert [x.offset_in(outs[r]) for x in got] == [  # received straight into out
            part.starts[(r - s - 2) % p] for s in range(p - 1)]
    final = [m for m in trace.messages if m.tag == "ring_allgather"]
    assert all(np.array_equal(m.payload, sum(xs)[m.offset_in(outs[m.src]):][:m.payload.size])
               for m in final)  # the all-gather passes finished sums

    _, rab = simulate(p, lambda comm: comm.allreduce(xs[comm.rank], algorithm="rabenseifner",
                                                     out=outs[comm.rank]), payloads=True)
    second = [m for m in rab.messages if m.tag == "rab_halving" and m.step == 1]
    assert len(second) == p
    assert all(m.offset_in(xs[m.src]) is None and m.offset_in(outs[m.src]) is None
               for m in second)  # from the scratch buffer the first halving reduced into


def test_without_payloads_nothing_is_copied():
    _, trace = simulate(3, lambda comm: comm.allreduce(np.ones(4), algorithm="ring"))
    assert all(m.payload is None and m.address is None and m.seen is None for m in trace)
    assert trace.messages[0].offset_in(np.ones(4)) is None


def test_events_order_each_rank():
    """event numbers a rank's sends and receive completions 0, 1, 2, ... per collective; in a
    ring each send comes before the receive of the same step (sendrecv-like)."""
    p = 5

    def body(comm):
        comm.allreduce(np.ones(7), algorithm="ring")
        comm.allreduce(np.ones(7), algorithm="recursive_doubling")

    _, trace = simulate(p, body)
    for seq in (1, 2):
        for r in range(p):
            sends = [m.event for m in trace.messages if m.src == r and m.seq == seq]
            recvs = [x.event for x in trace.receives if x.dst == r and x.seq == seq]
            assert sorted(sends + recvs) == list(range(len(sends) + len(recvs)))
    ring = sorted((m for m in trace.messages if m.seq == 1 and m.src == 0), key=lambda m: m.index)
    got = sorted((x for x in trace.receives if x.seq == 1 and x.dst == 0), key=lambda x: x.event)
    assert [m.event for m in ring] == [2 * i for i in range(len(ring))]
    assert [x.event for x in got] == [2 * i + 1 for i in range(len(got))]


def test_watch_sees_each_buffer_before_the_transport():
    """watch(rank, buf, sending) runs before each send and receive: a receive's buffer is seen
    before the data lands in it."""
    p, n = 3, 6
    outs = [np.full(n, -1.0) for _ in range(p)]
    calls = [[] for _ in range(p)]

    def watch(rank, buf, sending):
        calls[rank].append(sending)
        return buf.copy()

    _, trace = simulate(p, lambda comm: comm.allreduce(np.ones(n), algorithm="ring",
                                                       out=outs[comm.rank]),
                        payloads=True, watch=watch)
    for m in trace:
        np.testing.assert_array_equal(m.seen, m.payload)
    first = [x for x in trace.receives if x.tag == "ring_reduce_scatter" and x.order == 0]
    assert len(first) == p and all((x.seen == -1).all() for x in first)  # out, before it lands
    assert [(c.count(True), c.count(False)) for c in calls] == [
        (len(trace.select(src=r)), len(trace.select(dst=r))) for r in range(p)]


def test_comm_trace_payloads_and_gather():
    p = 3

    def body(comm):
        x = np.arange(4.0) + comm.rank
        with comm.trace(payloads=True) as t:
            comm.allreduce(x, algorithm="recursive_doubling")
        with pytest.raises(ringcoll.InvalidArgumentError, match="Trace\\(payloads=True\\)"):
            with comm.trace(ringcoll.Trace(), payloads=True):
                pass
        return t.gather(comm)

    for t in ringcoll.run_threads(p, body, timeout=TIMEOUT):
        assert len(t) == 4  # fold, one exchange each way, unfold
        fold = next(m for m in t if m.tag == "rd_fold")
        np.testing.assert_array_equal(fold.payload, np.arange(4.0))  # rank 0's x
