"""The CUDA kernel source of ringcoll.kernels.cuda, compiled for the CPU and checked on the CPU.

This tests the *source text* the GPU compiles (every op on every dtype, the float16/bfloat16
conversions, wrap-around, NaN rules, the fused avg kernels), not the GPU: a small shim maps the
CUDA built-ins it uses (__global__, blockIdx, __float_as_uint, __fmul_rn, ...) onto plain C++,
g++ builds a shared library, and each kernel runs as one thread over the whole array. Every
result must equal ringcoll's NumPy kernels bit for bit (NaN payloads aside). NVRTC, the CuPy
launch and real device memory are covered by tests/test_gpu.py on a machine with a GPU.
"""

import ctypes
import shutil
import subprocess
import zlib

import numpy as np
import pytest

from ringcoll.kernels import cuda
from ringcoll.ops import get_op

import _oracle as O

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++/c++/clang++) on PATH "
                                "to build the CUDA kernel source for the CPU")

SHIM = r"""
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
struct rc_dim3 { unsigned int x; };
static const rc_dim3 blockIdx = {0}, blockDim = {1}, gridDim = {1}, threadIdx = {0};
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4);
                                                      return u; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
"""

EXTRA = r"""
extern "C" void rc_test_f2h(const float* x, unsigned short* o, unsigned long long n) {
    for (unsigned long long i = 0; i < n; i++) o[i] = rc_f2h(x[i]); }
extern "C" void rc_test_h2f(const unsigned short* x, float* o, unsigned long long n) {
    for (unsigned long long i = 0; i < n; i++) o[i] = rc_h2f(x[i]); }
extern "C" void rc_test_f2b(const float* x, unsigned short* o, unsigned long long n) {
    for (unsigned long long i = 0; i < n; i++) o[i] = rc_f2b(x[i]); }
"""

KEYS = [k for k in cuda._TYPES if k != "bfloat16" or O.BFLOAT16 is not None]
PAIRS = [(op, k) for k in KEYS for op in cuda.OPS
         if not (cuda._TYPES[k][3] == "c" and op in ("max", "min"))]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    src, so = d / "kernels.cpp", d / "kernels.so"
    src.write_text(SHIM + cuda.source(PAIRS) + EXTRA)
    # -ffp-contract=off: the GPU build cannot fuse either (the _rn intrinsics, no a*b+c forms)
    run = subprocess.run([CXX, "-std=c++11", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                          "-o", str(so), str(src)], capture_output=True, text=True)
    assert run.returncode == 0, f"the kernel source does not compile:\n{run.stderr[-4000:]}"
    return ctypes.CDLL(str(so))


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def launch(lib, name, a, b, out, d, double):
    fn = getattr(lib, name)
    fn.restype = None
    fn(_ptr(a), _ptr(b), _ptr(out), ctypes.c_ulonglong(out.size),
       (ctypes.c_double if double else ctypes.c_float)(d))


def _dtype(key):
    return O.BFLOAT16 if key == "bfloat16" else np.dtype(key)


def _random(rng, dtype, n):
    with np.errstate(all="ignore"):  # the specials overflow float16 on purpose
        return _random_values(rng, np.dtype(dtype), n)


def _random_values(rng, dtype, n):
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, size=n))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 65504.0, 65520.0])
    x[:special.size] = special
    if dtype.kind == "c":
        x = x + 1j * np.roll(x, 3)
    return x.astype(dtype)


_same = O.same_bits


@pytest.fixture(autouse=True)
def _quiet_floats():
    with np.errstate(all="ignore"):  # inf - inf, overflow to inf: part of the data on purpose
        yield


@pytest.mark.parametrize("op,key", PAIRS, ids=[f"{o}-{k}" for o, k in PAIRS])
def test_combine_matches_numpy_bitwise(lib, op, key):
    dtype = _dtype(key)
    rng = np.random.default_rng(zlib.crc32(f"{op} {key}".encode()))
    n = 4099
    a, b = _random(rng, dtype, n), _random(rng, dtype, n)
    want = np.empty(n, dtype)
    get_op(op).bind(dtype)(a, b, want)  # ringcoll's CPU kernel
    got = np.empty(n, dtype)
    launch(lib, f"rc_combine_{op}_{key}", a, b, got, 0, False)
    alias = a.copy()  # out may be a itself, as the algorithms pass it
    launch(lib, f"rc_combine_{op}_{key}", alias, b, alias, 0, False)
    assert np.array_equal(got.view(np.uint8), alias.view(np.uint8))
    if op == "prod" and dtype.kind == "c":
        # NumPy's SIMD complex multiply uses FMA where the CPU has it; the kernel rounds each
        # product (so GPU ranks agree whatever the compiler does): the last bits may differ.
        eps = np.finfo(dtype).eps
        ok = np.isclose(got, want, rtol=4 * eps, atol=0) | ~np.isfinite(want) | (
            np.abs(want) < 1e-25)
        assert np.all(ok), f"{op} {key}: {got[~ok][:4]} vs {want[~ok][:4]}"
    else:
        assert _same(got, want), f"{op} {key}: {got[:8]} vs {want[:8]}"


