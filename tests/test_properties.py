"""Property-based tests (hypothesis) of every collective over the thread transport.

Each example draws a rank count, a shape and memory layout, a dtype, an op, an algorithm and the
communicator options, plus one seed. Rank r builds its input from np.random.default_rng([seed,
r]) (`make_input`), so the main thread rebuilds every rank's input and checks the result against
NumPy:

- integers: exactly, reduced by NumPy in the dtype itself (wrapping like the library does);
- floats/complex max and min: exactly;
- floats/complex sum, avg and prod on random (non-exact) data: within a rounding-error bound for
  the dtype (float16/bfloat16 accumulate in float32 per step and round to the half type after
  each step, so their bound is in half-precision eps), against a float64/complex128 oracle;
- all-reduce results are bitwise identical on every rank (the library guarantees it);
- out-of-place calls leave x untouched; in-place calls return x; out= calls return out.

Combinations the library rejects (avg on integers, max/min on complex) must raise TypeError.
`derandomize=True` makes every run test the same examples, so CI is reproducible.
"""

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import ringcoll

from _oracle import ALL_DTYPES as DTYPES
from _oracle import BFLOAT16, OPS

if BFLOAT16 is not None:
    import ml_dtypes

TIMEOUT = 20  # seconds a thread rank may wait: a deadlock fails instead of hanging

ALGORITHMS = ["auto", "ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical"]
MAX_P = 9
#: examples per property: all-reduce and reduce-scatter/reduce per dtype (x15), the data
#: movers in all; the whole file runs in about 20 s on the 2-core development VM
ALLREDUCE_EXAMPLES = 100
ROOTED_EXAMPLES = 40
MOVE_EXAMPLES = 300


def seed_for(name, dtype):
    """A fixed seed per (property, dtype): the nested per-dtype properties share one source, so
    derandomize alone would draw the very same cases for every dtype."""
    return seed(zlib.crc32(f"{name} {dtype}".encode()))


def settings_for(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def valid(op, dtype):
    """Whether the library accepts op on dtype (else: TypeError)."""
    if op == "avg" and dtype.kind in "iu":
        return False
    if op in ("max", "min") and dtype.kind == "c":
        return False
    return True


def _values(rng, shape, dtype, op):
    """Random values of `dtype` for `op`: integers over the whole range (small for prod),
    floats of varied magnitude (near 1 for prod, smaller for float16)."""
    if dtype.kind in "iu":
        if op == "prod":
            lo = 0 if dtype.kind == "u" else -4
            return rng.integers(lo, 5, size=shape).astype(dtype)
        info = np.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, size=shape, dtype=dtype)
    if op == "prod":  # magnitudes in [0.75, 1.25]: 9 ranks stay far from overflow
        mag = rng.uniform(0.75, 1.25, size=shape)
        if dtype.kind == "c":
            return (mag * np.exp(1j * rng.uniform(0, 2 * np.pi, size=shape))).astype(dtype)
        return (mag * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)
    top = 3 if dtype == np.float16 else 5
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-4, top, size=shape))
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape) * np.exp2(rng.integers(-4, top, size=shape))
    return np.asarray(x).astype(dtype)


def make_input(seed, rank, shape, layout, dtype, op="sum"):
    """Rank `rank`'s input: logical shape `shape`, laid out as `layout`:
    C, F (asfortranarray), step0 (x[::2] of a twice-as-long axis 0) or steplast (x[..., ::2])."""
    rng = np.random.default_rng([int(seed), int(rank)])
    shape = tuple(shape)
    if layout == "step0":
        return _values(rng, (2 * shape[0],) + shape[1:], dtype, op)[::2]
    if layout == "steplast":
        return _values(rng, shape[:-1] + (2 * shape[-1],), dtype, op)[..., ::2]
    x = _values(rng, shape, dtype, op)
    if layout == "F":
        return np.asfortranarray(x)
    return np.ascontiguousarray(x) if x.ndim else np.array(x)


def layouts_for(ndim):
    if ndim == 0:
        return ["C"]
    if ndim == 1:
        return ["C", "step0"]
    return ["C", "F", "step0", "steplast"]


@st.composite
def shapes(draw, p, min_ndim=0, max_dim=6):
    """A shape of 0..3 dimensions (at most a few hundred elements); 1-D lengths favour the
    edge cases 0, 1, p-1, p, p+1."""
    ndim = draw(st.sampled_from([d for d in (1, 2, 3, 0) if d >= min_ndim]))
    if ndim == 0:
        return ()
    if ndim == 1:
        return (draw(st.one_of(st.sampled_from(sorted({0, 1, max(p - 1, 0), p, p + 1})),
                               st.integers(0, 300))),)
    first = draw(st.one_of(st.sampled_from([0, 1, max(p - 1, 0), p, p + 1]),
                           st.integers(0, 2 * p + 3)))
    rest = tuple(draw(st.integers(0 if ndim == 2 else 1, max_dim)) for _ in range(ndim - 1))
    return (first,) + rest


