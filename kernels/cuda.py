"""CUDA reduction kernels for CuPy arrays, installed as ringcoll.kernels.cuda.

One kernel launch per reduction step: combine(a, b, out) sets out = a (op) b elementwise with
one RawKernel launch (a grid-stride loop), where out may alias a or b exactly (the same views
the CPU kernels get). 'avg' adds two kernels: combine_scale, out = (a + b) / p in one launch
(the ring's last reduce-scatter step, ReduceOp.fuses_finish), and scale, out = src / p (the
prescale of float16/bfloat16, and the division after algorithms other than the ring).

The 'many' kernel, combine.many(inputs, out), sets out = ((x0 op x1) op x2) op ... over up to
MANY inputs in one launch: the node tier (ringcoll.algorithms.node) reduces a block from the p
ranks' buffers in one pass over memory instead of p - 1 combine launches that each re-read and
re-write out. Its numerics are the chain's, bit for bit: every intermediate is rounded to the
stored type (float16/bfloat16 included) exactly as separate combine launches would store it.

Why RawKernels and not CuPy's ElementwiseKernel or ufuncs: an ElementwiseKernel copies any
input that overlaps the output unless it is the very same Python object (cupy's
_copy_in_args_if_needed), and an algorithm's `combine(x[k], y[k], x[k])` makes two distinct
view objects of the same memory: every in-place step would allocate and copy first. A
RawKernel takes the pointers as they are.

Numerics are the CPU kernels' (ringcoll.kernels): float16 and bfloat16 are loaded into float32,
combined there and rounded back to nearest-even, by integer bit manipulation in the kernel
(rc_h2f/rc_f2h, rc_b2f/rc_f2b below), so no CUDA half header or CuPy half type is involved and
CuPy only has to hand over the pointer; integer sums and products wrap (computed in the unsigned
type: signed overflow is undefined in C++); max/min propagate NaN like np.maximum/np.minimum
(max(a, b) = a if a > b or a is NaN, else b); complex products use round-to-nearest intrinsics
so the compiler cannot fuse them into FMAs; the 'avg' division of complex values is NumPy's
complex / (p + 0j) (Smith's form: each part times the rounded 1/p). So a GPU result equals the
CPU one bit for bit, except for NaN payloads (CUDA arithmetic returns a canonical NaN) and
complex products, where NumPy's SIMD loops use FMA instructions on CPUs that have them (then
the last bit may differ; every GPU rank still agrees with every other).

What has been verified where: the kernel *source* (every op, every dtype, the conversions) is
compiled with g++ on the CPU through a small shim and checked against NumPy by
tests/test_kernel_source.py, which runs on every machine with a C++ compiler. The CuPy side
(compiling with NVRTC, launching, the pointers CuPy passes) runs only on a GPU:
tests/test_gpu.py; it has not run on a GPU yet when this was written (see docs/gpu.md).

Cost: each (op, dtype) compiles once per process (NVRTC, ~0.1-0.5 s; CuPy caches the binary on
disk across processes), then a launch costs a few microseconds of Python plus one pass over the
three operands in device memory.
"""

from functools import lru_cache, partial

import numpy as np

THREADS = 256  # threads per block
MAX_BLOCKS = 8192  # the grid-stride loop covers the rest
MANY = 8  # input pointers of the 'many' kernel; more inputs chain launches through out

# C type of the stored element, the type computations run in, the type of the divisor of avg,
# and the kind: "i" signed, "u" unsigned, "f" real float, "h" half-width float, "c" complex.
_TYPES = {
    "int8": ("signed char", "signed char", None, "i"),
    "int16": ("short", "short", None, "i"),
    "int32": ("int", "int", None, "i"),
    "int64": ("long long", "long long", None, "i"),
    "uint8": ("unsigned char", "unsigned char", None, "u"),
    "uint16": ("unsigned short", "unsigned short", None, "u"),
    "uint32": ("unsigned int", "unsigned int", None, "u"),
    "uint64": ("unsigned long long", "unsigned long long", None, "u"),
    "float16": ("unsigned short", "float", "float", "h"),
    "bfloat16": ("unsigned short", "float", "float", "h"),
    "float32": ("float", "float", "float", "f"),
    "float64": ("double", "double", "double", "f"),
    "complex64": ("rc_c64", "rc_c64", "float", "c"),
    "complex128": ("rc_c128", "rc_c128", "double", "c"),
}
OPS = ("sum", "prod", "max", "min")

