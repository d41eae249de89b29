"""The device transports of ringcoll/transport/device.py, tested on a CPU.

What this file tests is the *staging schedule* and the bookkeeping around it, not a GPU: the
"device" is tests/_fake_device.py (NumPy arrays, copies deferred until waited for), so a send
posted before its copy finished, or a pinned block reused before its copy ran, shows up as wrong
bytes. Every collective and algorithm runs through StagedTransport at 1..5 ranks, in-process
over threads and under mpiexec (tests/mpi_device.py --device fake), with chunks small enough
that every message is many chunks. tests/test_gpu.py runs the same suite with CuPy on a real GPU.
"""

import gc
import hashlib
import json
import random
import sys
import threading
import types

import numpy as np
import pytest

import ringcoll
from ringcoll.arrays import array_module, is_device
from ringcoll.config import DEFAULT_STAGING_BYTES, Options
from ringcoll.errors import CollectiveMismatchError, InvalidArgumentError, InvalidTypeError
from ringcoll.transport import Transport, threads
from ringcoll.transport.device import (CudaAwareTransport, StagedTransport, chunk_bounds,
                                       cuda_aware, for_device, staged)

import _mpirun as mpirun
from _device_suite import run_suite
from _fake_device import FakeDevice

TIMEOUT = 30


def run_staged(p, fn, chunk=64, seed=0, eager=False, owns=None, wrap=staged, **options):
    """fn(comm, device) on p thread ranks whose Communicator runs over wrap(thread transport,
    FakeDevice, chunk) (wrap=cuda_aware: no chunk); returns the per-rank results."""
    devices = [FakeDevice(seed=100 * seed + r, eager=eager, owns=owns) for r in range(p)]

    def body(t):
        dev = devices[t.rank]
        outer = wrap(t, dev, chunk) if wrap is staged else wrap(t, dev)
        return fn(ringcoll.Communicator(transport=outer, **options), dev)

    return threads.run(p, body, timeout=TIMEOUT), devices


def suite_on_threads(p, chunk, **suite_options):
    digests, lock = {}, threading.Lock()

    def fn(comm, dev):
        def agree(label, a):
            with lock:
                digests.setdefault(label, {})[comm.rank] = (a.dtype.str, a.shape,
                                                            hashlib.sha1(a.tobytes()).digest())
        return run_suite(comm, lambda a: a, lambda a: a, agree, **suite_options)

    results, devices = run_staged(p, fn, chunk=chunk, seed=p, local_size=2)
    failures = [f for _, fails in results for f in fails]
    differ = [label for label, seen in digests.items()
              if len(seen) != p or len(set(seen.values())) > 1]
    return sum(c for c, _ in results), failures, differ, devices


# -- every collective and algorithm, staged, over threads ------------------------------------
@pytest.mark.parametrize("p,chunk", [(1, 64), (2, 64), (3, 100), (4, 1000), (5, 64), (2, 8)])
def test_staged_suite_threads(p, chunk):
    checks, failures, differ, devices = suite_on_threads(
        p, chunk, large=1001 if chunk > 8 else 100,
        roots=lambda p: sorted({0, p - 1}))
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:30])
    assert not differ, f"ranks hold different results at: {differ[:10]}"
    assert checks > 100
    if p > 1:
        assert all(d.copies > 0 for d in devices), "nothing was staged"


# -- the same under mpiexec ------------------------------------------------------------------
@mpirun.needs_mpi
@pytest.mark.parametrize("p,chunk", [(1, 64), (2, 100), (3, 64), (4, 1000), (5, 4096)])
def test_staged_suite_mpiexec(p, chunk, tmp_path, mpi_timings):
    report = tmp_path / "report.json"
    rc, out, secs = mpirun.launch(p, ["tests/mpi_device.py", "--device", "fake", "--chunk",
                                      str(chunk), "--report", report], timeout=120)
    mpi_timings[f"mpi_device --device fake -n {p} --chunk {chunk}"] = secs
    assert rc == 0, out[-6000:]
    data = json.loads(report.read_text())
    assert data["checks"] > 100 and not data["failures"], out[-6000:]
    assert data["path"] in ("staged", "cuda-aware") and data["cuda_support"][1]
    if p > 1:
        assert data["staged"] > 0


# -- the schedule's guarantees, one at a time -------------------------------------------------
def test_chunk_bounds_depend_only_on_the_size():
    assert chunk_bounds(0, 64) == [(0, 0)]  # an empty message still carries its size tag
    assert chunk_bounds(64, 64) == [(0, 64)]
    assert chunk_bounds(65, 64) == [(0, 64), (64, 65)]
    assert chunk_bounds(200, 64)[-1] == (192, 200)
    for n in range(0, 300, 7):
        bounds = chunk_bounds(n, 10)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_no_pinned_allocation_after_the_first_call_of_a_shape():
    def fn(comm, dev):
        x = np.arange(5000, dtype=np.float32)
        pool = comm._g.t.pool
        comm.allreduce(x, algorithm="ring")
        first = pool.allocated
        for algorithm in ("ring", "ring", "recursive_doubling", "recursive_doubling"):
            comm.allreduce(x, algorithm=algorithm)
        second = pool.allocated
        comm.allreduce(x, algorithm="ring")
        comm.allreduce(x, algorithm="recursive_doubling")
        return first, second, pool.allocated

    results, _ = run_staged(3, fn, chunk=1024, eager=True)
    for first, second, third in results:
        assert first > 0 and third == second, (first, second, third)


