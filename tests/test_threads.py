"""Thread tier: every collective at 1..16 ranks, each rank a thread (ringcoll.run_threads).

The thread transport follows MPI's matching rules, so the algorithms run exactly as under
mpiexec. Every rank's input comes from a seeded RNG keyed by its rank (tests/_oracle.py), so the
test rebuilds all inputs and checks each rank's result against NumPy, exactly for integers, and
checks that all ranks hold bitwise identical results.
"""

import itertools
import threading
import time

import numpy as np
import pytest

import ringcoll
from ringcoll.algorithms import ALLREDUCE, CostModel
from ringcoll.arrays import Partition

import _oracle as O

TIMEOUT = 20  # seconds a thread rank may wait for a message: a deadlock fails, fast

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical", "node",
              "auto")
#: (algorithm, local_size): hierarchical on one node, and on nodes of 1, 2 and 3 ranks
CONFIGS = [
    ("ring", None), ("recursive_doubling", None), ("rabenseifner", None), ("bruck", None),
    ("hierarchical", None), ("hierarchical", 1), ("hierarchical", 2), ("hierarchical", 3),
    ("auto", None), ("auto", 2), ("node", None),
]
CONFIG_IDS = [f"{a}-ls{k}" for a, k in CONFIGS]
PS = list(range(1, 17))
SEGMENTS = [None, 64]  # None: the 1 MiB default (one segment); 64 B: many pipeline segments
SLOTS = 24  # allreduce calls per grid test: 6 counts x (out-of-place, in-place) x 2 combos


def run(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.run_threads(p, fn, **options)


def per_rank(p, fn, **options):
    """Run fn(comm) on p ranks: [each rank's result, or the exception it raised].

    A raising rank still fails its world (so the others are released with PeerFailedError,
    as in real use); run_threads' own re-raise is swallowed here.
    """
    outcome = [None] * p

    def body(comm):
        try:
            outcome[comm.rank] = fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[comm.rank] = exc
            raise

    try:
        run(p, body, **options)
    except Exception:  # noqa: BLE001 - every rank's outcome is returned instead
        pass
    return outcome


def check_all(failures):
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:40])


# ---------------------------------------------------------------------------------------------
# all-reduce: the grid
# ---------------------------------------------------------------------------------------------
def grid_counts(p, seg):
    big = 10007 if seg is None else 1001
    return sorted({0, 1, max(p - 1, 0), p, p + 1, big})


def grid_cases(cfg_index, p, seg):
    """[(seed, count, in_place, dtype, op)] of one grid test.

    (dtype, op) cycles through every valid pair (O.COMBOS): consecutive slots over p and the two
    segment sizes take consecutive pairs (stride 7, coprime to the number of pairs), so every
    algorithm meets every dtype x op pair (test_grid_covers_every_combo checks it).
    """
    seg_index = SEGMENTS.index(seg)
    cases = []
    for i, (count, in_place, _) in enumerate(
            itertools.product(grid_counts(p, seg), (False, True), range(2))):
        g = (seg_index * len(PS) + (p - 1)) * SLOTS + i
        dtype, op = O.COMBOS[(7 * g + 11 * cfg_index) % len(O.COMBOS)]
        seed = 1_000_000 * cfg_index + 1000 * g + 17
        cases.append((seed, count, in_place, dtype, op))
    return cases


def test_grid_covers_every_combo():
    for cfg_index in range(len(CONFIGS)):
        seen = {(d, op) for p in PS for seg in SEGMENTS
                for (_, _, _, d, op) in grid_cases(cfg_index, p, seg)}
        assert seen == set(O.COMBOS), CONFIGS[cfg_index]


@pytest.mark.parametrize("seg", SEGMENTS, ids=["seg-default", "seg-64B"])
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)), ids=CONFIG_IDS)
def test_allreduce_grid(cfg_index, p, seg):
    algorithm, local_size = CONFIGS[cfg_index]
    cases = grid_cases(cfg_index, p, seg)

    def fn(comm):
        out = []
        for seed, count, in_place, dtype, op in cases:
            x = O.make_input(seed, comm.rank, (count,), dtype, op)
            before = x.copy()
            if in_place:
                y = comm.allreduce(x, op=op, algorithm=algorithm, out=x)
                note = None if y is x else "in-place call did not return x"
            else:
                y = comm.allreduce(x, op=op, algorithm=algorithm)
                note = None if x.tobytes() == before.tobytes() \
                    else "out-of-place call modified its input"
                if y is x or np.shares_memory(x, y):
                    note = "out-of-place result shares memory with the input"
            out.append((y.copy(), note))
        return out

    # seg-64B also cuts the node tier's calls into chunks of 256 bytes (many per call)
    results = run(p, fn, local_size=local_size, segment_bytes=seg,
                  node_chunk=None if seg is None else 256)
    failures = []
    for k, (seed, count, in_place, dtype, op) in enumerate(cases):
        label = f"{algorithm} p={p} count={count} {dtype} {op} in_place={in_place} seg={seg}"
        expected = O.reduce_oracle([O.make_input(seed, r, (count,), dtype, op)
                                    for r in range(p)], op, dtype)
        for r in range(p):
            got, note = results[r][k]
            if note:
                failures.append(f"{label} rank {r}: {note}")
            bad = O.compare(got, expected, op, dtype, nranks=p)
            if bad:
                failures.append(f"{label} rank {r}: {bad}")
        bad = O.identical([results[r][k][0] for r in range(p)])
        if bad:
            failures.append(f"{label}: {bad}")
    check_all(failures)


@pytest.mark.parametrize("p", [2, 3, 5, 6, 7, 8, 11, 13, 16])
@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)), ids=CONFIG_IDS)
def test_allreduce_random_floats_bitwise_identical(cfg_index, p):
    """Non-exact float data: all ranks bitwise identical, and within rounding of the exact sum."""
    algorithm, local_size = CONFIGS[cfg_index]
    dtypes = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
              np.dtype(np.complex64)] + ([O.BFLOAT16] if O.BFLOAT16 is not None else [])
    cases = [(900 + i, dt, op, n) for i, (dt, op, n) in
             enumerate(itertools.product(dtypes, ("sum", "avg"), (3 * p + 1, 777)))]

    def fn(comm):
        return [comm.allreduce(O.random_floats(seed, comm.rank, (n,), dt), op=op,
                               algorithm=algorithm) for seed, dt, op, n in cases]

    results = run(p, fn, local_size=local_size, segment_bytes=96 if p % 2 else None)
    failures = []
    for k, (seed, dt, op, n) in enumerate(cases):
        label = f"{algorithm} p={p} {dt} {op} n={n}"
        got = [results[r][k] for r in range(p)]
        bad = O.identical(got)
        if bad:
            failures.append(f"{label}: {bad}")
        inputs = [O.random_floats(seed, r, (n,), dt) for r in range(p)]
        exact = np.add.reduce(np.stack([O._cmp_view(a).astype(O.wide(dt)) for a in inputs]),
                              axis=0)
        tol = O.float_tolerance(inputs, dt)
        if op == "avg":
            exact, tol = exact / p, tol / p + np.abs(exact / p) * 4 * O._eps(dt)
        err = np.abs(O._cmp_view(got[0]).astype(O.wide(dt)) - exact)
        if not np.all(err <= tol):
            i = int(np.argmax(err - tol))
            failures.append(f"{label}: error {err[i]} > bound {tol[i]} at {i}")
    check_all(failures)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 16])
