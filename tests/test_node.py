"""The node tier (algorithms/node.py) on the thread transport, and under mpiexec.

The tier's all-reduce also runs the whole thread grid of tests/test_threads.py (algorithm
"node" in its CONFIGS) and every allreduce check of tests/mpi_checks.py (ALLREDUCE_NAMES); here
are what only the tier has: its chunk geometry, many chunks per call, reduce-scatter and
all-gather through it, registered buffers (alone and mixed with ordinary arrays on other
ranks), the header check, a dead or missing peer, the fallback where there is no shared memory,
hierarchical's intra-node stage going through it, and DistributedOptimizer's buckets in it.
"""

import os

import numpy as np
import pytest

import ringcoll
from ringcoll.algorithms import node
from ringcoll.arrays import Partition, Workspace
from ringcoll.ops import get_op
from ringcoll.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerFailedError
from ringcoll.transport.base import NoSharedMemory, Tag
from ringcoll.transport import threads
from ringcoll.transport.device import StagedTransport
from ringcoll.transport.threads import ThreadTransport, ThreadWorld

import _mpirun as mpirun
import _oracle as O
from _fake_device import FakeDevice

TIMEOUT = 20
COMBINE = get_op("sum").bind(np.float64)
PS = [1, 2, 3, 4, 5, 8, 16]


def run(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.run_threads(p, fn, **options)


def inputs(seed, p, n, dtype):
    return [O.make_input(seed, r, (n,), np.dtype(dtype), "sum") for r in range(p)]


# -- the schedule ------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [[0], [0, 0, 0], [1, 0], [5, 5, 4], [7, 0, 3, 1],
                                    [1000, 1, 0, 999, 17], [123457] * 3])
@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_chunks_cover_every_block_once_and_fit_a_slot(counts, chunk):
    part, p, item = Partition(counts), len(counts), 8
    plan = node.chunks(part, item, chunk, p)
    assert len(plan) >= 1
    covered = [[] for _ in range(p)]
    for row in plan:
        assert len(row) == p
        offsets = [off for _, _, off in row]
        assert offsets == sorted(offsets) and offsets[0] == 0  # back to back, in rank order
        used = sum(count for _, count, _ in row) * item
        assert used <= chunk + 64 * p  # what Tier allocates per slot
        for q, (start, count, off) in enumerate(row):
            covered[q].append((start, count))
    for q in range(p):  # block q, piece by piece, in order, nothing twice, nothing missing
        pos = part.starts[q]
        for start, count in covered[q]:
            assert start == pos
            pos += count
        assert pos == part.starts[q + 1]


# -- the collectives on threads --------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("p", PS)
def test_allreduce_reduce_scatter_allgather(p, chunk):
    counts = sorted({0, 1, max(p - 1, 0), p + 1, 1001, 30011})
    dtypes = [np.int32, np.float64, np.float16]

    def fn(comm):
        out = []
        for i, (n, dt) in enumerate((n, dt) for n in counts for dt in dtypes):
            x = inputs(100 + i, p, n, dt)[comm.rank]
            out.append(comm.allreduce(x, algorithm="node"))
            y = x.copy()
            out.append(comm.allreduce(y, algorithm="node", out=y))
            out.append(comm.reduce_scatter(x, algorithm="node"))
            out.append(comm.allgather(x[:(n + comm.rank) % 11], algorithm="node"))
        return out

    results = run(p, fn, node_chunk=chunk)
    k = 0
    for i, (n, dt) in enumerate((n, dt) for n in counts for dt in dtypes):
        xs = inputs(100 + i, p, n, dt)
        full = O.reduce_oracle(xs, "sum", np.dtype(dt))
        gathered = np.concatenate([xs[r][:(n + r) % 11] for r in range(p)])
        for r in range(p):
            label = f"p={p} n={n} {np.dtype(dt)} rank {r}"
            for j, want in enumerate((full, full, np.array_split(full, p)[r], gathered)):
                got = results[r][k + j]
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                    (label, ["allreduce", "allreduce in place", "reduce_scatter",
                             "allgather"][j])
        for j in (0, 1):
            assert O.identical([results[r][k + j] for r in range(p)]) is None
        k += 4


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_reduce_scatter_uneven_counts_and_avg(p):
    n = 3 * p + 2
    counts = [n - 2 * (p - 1)] + [2] * (p - 1)

    def fn(comm):
        x = np.arange(n, dtype=np.float64) + comm.rank
        return (comm.reduce_scatter(x, algorithm="node", counts=counts),
                comm.reduce_scatter(x, op="avg", algorithm="node"))

    starts = np.cumsum([0] + counts)
    full = sum(np.arange(n, dtype=np.float64) + r for r in range(p))
    for r, (uneven, avg) in enumerate(run(p, fn, node_chunk=64)):
        assert uneven.tolist() == full[starts[r]:starts[r + 1]].tolist()
        assert np.allclose(avg, np.array_split(full / p, p)[r])