def wide(dtype):
    if dtype.kind in "iu":
        return dtype
    return np.dtype(np.complex128) if dtype.kind == "c" else np.dtype(np.float64)


def eps_of(dtype):
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return float(ml_dtypes.finfo(BFLOAT16).eps), float(ml_dtypes.finfo(BFLOAT16).tiny)
    info = np.finfo(dtype)
    return float(info.eps), float(info.tiny)


def as_wide(a, dtype):
    a = np.asarray(a)
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        a = a.astype(np.float32)
    return a.astype(wide(dtype))


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------
def oracle(inputs, op, dtype):
    """(exact result in wide(dtype), error bound or None for an exact comparison)."""
    p = len(inputs)
    stack = np.stack([as_wide(a, dtype) for a in inputs])
    if op in ("sum", "avg"):
        res = np.add.reduce(stack, axis=0, dtype=wide(dtype))
    elif op == "prod":
        res = np.multiply.reduce(stack, axis=0, dtype=wide(dtype))
    elif op == "max":
        res = np.maximum.reduce(stack, axis=0)
    else:
        res = np.minimum.reduce(stack, axis=0)
    if dtype.kind in "iu" or op in ("max", "min"):
        return res, None
    eps, tiny = eps_of(dtype)
    atol = 4 * p * tiny * eps  # a few subnormal spacings per rank (float16 avg prescales)
    if op == "prod":
        return res, 8 * p * eps * np.abs(res) + atol
    # every partial sum is rounded at most once per step, each by <= eps/2 of sum |x|
    bound = 2 * p * eps * np.add.reduce(np.abs(stack), axis=0) + atol
    if op == "avg":
        res = res / p
        bound = bound / p + 4 * eps * np.abs(res) + atol
    return res, bound


def check_reduced(got, expected, bound, dtype, label):
    got = np.asarray(got)
    assert got.dtype == dtype, f"{label}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == expected.shape, f"{label}: shape {got.shape}, expected {expected.shape}"
    if bound is None:
        want = np.asarray(expected).astype(dtype)
        assert got.tobytes() == want.tobytes(), (
            f"{label}: got {got!r}, expected {want!r}")
        return
    err = np.abs(as_wide(got, dtype) - expected)
    ok = err <= bound
    if not np.all(ok):
        i = np.unravel_index(int(np.argmax(~ok)), ok.shape) if ok.ndim else ()
        raise AssertionError(f"{label}: at {i} got {as_wide(got, dtype)[i]!r}, "
                             f"expected {expected[i]!r} (error {err[i]:.3g} > bound "
                             f"{bound[i]:.3g}); {int(np.sum(~ok))} of {ok.size} elements off")


def run(p, fn, **options):
    return ringcoll.run_threads(p, fn, timeout=TIMEOUT, **options)


common_options = st.fixed_dictionaries({
    "segment_bytes": st.one_of(st.none(), st.integers(8, 256)),
})


@st.composite
def world(draw):
    """(p, run_threads options): segment_bytes sometimes small, local_size sometimes set."""
    p = draw(st.integers(1, MAX_P))
    options = draw(common_options)
    options["local_size"] = draw(st.one_of(st.none(), st.integers(1, p)))
    return p, options


def contiguous(x):
    return bool(x.flags.c_contiguous or x.flags.f_contiguous)


# ---------------------------------------------------------------------------------------------
# all-reduce
# ---------------------------------------------------------------------------------------------
@st.composite
def allreduce_cases(draw, dtype):
    p, options = draw(world())
    shape = draw(shapes(p))
    return dict(
        p=p, options=options, shape=shape,
        layout=draw(st.sampled_from(layouts_for(len(shape)))),
        dtype=dtype,
        op=draw(st.sampled_from(OPS)),
        algorithm=draw(st.sampled_from(ALGORITHMS)),
        mode=draw(st.sampled_from(["new", "inplace", "out_C", "out_F"])),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
    )