def test_allreduce_rank_values_exact(algorithm, p):
    """Rank-valued integers: the sum is p(p-1)/2, the max p-1, the min 0, exactly."""

    def fn(comm):
        x = np.full(5, comm.rank, dtype=np.int64)
        return [comm.allreduce(x, op=op, algorithm=algorithm) for op in ("sum", "max", "min")]

    for r, (s, mx, mn) in enumerate(run(p, fn, local_size=2 if p > 2 else None)):
        assert s.tolist() == [p * (p - 1) // 2] * 5, r
        assert mx.tolist() == [p - 1] * 5 and mn.tolist() == [0] * 5, r


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_int64_beyond_float_precision(algorithm):
    """Integers are summed as integers: values above 2**53 that float64 would round."""
    p = 5
    base = 2 ** 60 + 1

    def fn(comm):
        return comm.allreduce(np.array([base + comm.rank, -base - 3 * comm.rank], np.int64),
                              algorithm=algorithm)

    expected = np.array([sum(base + r for r in range(p)), sum(-base - 3 * r for r in range(p))])
    assert int(float(expected[0])) != int(expected[0])  # not representable in float64
    for y in run(p, fn, local_size=2):
        assert y.dtype == np.int64
        assert y.tolist() == expected.tolist()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_mpi_ops(algorithm):
    """mpi4py's MPI.SUM/PROD/MAX/MIN are accepted as ops and mean sum/prod/max/min."""
    MPI = pytest.importorskip("mpi4py.MPI")
    p = 3
    ops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}

    def fn(comm):
        x = np.array([comm.rank + 1.0, 2.0 - comm.rank])
        return {name: comm.allreduce(x, op=op, algorithm=algorithm) for name, op in ops.items()}

    stack = np.array([[r + 1.0, 2.0 - r] for r in range(p)])
    for res in run(p, fn):
        assert res["sum"].tolist() == stack.sum(0).tolist()
        assert res["prod"].tolist() == stack.prod(0).tolist()
        assert res["max"].tolist() == stack.max(0).tolist()
        assert res["min"].tolist() == stack.min(0).tolist()


def test_allreduce_op_names_are_case_insensitive_and_mean_is_avg():
    def fn(comm):
        x = np.array([float(comm.rank)])
        return comm.allreduce(x, op="SUM"), comm.allreduce(x, op="mean"), comm.allreduce(x, "Max")

    for s, m, mx in run(4, fn):
        assert s.tolist() == [6.0] and m.tolist() == [1.5] and mx.tolist() == [3.0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", [1, 3, 4])
def test_allreduce_zero_dim(algorithm, p):
    def fn(comm):
        x = np.array(comm.rank + 0.5)
        y = comm.allreduce(x, algorithm=algorithm)
        z = comm.allreduce(np.int32(comm.rank), op="max", algorithm=algorithm)
        w = np.array(comm.rank + 1.0)
        v = comm.allreduce(w, op="prod", algorithm=algorithm, out=w)
        return y, z, v is w, w

    for y, z, same, w in run(p, fn, local_size=2):
        assert y.shape == () and y == sum(r + 0.5 for r in range(p))
        assert np.asarray(z).shape == () and z == p - 1 and np.asarray(z).dtype == np.int32
        assert same and w.shape == () and w == np.prod([r + 1.0 for r in range(p)])


LAYOUTS = ["F", "C_out_for_F", "F_out_for_C", "strided", "transposed_strided", "2d_C"]


def layout_input(kind, seed, rank):
    base = O.make_input(seed, rank, (6, 10), np.float64)
    if kind in ("F", "C_out_for_F"):
        return np.asfortranarray(base)
    if kind == "strided":
        return O.make_input(seed, rank, (6, 20), np.float64)[:, ::2]
    if kind == "transposed_strided":
        return O.make_input(seed, rank, (20, 6), np.float64)[::2].T
    return base


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_layouts(algorithm, kind):
    """F-contiguous, non-contiguous and mixed-layout inputs/outputs give the right values."""
    p = 5

    def fn(comm):
        x = layout_input(kind, 31, comm.rank)
        before = x.copy()
        if kind == "C_out_for_F":
            out = np.empty(x.shape, order="C")
            y = comm.allreduce(x, algorithm=algorithm, out=out)
        elif kind == "F_out_for_C":
            out = np.empty(x.shape, order="F")
            y = comm.allreduce(x, algorithm=algorithm, out=out)
        else:
            out, y = None, comm.allreduce(x, algorithm=algorithm)
        in_place = None
        if kind in ("F", "2d_C"):
            z = x.copy(order="K")
            in_place = (comm.allreduce(z, algorithm=algorithm, out=z) is z, z)
        return y, out, np.array_equal(x, before), in_place

    expected = sum(layout_input(kind, 31, r) for r in range(p))
    results = run(p, fn, local_size=2, segment_bytes=64)
    for r, (y, out, unchanged, in_place) in enumerate(results):
        assert np.array_equal(y, expected), (kind, r)
        assert unchanged, f"rank {r}: input modified"
        if out is not None:
            assert y is out
        if in_place is not None:
            assert in_place[0] and np.array_equal(in_place[1], expected)


# ---------------------------------------------------------------------------------------------
# reduce-scatter, all-gather, broadcast, reduce, all-to-all, barrier
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
def test_reduce_scatter(p):
    rows_list = sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3})
    cases = []
    for i, (rows, trail) in enumerate(itertools.product(rows_list, ((), (3,), (2, 2)))):
        dtype, op = O.COMBOS[(5 * (i + 37 * p)) % len(O.COMBOS)]
        cases.append((7000 + 100 * p + i, (rows,) + trail, dtype, op, i % 2 == 0))

    def fn(comm):
        res = []
        for seed, shape, dtype, op, give_out in cases:
            x = O.make_input(seed, comm.rank, shape, dtype, op)
            before = x.copy()
            block = np.array_split(np.empty(shape[0]), comm.size)[comm.rank].shape[0]
            out = np.empty((block,) + shape[1:], dtype) if give_out else None
            y = comm.reduce_scatter(x, op=op, out=out)
            res.append((y.copy(), out is None or y is out,
                        x.tobytes() == before.tobytes()))
        return res

    results = run(p, fn, segment_bytes=64 if p % 3 == 0 else None)
    failures = []
    for k, (seed, shape, dtype, op, give_out) in enumerate(cases):
        full = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op) for r in range(p)],
                               op, dtype)
        blocks = np.array_split(full, p, axis=0)
        for r in range(p):
            got, returned_out, unchanged = results[r][k]
            label = f"p={p} shape={shape} {dtype} {op} out={give_out} rank {r}"
            bad = O.compare(got, blocks[r], op, dtype, nranks=p)
            if bad:
                failures.append(f"{label}: {bad}")
            if not returned_out:
                failures.append(f"{label}: did not return out")
            if not unchanged:
                failures.append(f"{label}: input modified")
    check_all(failures)