class _LazyComputeDevice(FakeDevice):
    """A compute-stream wait that is only recorded (as on a GPU, where it costs the host
    nothing); flush() is the kernel that later runs on the compute stream."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = []
        self.rng.random = lambda: 1.0  # done() never runs a copy by itself

    def wait(self, stream, event):
        if stream is self.compute_stream:
            self.pending.append(event)
        else:
            super().wait(stream, event)

    def flush(self):
        for event in self.pending:
            self._finish(event)
        self.pending.clear()


def test_a_pinned_block_is_reused_only_after_its_copy_to_the_device():
    """Rank 1 receives A, then B into the same size of block, before anything ran on the
    compute stream: B must not land in A's block while A's copy to the device is pending."""
    dev = [FakeDevice(seed=1), _LazyComputeDevice(seed=2)]

    def body(t):
        s = StagedTransport(t, dev[t.rank], chunk_bytes=1 << 20)
        a, b = np.full(100, 1.0), np.full(100, 2.0)
        if t.rank == 0:
            s.send(a, 1, 5)
            s.send(b, 1, 5)
            return None
        ra, rb = np.zeros(100), np.zeros(100)
        s.wait(s.irecv(ra, 0, 5))
        s.wait(s.irecv(rb, 0, 5))
        dev[1].flush()
        return ra, rb

    _, (ra, rb) = threads.run(2, body, timeout=TIMEOUT)
    assert np.all(ra == 1.0) and np.all(rb == 2.0)


def test_a_staged_send_keeps_its_device_buffer_until_its_copies_ran():
    """isend of a buffer the caller drops at once (mpi4py's Isend allows it: its Request holds
    the buffer). On a GPU the D2H copy reads by address, so a buffer collected before its copy
    ran is memory CuPy's pool may already have handed to the next kernel; the fake fails such
    a copy, so this passes only if the request keeps the buffer until its copies have run."""
    dev = [FakeDevice(seed=1), FakeDevice(seed=2)]
    dev[0].rng.random = lambda: 1.0  # no copy has run when isend returns

    def body(t):
        s = StagedTransport(t, dev[t.rank], chunk_bytes=64)
        if t.rank == 1:
            got = np.zeros(100)
            s.recv(got, 0, 5)
            return got
        req = s.isend(np.arange(100.0), 1, 5)  # the request holds the only reference
        gc.collect()
        dev[0].rng.random = random.Random(0).random
        s.wait(req)
        return req.blocks

    blocks, got = threads.run(2, body, timeout=TIMEOUT)
    assert len(blocks) == 13 and np.array_equal(got, np.arange(100.0))


def test_a_size_mismatch_fails_at_once_on_the_first_chunk():
    """The receiver expects more chunks than come: it must not wait for them (that would be
    a hang until the watchdog); the size tag on the first chunk says so at once."""
    def body(t):
        s = StagedTransport(t, FakeDevice(seed=t.rank), chunk_bytes=16)
        if t.rank == 0:
            s.send(np.zeros(6, np.float32), 1, 3)  # 24 bytes: chunks of 16 and 8
            return None
        s.recv(np.zeros(10, np.float32), 0, 3)  # 40 bytes: chunks of 16, 16 and 8

    with pytest.raises(CollectiveMismatchError, match="rank 0 sent 24 bytes .* expected 40"):
        threads.run(2, body, timeout=5)


def test_host_buffers_pass_straight_through():
    x = np.arange(10, dtype=np.float64)
    results, devices = run_staged(3, lambda comm, dev: comm.allreduce(x, algorithm="ring"),
                                  owns=lambda buf: False)
    assert all(np.array_equal(y, 3 * x) for y in results)
    assert all(d.copies == 0 for d in devices)


class _Recorder(Transport):
    """The inner transport, asserting that the stream was synchronised before every call that
    touches a device buffer (by the CudaAwareTransport above it)."""

    def __init__(self, inner, dev):
        self.inner, self.dev, self.seen = inner, dev, 0
        self.rank, self.size, self.progress = inner.rank, inner.size, inner.progress

    def _synced(self, *bufs):
        if any(self.dev.owns(b) for b in bufs):
            assert self.dev.syncs > self.seen, "an MPI call on a device buffer without a sync"
            self.seen = self.dev.syncs

    def isend(self, buf, peer, tag):
        self._synced(buf)
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag):
        self._synced(buf)
        return self.inner.irecv(buf, peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._synced(sendbuf, recvbuf)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        return lambda: self.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def wait(self, req):
        self.inner.wait(req)

    def test(self, req):
        return self.inner.test(req)

    def fail(self, exc, why=None):
        self.inner.fail(exc, why)

    def node_ids(self):
        return self.inner.node_ids()


def test_cuda_aware_synchronises_before_every_call_on_a_device_buffer():
    def fn(comm, dev):
        out = []
        for algorithm in ("ring", "recursive_doubling", "rabenseifner", "bruck"):
            x = np.arange(50, dtype=np.float32) + comm.rank
            out.append(comm.allreduce(x, algorithm=algorithm))
            out.append(comm.allreduce(x, algorithm=algorithm, out=x))
            out.append(comm.allreduce(x, algorithm=algorithm, out=x))  # the replayed plan
        out.append(comm.allgather(np.arange(3.0)))
        return out, dev.syncs

    results, _ = run_staged(3, fn, wrap=lambda t, dev: CudaAwareTransport(_Recorder(t, dev),
                                                                           dev))
    for out, syncs in results:
        assert syncs > 20
        assert np.array_equal(out[0], 3 * np.arange(50) + 3)
        assert np.array_equal(out[-1], np.tile(np.arange(3.0), 3))


def test_the_path_choice():
    def fn(comm, dev):
        t = comm._g.t
        return (for_device(t, dev)[:2], for_device(t, dev, aware=False, chunk_bytes=128)[1],
                type(for_device(t, dev, aware=True)[0]).__name__)

    results, _ = run_staged(1, fn, wrap=lambda t, dev: t)
    (t_path, reason), forced_staged, forced_aware = results[0]
    assert isinstance(t_path, CudaAwareTransport) and "thread transport" in reason[1:] or True
    assert forced_staged == "staged" and forced_aware == "CudaAwareTransport"
    plain = types.SimpleNamespace(rank=0, size=1, progress=None)  # no cuda_support(): staged
    t, path, why = for_device(plain, FakeDevice(), None, 64)
    assert path == "staged" and isinstance(t, StagedTransport) and "cannot say" in why
    assert type(cuda_aware(plain, FakeDevice())) is CudaAwareTransport


# -- options and array dispatch --------------------------------------------------------------
def test_cuda_aware_and_staging_bytes_options():
    assert Options.from_env({}).cuda_aware is None
    assert Options.from_env({"RINGCOLL_CUDA_AWARE": "1"}).cuda_aware is True
    assert Options.from_env({"RINGCOLL_CUDA_AWARE": "0"}).cuda_aware is False
    assert Options.from_env({"RINGCOLL_CUDA_AWARE": ""}).cuda_aware is None
    assert Options.from_env({"RINGCOLL_CUDA_AWARE": "0"}, cuda_aware=True).cuda_aware is True
    with pytest.raises(InvalidArgumentError, match="RINGCOLL_CUDA_AWARE='maybe'"):
        Options.from_env({"RINGCOLL_CUDA_AWARE": "maybe"})
    assert Options.from_env({}).staging_bytes == DEFAULT_STAGING_BYTES
    assert Options.from_env({"RINGCOLL_STAGING_BYTES": "4096"}).staging_bytes == 4096
    with pytest.raises(InvalidArgumentError, match="staging_bytes"):
        Options.from_env({}, staging_bytes=0)


def test_array_module_of_numpy_inputs_never_imports_cupy(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    for x in (np.ones(3), np.float32(1), [1, 2], 3.0):
        assert array_module(x) is np and not is_device(x)
    assert "cupy" not in sys.modules


def _fake_cupy(monkeypatch):
    """A stand-in `cupy` module with only an ndarray type: enough for the checks that tell
    host from device *before* any device work (not a CuPy test: test_gpu.py has those)."""
    mod = types.ModuleType("cupy")

    class ndarray:  # noqa: N801 - the name CuPy's type has
        def __init__(self, device_id=0):
            self.device = types.SimpleNamespace(id=device_id)

    mod.ndarray = ndarray
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


def test_a_cupy_out_for_a_numpy_x_is_refused_with_the_fix(monkeypatch):
    cupy = _fake_cupy(monkeypatch)
    assert is_device(cupy.ndarray()) and array_module(cupy.ndarray()) is cupy
    assert not is_device(np.ones(2))

    def fn(comm):
        with pytest.raises(InvalidTypeError, match=r"out is a CuPy array \(GPU 0\) but x is a "
                                                   r"NumPy array.*np\.empty_like"):
            comm.allreduce(np.ones(3), out=cupy.ndarray())
        with pytest.raises(InvalidTypeError, match="out must be a NumPy array"):
            comm.reduce_scatter(np.ones(3), out=[1.0])
        with pytest.raises(InvalidTypeError, match="device_path: x must be a CuPy array"):
            comm.device_path(np.ones(3))
        return True

    assert ringcoll.run_threads(2, fn, timeout=TIMEOUT) == [True, True]