@pytest.mark.parametrize("key", [k for k in KEYS if cuda._TYPES[k][2] is not None])
def test_avg_kernels_match_the_cpu_path(lib, key):
    """scale = ReduceOp.start's prescale / finish's division; combine_scale = the ring's last
    step (combine.final): both bitwise equal to the CPU kernels' two calls."""
    dtype, double = _dtype(key), cuda._TYPES[key][2] == "double"
    rng = np.random.default_rng(7)
    a, b = _random(rng, dtype, 2051), _random(rng, dtype, 2051)
    avg = get_op("avg")
    half = key in ("float16", "bfloat16")  # these prescale: no fused kernel (nor use for one)
    for p in (3, 4, 7):
        combine = avg.bind(dtype)
        got = np.empty_like(a)
        if not half:
            want = np.empty_like(a)
            combine.final(p)(a, b, want)
            launch(lib, f"rc_combine_scale_{key}", a, b, got, p, double)
            assert _same(got, want), f"combine_scale {key} p={p}"
        want = np.empty_like(a)
        combine.scale_into(a, p, want, None if key not in ("float16", "bfloat16")
                           else np.dtype(np.float32))
        launch(lib, f"rc_scale_{key}", a, a, got, p, double)
        assert _same(got, want), f"scale {key} p={p}"



def test_float16_conversions_exhaustive(lib):
    """Every float16 to float32 and back; float32 values at, between and around every half
    (the round-to-nearest-even ties included), against NumPy's casts."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = np.empty(halves.size, np.float32)
    fn = lib.rc_test_h2f
    fn(_ptr(halves), _ptr(f), ctypes.c_ulonglong(halves.size))
    want = halves.view(np.float16).astype(np.float32)
    assert np.array_equal(f.view(np.uint32), want.view(np.uint32))
    finite = want[np.isfinite(want)].astype(np.float64)
    finite = np.unique(finite)
    mids = (finite[:-1] + finite[1:]) / 2  # exact ties in float32 (halves have 11 bits)
    probe = np.concatenate([finite, mids]).astype(np.float32)
    ups = np.nextafter(probe, np.float32(np.inf))
    downs = np.nextafter(probe, np.float32(-np.inf))
    rng = np.random.default_rng(3)
    wild = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(
        np.float32)
    x = np.concatenate([probe, ups, downs, wild, np.array([65519.996, 65520.0, 1e10, -1e10,
                                                           np.inf, -np.inf], np.float32)])
    got = np.empty(x.size, np.uint16)
    lib.rc_test_f2h(_ptr(x), _ptr(got), ctypes.c_ulonglong(x.size))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(np.float16)))


@pytest.mark.skipif(O.BFLOAT16 is None, reason="ml_dtypes is not installed")
def test_bfloat16_conversions(lib):
    """float32 -> bfloat16 rounding (ties included) against ml_dtypes' cast."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000  # exactly halfway
    x = np.concatenate([bits, ties, ties + 1, ties - 1]).view(np.float32)
    got = np.empty(x.size, np.uint16)
    lib.rc_test_f2b(_ptr(x), _ptr(got), ctypes.c_ulonglong(x.size))
    want = x.astype(O.BFLOAT16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(O.BFLOAT16).astype(np.float32)))


def test_every_dtype_ringcoll_reduces_has_kernels():
    """The GPU path covers exactly the dtypes and ops the CPU path does."""
    for dtype in O.ALL_DTYPES:
        for op in ("sum", "prod", "max", "min", "avg"):
            if not O.valid(op, dtype):
                continue
            red = cuda.reduction("sum" if op == "avg" else op, dtype)
            assert red.key == cuda.dtype_key(dtype)
            if op == "avg":
                names = cuda.kernel_names("sum", red.key)
                assert "scale" in names
                assert ("combine_scale" in names) == (dtype not in O.HALF_DTYPES)