STRUCT = np.dtype([("a", np.int8), ("b", np.float64)], align=True)  # 7 bytes of padding


@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("p", PS)
def test_broadcast_every_root_any_dtype_bitwise(p, chunk):
    """Every root, sizes 0 .. many chunks, any dtype (a struct's padding and a NaN's payload
    arrive as they were: the tier moves bytes), and a root whose array is registered."""
    shapes = [(0,), (1,), (p + 1,), (3, 5), (), (20011,)]
    dtypes = [np.float64, np.int8, np.complex64, STRUCT, np.bool_, np.float16]

    def fn(comm):
        out = []
        for root in range(p):
            for i, shape in enumerate(shapes):
                dtype = dtypes[(root + i) % len(dtypes)]
                want = O.make_bytes(10 * root + i, root, shape, dtype)
                # made twice, not copied: NumPy's copy of a struct drops its padding bytes
                x = (O.make_bytes(10 * root + i, root, shape, dtype) if comm.rank == root
                     else np.zeros(shape, dtype))
                y = comm.broadcast(x, root=root, algorithm="node")
                out.append(y is x and x.tobytes() == want.tobytes())
            g = comm.shared_array(4099, np.int64)  # registered: the peers read it in place
            g[...] = np.arange(4099) * (root + 1) if comm.rank == root else -1
            comm.broadcast(g, root=root, algorithm="node")
            out.append(np.array_equal(g, np.arange(4099) * (root + 1)))
            comm.release(g)
        return out

    for r, ok in enumerate(run(p, fn, node_chunk=chunk)):
        assert all(ok), (r, [i for i, good in enumerate(ok) if not good])


def test_broadcast_mismatch_raises_on_every_rank_and_the_tier_goes_on():
    def fn(comm):
        got = []
        for bad in ({"root": comm.rank == 1}, {"n": 5 + (comm.rank == 2)}):
            x = np.zeros(bad.get("n", 5))
            with pytest.raises(CollectiveMismatchError, match=r"broadcast \(node tier\)"):
                comm.broadcast(x, root=int(bad.get("root", 0)), algorithm="node")
            y = np.full(9, float(comm.rank))
            got.append(comm.broadcast(y, root=2, algorithm="node").tolist() == [2.0] * 9)
        return all(got)

    assert all(run(3, fn, node_chunk=64))


# -- registered buffers ------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 512])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 16])
def test_registered_buffers_alone_and_mixed(p, chunk):
    sizes = [0, 1, p + 1, 5000]

    def fn(comm):
        out = []
        for i, n in enumerate(sizes):
            g = comm.shared_array(n, np.int64)
            assert comm.is_shared(g) == (p > 1) and g.shape == (n,) and not g.any()
            want = sum(np.arange(n, dtype=np.int64) * (r + 1) for r in range(p))
            for rep in range(3):  # repeated calls: the tier's counters move on
                g[...] = np.arange(n) * (comm.rank + 1)
                comm.allreduce(g, algorithm="node", out=g)
                out.append(np.array_equal(g, want))
                # even ranks pass the registered array, odd ones an ordinary one
                h = g if comm.rank % 2 == 0 else np.empty(n, np.int64)
                h[...] = np.arange(n) * (comm.rank + 1)
                comm.allreduce(h, algorithm="node", out=h)
                out.append(np.array_equal(h, want))
            comm.release(g)
            assert not comm.is_shared(np.zeros(3))
        return out

    for r, ok in enumerate(run(p, fn, node_chunk=chunk)):
        assert all(ok), (r, ok)