#: Shared definitions: complex pairs and the half <-> float conversions. Plain C++ on 32-bit
#: integers, so the same text compiles with NVRTC and (through tests' shim) with g++.
PREAMBLE = r"""
struct rc_c64 { float re, im; };
struct rc_c128 { double re, im; };

/* float16 -> float32: exact (subnormals scaled by 2^-24, inf and NaN payload kept). */
__device__ __forceinline__ float rc_h2f(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mant = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0u) return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
    return __uint_as_float(__float_as_uint((float)mant * 5.9604644775390625e-08f) | sign);
}

/* float32 -> float16, round to nearest even (F. Giesen's float_to_half_fast3_rtne); NaN keeps
   the top payload bits (as NumPy's software conversion), overflow goes to infinity. */
__device__ __forceinline__ unsigned short rc_f2h(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int o;
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) {                       /* >= 2^16: infinity, or NaN */
        o = 0x7c00u;
        if (x > 0x7f800000u) {
            o |= (x & 0x7fffffu) >> 13;
            if (o == 0x7c00u) o = 0x7c01u;
        }
    } else if (x < 0x38800000u) {                 /* < 2^-14: a subnormal half, or zero */
        /* adding 0.5 rounds (to nearest even) at 2^-24, the subnormal half's unit */
        o = __float_as_uint(__uint_as_float(x) + 0.5f) - 0x3f000000u;
    } else {
        unsigned int odd = (x >> 13) & 1u;
        x += 0xc8000fffu + odd;                   /* rebias the exponent by -112, round */
        o = x >> 13;
    }
    return (unsigned short)(o | sign);
}

/* bfloat16 <-> float32: the top 16 bits; rounding to nearest even, NaN stays a (quiet) NaN. */
__device__ __forceinline__ float rc_b2f(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

__device__ __forceinline__ unsigned short rc_f2b(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
"""


def dtype_key(dtype):
    """'bfloat16', 'float32', ...: the name _TYPES knows dtype by (KeyError if none)."""
    name = np.dtype(dtype).name
    if name not in _TYPES:
        raise KeyError(f"no CUDA reduction kernel for dtype {name}")
    return name


def _load(key, v):
    return {"float16": f"rc_h2f({v})", "bfloat16": f"rc_b2f({v})"}.get(key, v)


def _store(key, v):
    return {"float16": f"rc_f2h({v})", "bfloat16": f"rc_f2b({v})"}.get(key, v)


def _op_expr(op, key):
    """C expression of `a op b` on the computation type of dtype key."""
    _, acc, _, kind = _TYPES[key]
    if kind in "iu":
        unsigned = "unsigned long long" if "long long" in acc else "unsigned int"
        return {"sum": f"({acc})(({unsigned})a + ({unsigned})b)",
                "prod": f"({acc})(({unsigned})a * ({unsigned})b)",
                "max": "(a > b) ? a : b", "min": "(a < b) ? a : b"}[op]
    if kind == "c":
        f = "f" if acc == "rc_c64" else "d"
        return {"sum": f"{acc}{{a.re + b.re, a.im + b.im}}",
                "prod": (f"{acc}{{__{f}sub_rn(__{f}mul_rn(a.re, b.re), __{f}mul_rn(a.im, b.im)), "
                         f"__{f}add_rn(__{f}mul_rn(a.re, b.im), __{f}mul_rn(a.im, b.re))}}")}[op]
    return {"sum": "a + b", "prod": "a * b",
            "max": "(a > b || a != a) ? a : b", "min": "(a < b || a != a) ? a : b"}[op]


def kernel_names(op, key):
    """{flavour: kernel name} of the kernels source(...) defines for (op, dtype key)."""
    names = {"combine": f"rc_combine_{op}_{key}", "many": f"rc_many_{op}_{key}"}
    kind = _TYPES[key][3]
    if op == "sum" and kind in "fhc":  # avg: only float and complex types
        names["scale"] = f"rc_scale_{key}"
        if kind != "h":  # half types prescale instead (ReduceOp.prescales): no fused kernel
            names["combine_scale"] = f"rc_combine_scale_{key}"
    return names