def check_allreduce(case):
    p, shape, layout, dtype, op = (case[k] for k in ("p", "shape", "layout", "dtype", "op"))
    algorithm, mode, seed = case["algorithm"], case["mode"], case["seed"]
    label = (f"allreduce p={p} shape={shape} layout={layout} {dtype} {op} {algorithm} "
             f"mode={mode} {case['options']}")

    def fn(comm):
        x = make_input(seed, comm.rank, shape, layout, dtype, op)
        before = x.tobytes()
        if mode == "new":
            y = comm.allreduce(x, op=op, algorithm=algorithm)
            assert y is not x and not np.shares_memory(x, y), f"{label}: result aliases x"
        elif mode == "inplace":
            y = comm.allreduce(x, op=op, algorithm=algorithm, out=x)
            assert y is x, f"{label}: in-place call did not return x"
            return y.copy()
        else:
            out = np.empty(shape, dtype, order=mode[-1])
            y = comm.allreduce(x, op=op, algorithm=algorithm, out=out)
            assert y is out, f"{label}: did not return out"
        assert x.tobytes() == before, f"{label}: out-of-place call modified x"
        return y.copy()

    x0 = make_input(seed, 0, shape, layout, dtype, op)
    if not valid(op, dtype):
        with pytest.raises(TypeError):
            run(p, fn, **case["options"])
        return
    if mode == "inplace" and not contiguous(x0):
        with pytest.raises(ValueError, match="contiguous"):
            run(p, fn, **case["options"])
        return
    results = run(p, fn, **case["options"])
    expected, bound = oracle([make_input(seed, r, shape, layout, dtype, op) for r in range(p)],
                             op, dtype)
    for r, got in enumerate(results):
        assert got.tobytes() == results[0].tobytes() and got.shape == results[0].shape, \
            f"{label}: rank {r} differs bitwise from rank 0"
    check_reduced(results[0], expected, bound, dtype, label)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_matches_numpy(dtype):
    @seed_for("allreduce", dtype)
    @settings_for(ALLREDUCE_EXAMPLES)
    @given(allreduce_cases(dtype))
    def prop(case):
        check_allreduce(case)

    prop()


