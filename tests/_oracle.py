"""Inputs and oracles shared by the thread tier (test_threads.py) and the MPI tier (mpi_checks.py).

Every rank builds its input from a seeded RNG keyed by (seed, rank), so whoever checks the result
can rebuild every rank's input and compute the expected value with NumPy. The data are chosen so
that the reduction is exact in any order:

- integers: any values; NumPy's integer arithmetic wraps modulo 2^bits, which is associative, so
  the reduction equals the oracle's exactly whatever order the algorithm combines in;
- floats and complex for sum/avg/max/min: small integer values (|x| <= 8), whose sums over up to
  16 ranks are exact even in float16/bfloat16;
- floats for prod: +-1 and +-0.5 (products are exact powers of two, no overflow at 16 ranks);
  complex for prod: units 1, -1, 1j, -1j, 1+1j (exact small Gaussian integers).

So the expected value is exact and the comparison is equality (avg: within 2 ulp, the division
may round twice). Random, non-exact float data are tested separately with a tolerance.
"""

import numpy as np

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BFLOAT16 = None

INT_DTYPES = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                    np.uint8, np.uint16, np.uint32, np.uint64)]
FLOAT_DTYPES = [np.dtype(t) for t in (np.float16, np.float32, np.float64)]
if BFLOAT16 is not None:
    FLOAT_DTYPES.append(BFLOAT16)
COMPLEX_DTYPES = [np.dtype(np.complex64), np.dtype(np.complex128)]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES
HALF_DTYPES = [d for d in (np.dtype(np.float16), BFLOAT16) if d is not None]
OPS = ["sum", "prod", "max", "min", "avg"]


def valid(op, dtype):
    dtype = np.dtype(dtype)
    if op == "avg" and dtype.kind in "iu":
        return False
    if op in ("max", "min") and dtype.kind == "c":
        return False
    return True


#: every (dtype, op) pair ringcoll must accept, in a fixed order
COMBOS = [(d, op) for op in OPS for d in ALL_DTYPES if valid(op, d)]


def rng_for(seed, rank):
    return np.random.default_rng([int(seed), int(rank), 0x5EED])


def make_input(seed, rank, shape, dtype, op="sum"):
    """Rank `rank`'s input for the case `seed`: exact to reduce in any order (module docstring).

    Always an ndarray (0-d for shape ()), C-contiguous, of exactly `dtype`.
    """
    x = np.asarray(_make_input(seed, rank, shape, dtype, op))
    assert x.dtype == np.dtype(dtype) and x.shape == tuple(shape)
    return np.ascontiguousarray(x) if x.ndim else x.copy()


def _make_input(seed, rank, shape, dtype, op):
    dtype = np.dtype(dtype)
    rng = rng_for(seed, rank)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if op == "prod":
            lo, hi = (0, 4) if dtype.kind == "u" else (-3, 4)
        else:  # the whole range: sums wrap, exactly as in the oracle
            lo, hi = int(info.min), int(info.max) + 1
        return rng.integers(lo, hi, size=shape, dtype=dtype)
    if dtype.kind == "c":
        if op == "prod":
            units = np.array([1, -1, 1j, -1j, 1 + 1j])
            return units[rng.integers(0, len(units), size=shape)].astype(dtype)
        re = rng.integers(-8, 9, size=shape)
        im = rng.integers(-8, 9, size=shape)
        return (re + 1j * im).astype(dtype)
    # real floats, including float16 and bfloat16
    if op == "prod":
        vals = np.array([-1.0, -0.5, 0.5, 1.0])
        return vals[rng.integers(0, len(vals), size=shape)].astype(dtype)
    return rng.integers(-8, 9, size=shape).astype(np.float64).astype(dtype)