@pytest.mark.parametrize("p", PS)
def test_allgather(p):
    cases = [  # (seed, rows per rank, trailing shape, dtype)
        (1, [(r * 7 + 3) % 4 for r in range(p)], (), O.ALL_DTYPES[p % len(O.ALL_DTYPES)]),
        (2, [(r * 5 + 1) % 3 for r in range(p)], (2, 3), O.ALL_DTYPES[(p + 5) % len(O.ALL_DTYPES)]),
        (3, [4] * p, (5,), np.dtype(np.float32)),
        (4, [0] * p, (2,), np.dtype(np.int16)),
        (5, [1001 if r == p // 2 else 1 for r in range(p)], (), np.dtype(np.float64)),
    ]

    def fn(comm):
        res = []
        for i, (seed, rows, trail, dtype) in enumerate(cases):
            x = O.make_input(seed, comm.rank, (rows[comm.rank],) + trail, dtype)
            before = x.copy()
            out = np.empty((sum(rows),) + trail, dtype) if i % 2 else None
            y = comm.allgather(x, out=out)
            res.append((y.copy(), out is None or y is out, np.array_equal(x, before)))
        return res

    results = run(p, fn, segment_bytes=64 if p % 2 else None)
    failures = []
    for k, (seed, rows, trail, dtype) in enumerate(cases):
        expected = np.concatenate([O.make_input(seed, r, (rows[r],) + trail, dtype)
                                   for r in range(p)])
        for r in range(p):
            got, returned_out, unchanged = results[r][k]
            if got.dtype != dtype or got.shape != expected.shape or \
                    got.tobytes() != expected.tobytes():
                failures.append(f"p={p} case {k} rank {r}: got {got.shape} {got.dtype}")
            if not (returned_out and unchanged):
                failures.append(f"p={p} case {k} rank {r}: out not returned / input modified")
    check_all(failures)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_allgather_zero_dim_and_non_contiguous(p):
    def fn(comm):
        a = comm.allgather(np.float32(comm.rank))
        big = np.arange(40).reshape(4, 10) + 100 * comm.rank
        b = comm.allgather(big[:, ::3])
        c = comm.allgather(np.asfortranarray(big))
        return a, b, c

    for a, b, c in run(p, fn):
        assert a.shape == (p,) and a.dtype == np.float32 and a.tolist() == list(range(p))
        assert np.array_equal(b, np.concatenate([(np.arange(40).reshape(4, 10) + 100 * r)[:, ::3]
                                                 for r in range(p)]))
        assert np.array_equal(c, np.concatenate([np.arange(40).reshape(4, 10) + 100 * r
                                                 for r in range(p)]))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 12, 16])
def test_broadcast_every_root(p):
    shapes = [(0,), (1,), (1001,), (3, 4), ()]

    def fn(comm):
        res = []
        for root in range(p):
            for i, shape in enumerate(shapes):
                dtype = O.ALL_DTYPES[(root + 3 * i) % len(O.ALL_DTYPES)]
                seed = 100 * root + i
                if comm.rank == root:
                    x = O.make_input(seed, root, shape, dtype)
                    if len(shape) == 2:
                        x = np.asfortranarray(x)
                else:  # garbage of the right shape and layout
                    x = np.full(shape, 3, dtype=dtype, order="F" if len(shape) == 2 else "C")
                before = x.copy()
                y = comm.broadcast(x, root=root)
                res.append((x.copy(), y is x, comm.rank != root or np.array_equal(x, before)))
        return res

    results = run(p, fn)
    failures = []
    k = 0
    for root in range(p):
        for i, shape in enumerate(shapes):
            dtype = O.ALL_DTYPES[(root + 3 * i) % len(O.ALL_DTYPES)]
            expected = O.make_input(100 * root + i, root, shape, dtype)
            for r in range(p):
                got, same, unchanged = results[r][k]
                if got.shape != expected.shape or not np.array_equal(got, expected):
                    failures.append(f"p={p} root={root} shape={shape} rank {r}: wrong data")
                if not (same and unchanged):
                    failures.append(f"p={p} root={root} rank {r}: not in place / root changed")
            k += 1
    check_all(failures)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_reduce_scatter_zero_dim_and_non_contiguous(p):
    def fn(comm):
        a = comm.reduce_scatter(np.float64(comm.rank + 1))
        base = np.arange(4 * p * 6).reshape(4 * p, 6) * (comm.rank + 1)
        b = comm.reduce_scatter(base[:, ::2], op="max")
        c = comm.reduce_scatter(np.asfortranarray(base))
        return a, b, c

    s = sum(r + 1 for r in range(p))
    base = np.arange(4 * p * 6).reshape(4 * p, 6)
    for r, (a, b, c) in enumerate(run(p, fn)):
        assert a.shape == ((1,) if r == 0 else (0,)) and (r != 0 or a[0] == s)
        assert np.array_equal(b, (base[:, ::2] * p)[4 * r:4 * r + 4])
        assert np.array_equal(c, (base * s)[4 * r:4 * r + 4])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8, 11, 16])
def test_reduce_every_root(p):
    shapes = [(7,), (0,), (), (4, 3)]

    def fn(comm):
        res = []
        for root in range(p):
            for i, shape in enumerate(shapes):
                dtype, op = O.COMBOS[(3 * root + 13 * i + p) % len(O.COMBOS)]
                seed = 50 + 10 * root + i
                x = O.make_input(seed, comm.rank, shape, dtype, op)
                before = x.copy()
                mode = (root + i) % 3  # 0: new array, 1: out= on root, 2: in place on root
                if mode == 1 and comm.rank == root:
                    out = np.empty(shape, dtype)
                    y = comm.reduce(x, op=op, root=root, out=out)
                    flag = y is out
                elif mode == 2 and comm.rank == root:
                    y = comm.reduce(x, op=op, root=root, out=x)
                    flag = y is x
                else:
                    y = comm.reduce(x, op=op, root=root)
                    flag = x.tobytes() == before.tobytes()
                res.append((None if y is None else y.copy(), flag))
        return res

    results = run(p, fn)
    failures = []
    k = 0
    for root in range(p):
        for i, shape in enumerate(shapes):
            dtype, op = O.COMBOS[(3 * root + 13 * i + p) % len(O.COMBOS)]
            seed = 50 + 10 * root + i
            expected = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op)
                                        for r in range(p)], op, dtype)
            for r in range(p):
                got, flag = results[r][k]
                label = f"p={p} root={root} {shape} {dtype} {op} rank {r}"
                if r == root:
                    bad = ("returned None" if got is None
                           else O.compare(got, expected, op, dtype, nranks=p))
                    if bad:
                        failures.append(f"{label}: {bad}")
                elif got is not None:
                    failures.append(f"{label}: non-root got {got!r}, expected None")
                if not flag:
                    failures.append(f"{label}: out not returned or input modified")
            k += 1
    check_all(failures)


def test_reduce_non_contiguous_and_fortran():
    p = 4

    def fn(comm):
        base = np.arange(60.0).reshape(6, 10) * (comm.rank + 1)
        a = comm.reduce(base[:, ::2], root=1)
        b = comm.reduce(np.asfortranarray(base), root=2, op="max")
        return a, b

    res = run(p, fn)
    s = sum(r + 1 for r in range(p))
    assert np.array_equal(res[1][0], np.arange(60.0).reshape(6, 10)[:, ::2] * s)
    assert np.array_equal(res[2][1], np.arange(60.0).reshape(6, 10) * p)
    assert res[0][0] is None and res[0][1] is None