# ---------------------------------------------------------------------------------------------
# reduce-scatter
# ---------------------------------------------------------------------------------------------
@st.composite
def reduce_scatter_cases(draw, dtype):
    p, options = draw(world())
    shape = draw(shapes(p))
    return dict(
        p=p, options=options, shape=shape,
        layout=draw(st.sampled_from(layouts_for(len(shape)))),
        dtype=dtype,
        op=draw(st.sampled_from(OPS)),
        out=draw(st.sampled_from([None, "C", "F"])),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_matches_numpy(dtype):
    @seed_for("reduce_scatter", dtype)
    @settings_for(ROOTED_EXAMPLES)
    @given(reduce_scatter_cases(dtype))
    def prop(case):
        check_reduce_scatter(case)

    prop()


def check_reduce_scatter(case):
    p, shape, layout, dtype, op = (case[k] for k in ("p", "shape", "layout", "dtype", "op"))
    seed, out_order = case["seed"], case["out"]
    label = (f"reduce_scatter p={p} shape={shape} layout={layout} {dtype} {op} "
             f"out={out_order} {case['options']}")
    rows_shape = shape if shape else (1,)

    def block_shape(rank):
        return (np.array_split(np.empty(rows_shape[0]), p)[rank].shape[0],) + rows_shape[1:]

    def fn(comm):
        x = make_input(seed, comm.rank, shape, layout, dtype, op)
        before = x.tobytes()
        out = None if out_order is None else np.empty(block_shape(comm.rank), dtype,
                                                      order=out_order)
        y = comm.reduce_scatter(x, op=op, out=out)
        assert out is None or y is out, f"{label}: did not return out"
        assert x.tobytes() == before, f"{label}: modified x"
        return y.copy()

    if not valid(op, dtype):
        with pytest.raises(TypeError):
            run(p, fn, **case["options"])
        return
    results = run(p, fn, **case["options"])
    expected, bound = oracle([make_input(seed, r, shape, layout, dtype, op) for r in range(p)],
                             op, dtype)
    exp_blocks = np.array_split(expected.reshape(rows_shape), p, axis=0)
    bound_blocks = (None,) * p if bound is None else np.array_split(bound.reshape(rows_shape), p)
    for r, got in enumerate(results):
        check_reduced(got, exp_blocks[r], bound_blocks[r], dtype, f"{label} rank {r}")


# ---------------------------------------------------------------------------------------------
# reduce
# ---------------------------------------------------------------------------------------------
@st.composite
def reduce_cases(draw, dtype):
    p, options = draw(world())
    shape = draw(shapes(p))
    return dict(
        p=p, options=options, shape=shape,
        layout=draw(st.sampled_from(layouts_for(len(shape)))),
        dtype=dtype,
        op=draw(st.sampled_from(OPS)),
        root=draw(st.integers(0, p - 1)),
        mode=draw(st.sampled_from(["new", "inplace", "out"])),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
    )


def send_order(x):
    """The memory order in which a rank's x is reduced: F only for an F-contiguous x."""
    return "F" if x.flags.f_contiguous and not x.flags.c_contiguous else "C"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_matches_numpy_on_root_only(dtype):
    @seed_for("reduce", dtype)
    @settings_for(ROOTED_EXAMPLES)
    @given(reduce_cases(dtype))
    def prop(case):
        check_reduce(case)

    prop()


def check_reduce(case):
    p, shape, layout, dtype, op = (case[k] for k in ("p", "shape", "layout", "dtype", "op"))
    seed, root, mode = case["seed"], case["root"], case["mode"]
    label = (f"reduce p={p} root={root} shape={shape} layout={layout} {dtype} {op} mode={mode} "
             f"{case['options']}")
    x0 = make_input(seed, 0, shape, layout, dtype, op)
    if mode == "inplace" and not contiguous(x0):
        mode = "new"  # in place on the root needs a contiguous x (allreduce tests the error)

    def fn(comm):
        x = make_input(seed, comm.rank, shape, layout, dtype, op)
        before = x.tobytes()
        if comm.rank == root and mode == "inplace":
            y = comm.reduce(x, op=op, root=root, out=x)
            assert y is x, f"{label}: in-place call did not return x"
            return y.copy()
        out = None
        if comm.rank == root and mode == "out":
            # either layout: the root reduces in x's order and copies into out if it differs
            out = np.empty(shape, dtype, order="CF"[seed % 2])
        y = comm.reduce(x, op=op, root=root, out=out)
        assert x.tobytes() == before, f"{label}: rank {comm.rank} modified x"
        if comm.rank != root:
            assert y is None, f"{label}: non-root rank {comm.rank} got {y!r}"
            return None
        assert out is None or y is out, f"{label}: did not return out"
        return y.copy()

    if not valid(op, dtype):
        with pytest.raises(TypeError):
            run(p, fn, **case["options"])
        return
    results = run(p, fn, **case["options"])
    expected, bound = oracle([make_input(seed, r, shape, layout, dtype, op) for r in range(p)],
                             op, dtype)
    assert all(results[r] is None for r in range(p) if r != root), label
    assert results[root] is not None, f"{label}: root got None"
    check_reduced(results[root], expected, bound, dtype, label)


# ---------------------------------------------------------------------------------------------
# all-gather, broadcast, all-to-all: pure data movement, checked bitwise
# ---------------------------------------------------------------------------------------------
@st.composite
def trailing(draw):
    return tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=2)))


@settings_for(MOVE_EXAMPLES)
@given(world(), st.data())
def test_allgather_concatenates(w, data):
    p, options = w
    zero_d = data.draw(st.integers(0, 9)) == 0
    trail = () if zero_d else data.draw(trailing())
    rows = [] if zero_d else data.draw(st.lists(st.integers(0, 5), min_size=p, max_size=p))
    ndim = 0 if zero_d else 1 + len(trail)
    layout = data.draw(st.sampled_from(layouts_for(ndim)))
    dtype = data.draw(st.sampled_from(DTYPES))
    out_order = data.draw(st.sampled_from([None, "C", "F"]))
    seed = data.draw(st.integers(0, 2 ** 32 - 1))
    label = (f"allgather p={p} rows={rows} trail={trail} layout={layout} {dtype} "
             f"out={out_order} {options}")

    def shape_of(r):
        return () if zero_d else (rows[r],) + trail

    total = (p,) if zero_d else (sum(rows),) + trail

    def fn(comm):
        x = make_input(seed, comm.rank, shape_of(comm.rank), layout, dtype)
        before = x.tobytes()
        out = None if out_order is None else np.empty(total, dtype, order=out_order)
        y = comm.allgather(x, out=out)
        assert out is None or y is out, f"{label}: did not return out"
        assert x.tobytes() == before, f"{label}: modified x"
        return y.copy()

    results = run(p, fn, **options)
    expected = np.concatenate([make_input(seed, r, shape_of(r), layout, dtype).reshape(
        (rows[r] if rows else 1,) + trail) for r in range(p)])
    for r, got in enumerate(results):
        assert got.dtype == dtype and got.shape == expected.shape, \
            f"{label} rank {r}: {got.shape} {got.dtype}, expected {expected.shape}"
        assert got.tobytes() == expected.tobytes(), f"{label} rank {r}: wrong data"