def test_shared_array_shapes_dtypes_and_the_registration_limit():
    def fn(comm):
        a = comm.shared_array((3, 4), "float32")
        assert a.shape == (3, 4) and a.dtype == np.float32 and comm.is_shared(a)
        assert comm.is_shared(a[1:])  # a view of a registered buffer is in it too
        live = [comm.shared_array(8) for _ in range(node.MAX_REGISTERED - 1)]
        beyond = comm.shared_array(8)  # the limit: an ordinary array, on every rank alike
        assert not comm.is_shared(beyond) and beyond.shape == (8,)
        comm.release(live[0])
        again = comm.shared_array(8)
        assert comm.is_shared(again)
        with pytest.raises(ringcoll.InvalidArgumentError, match="negative"):
            comm.shared_array((2, -1))
        return True

    assert all(run(3, fn))


def test_release_of_different_registrations_raises_on_every_rank():
    def fn(comm):
        a, b = comm.shared_array(4), comm.shared_array(4)
        with pytest.raises(ringcoll.InvalidArgumentError, match="different registrations"):
            comm.release(a if comm.rank == 0 else b)
        comm.release(a)  # the tier and the communicator are still fine
        x = np.full(3, comm.rank, np.int64)
        return comm.allreduce(x, algorithm="node").tolist()

    assert run(2, fn) == [[1, 1, 1]] * 2


# -- errors ------------------------------------------------------------------------------------
def test_count_mismatch_raises_on_every_rank_and_the_tier_goes_on():
    def fn(comm):
        x = np.ones(10 + (comm.rank == 1), np.float64)
        with pytest.raises(CollectiveMismatchError, match=r"node tier.*rank\(s\) \[1\]"):
            comm.allreduce(x, algorithm="node")
        ok = [comm.allreduce(np.full(7, 1.0), algorithm="node").tolist() == [3.0] * 7
              for _ in range(3)]  # slots of both parities, after the failed call
        return all(ok)

    assert all(run(3, fn))


def test_a_rank_that_fails_releases_the_others():
    def fn(comm):
        x = np.ones(1000)
        comm.allreduce(x, algorithm="node")
        if comm.rank == 2:
            raise RuntimeError("rank 2 gives up")
        comm.allreduce(x, algorithm="node")

    with pytest.raises(RuntimeError, match="rank 2 gives up"):
        run(4, fn)


def test_a_rank_that_never_comes_times_out_naming_the_tier():
    seen = []

    def fn(comm):
        comm.allreduce(np.ones(4), algorithm="node")
        if comm.rank != 1:
            try:
                comm.allreduce(np.ones(4), algorithm="node")
            except (CollectiveTimeoutError, PeerFailedError) as exc:
                seen.append(exc)
                raise

    with pytest.raises((CollectiveTimeoutError, PeerFailedError)):
        run(3, fn, timeout=1.0)
    assert seen and any(isinstance(e, CollectiveTimeoutError) and "node tier" in str(e)
                        for e in seen), seen


def test_flags_wait_names_the_peer_in_progress():
    world = ThreadWorld(2, timeout=0.3)
    t = world.transports()[0]
    flags_box = {}

    import threading

    def other():
        flags_box[1] = world.transports()[1].flags(4)

    th = threading.Thread(target=other)
    th.start()
    flags = t.flags(4)
    th.join()
    t.progress.begin("allreduce", "node")
    with pytest.raises(CollectiveTimeoutError):
        flags.wait(1, 0, 1)
    assert t.progress.at == (1, Tag.NODE)
    assert "step 1: rank 1 (node)" in t.progress.waiting()


# -- where there is no shared memory: the ring --------------------------------------------------
class _NoShared(ThreadTransport):
    def shared(self, nbytes, members=None):
        raise NoSharedMemory("this test's transport has none")