@pytest.mark.parametrize("p", PS)
def test_alltoall(p):
    cases = [(rows_per, trail, O.ALL_DTYPES[(p + i) % len(O.ALL_DTYPES)])
             for i, (rows_per, trail) in enumerate([(1, ()), (3, (2,)), (0, (4,)), (2, (2, 2))])]

    def fn(comm):
        res = []
        for i, (rows_per, trail, dtype) in enumerate(cases):
            x = O.make_input(300 + i, comm.rank, (rows_per * p,) + trail, dtype)
            before = x.copy()
            out = np.empty_like(x) if i % 2 else None
            y = comm.alltoall(x, out=out)
            res.append((y.copy(), out is None or y is out, np.array_equal(x, before)))
        return res

    results = run(p, fn)
    failures = []
    for k, (rows_per, trail, dtype) in enumerate(cases):
        inputs = [O.make_input(300 + k, r, (rows_per * p,) + trail, dtype) for r in range(p)]
        for r in range(p):
            expected = np.concatenate([inputs[i][r * rows_per:(r + 1) * rows_per]
                                       for i in range(p)])
            got, returned_out, unchanged = results[r][k]
            if got.shape != expected.shape or got.tobytes() != expected.tobytes():
                failures.append(f"p={p} case {k} rank {r}: wrong blocks")
            if not (returned_out and unchanged):
                failures.append(f"p={p} case {k} rank {r}: out not returned / input modified")
    check_all(failures)


def test_alltoall_non_contiguous_input():
    p = 3

    def fn(comm):
        x = (np.arange(6 * 8).reshape(6, 8) + 1000 * comm.rank)[:, ::2]
        return comm.alltoall(x)

    res = run(p, fn)
    inputs = [(np.arange(6 * 8).reshape(6, 8) + 1000 * r)[:, ::2] for r in range(p)]
    for r in range(p):
        assert np.array_equal(res[r], np.concatenate([inputs[i][2 * r:2 * r + 2]
                                                      for i in range(p)]))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 16])
def test_barrier_waits_for_everyone(p):
    """After barrier() returns on any rank, every rank has entered it (several rounds)."""
    rounds = 4
    arrived = [[False] * p for _ in range(rounds)]
    lock = threading.Lock()

    def fn(comm):
        seen = []
        for k in range(rounds):
            if comm.rank == (k * 3) % p:
                time.sleep(0.02)  # one late rank per round
            with lock:
                arrived[k][comm.rank] = True
            comm.barrier()
            with lock:
                seen.append(all(arrived[k]))
        return seen

    for r, seen in enumerate(run(p, fn)):
        assert seen == [True] * rounds, f"rank {r} left a barrier before everyone arrived: {seen}"


# ---------------------------------------------------------------------------------------------
# non-blocking, split, topology
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 8])
def test_iallreduce_outstanding_then_blocking(p):
    specs = [  # (algorithm, dtype, op, count, in place)
        ("ring", np.float64, "sum", 1001, False),
        ("recursive_doubling", np.int32, "max", 5, True),
        ("rabenseifner", np.float32, "prod", 64, False),
        ("bruck", np.float64, "min", 7, True),
        ("hierarchical", np.int64, "sum", 3, True),
        ("auto", np.complex128, "sum", 0, False),
    ]

    def fn(comm):
        xs, reqs = [], []
        for i, (algo, dt, op, n, in_place) in enumerate(specs):
            x = O.make_input(400 + i, comm.rank, (n,), dt, op)
            xs.append(x)
            reqs.append(comm.iallreduce(x, op=op, algorithm=algo, out=x if in_place else None))
        gathered = comm.allgather(np.array([comm.rank * 10]))  # runs after all of them
        total = comm.allreduce(np.array([1]))
        outs = [req.wait() for req in reqs]
        done = [req.test() for req in reqs]
        same = [out is x for out, x, s in zip(outs, xs, specs) if s[4]]
        return outs, gathered, total, done, same

    for r, (outs, gathered, total, done, same) in enumerate(run(p, fn, local_size=2)):
        for i, (algo, dt, op, n, _) in enumerate(specs):
            expected = O.reduce_oracle([O.make_input(400 + i, q, (n,), dt, op)
                                        for q in range(p)], op, dt)
            assert O.compare(outs[i], expected, op, dt, nranks=p) is None, (r, algo)
        assert gathered.tolist() == [10 * q for q in range(p)]
        assert total.tolist() == [p]
        assert all(done) and all(same)


def test_iallreduce_error_is_raised_by_wait():
    """A failure inside the background collective (here: mismatched counts) comes out of wait()."""
    def fn(comm):
        req = comm.iallreduce(np.ones(4 + comm.rank), algorithm="recursive_doubling")
        return req.wait()

    with pytest.raises(ringcoll.RingcollError):
        run(2, fn, timeout=5)


def test_close_and_context_manager_finish_outstanding_work():
    def fn(comm):
        x = np.full(1000, comm.rank + 1.0)
        with comm:
            req = comm.iallreduce(x, out=x)
        return req.test(), x

    for done, x in run(3, fn):
        assert done and np.all(x == 6.0)


def test_iallreduce_test_polls_until_done():
    def fn(comm):
        req = comm.iallreduce(np.full(20000, comm.rank, np.float64), algorithm="ring")
        deadline = time.time() + TIMEOUT
        while not req.test():
            assert time.time() < deadline
            time.sleep(0.001)
        return req.wait()

    for y in run(3, fn, segment_bytes=256):
        assert np.all(y == 3)


@pytest.mark.parametrize("p", [1, 2, 5, 8, 16])
def test_split(p):
    def fn(comm):
        color = comm.rank % 3
        sub = comm.split(color, key=-comm.rank)  # reversed order inside each group
        none = comm.split(None if comm.rank == 0 else 1)
        s = sub.allreduce(np.array([comm.rank, 1]), algorithm="ring")
        g = sub.allgather(np.array([comm.rank]))
        b = sub.broadcast(np.array([comm.rank if sub.rank == 0 else -1]), root=0)
        nested = sub.split(sub.rank % 2)
        n = nested.allreduce(np.array([comm.rank]), algorithm="recursive_doubling")
        after = comm.allreduce(np.array([1]))  # the parent still works
        return (sub.rank, sub.size, s, g, b, none is None, None if none is None else none.size,
                n, nested.size, after)

    res = run(p, fn)
    for r, (srank, ssize, s, g, b, is_none, none_size, n, nsize, after) in enumerate(res):
        members = sorted((q for q in range(p) if q % 3 == r % 3), key=lambda q: -q)
        assert srank == members.index(r) and ssize == len(members)
        assert s.tolist() == [sum(members), len(members)]
        assert g.tolist() == members
        assert b.tolist() == [members[0]]
        assert is_none == (r == 0)
        assert is_none or none_size == p - 1
        nested = [q for i, q in enumerate(members) if i % 2 == srank % 2]
        assert nsize == len(nested) and n.tolist() == [sum(nested)]
        assert after.tolist() == [p]


def test_split_keeps_options():
    def fn(comm):
        sub = comm.split(comm.rank % 2)
        return sub.nodes, sub.options.algorithm, sub.options.segment_bytes

    for nodes, algo, seg in run(8, fn, local_size=2, algorithm="rabenseifner", segment_bytes=128):
        assert nodes == [[0, 1], [2, 3]] and algo == "rabenseifner" and seg == 128