@settings_for(MOVE_EXAMPLES)
@given(world(), st.data())
def test_broadcast_copies_root(w, data):
    p, options = w
    shape = data.draw(shapes(p))
    layout = data.draw(st.sampled_from([lo for lo in layouts_for(len(shape))
                                        if lo in ("C", "F")]))
    dtype = data.draw(st.sampled_from(DTYPES))
    root = data.draw(st.integers(0, p - 1))
    seed = data.draw(st.integers(0, 2 ** 32 - 1))
    label = f"broadcast p={p} root={root} shape={shape} layout={layout} {dtype} {options}"
    expected = make_input(seed, root, shape, layout, dtype)

    def fn(comm):
        if comm.rank == root:
            x = make_input(seed, root, shape, layout, dtype)
        else:  # another rank's data, same shape and layout: must be overwritten
            x = make_input(seed + 1, comm.rank, shape, layout, dtype)
        y = comm.broadcast(x, root=root)
        assert y is x, f"{label}: did not return x"
        return x.copy()

    for r, got in enumerate(run(p, fn, **options)):
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), \
            f"{label} rank {r}: wrong data"


@settings_for(MOVE_EXAMPLES)
@given(world(), st.data())
def test_alltoall_exchanges_blocks(w, data):
    p, options = w
    per = data.draw(st.integers(0, 3))
    trail = data.draw(trailing())
    shape = (per * p,) + trail
    layout = data.draw(st.sampled_from(layouts_for(len(shape))))
    dtype = data.draw(st.sampled_from(DTYPES))
    out_order = data.draw(st.sampled_from([None, "C", "F"]))
    seed = data.draw(st.integers(0, 2 ** 32 - 1))
    label = (f"alltoall p={p} shape={shape} layout={layout} {dtype} out={out_order} "
             f"{options}")

    def fn(comm):
        x = make_input(seed, comm.rank, shape, layout, dtype)
        before = x.tobytes()
        out = None if out_order is None else np.empty(shape, dtype, order=out_order)
        y = comm.alltoall(x, out=out)
        assert out is None or y is out, f"{label}: did not return out"
        assert x.tobytes() == before, f"{label}: modified x"
        return y.copy()

    results = run(p, fn, **options)
    inputs = [make_input(seed, r, shape, layout, dtype) for r in range(p)]
    for r, got in enumerate(results):
        expected = np.concatenate([inputs[i][r * per:(r + 1) * per] for i in range(p)])
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), \
            f"{label} rank {r}: wrong blocks"


# ---------------------------------------------------------------------------------------------
# the oracle itself: its bound must not be vacuous
# ---------------------------------------------------------------------------------------------
def test_oracle_bound_catches_a_wrong_sum():
    inputs = [make_input(5, r, (50,), "C", np.dtype(np.float32)) for r in range(4)]
    expected, bound = oracle(inputs, "sum", np.dtype(np.float32))
    right = sum(a.astype(np.float32) for a in inputs)
    check_reduced(right, expected, bound, np.dtype(np.float32), "right")
    wrong = right.copy()
    wrong[7] += max(abs(wrong[7]) * 1e-3, 1e-3)
    with pytest.raises(AssertionError):
        check_reduced(wrong, expected, bound, np.dtype(np.float32), "wrong")
    missing = sum(a.astype(np.float32) for a in inputs[:3])  # one rank's contribution lost
    with pytest.raises(AssertionError):
        check_reduced(missing, expected, bound, np.dtype(np.float32), "missing")


# ---------------------------------------------------------------------------------------------
# regressions: library bugs the properties above found
# ---------------------------------------------------------------------------------------------
# reduce's root used to reduce in its out='s memory order while the other ranks sent x in x's
# own order, so a root out= laid out unlike x combined transposed elements.
@pytest.mark.parametrize("x_order,out_order", [("C", "F"), ("F", "C")])
def test_reduce_root_out_in_another_memory_order(x_order, out_order):
    # found as: reduce p=2 root=0 shape=(2, 2) int8 sum, C x, out= F-ordered on the root
    def fn(comm):
        x = np.asarray(np.arange(4).reshape(2, 2) * (comm.rank + 1), order=x_order)
        out = np.empty((2, 2), x.dtype, order=out_order) if comm.rank == 0 else None
        return comm.reduce(x, root=0, out=out)

    got = run(2, fn)[0]
    # was [[0, 5], [4, 9]]: the off-diagonal elements of rank 1 swapped
    np.testing.assert_array_equal(got, np.arange(4).reshape(2, 2) * 3)