def test_no_shared_memory_falls_back_to_the_ring():
    world = ThreadWorld(3, timeout=TIMEOUT)
    transports = [_NoShared(world, r) for r in range(3)]
    results = [None] * 3

    def body(t):
        comm = ringcoll.Communicator(transport=t)
        x = np.arange(10, dtype=np.int64) * (t.rank + 1)
        results[t.rank] = (comm.allreduce(x, algorithm="node").tolist(),
                           comm.reduce_scatter(x, algorithm="node").tolist(),
                           comm.allgather(x[:2], algorithm="node").tolist(),
                           comm.is_shared(comm.shared_array(4)))

    import threading

    threads = [threading.Thread(target=body, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    full = (np.arange(10) * 6).tolist()
    for r in range(3):
        assert results[r][0] == full
        assert results[r][1] == np.array_split(np.array(full), 3)[r].tolist()
        assert results[r][2] == [0, 1, 0, 2, 0, 3]
        assert results[r][3] is False


def test_auto_picks_the_tier_only_on_one_node():
    def fn(comm):
        model = ringcoll.CostModel(alpha=1e-6, beta=1e-9, gamma=0.0)  # bytes dominate
        return (model.choose_allreduce(64 << 20, comm.size, comm.nodes, tier=True),
                model.choose_allreduce(64 << 20, comm.size, [[0], [1, 2, 3]], tier=True),
                model.choose_allreduce(64 << 20, comm.size, comm.nodes, tier=False))

    one, several, without = run(4, fn)[0]
    assert one == "node" and several != "node" and without != "node"


# -- hierarchical's intra-node stage ------------------------------------------------------------
@pytest.mark.parametrize("p,local", [(4, 2), (6, 3), (5, 2)])
def test_hierarchical_intra_node_stage_sends_no_messages(p, local):
    def fn(comm):
        x = np.arange(5000, dtype=np.int64) + comm.rank
        comm.allreduce(x, algorithm="hierarchical")  # makes the node tiers
        with comm.trace() as trace:
            y = comm.allreduce(x, algorithm="hierarchical")
        node_of = {r: i for i, m in enumerate(comm.nodes) for r in m}
        intra = [m for m in trace.messages if node_of[m.src] == node_of[m.dst]
                 and m.tag.startswith(("ring_reduce_scatter", "ring_allgather"))]
        return y.tolist(), len(intra), len(trace.messages)

    want = sum(np.arange(5000) + r for r in range(p)).tolist()
    for y, intra, total in run(p, fn, local_size=local):
        assert y == want
        assert intra == 0, f"{intra} ring messages inside a node"


# -- DistributedOptimizer's buckets --------------------------------------------------------------
def test_distributed_optimizer_buckets_are_registered_and_average():
    from ringcoll.optim import SGD

    def fn(comm):
        params = {"w": np.zeros(1000), "b": np.zeros(10)}
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=1.0), comm, bucket_bytes=4096)
        assert all(comm.is_shared(b.buf) for b in opt.buckets)
        for step in range(3):
            opt.step({"w": np.full(1000, float(comm.rank + step)),
                      "b": np.full(10, 2.0 * comm.rank)})
        return params["w"].copy(), params["b"].copy()

    out = run(3, fn)
    for w, b in out:  # lr 1: w = -(sum over steps of the rank-mean of rank + step)
        assert np.array_equal(w, np.full(1000, -(1.0 + 2.0 + 3.0)))
        assert np.array_equal(b, np.full(10, -3 * 2.0))
        assert w.tobytes() == out[0][0].tobytes()


# -- under mpiexec ------------------------------------------------------------------------------
# -- device memory on tests/_fake_device.py ----------------------------------------------------
def _on_fake_devices(p, fn, chunk, fence_flushes=True):
    """fn(t, ws, dev) on p thread ranks, each with a fake device whose memory the tier maps
    by pointer (one process, as NCCL's ranks in one process); returns the ranks' results."""
    devices = []
    for r in range(p):
        dev = FakeDevice(seed=r, prefix=f"rcnode_t{os.getpid()}")
        if not fence_flushes:  # a fence that no longer waits for the stream: what it guards
            dev.fence = lambda d=dev: None
        devices.append(dev)

    def body(t):
        dev = devices[t.rank]
        s = StagedTransport(t, dev, chunk_bytes=64)
        ws = Workspace(1 << 20, node_chunk=chunk, device=True)
        try:
            return fn(s, ws, dev)
        finally:
            ws.close_resident()
            dev.flush()

    results = threads.run(p, body, timeout=TIMEOUT)
    for dev in devices:
        assert dev.live() == ([], []), dev.live()
    return results


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("chunk", [64, 4096])
def test_tier_on_device_memory_whose_kernels_run_late(p, chunk):
    """The tier over the fake's device memory, where a write or a reduction runs only when
    the stream is synchronised (a GPU's order): every kind of call right on every rank, so
    every write is fenced before the counter that announces it and every read before the
    counter that frees the slot it read."""
    def body(t, ws, dev):
        out = {}
        for n in (0, 1, p - 1, p + 1, 1000):
            xs = inputs(n, p, n, np.float64)
            src = dev.array(xs[t.rank])
            dst = dev.array(np.full(n, np.nan))
            node.allreduce(t, src, dst, COMBINE, ws)
            out[("allreduce", n)] = np.array(dst.copy())
            inplace = dev.array(xs[t.rank])
            node.allreduce(t, inplace, inplace, COMBINE, ws)
            out[("in place", n)] = inplace.copy()
            part = Partition.even(n, p)
            mine = dev.array(np.full(part.counts[t.rank], np.nan))
            node.reduce_scatter(t, src, mine, part, COMBINE, ws)
            out[("reduce_scatter", n)] = mine.copy()
            buf = dev.array(np.full(n, np.nan))
            lo, hi = part.starts[t.rank], part.starts[t.rank] + part.counts[t.rank]
            buf[lo:hi] = src[lo:hi]
            node.allgather(t, buf, part, ws)
            out[("allgather", n)] = buf.copy()
            for root in sorted({0, p - 1}):
                b = dev.array(xs[root] if t.rank == root else np.full(n, np.nan))
                node.broadcast(t, b, root, ws)
                out[("broadcast", n, root)] = b.copy()
        assert node.existing(t, ws) is not None, "no tier was made"
        assert dev.kernels > 0 and dev.fences > 0
        return out

    results = _on_fake_devices(p, body, chunk)
    for key in results[0]:
        n = key[1]
        xs = inputs(n, p, n, np.float64)
        total = np.sum(xs, axis=0) if n else np.zeros(0)
        part = Partition.even(n, p)
        for r, res in enumerate(results):
            got = res[key]
            if key[0] == "reduce_scatter":
                want = total[part.starts[r]:part.starts[r] + part.counts[r]]
            elif key[0] == "allgather":
                want = np.concatenate([xs[q][part.starts[q]:part.starts[q] + part.counts[q]]
                                       for q in range(p)])
            elif key[0] == "broadcast":
                want = xs[key[2]]
            else:
                want = total
            assert np.allclose(got, want, rtol=1e-12, atol=0), (key, r)
            assert got.tobytes() == results[0][key].tobytes() or key[0] == "reduce_scatter"


