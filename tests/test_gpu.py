"""GPU tier: ringcoll with CuPy arrays on a real GPU, skipped with the reason where there is none.

- The CUDA kernels themselves (every op and dtype, aliasing, the avg kernels) against the NumPy
  kernels, on device memory.
- The collective suite of tests/_device_suite.py (every collective and algorithm, counts 0, 1,
  p-1, p+1 and 1001, in and out of place, uneven rows, every root) with CuPy arrays,
  in-process over the thread transport at 1..4 ranks, both paths: "direct" (the arrays go to
  the transport as they are, as with a CUDA-aware MPI) and "staged" (pinned host buffers).
- The same suite under mpiexec at -n 1, 2 and 4, every rank on the same GPU when there is only
  one: the path MPI says (auto), and staging forced (RINGCOLL_CUDA_AWARE=0).
- Placement errors, results on x's device with x's dtype, debug mode's path line, and a
  non-blocking all-reduce on a user stream.

Run it on a GPU machine with scripts/gpu_check.sh (which also installs what is missing, and
sets RINGCOLL_REQUIRE_GPU=1: then a missing GPU fails the tests instead of skipping them).
"""

import json
import os

import numpy as np
import pytest

import ringcoll
from ringcoll.errors import InvalidTypeError
from ringcoll.ops import get_op

import _mpirun as mpirun
import _oracle as O
from _device_suite import cupy_bfloat16_ok, run_suite


def _gpu():
    """(cupy or None, the reason to skip)."""
    try:
        import cupy
    except ImportError as exc:
        return None, (f"CuPy not installed ({exc}); on a machine with an NVIDIA GPU: pip install "
                      "cupy-cuda12x or cupy-cuda13x (see docs/gpu.md)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        cupy.zeros(1).sum().item()  # a context, an allocation and a kernel
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means: no usable GPU here
        return None, f"no CUDA device: {type(exc).__name__}: {exc}"
    if count < 1:
        return None, "no CUDA device: cupy.cuda.runtime.getDeviceCount() is 0"
    return cupy, None


cp, WHY = _gpu()
#: scripts/gpu_check.sh sets it: there, a missing GPU is a failure, not a skip
REQUIRED = os.environ.get("RINGCOLL_REQUIRE_GPU") == "1"
pytestmark = pytest.mark.skipif(cp is None and not REQUIRED, reason=WHY or "")


def test_a_gpu_is_there():
    assert cp is not None, f"RINGCOLL_REQUIRE_GPU=1 but {WHY}"
BF16 = cp is not None and cupy_bfloat16_ok(cp)
DTYPES = [d for d in O.ALL_DTYPES if d != O.BFLOAT16 or BF16]
TIMEOUT = 120


def test_bfloat16_support_is_known():
    if not BF16:
        pytest.skip("this CuPy cannot hold ml_dtypes bfloat16 arrays: bfloat16 GPU cases are "
                    "left out of every test here (the CPU tests cover the kernel source)")


# -- the kernels on device memory ------------------------------------------------------------
KERNEL_CASES = [(op, d) for d in DTYPES for op in ("sum", "prod", "max", "min", "avg")
                if O.valid(op, d)]


def _data(dtype, seed, n=100_003):
    rng = np.random.default_rng(seed)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    return O.random_floats(seed, 0, (n,), dtype)


def _matches(got, want, op, dtype):
    if op == "prod" and dtype.kind == "c":  # NumPy's SIMD loop may use FMA (see cuda.py)
        return np.allclose(got, want, rtol=4 * np.finfo(dtype).eps, atol=0, equal_nan=True)
    return O.same_bits(got, want)


@pytest.mark.parametrize("op,dtype", KERNEL_CASES, ids=[f"{o}-{d}" for o, d in KERNEL_CASES])
def test_kernels_match_the_cpu_kernels(op, dtype):
    """Each CUDA kernel on device memory against ringcoll's NumPy kernel, bit for bit (NaN
    payloads aside); in place into an input view gives the same bits."""
    a, b = _data(dtype, 1), _data(dtype, 2)
    reduce_op = get_op(op)
    host, dev = reduce_op.bind(dtype), reduce_op.bind(dtype, cp)
    with np.errstate(all="ignore"):
        want = np.empty_like(a)
        host(a, b, want)
    da, db = cp.asarray(a), cp.asarray(b)
    got = cp.empty_like(da)
    dev(da, db, got)
    dev(da, db, da)
    assert cp.asnumpy(got).tobytes() == cp.asnumpy(da).tobytes()
    assert _matches(cp.asnumpy(got), want, op, dtype), f"{op} {dtype}"
    if op != "avg":
        return
    acc = np.dtype(np.float32) if dtype in O.HALF_DTYPES else None
    for p in (3, 4):
        with np.errstate(all="ignore"):
            host.scale_into(a, p, want, acc)
        dev.scale_into(cp.asarray(a), p, got)
        assert O.same_bits(cp.asnumpy(got), want), f"scale {dtype} p={p}"
        if dtype not in O.HALF_DTYPES:  # those prescale: no fused kernel
            with np.errstate(all="ignore"):
                host.final(p)(a, b, want)
            dev.final(p)(cp.asarray(a), db, got)
            assert O.same_bits(cp.asnumpy(got), want), f"combine+scale {dtype} p={p}"


# -- the collective suite, in-process over threads --------------------------------------------
def suite_on_threads(p, cuda_aware, chunk=1000):  # 1000 B: many chunks, split elements
    digests = {}

    def fn(comm):
        def agree(label, a):
            digests.setdefault(label, {})[comm.rank] = (a.dtype.str, a.shape, a.tobytes())
        return run_suite(comm, cp.asarray, cp.asnumpy, agree, dtypes=DTYPES,
                         roots=lambda p: sorted({0, p - 1}))

    results = ringcoll.run_threads(p, fn, timeout=TIMEOUT, local_size=2, cuda_aware=cuda_aware,
                                   staging_bytes=chunk)
    failures = [f for _, fails in results for f in fails]
    differ = [k for k, seen in digests.items() if len(seen) != p or len(set(seen.values())) > 1]
    return failures, differ


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_suite_threads(p, path):
    failures, differ = suite_on_threads(p, cuda_aware=path == "direct")
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:30])
    assert not differ, f"ranks hold different results at {differ[:10]}"