def source(pairs):
    """CUDA C++ defining the kernels of every (op, dtype key) in pairs, each helper once.

    Every kernel but 'many' has the same signature, (const T* a, const T* b, T* out,
    unsigned long long n, D d): combine ignores d, scale ignores b. 'many' is
    (const T* a0, ..., const T* a7, unsigned int k, T* out, unsigned long long n), see _many.
    """
    parts, seen = [PREAMBLE], set()
    for op, key in pairs:
        ctype, acc, div, kind = _TYPES[key]
        d_type = div or "float"
        if ("div", key) not in seen and div is not None:
            seen.add(("div", key))
            if kind == "c":  # NumPy's complex / (d + 0j): Smith's form, rat = 0, scl = 1 / d
                f = "f" if acc == "rc_c64" else "d"
                zero = "0.0f" if f == "f" else "0.0"
                body = (f"{div} s = {'1.0f' if f == 'f' else '1.0'} / d; return {acc}{{"
                        f"__{f}mul_rn(__{f}add_rn(v.re, __{f}mul_rn(v.im, {zero})), s), "
                        f"__{f}mul_rn(__{f}sub_rn(v.im, __{f}mul_rn(v.re, {zero})), s)}};")
            else:
                body = "return v / d;"
            parts.append(f"__device__ __forceinline__ {acc} rc_div_{key}({acc} v, {div} d) "
                         f"{{ {body} }}\n")
        if (op, key) in seen:
            continue
        seen.add((op, key))
        parts.append(f"__device__ __forceinline__ {acc} rc_{op}_{key}({acc} a, {acc} b) "
                     f"{{ return {_op_expr(op, key)}; }}\n")
        for flavour, name in kernel_names(op, key).items():
            if flavour == "many":
                parts.append(_many(op, key, name))
                continue
            a, b = _load(key, "a[i]"), _load(key, "b[i]")
            expr = {"combine": f"rc_{op}_{key}({a}, {b})",
                    "combine_scale": f"rc_div_{key}(rc_{op}_{key}({a}, {b}), d)",
                    "scale": f"rc_div_{key}({a}, d)"}[flavour]
            parts.append(
                f'extern "C" __global__ void {name}(const {ctype}* a, const {ctype}* b, '
                f"{ctype}* out, unsigned long long n, {d_type} d) {{\n"
                "    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x "
                "+ threadIdx.x;\n"
                "    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;\n"
                f"    for (; i < n; i += stride) out[i] = {_store(key, expr)};\n"
                "}\n")
    return "\n".join(parts)


def _many(op, key, name):
    """The 'many' kernel: out = ((a0 op a1) op a2) op ... op a(k-1), 2 <= k <= MANY.

    v goes through the stored type after every step (rc_f2h then rc_h2f for float16; nothing
    for types computed as stored) so the result is the chain of k - 1 combine launches bit for
    bit. Unrolled tests of k rather than a pointer array: an array indexed at run time would
    live in local memory on the GPU. out may be a0 (each thread reads a0[i] before writing
    out[i]), never a later input.
    """
    ctype = _TYPES[key][0]
    pointers = ", ".join(f"const {ctype}* a{j}" for j in range(MANY))
    steps = "".join(f"        if (k > {j}) v = rc_{op}_{key}({_load(key, _store(key, 'v'))}, "
                    f"{_load(key, f'a{j}[i]')});\n" for j in range(2, MANY))
    return (f'extern "C" __global__ void {name}({pointers}, unsigned int k, {ctype}* out, '
            "unsigned long long n) {\n"
            "    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x "
            "+ threadIdx.x;\n"
            "    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;\n"
            "    for (; i < n; i += stride) {\n"
            f"        {_TYPES[key][1]} v = rc_{op}_{key}({_load(key, 'a0[i]')}, "
            f"{_load(key, 'a1[i]')});\n"
            f"{steps}"
            f"        out[i] = {_store(key, 'v')};\n"
            "    }\n"
            "}\n")