def test_the_fake_catches_a_tier_that_does_not_wait_for_its_kernels():
    """The fake's teeth: with a fence that does not wait for the stream, the copies into the
    slots have not run when the peers read them, and the results are wrong. (If this passes
    with right results, the fake has stopped deferring work and the test above proves
    nothing.)"""
    def body(t, ws, dev):
        src = dev.array(np.full(1000, 1.0 + t.rank))
        dst = dev.array(np.full(1000, np.nan))
        node.allreduce(t, src, dst, COMBINE, ws)
        return dst.copy()

    results = _on_fake_devices(3, body, 4096, fence_flushes=False)
    assert not all(np.array_equal(r, np.full(1000, 6.0)) for r in results), results


@mpirun.needs_mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_mpi_node_tier(nprocs, mpi_timings):
    rc, out, secs = mpirun.launch(nprocs, ["tests/mpi_node.py"], timeout=180)
    mpi_timings[f"mpi_node -n {nprocs}"] = secs
    assert rc == 0, f"mpiexec -n {nprocs} tests/mpi_node.py: rc {rc}\n{out[-6000:]}"
    assert out.count("mpi_node: ok") == nprocs, out[-3000:]


@mpirun.needs_mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_mpi_node_tier_device_memory_on_the_fake(nprocs, mpi_timings):
    """The device half of the tier (CUDA IPC set-up, agreement, bookkeeping) under real MPI,
    on tests/_fake_device.py: every case's sums right, every peer's segment opened once."""
    prefix = f"rcipc_t{os.getpid()}_{nprocs}"
    rc, out, secs = mpirun.launch(nprocs, ["tests/mpi_node_ipc.py", "--prefix", prefix],
                                  timeout=180)
    mpi_timings[f"mpi_node_ipc -n {nprocs}"] = secs
    assert rc == 0, f"mpiexec -n {nprocs} tests/mpi_node_ipc.py: rc {rc}\n{out[-6000:]}"
    assert f"mpi_node_ipc P={nprocs}:" in out and " 0 failures" in out, out[-3000:]


@mpirun.needs_mpi
def test_mpi_node_tier_dead_peer_ends_the_job():
    """A rank that dies inside the tier's collective: the others must not wait forever (the
    watchdog aborts the job, naming the tier's wait), and the run exits non-zero."""
    rc, out, secs = mpirun.launch(3, ["tests/mpi_node.py", "--dead-peer"],
                                  env={"RINGCOLL_TIMEOUT": "4"}, timeout=90)
    assert rc not in (0, None), f"rc {rc} after {secs:.0f} s\n{out[-3000:]}"
    assert "(node)" in out or "node tier" in out, out[-3000:]