@pytest.mark.parametrize("p,k", [(1, None), (7, 3), (8, 2), (5, 1), (4, 4), (3, 5)])
def test_nodes_from_local_size(p, k):
    def fn(comm):
        return comm.nodes, comm.local_rank, comm.local_size

    expected = [list(range(i, min(i + k, p))) for i in range(0, p, k)] if k else [list(range(p))]
    for r, (nodes, lr, ls) in enumerate(run(p, fn, local_size=k)):
        assert nodes == expected
        node = next(m for m in expected if r in m)
        assert lr == node.index(r) and ls == len(node)


def test_local_size_from_environment(monkeypatch):
    monkeypatch.setenv("RINGCOLL_LOCAL_SIZE", "2")
    res = run(5, lambda comm: (comm.nodes, comm.allreduce(np.array([comm.rank]),
                                                          algorithm="hierarchical")))
    for nodes, y in res:
        assert nodes == [[0, 1], [2, 3], [4]] and y.tolist() == [10]


# ---------------------------------------------------------------------------------------------
# algorithm choice: the cost model and `auto`
# ---------------------------------------------------------------------------------------------
def test_cost_model_small_messages_pick_the_fewest_steps():
    """8 B: recursive doubling (log2 p steps) at powers of two; elsewhere Bruck's ceil(log2 p)
    steps beat recursive doubling's floor(log2 p) + 2 (the fold)."""
    model = CostModel()
    for p in range(2, 17):
        want = "recursive_doubling" if p & (p - 1) == 0 else "bruck"
        assert model.choose_allreduce(8, p, [list(range(p))]) == want, p


def test_cost_model_large_messages_pick_a_bandwidth_optimal_algorithm():
    model = CostModel()
    n = 256 << 20
    for p in range(3, 17):
        choice = model.choose_allreduce(n, p, [list(range(p))])
        if p & (p - 1):  # not a power of two: Rabenseifner pays the fold, ring wins
            assert choice == "ring", p
        else:  # a power of two: Rabenseifner moves the ring's bytes in fewer steps
            assert choice == "rabenseifner", p
        assert choice != "recursive_doubling"


def test_cost_model_picks_the_cheapest_and_hierarchical_only_across_nodes():
    for model in (CostModel(), CostModel(inter_alpha=50e-6, inter_beta=10e-9)):
        for p, nodes in [(8, [[0, 1, 2, 3], [4, 5, 6, 7]]), (6, [[0, 1, 2], [3, 4, 5]])]:
            for n in (8, 4096, 1 << 20, 1 << 28):
                names = ["ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical"]
                best = min(names, key=lambda a: model.allreduce(a, n, p, nodes))
                assert model.choose_allreduce(n, p, nodes) == best
    # with intra-node costs everywhere, 2 nodes x 3 ranks: hierarchical's 3-rank rings win
    assert CostModel().choose_allreduce(1 << 28, 6, [[0, 1, 2], [3, 4, 5]]) == "hierarchical"
    for n in (8, 1 << 28):  # one node, or one rank per node: no hierarchical
        assert model.choose_allreduce(n, 4, [[0, 1, 2, 3]]) != "hierarchical"
        assert model.choose_allreduce(n, 4, [[0], [1], [2], [3]]) != "hierarchical"
    assert model.allreduce("ring", 1 << 20, 1) == 0.0
    with pytest.raises(ValueError):
        model.allreduce("bogus", 8, 4)


@pytest.mark.parametrize("p,nodes", [(8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                                     (6, [[0, 1, 2], [3, 4, 5]]),
                                     (16, [list(range(8)), list(range(8, 16))])])
def test_cost_model_slow_network_favours_hierarchical(p, nodes):
    """Telling the model that links between nodes are slow (inter_alpha/inter_beta, as
    docs/cluster.md advises) must not make it prefer the flat algorithms, whose every step may cross
    the network, over hierarchical, which sends only n/k bytes per rank across it."""
    n = 1 << 28
    fast = CostModel()
    slow = CostModel(inter_alpha=50e-6, inter_beta=10 * fast.beta)
    assert slow.choose_allreduce(n, p, nodes) == "hierarchical"
    for name in ("ring", "recursive_doubling", "rabenseifner"):  # a slower network costs more
        assert slow.allreduce(name, n, p, nodes) > fast.allreduce(name, n, p, nodes), name


def auto_choices(p, sizes, capsys, **options):
    def fn(comm):
        for n in sizes:
            comm.allreduce(np.zeros(n, np.float64))

    capsys.readouterr()
    run(p, fn, debug=True, **options)
    err = capsys.readouterr().err
    return [line.rsplit("-> ", 1)[1] for line in err.splitlines() if "allreduce" in line]


def test_auto_dispatches_by_the_cost_model(capsys):
    sizes = [1, 1 << 17]  # 8 B and 1 MiB of float64
    # p = 3: Bruck's 2 steps beat recursive doubling's fold (3 messages) for 8 B
    assert auto_choices(3, sizes, capsys) == ["bruck", "ring"]
    assert auto_choices(4, sizes, capsys) == ["recursive_doubling", "rabenseifner"]
    # a cost model where only latency counts: the fewest steps at every size, Bruck only
    # where it is a candidate at all (up to bruck.MAX_BYTES)
    latency_only = CostModel(alpha=1.0, beta=0.0, gamma=0.0)
    assert auto_choices(3, sizes, capsys, cost_model=latency_only) == ["bruck",
                                                                       "recursive_doubling"]
    assert auto_choices(4, sizes, capsys, cost_model=latency_only) == ["recursive_doubling"] * 2


def test_algorithm_from_environment_and_argument_wins(monkeypatch, capsys):
    monkeypatch.setenv("RINGCOLL_ALGO", "rabenseifner")

    def fn(comm):
        comm.allreduce(np.ones(4))
        comm.allreduce(np.ones(4), algorithm="ring")
        return comm.options.algorithm

    capsys.readouterr()
    assert run(3, fn, debug=True) == ["rabenseifner"] * 3
    err = capsys.readouterr().err
    assert [line.rsplit("-> ", 1)[1] for line in err.splitlines()] == ["rabenseifner", "ring"]


def test_registry_names():
    assert set(ringcoll.ALLREDUCE_NAMES) == {"auto", "ring", "recursive_doubling",
                                             "rabenseifner", "bruck", "hierarchical", "node",
                                             "native"}
    assert set(ALLREDUCE) == set(ringcoll.ALLREDUCE_NAMES) - {"auto", "native"}


# ---------------------------------------------------------------------------------------------
# Partition
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 7, 16])
def test_partition_even_matches_array_split(parts):
    for n in [0, 1, 2, parts - 1, parts, parts + 1, 2 * parts + 3, 10007]:
        part = Partition.even(n, parts)
        blocks = np.array_split(np.arange(n), parts)
        assert part.counts == [len(b) for b in blocks]
        assert len(part) == parts and part.total == n
        assert part.starts == [0] + list(np.cumsum(part.counts))
        for s, b in zip(part.slices, blocks):
            assert np.arange(n)[s].tolist() == b.tolist()


def test_partition_rows_and_equality():
    part = Partition.rows(7, 3, 4)
    assert part.counts == [12, 8, 8] and part.total == 28
    assert part == Partition([12, 8, 8]) and part != Partition([8, 12, 8])
    assert part != [12, 8, 8]
    assert Partition([]).total == 0 and len(Partition([])) == 0
    assert "12, 8, 8" in repr(part)