def _grid(n):
    return (min((n + THREADS - 1) // THREADS, MAX_BLOCKS),)


def _nothing():
    pass


class CudaReduction:
    """The reduction of one (op, dtype) on CuPy arrays, as a combine for ringcoll's algorithms.

    combine(a, b, out): out = a (op) b, one launch on the current CuPy stream; out may be a or b.
    combine.bind(a, b, out): the same launch with its arguments bound (replayed schedules).
    combine.final(p): combine then divide by p, fused into one launch (op 'sum' only: 'avg').
    combine.many(inputs, out): out = inputs[0] (op) inputs[1] (op) ..., one launch per MANY
    inputs (the node tier's p-input reduction), bitwise the chain of combines.
    combine.scale_into(src, p, out): out = src / p (the acc argument of the CPU kernel is
    implied: half types always compute in float32 here).
    The module compiles on first use, per device.
    """

    __slots__ = ("op", "key", "_divisor", "_functions")

    def __init__(self, op, key):
        self.op, self.key = op, key
        div = _TYPES[key][2]
        self._divisor = np.float64 if div == "double" else np.float32
        self._functions = {}  # (device id, flavour) -> cupy RawKernel function

    def __repr__(self):
        return f"CudaReduction({self.op!r}, {self.key!r})"

    def _function(self, flavour):
        import cupy

        device = cupy.cuda.runtime.getDevice()
        fn = self._functions.get((device, flavour))
        if fn is None:
            module = cupy.RawModule(code=source([(self.op, self.key)]))
            for name_flavour, name in kernel_names(self.op, self.key).items():
                self._functions[(device, name_flavour)] = module.get_function(name)
            fn = self._functions[(device, flavour)]
        return fn

    def _launch(self, flavour, a, b, out, d=0):
        n = out.size
        if n:
            self._function(flavour)(_grid(n), (THREADS,),
                                    (a, b, out, np.uint64(n), self._divisor(d)))

    def __call__(self, a, b, out):
        self._launch("combine", a, b, out)

    def bind(self, a, b, out):
        n = out.size
        if not n:
            return _nothing
        return partial(self._function("combine"), _grid(n), (THREADS,),
                       (a, b, out, np.uint64(n), self._divisor(0)))

    def final(self, divisor):
        if "combine_scale" not in kernel_names(self.op, self.key):
            raise ValueError(f"no fused combine-and-scale kernel for {self.op} of {self.key}")
        return partial(self._launch, "combine_scale", d=divisor)

    def scale_into(self, src, divisor, out, acc=None):
        self._launch("scale", src, src, out, divisor)

    def many(self, inputs, out):
        """out = ((inputs[0] op inputs[1]) op inputs[2]) op ..., in ceil((len - 1) / 7) launches.

        Args:
            inputs (list of cupy.ndarray): two or more arrays of out's size and dtype.
            out (cupy.ndarray): may be the very memory of inputs[0], never of a later input.

        The first launch reduces up to MANY inputs into out; each further one takes out as its
        a0 and up to MANY - 1 more, so the order of the chain (and its rounding) is kept.
        """
        if len(inputs) < 2:
            raise ValueError(f"combine.many needs two or more inputs, got {len(inputs)}")
        n = out.size
        if not n:
            return
        fn, grid, count = self._function("many"), _grid(n), np.uint64(n)
        first, rest = inputs[:MANY], inputs[MANY:]
        batches = [first] + [[out, *rest[s:s + MANY - 1]] for s in range(0, len(rest), MANY - 1)]
        for batch in batches:
            # unused slots: any valid pointer; the kernel reads only the first k
            slots = tuple(batch) + (batch[-1],) * (MANY - len(batch))
            fn(grid, (THREADS,), slots + (np.uint32(len(batch)), out, count))


@lru_cache(maxsize=None)
def _reduction(op, key):
    return CudaReduction(op, key)


def reduction(op, dtype):
    """The CudaReduction of op ('sum', 'prod', 'max', 'min') on dtype, one per process."""
    key = dtype_key(dtype)
    if op not in OPS:
        raise ValueError(f"no CUDA kernel for op {op!r}")
    if _TYPES[key][3] == "c" and op in ("max", "min"):
        raise ValueError(f"no CUDA kernel for {op} of complex {key}")
    return _reduction(op, key)