# -- the same under mpiexec, ranks sharing the GPU --------------------------------------------
@mpirun.needs_mpi
@pytest.mark.parametrize("path", ["auto", "staged"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_suite_mpiexec(p, path, tmp_path, mpi_timings):
    report = tmp_path / "report.json"
    env = {"RINGCOLL_CUDA_AWARE": "0"} if path == "staged" else {}
    rc, out, secs = mpirun.launch(p, ["tests/mpi_device.py", "--device", "cupy", "--chunk",
                                      "1000", "--report", report], env=env, timeout=240)
    mpi_timings[f"mpi_device --device cupy -n {p} ({path})"] = secs
    assert rc == 0, out[-8000:]
    data = json.loads(report.read_text())
    assert not data["failures"] and data["checks"] > 100, out[-8000:]
    if path == "staged":
        assert data["path"] == "staged"
    print(f"-n {p} {path}: {data['path']} ({data.get('why')}); {data['device']}")


# -- placement, types, debug output, streams --------------------------------------------------
def test_results_stay_on_the_device_with_the_dtype():
    def fn(comm):
        x = cp.arange(10, dtype=cp.float32) + comm.rank
        y = comm.allreduce(x)
        z = comm.allgather(x[:3])
        return type(y), y.dtype, y.device.id, cp.asnumpy(y), type(z), z.device.id

    for ty, dt, dev, y, tz, dz in ringcoll.run_threads(2, fn, timeout=TIMEOUT):
        assert ty is cp.ndarray and tz is cp.ndarray and dt == np.float32
        assert dev == dz == cp.cuda.runtime.getDevice()
        assert np.array_equal(y, 2 * np.arange(10) + 1)


def test_mixing_host_and_device_is_refused_with_the_fix():
    def fn(comm):
        with pytest.raises(InvalidTypeError, match="results stay on x's device.*cupy.empty_like"):
            comm.allreduce(cp.ones(3), out=np.empty(3))
        with pytest.raises(InvalidTypeError, match=r"out is a CuPy array .* NumPy array"):
            comm.allreduce(np.ones(3), out=cp.empty(3))
        with pytest.raises(InvalidTypeError, match="results stay on x's device"):
            comm.reduce_scatter(cp.ones((4, 2)), out=np.empty((2, 2)))
        return True

    assert all(ringcoll.run_threads(2, fn, timeout=TIMEOUT))


@pytest.mark.parametrize("aware", [None, True, False])
def test_device_path(aware):
    def fn(comm):
        return comm.device_path(cp.zeros(1))

    path, why = ringcoll.run_threads(1, fn, timeout=TIMEOUT, cuda_aware=aware)[0]
    assert path == ("staged" if aware is False else "cuda-aware")  # threads copy device arrays
    assert ("forced" in why) == (aware is not None), why


@pytest.mark.parametrize("aware", [True, False])
def test_debug_mode_says_which_path(aware, capfd):
    ringcoll.run_threads(2, lambda comm: comm.allreduce(cp.ones(4)), timeout=TIMEOUT, debug=True,
                         cuda_aware=aware)
    err = capfd.readouterr().err
    assert ("cuda-aware" if aware else "staged via pinned host buffers, chunk") in err, err
    assert "forced by RINGCOLL_CUDA_AWARE" in err
    assert "memory=gpu" in err  # the fingerprint records where the buffers are


@pytest.mark.parametrize("aware", [True, False])
def test_iallreduce_on_a_user_stream(aware):
    """x is written on a non-default stream; the collective must see the write, and its result
    must be in place for the next kernel on that stream."""
    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            x = cp.zeros(1 << 20, dtype=cp.float32)
            x += comm.rank + 1  # queued on the stream, maybe not run yet
            req = comm.iallreduce(x, out=x)
            req.wait()
            y = x * 2
            stream.synchronize()
        return cp.asnumpy(y)

    p = 3
    for y in ringcoll.run_threads(p, fn, timeout=TIMEOUT, cuda_aware=aware):
        assert np.all(y == 2 * p * (p + 1) / 2)


def test_staged_path_allocates_nothing_after_the_first_call_of_a_shape():
    """Once its copies have run (the stream synchronised after each call, so this does not
    depend on timing), every pinned block is reused: no allocation after the first call of
    each shape and algorithm."""
    def fn(comm):
        x = cp.ones(3 << 18, dtype=cp.float32)
        stream = cp.cuda.get_current_stream()
        for algorithm in ("ring", "recursive_doubling"):  # the first call of each
            comm.allreduce(x, algorithm=algorithm)
            stream.synchronize()
        pool = comm._g.sides.devices[x.device.id].t.pool
        before = pool.allocated
        for algorithm in ("ring", "recursive_doubling", "ring", "ring", "recursive_doubling"):
            comm.allreduce(x, algorithm=algorithm)
            stream.synchronize()
        return before, pool.allocated

    for before, after in ringcoll.run_threads(2, fn, timeout=TIMEOUT, cuda_aware=False,
                                              staging_bytes=1 << 18):
        assert after == before


def test_environment_is_recorded():
    """Not a check: prints what the GPU tests ran on, for the device check's log."""
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"cupy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
          f"{props['name'].decode()}, bfloat16 {'yes' if BF16 else 'no'}, "
          f"{os.cpu_count()} cores")