# ---------------------------------------------------------------------------------------------
# errors: bad input is rejected on every rank, with a message naming the rank; never a hang
# ---------------------------------------------------------------------------------------------
def expect_error_on_every_rank(p, fn, exc_type, match=None, **options):
    errors = per_rank(p, fn, **options)
    for r, e in enumerate(errors):
        assert isinstance(e, exc_type), f"rank {r}: expected {exc_type.__name__}, got {e!r}"
        assert f"ringcoll rank {r}," in str(e), f"rank {r}: message does not name it: {e}"
        if match:
            assert match in str(e), f"rank {r}: {match!r} not in {e}"
    return errors


def expect_error_after_exchange(p, fn, exc_type, match=None, **options):
    """For errors found after a collective step (allgather's row-count exchange): every rank
    raises exc_type naming itself, or - if another rank found the error first and failed the
    thread world while this one still waited - PeerFailedError citing exc_type."""
    errors = per_rank(p, fn, **options)
    own = 0
    for r, e in enumerate(errors):
        if isinstance(e, exc_type):
            own += 1
            assert f"ringcoll rank {r}," in str(e), f"rank {r}: message does not name it: {e}"
            assert match is None or match in str(e), f"rank {r}: {match!r} not in {e}"
        else:
            assert isinstance(e, ringcoll.PeerFailedError) and exc_type.__name__ in str(e), \
                f"rank {r}: expected {exc_type.__name__}, got {e!r}"
    assert own >= 1
    return errors


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["xor", "", "SUMM"])
def test_bad_op(algorithm, op):
    expect_error_on_every_rank(3, lambda c: c.allreduce(np.ones(3), op=op, algorithm=algorithm),
                               ValueError, "unknown reduction op")


@pytest.mark.parametrize("op", [42, None, object()])
def test_bad_non_string_op_is_a_value_error(op):
    expect_error_on_every_rank(2, lambda c: c.allreduce(np.ones(3), op=op), ValueError,
                               "unknown reduction op")


@pytest.mark.parametrize("dtype", O.INT_DTYPES)
def test_avg_on_integers_is_a_type_error(dtype):
    expect_error_on_every_rank(3, lambda c: c.allreduce(np.ones(3, dtype), op="avg"), TypeError,
                               "avg")
    expect_error_on_every_rank(2, lambda c: c.reduce_scatter(np.ones(4, dtype), op="avg"),
                               TypeError)
    expect_error_on_every_rank(2, lambda c: c.reduce(np.ones(4, dtype), op="avg"), TypeError)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", O.COMPLEX_DTYPES)
def test_max_min_on_complex_is_a_type_error(op, dtype):
    expect_error_on_every_rank(2, lambda c: c.allreduce(np.ones(3, dtype), op=op), TypeError)


BAD_ARRAYS = {
    "object": lambda: np.array([1, "a", None], dtype=object),
    "str": lambda: np.array(["ab", "cd"]),
    "bool": lambda: np.ones(3, dtype=bool),
    "datetime": lambda: np.array(["2020-01-01"], dtype="datetime64[D]"),
    "structured": lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
    "list_of_str": lambda: ["x", "y"],
}


@pytest.mark.parametrize("kind", list(BAD_ARRAYS))
def test_bad_dtype_for_a_reduction(kind):
    calls = [
        lambda c, x: c.allreduce(x),
        lambda c, x: c.reduce_scatter(x),
        lambda c, x: c.reduce(x),
        lambda c, x: c.iallreduce(x),
    ]
    for call in calls:
        expect_error_on_every_rank(2, lambda c: call(c, BAD_ARRAYS[kind]()), TypeError,
                                   "not supported")


def test_object_dtype_cannot_move():
    calls = [
        lambda c, x: c.allgather(x),
        lambda c, x: c.gather(x),
        lambda c, x: c.alltoall(x),
        lambda c, x: c.broadcast(x),
    ]
    for call in calls:
        expect_error_on_every_rank(2, lambda c: call(c, BAD_ARRAYS["object"]()),
                                   ringcoll.InvalidTypeError, "pass a fixed-size dtype")


@pytest.mark.parametrize("kind", [k for k in BAD_ARRAYS if k != "object"])
def test_data_movement_takes_what_reductions_refuse(kind):
    """The dtypes the reductions refuse above move as they are: rank r's x is the array
    rolled by r, repeated p times (so alltoall has p equal blocks)."""
    p = 3
    base = np.asarray(BAD_ARRAYS[kind]())
    inputs = [np.roll(np.tile(base, p), r) for r in range(p)]
    block = base.size

    def fn(comm):
        mine = inputs[comm.rank]
        x = mine.copy() if comm.rank == 1 else np.zeros_like(mine)
        arg = (lambda a: a.tolist()) if kind == "list_of_str" else (lambda a: a)
        return (comm.allgather(arg(mine)), comm.gather(arg(mine), root=2),
                comm.alltoall(arg(mine)), comm.broadcast(x, root=1))

    failures = []
    for r, (allgathered, gathered, swapped, broadcast) in enumerate(run(p, fn)):
        expected = {
            "allgather": np.concatenate(inputs),
            "gather": np.concatenate(inputs) if r == 2 else None,
            "alltoall": np.concatenate([x[r * block:(r + 1) * block] for x in inputs]),
            "broadcast": inputs[1],
        }
        got = {"allgather": allgathered, "gather": gathered, "alltoall": swapped,
               "broadcast": broadcast}
        for name, want in expected.items():
            have = got[name]
            if want is None:
                if have is not None:
                    failures.append(f"{kind} {name} rank {r}: expected None, got {have!r}")
            elif (have.dtype, have.shape, have.tobytes()) != (want.dtype, want.shape,
                                                                 want.tobytes()):
                failures.append(f"{kind} {name} rank {r}: {have!r} != {want!r}")
    check_all(failures)


def test_broadcast_needs_an_array():
    expect_error_on_every_rank(2, lambda c: c.broadcast([1, 2]), TypeError)


@pytest.mark.parametrize("root", [-1, 3, 100, 1.0, "0", None])
def test_bad_root(root):
    expect_error_on_every_rank(3, lambda c: c.broadcast(np.ones(2), root=root), ValueError,
                               "root")
    expect_error_on_every_rank(3, lambda c: c.reduce(np.ones(2), root=root), ValueError, "root")


OUT_CASES = {
    "shape": lambda x: np.empty(x.size + 1, x.dtype),
    "dtype": lambda x: np.empty(x.shape, np.float32),
    "readonly": lambda x: _readonly(np.empty(x.shape, x.dtype)),
    "non_contiguous": lambda x: np.empty((x.size, 2), x.dtype)[:, 0],
    "not_an_array": lambda x: [0.0] * x.size,
}


