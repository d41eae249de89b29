"""The CUDA kernel source of ringcoll.kernels.cuda, compiled for the CPU and checked on the CPU.

This tests the *source text* the GPU compiles (every op on every dtype, the float16/bfloat16
conversions, wrap-around, NaN rules, the fused avg kernels, the p-input 'many' kernel and the
launches CudaReduction.many chains), not the GPU: a small shim maps the
CUDA built-ins it uses (__global__, blockIdx, __float_as_uint, __fmul_rn, ...) onto plain C++,
g++ builds a shared library, and each kernel runs as one thread over the whole array. Every
result must equal ringcoll's NumPy kernels bit for bit (NaN payloads aside). NVRTC, the CuPy
launch and real device memory are covered by tests/test_gpu.py on a machine with a GPU.
"""

import ctypes
import shutil
import subprocess
import sys
import types
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


def launch_many(lib, name, inputs, out):
    """One 'many' launch over inputs (2..MANY of them), the unused slots as the last input."""
    fn = getattr(lib, name)
    fn.restype = None
    slots = list(inputs) + [inputs[-1]] * (cuda.MANY - len(inputs))
    fn(*[_ptr(x) for x in slots], ctypes.c_uint(len(inputs)), _ptr(out),
       ctypes.c_ulonglong(out.size))


def combine_chain(lib, op, key, inputs, out):
    """What the node tier does without a 'many' kernel: k - 1 combine launches through out."""
    launch(lib, f"rc_combine_{op}_{key}", inputs[0], inputs[1], out, 0, False)
    for x in inputs[2:]:
        launch(lib, f"rc_combine_{op}_{key}", out, x, out, 0, False)


def host_chain(op, dtype, inputs, out):
    """The same chain with ringcoll's CPU kernels (ringcoll.algorithms.node._reduce)."""
    combine = get_op(op).bind(dtype)
    combine(inputs[0], inputs[1], out)
    for x in inputs[2:]:
        combine(out, x, out)


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


def _inputs(rng, dtype, n, count):
    # each input's specials rolled elsewhere, so inf meets finite values and NaN meets inf
    return [np.roll(_random(rng, dtype, n), 3 * j) for j in range(count)]


def _assert_near_host(got, want, op, key, k):
    if op == "prod" and got.dtype.kind == "c":
        # NumPy's complex multiply may use FMA (see test_combine_matches_numpy_bitwise); over
        # k - 1 products the last-bit differences add up, at most a few eps each
        eps = np.finfo(got.dtype).eps
        ok = np.isclose(got, want, rtol=4 * (k - 1) * eps, atol=0) | ~np.isfinite(want) | (
            np.abs(want) < 1e-25)
        assert np.all(ok), f"many {op} {key} k={k}: {got[~ok][:4]} vs {want[~ok][:4]}"
    else:
        assert _same(got, want), f"many {op} {key} k={k}: {got[:8]} vs {want[:8]}"


@pytest.mark.parametrize("op,key", PAIRS, ids=[f"{o}-{k}" for o, k in PAIRS])
def test_many_matches_the_chain_bitwise(lib, op, key):
    """rc_many over k inputs = k - 1 rc_combine launches through out, bit for bit (NaN payloads
    too: the same rounding to the stored type after every step), = NumPy's chain of the CPU
    kernels (NaN payloads aside); out may be a0."""
    dtype = _dtype(key)
    rng = np.random.default_rng(zlib.crc32(f"many {op} {key}".encode()))
    n = 4099
    xs = _inputs(rng, dtype, n, cuda.MANY)
    name = cuda.kernel_names(op, key)["many"]
    for k in (2, 3, 5, 8):
        inputs = xs[:k]
        got = np.empty(n, dtype)
        launch_many(lib, name, inputs, got)
        chain = np.empty(n, dtype)
        combine_chain(lib, op, key, inputs, chain)
        assert np.array_equal(got.view(np.uint8), chain.view(np.uint8)), f"{op} {key} k={k}"
        alias = inputs[0].copy()  # the node tier may reduce into its own buffer, inputs[0]
        launch_many(lib, name, [alias] + inputs[1:], alias)
        assert np.array_equal(got.view(np.uint8), alias.view(np.uint8)), f"alias k={k}"
        want = np.empty(n, dtype)
        host_chain(op, dtype, inputs, want)
        _assert_near_host(got, want, op, key, k)