def wide(dtype):
    """The dtype the oracle computes in: the dtype itself for integers (wrapping), else 64-bit."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return dtype
    return np.dtype(np.complex128) if dtype.kind == "c" else np.dtype(np.float64)


def reduce_oracle(inputs, op, dtype):
    """The exact reduction of the per-rank inputs (a list in rank order), in dtype."""
    dtype = np.dtype(dtype)
    w = wide(dtype)
    stack = np.stack([np.asarray(a).astype(w) for a in inputs])
    if op in ("sum", "avg"):
        res = np.add.reduce(stack, axis=0, dtype=w)
        if op == "avg":
            res = res / len(inputs)
    elif op == "prod":
        res = np.multiply.reduce(stack, axis=0, dtype=w)
    elif op == "max":
        res = np.maximum.reduce(stack, axis=0)
    elif op == "min":
        res = np.minimum.reduce(stack, axis=0)
    else:
        raise ValueError(op)
    return np.asarray(res).astype(dtype)


def _eps(dtype):
    dtype = np.dtype(dtype)
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return float(ml_dtypes.finfo(BFLOAT16).eps)
    return float(np.finfo(dtype).eps)


def _cmp_view(a):
    a = np.asarray(a)
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        return a.astype(np.float32)
    return a


def compare(got, expected, op, dtype, nranks=None):
    """None if got matches the oracle (exactly; avg to 2 ulp), else a short description.

    float16/bfloat16 avg divides each contribution by p before the sum (so it cannot
    overflow), which rounds every term and every stored partial sum: with |x| <= 8 the error
    is at most 4 eps per term in all plus 4 eps per step, i.e. 4 p eps; nranks gives p.
    """
    dtype = np.dtype(dtype)
    got = np.asarray(got)
    if got.dtype != dtype:
        return f"dtype {got.dtype}, expected {dtype}"
    if got.shape != np.shape(expected):
        return f"shape {got.shape}, expected {np.shape(expected)}"
    g, e = _cmp_view(got), _cmp_view(expected)
    if op == "avg":
        eps = _eps(dtype)
        prescaled = dtype.itemsize == 2 and dtype.kind != "i" and dtype.kind != "u"
        atol = 4 * (nranks or 16) * eps if prescaled else 0
        ok = np.allclose(g.astype(wide(dtype)), e.astype(wide(dtype)), rtol=2 * eps, atol=atol)
    else:
        ok = np.array_equal(g, e)
    if ok:
        return None
    bad = np.flatnonzero(~np.isclose(g.astype(wide(dtype)).reshape(-1),
                                     e.astype(wide(dtype)).reshape(-1), rtol=0, atol=0))
    i = int(bad[0]) if bad.size else 0
    return (f"{bad.size} of {g.size} elements differ; first at flat index {i}: "
            f"got {g.reshape(-1)[i]!r}, expected {e.reshape(-1)[i]!r}")


def identical(results):
    """None if all ranks' results are bitwise identical (same dtype and shape too), else who not."""
    ref = results[0]
    bad = [r for r, x in enumerate(results)
           if x.dtype != ref.dtype or x.shape != ref.shape or x.tobytes() != ref.tobytes()]
    return None if not bad else f"ranks {bad} differ bitwise from rank 0"


def random_floats(seed, rank, shape, dtype):
    """Non-exact data (normal, with varied magnitudes) for the bitwise-identity checks."""
    rng = rng_for(seed, rank)
    dtype = np.dtype(dtype)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, size=shape))
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def float_tolerance(inputs, dtype):
    """An absolute error bound for a sum of `inputs` done in any order in dtype (float32 for halves:
    each step accumulates in float32 then rounds to the half type)."""
    dtype = np.dtype(dtype)
    eps = _eps(dtype)
    mag = np.add.reduce(np.stack([np.abs(_cmp_view(a).astype(wide(dtype))) for a in inputs]),
                        axis=0)
    return 2 * len(inputs) * eps * mag + 1e-30


def same_bits(got, want):
    """Bitwise equal, except that a NaN only has to meet a NaN (GPU arithmetic returns a
    canonical NaN where the CPU keeps payloads)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind in "iu":
        return np.array_equal(got, want)
    if got.dtype.kind == "c":  # the real and imaginary parts, as floats
        got, want = got.view(got.real.dtype), want.view(want.real.dtype)
    size = got.dtype.itemsize
    nan = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    return bool(np.all((got.view(f"u{size}") == want.view(f"u{size}")) | nan))


# -- data movement: the dtypes broadcast, gather, allgather and alltoall take beyond numbers --
#: a struct with 7 padding bytes after 'a' (align=True): its padding must travel too
PADDED_STRUCT = np.dtype([("a", "u1"), ("b", "<f8")], align=True)
MOVABLE_DTYPES = [np.dtype(d) for d in (bool, "S7", "U3", PADDED_STRUCT, "datetime64[ns]",
                                        "timedelta64[s]", np.complex128, "V5")]


def make_bytes(seed, rank, shape, dtype):
    """Rank `rank`'s input of case `seed` for a data-movement check: random bytes, so every
    bit (a struct's padding, a NaN's payload, NaT) must arrive as it was. Kept legal where
    NumPy cares: bools are 0 or 1, 'U' code points are below the surrogates."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    rng = rng_for(seed, rank)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "U":
        points = rng.integers(32, 0xD800, count * (dtype.itemsize // 4), dtype=np.uint32)
        return points.view(dtype).reshape(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def concat_bytes(parts, dtype, row_shape):
    """np.concatenate(parts) along axis 0, byte for byte (NumPy's own concatenate copies a
    struct field by field and leaves its padding as np.empty found it)."""
    raw = b"".join(np.ascontiguousarray(a).tobytes() for a in parts)
    return np.frombuffer(raw, np.dtype(dtype)).reshape((-1,) + tuple(row_shape))