def _readonly(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("case", list(OUT_CASES))
def test_bad_out(case):
    p = 2
    x = np.ones(4)
    ctor = OUT_CASES[case]
    exc = TypeError if case == "not_an_array" else ValueError
    expect_error_on_every_rank(p, lambda c: c.allreduce(x.copy(), out=ctor(x)), exc)
    expect_error_on_every_rank(p, lambda c: c.iallreduce(x.copy(), out=ctor(x)), exc)
    # reduce checks out= on the root only; the others are released by the root's failure
    errors = per_rank(p, lambda c: c.reduce(x.copy(), out=ctor(x), root=0))
    assert isinstance(errors[0], exc) and "ringcoll rank 0," in str(errors[0]), errors[0]
    assert errors[1] is None or isinstance(errors[1], ringcoll.PeerFailedError), errors[1]
    if case == "non_contiguous":
        # the axis-0 collectives stage a non-contiguous out and copy into it: right values
        results = ringcoll.run_threads(
            p, lambda c: c.reduce_scatter(np.arange(4.0) * (c.rank + 1), out=ctor(np.ones(2))))
        for r, got in enumerate(results):
            np.testing.assert_array_equal(got, 3 * np.arange(4.0)[2 * r:2 * r + 2])
        results = ringcoll.run_threads(
            p, lambda c: c.alltoall(np.arange(4.0) + 10 * c.rank, out=ctor(np.ones(4))))
        for r, got in enumerate(results):
            np.testing.assert_array_equal(got, [2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r])
        return
    expect_error_on_every_rank(p, lambda c: c.reduce_scatter(np.ones(4), out=ctor(np.ones(2))),
                               exc)
    expect_error_on_every_rank(p, lambda c: c.alltoall(np.ones(4), out=ctor(np.ones(4))), exc)


def test_bad_out_on_allgather_fails_every_rank():
    # allgather exchanges the row counts first, so the check comes after a collective step
    expect_error_after_exchange(2, lambda c: c.allgather(np.ones(2), out=np.empty(3)),
                                ValueError, "out has shape")


def test_in_place_needs_a_writeable_contiguous_x():
    def readonly(c):
        x = np.ones(4)
        x.flags.writeable = False
        return c.allreduce(x, out=x)

    expect_error_on_every_rank(2, readonly, ValueError)

    def overlapping(c):
        x = np.ones(8)
        return c.allreduce(x[:4], out=x[2:6])

    expect_error_on_every_rank(2, overlapping, ValueError, "overlaps")


def test_broadcast_into_non_contiguous_or_readonly_is_rejected():
    expect_error_on_every_rank(2, lambda c: c.broadcast(np.ones(8)[::2]), ValueError,
                               "contiguous")

    def readonly(c):
        x = np.ones(4)
        x.flags.writeable = False
        return c.broadcast(x, root=0)

    errors = per_rank(2, readonly)  # root may broadcast from a read-only buffer
    assert isinstance(errors[1], ValueError) and "read-only" in str(errors[1])


@pytest.mark.parametrize("p,rows", [(2, 3), (3, 4), (4, 2), (5, 7)])
def test_alltoall_rows_not_divisible(p, rows):
    expect_error_on_every_rank(p, lambda c: c.alltoall(np.ones((rows, 2))), ValueError,
                               "multiple of the communicator size")


def test_allgather_mismatched_trailing_shape_or_dtype():
    mismatch = ringcoll.CollectiveMismatchError
    expect_error_after_exchange(3, lambda c: c.allgather(np.ones((2, 3 if c.rank != 1 else 4))),
                                mismatch, "trailing shape")
    expect_error_after_exchange(3, lambda c: c.allgather(
        np.ones(2, np.float32 if c.rank == 2 else np.float64)), mismatch, "rank(s) [")
    expect_error_after_exchange(2, lambda c: c.allgather(np.ones((2,) + (1,) * c.rank)), mismatch)
    expect_error_after_exchange(4, lambda c: c.allgather(np.ones((c.rank, 2, 2 + c.rank // 3))),
                                mismatch, "passed a different dtype or trailing shape")


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "rabenseifner",
                                       "hierarchical", "auto"])
@pytest.mark.parametrize("counts", [(4, 5), (5, 4, 4), (8, 8, 9, 8), (6, 7, 6, 6, 6)])
def test_allreduce_mismatched_counts_raise_not_hang(algorithm, counts):
    p = len(counts)
    start = time.time()
    with pytest.raises(ringcoll.RingcollError):
        run(p, lambda c: c.allreduce(np.ones(counts[c.rank]), algorithm=algorithm),
            local_size=2, timeout=3)
    assert time.time() - start < 10


# Segments of equal size (or a zero count) hide a count mismatch from the size checks: the
# ring's neighbour check (ringcoll.checks) catches it at once.
@pytest.mark.parametrize("counts,seg", [((4, 5), 8), ((0, 5), None)])
def test_allreduce_mismatched_counts_fail_every_rank_promptly(counts, seg):
    p = len(counts)
    start = time.time()
    errors = per_rank(p, lambda c: c.allreduce(np.ones(counts[c.rank]), algorithm="ring"),
                      timeout=2, segment_bytes=seg)
    assert all(isinstance(e, ringcoll.RingcollError) for e in errors), errors
    assert time.time() - start < 1.5, "only the timeout caught it"


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast",
                                        "reduce", "alltoall", "barrier"])
def test_native_is_unavailable_on_threads(collective):
    calls = {
        "allreduce": lambda c: c.allreduce(np.ones(2), algorithm="native"),
        "reduce_scatter": lambda c: c.reduce_scatter(np.ones(2), algorithm="native"),
        "allgather": lambda c: c.allgather(np.ones(2), algorithm="native"),
        "broadcast": lambda c: c.broadcast(np.ones(2), algorithm="native"),
        "reduce": lambda c: c.reduce(np.ones(2), algorithm="native"),
        "alltoall": lambda c: c.alltoall(np.ones(2), algorithm="native"),
        "barrier": lambda c: c.barrier(algorithm="native"),
    }
    # allgather exchanges row counts before it looks at the algorithm
    expect = expect_error_after_exchange if collective == "allgather" else \
        expect_error_on_every_rank
    expect(2, calls[collective], ringcoll.RingcollError, "MPI transport")


def test_unknown_algorithm():
    expect_error_on_every_rank(2, lambda c: c.allreduce(np.ones(2), algorithm="bogus"),
                               ValueError, "unknown algorithm")
    expect_error_on_every_rank(2, lambda c: c.broadcast(np.ones(2), algorithm="bogus"),
                               ValueError, "unknown algorithm")
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        run(2, lambda c: None, algorithm="bogus")


@pytest.mark.parametrize("options", [{"local_size": 0}, {"segment_bytes": 0}])
def test_bad_options(options):
    with pytest.raises(ValueError):
        run(2, lambda c: None, **options)


@pytest.mark.parametrize("var,value", [("RINGCOLL_LOCAL_SIZE", "two"),
                                       ("RINGCOLL_TIMEOUT", "soon"),
                                       ("RINGCOLL_ALGO", "fastest")])