class _Launches:
    """A stand-in for a compiled RawKernel function: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args):
        self.calls.append((grid, block, args))


def _fake_function(monkeypatch, fn):
    flavours = []

    def _function(self, flavour):
        flavours.append(flavour)
        return fn
    monkeypatch.setattr(cuda.CudaReduction, "_function", _function)
    return flavours


# input indices of each launch ("out": the output array as a0), written out by hand
_PLANS = {
    2: [[0, 1]],
    8: [[0, 1, 2, 3, 4, 5, 6, 7]],
    9: [[0, 1, 2, 3, 4, 5, 6, 7], ["out", 8]],
    16: [[0, 1, 2, 3, 4, 5, 6, 7], ["out", 8, 9, 10, 11, 12, 13, 14], ["out", 15]],
}


@pytest.mark.parametrize("count", sorted(_PLANS))
def test_many_chains_launches_through_out(monkeypatch, count):
    """CudaReduction.many: up to MANY inputs in the first launch, then out plus up to MANY - 1
    more per launch, in order; unused slots repeat the last pointer; k and n as the kernel
    takes them (unsigned int, unsigned long long)."""
    fn = _Launches()
    flavours = _fake_function(monkeypatch, fn)
    red = cuda.CudaReduction("sum", "float32")
    n = 1000
    inputs = [np.zeros(n, np.float32) for _ in range(count)]
    out = np.zeros(n, np.float32)
    red.many(inputs, out)
    assert set(flavours) == {"many"}
    assert len(fn.calls) == len(_PLANS[count])
    for (grid, block, args), plan in zip(fn.calls, _PLANS[count]):
        batch = [out if j == "out" else inputs[j] for j in plan]
        k = len(batch)
        assert grid == cuda._grid(n) and block == (cuda.THREADS,)
        assert len(args) == cuda.MANY + 3
        assert all(a is b for a, b in zip(args[:k], batch)), plan
        assert all(a is batch[-1] for a in args[k:cuda.MANY]), plan
        assert type(args[cuda.MANY]) is np.uint32 and args[cuda.MANY] == k
        assert args[cuda.MANY + 1] is out
        assert type(args[cuda.MANY + 2]) is np.uint64 and args[cuda.MANY + 2] == n


def test_many_edge_cases(monkeypatch):
    """n == 0: no launch (nor a compile); out may be inputs[0]; fewer than 2 inputs: an error."""
    fn = _Launches()
    flavours = _fake_function(monkeypatch, fn)
    red = cuda.CudaReduction("max", "int8")
    empty = [np.zeros(0, np.int8) for _ in range(3)]
    red.many(empty, empty[0])
    assert fn.calls == [] and flavours == []
    inputs = [np.zeros(5, np.int8) for _ in range(10)]
    red.many(inputs, inputs[0])
    assert len(fn.calls) == 2  # 8 inputs, then out (= inputs[0]) and the last 2
    assert all(args[0] is inputs[0] and args[cuda.MANY + 1] is inputs[0]
               for _, _, args in fn.calls)
    assert fn.calls[1][2][1] is inputs[8] and fn.calls[1][2][2] is inputs[9]
    with pytest.raises(ValueError, match="two or more inputs"):
        red.many(inputs[:1], inputs[0])


@pytest.mark.parametrize("op,key", PAIRS, ids=[f"{o}-{k}" for o, k in PAIRS])
def test_many_chained_launches_match_the_chain(lib, monkeypatch, op, key):
    """CudaReduction.many past MANY inputs, each launch run by the g++-built kernel: the
    result is the chain of combines (bitwise) and NumPy's chain."""
    dtype = _dtype(key)
    kernel = getattr(lib, cuda.kernel_names(op, key)["many"])
    kernel.restype = None

    def run(grid, block, args):
        *pointers, k, out, n = args
        kernel(*[_ptr(x) for x in pointers], ctypes.c_uint(int(k)), _ptr(out),
               ctypes.c_ulonglong(int(n)))
    _fake_function(monkeypatch, run)
    red = cuda.CudaReduction(op, key)
    rng = np.random.default_rng(zlib.crc32(f"chained {op} {key}".encode()))
    n = 1031
    for count in (9, 16, 17):
        inputs = _inputs(rng, dtype, n, count)
        got = np.empty(n, dtype)
        red.many(inputs, got)
        chain = np.empty(n, dtype)
        combine_chain(lib, op, key, inputs, chain)
        assert np.array_equal(got.view(np.uint8), chain.view(np.uint8)), f"{count} inputs"
        want = np.empty(n, dtype)
        host_chain(op, dtype, inputs, want)
        _assert_near_host(got, want, op, key, count)


def test_many_compiles_with_the_other_flavours(monkeypatch):
    """_function('many') compiles the (op, dtype) module once, on first use, and takes every
    flavour's function from it (a stand-in cupy: no GPU needed)."""
    codes = []

    class RawModule:
        def __init__(self, code):
            codes.append(code)

        def get_function(self, name):
            assert f"void {name}(" in codes[-1], name
            return ("function", name)
    cupy = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    red = cuda.CudaReduction("sum", "float16")
    assert red._function("many") == ("function", "rc_many_sum_float16")
    assert red._function("combine") == ("function", "rc_combine_sum_float16")
    assert red._function("scale") == ("function", "rc_scale_float16")
    assert len(codes) == 1


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
            assert "many" in cuda.kernel_names(red.op, red.key)  # the node tier's kernel
            if op == "avg":
                names = cuda.kernel_names("sum", red.key)
                assert "scale" in names
                assert ("combine_scale" in names) == (dtype not in O.HALF_DTYPES)