def test_bad_environment(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        run(2, lambda c: None)


def test_one_rank_with_bad_input_releases_the_others():
    """Rank 1 alone passes a bad op: it raises ValueError, the others PeerFailedError, fast."""
    start = time.time()
    errors = per_rank(4, lambda c: c.allreduce(np.ones(100), op="xor" if c.rank == 1 else "sum",
                                               algorithm="ring"), timeout=30)
    assert isinstance(errors[1], ValueError) and "ringcoll rank 1," in str(errors[1])
    for r in (0, 2, 3):
        assert isinstance(errors[r], ringcoll.PeerFailedError), (r, errors[r])
        assert "rank 1 failed" in str(errors[r])
    assert time.time() - start < 10

    with pytest.raises(ValueError, match="ringcoll rank 1,") as info:
        run(4, lambda c: c.allreduce(np.ones(100), op="xor" if c.rank == 1 else "sum"))
    assert "raised on rank 1 of 4" in "".join(getattr(info.value, "__notes__", []))


def test_rank_that_skips_a_collective_times_out():
    start = time.time()
    errors = per_rank(3, lambda c: None if c.rank == 2 else c.allreduce(np.ones(10),
                                                                         algorithm="ring"),
                      timeout=0.5)
    assert errors[2] is None
    assert any(isinstance(e, ringcoll.CollectiveTimeoutError) for e in errors[:2]), errors
    assert all(isinstance(e, (ringcoll.CollectiveTimeoutError, ringcoll.PeerFailedError))
               for e in errors[:2]), errors
    assert time.time() - start < 10


def test_exception_hierarchy():
    for cls in (ringcoll.CollectiveMismatchError, ringcoll.CollectiveTimeoutError,
                ringcoll.PeerFailedError):
        assert issubclass(cls, ringcoll.RingcollError)
    assert issubclass(ringcoll.RingcollError, RuntimeError)


def test_run_threads_size_must_be_positive():
    with pytest.raises(ValueError):
        run(0, lambda c: None)


# ---------------------------------------------------------------------------------------------
# known library bugs (reported): these fail until fixed
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "alltoall"])
def test_fortran_ordered_out_gets_correct_values(collective):
    """out= may be C- or F-contiguous (it is accepted); an F-ordered out must hold the values."""
    p = 2

    def fn(comm):
        x = np.arange(12.0).reshape(4, 3) * (comm.rank + 1)
        if collective == "reduce_scatter":
            return comm.reduce_scatter(x, out=np.empty((2, 3), order="F"))
        if collective == "allgather":
            return comm.allgather(x, out=np.empty((8, 3), order="F"))
        return comm.alltoall(x, out=np.empty((4, 3), order="F"))

    res = run(p, fn)
    xs = [np.arange(12.0).reshape(4, 3) * (r + 1) for r in range(p)]
    for r in range(p):
        if collective == "reduce_scatter":
            expected = (xs[0] + xs[1])[2 * r:2 * r + 2]
        elif collective == "allgather":
            expected = np.concatenate(xs)
        else:
            expected = np.concatenate([xs[i][2 * r:2 * r + 2] for i in range(p)])
        np.testing.assert_array_equal(res[r], expected, err_msg=f"rank {r}")


# --- behaviours added after review ------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("dtype", O.HALF_DTYPES)
def test_half_avg_does_not_overflow_where_the_average_fits(p, dtype):
    # 40000 fits float16 (max 65504) but p * 40000 does not: a sum-then-divide would give inf
    for algo in ["ring", "recursive_doubling", "rabenseifner", "hierarchical"]:
        results = run(p, lambda c: c.allreduce(np.full(7, 40000, dtype), op="avg",
                                               algorithm=algo), local_size=2)
        for r, y in enumerate(results):
            assert y.dtype == np.dtype(dtype)
            assert np.all(np.abs(y.astype(np.float32) - 40000) <= 64), (algo, r, y)
    blocks = run(p, lambda c: c.reduce_scatter(np.full(2 * p, 40000, dtype), op="avg"))
    assert all(np.all(np.abs(b.astype(np.float32) - 40000) <= 64) for b in blocks), blocks
    root = run(p, lambda c: c.reduce(np.full(3, 40000, dtype), op="avg", root=p - 1))[p - 1]
    assert np.all(np.abs(root.astype(np.float32) - 40000) <= 64), root


@pytest.mark.parametrize("call", ["reduce_scatter", "allgather", "broadcast", "reduce",
                                  "alltoall"])
def test_other_collectives_reject_algorithms_they_do_not_have(call):
    def fn(c):
        x = np.ones(4)
        getattr(c, call)(x, algorithm="rabenseifner")

    expect_error_on_every_rank(2, fn, ValueError, match="unknown algorithm")


def test_timeout_zero_means_no_limit():
    from ringcoll.config import Options

    assert Options.from_env({"RINGCOLL_TIMEOUT": "0"}).timeout == 0
    assert Options.from_env({"RINGCOLL_TIMEOUT": "2.5"}).timeout == 2.5
    with pytest.raises(ValueError, match="RINGCOLL_TIMEOUT"):
        Options.from_env({"RINGCOLL_TIMEOUT": "-1"})

    def late_rank_0(c):  # rank 0 arrives 0.3 s after the others
        if c.rank == 0:
            time.sleep(0.3)
        return c.allreduce(np.ones(2))

    with pytest.raises(ringcoll.CollectiveTimeoutError):
        ringcoll.run_threads(2, late_rank_0, timeout=0.1)
    assert all(np.array_equal(y, [2, 2]) for y in ringcoll.run_threads(2, late_rank_0, timeout=0))


# -- the thread transport's matching of wildcard receives (ANY_SOURCE), MPI's rules -----------
def _world(p):
    from ringcoll.transport.threads import ThreadWorld
    return ThreadWorld(p, timeout=5).transports()


def _msg(src, k):
    return np.array([src, k], dtype=np.int64)


def test_thread_wildcards_match_posted_receives_in_posting_order():
    """Receives posted first (a wildcard, one naming rank 1, a wildcard) get the messages in
    the order the receives were posted, each message the earliest-posted receive it matches:
    rank 1's two, then rank 2's."""
    from ringcoll.transport.base import ANY_SOURCE
    t0, t1, t2 = _world(3)
    outs = [np.empty(2, np.int64) for _ in range(3)]
    reqs = [t0.irecv(outs[0], ANY_SOURCE, 7), t0.irecv(outs[1], 1, 7),
            t0.irecv(outs[2], ANY_SOURCE, 7)]
    t1.isend(_msg(1, 0), 0, 7)  # eager: matched at once, on this thread
    t1.isend(_msg(1, 1), 0, 7)
    t2.isend(_msg(2, 0), 0, 7)
    for req in reqs:
        t0.wait(req)
    assert [o.tolist() for o in outs] == [[1, 0], [1, 1], [2, 0]]
    assert [t0.source(r) for r in reqs] == [1, 1, 2]


def test_thread_wildcards_take_unexpected_messages_in_send_order():
    """Messages sent before any receive: a wildcard takes the earliest sent, a receive
    naming rank 1 rank 1's first, whatever else came in between (non-overtaking per sender)."""
    from ringcoll.transport.base import ANY_SOURCE
    t0, t1, t2 = _world(3)
    t2.isend(_msg(2, 0), 0, 7)
    t1.isend(_msg(1, 0), 0, 7)
    t1.isend(_msg(1, 1), 0, 7)
    t2.isend(_msg(2, 1), 0, 9)  # another tag: never matched by a receive with tag 7
    got = []
    for peer in (1, ANY_SOURCE, ANY_SOURCE):
        out = np.empty(2, np.int64)
        req = t0.irecv(out, peer, 7)
        t0.wait(req)
        got.append((t0.source(req), out.tolist()))
    assert got == [(1, [1, 0]), (2, [2, 0]), (1, [1, 1])]
    out = np.empty(2, np.int64)
    req = t0.irecv(out, ANY_SOURCE, 9)
    t0.wait(req)
    assert t0.source(req) == 2 and out.tolist() == [2, 1]


def test_thread_wildcard_with_no_message_times_out_naming_any_rank():
    from ringcoll.transport.base import ANY_SOURCE
    from ringcoll.transport.threads import ThreadWorld
    t0, _ = ThreadWorld(2, timeout=0.2).transports()
    req = t0.irecv(np.empty(1), ANY_SOURCE, 16)
    with pytest.raises(ringcoll.CollectiveTimeoutError, match="no message from any rank"):
        t0.wait(req)
