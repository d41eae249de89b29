"""Communicator.scan and .exscan on thread ranks, p = 1..16, against NumPy on the inputs.

Every rank's input comes from a seeded RNG keyed by its rank (tests/_oracle.py: exact to
reduce in any order), so each rank's prefix is checked exactly against the oracle's reduction
of ranks 0..r (exscan: 0..r-1) in rank order. The MPI tier is the "scan" group of
tests/mpi_checks.py (mpiexec -n 1..8, against mpi4py's own Scan / Exscan).
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.algorithms.scan import partners
from ringcoll.transport.base import Tag

import _oracle as O
from test_threads import expect_error_on_every_rank, run

PS = list(range(1, 17))
#: every valid (dtype, op) pair but avg, which scan refuses
COMBOS = [(d, op) for d, op in O.COMBOS if op != "avg"]
BIG = 1001  # several of every dtype's cache lines; scan has no pipeline segments
SENTINEL = 99  # what exscan's rank 0 finds in its out afterwards: untouched


def counts(p):
    return sorted({0, 1, max(p - 1, 0), p + 1, BIG})


def cases(p):
    """[(seed, shape, dtype, op, mode)]: every combo once; the counts, a 2-D x and the three
    out= modes (0: none, 1: out given, 2: in place) cycle through them."""
    found = []
    cs = counts(p)
    for i, (dtype, op) in enumerate(COMBOS):
        n = cs[i % len(cs)]
        shape = (n // 3 + 1, 3) if i % 4 == 3 else (n,)  # a 2-D x now and then
        found.append((9000 + 100 * p + i, shape, dtype, op, (i + p) % 3))
    return found


def call(comm, exclusive, x, op, mode):
    """(result copy or None, result is what it should be, x unchanged, rank 0's out kept)."""
    before = x.copy()
    fn = comm.exscan if exclusive else comm.scan
    out = x if mode == 2 else np.full(x.shape, SENTINEL, x.dtype) if mode == 1 else None
    y = fn(x, op=op, out=out)
    none = exclusive and comm.rank == 0
    if none:
        returned = y is None
        kept = mode == 0 or np.array_equal(out, before if mode == 2 else
                                           np.full(x.shape, SENTINEL, x.dtype))
    else:
        returned = y is out if out is not None else (y is not x and y.shape == x.shape)
        kept = True
    unchanged = mode == 2 or x.tobytes() == before.tobytes()
    return None if y is None else y.copy(), returned, unchanged, kept


def expected(seed, shape, dtype, op, r, exclusive):
    """The oracle: NumPy's reduction of ranks 0..r (exclusive: 0..r-1) in rank order."""
    upto = r if exclusive else r + 1
    if upto == 0:
        return None
    return O.reduce_oracle([O.make_input(seed, q, shape, dtype, op) for q in range(upto)],
                           op, dtype)


def check(results, p, case_list, exclusive):
    failures = []
    for k, (seed, shape, dtype, op, mode) in enumerate(case_list):
        for r in range(p):
            got, returned, unchanged, kept = results[r][k]
            where = f"{'exscan' if exclusive else 'scan'} p={p} case {k} {shape} {dtype} {op} " \
                    f"mode {mode} rank {r}"
            want = expected(seed, shape, dtype, op, r, exclusive)
            if want is None:
                if got is not None:
                    failures.append(f"{where}: got {got!r}, not None")
            else:
                bad = O.compare(got, want, op, dtype, nranks=p)
                if bad:
                    failures.append(f"{where}: {bad}")
            if not returned:
                failures.append(f"{where}: wrong object returned")
            if not unchanged:
                failures.append(f"{where}: x modified")
            if not kept:
                failures.append(f"{where}: rank 0's out was written")
    return failures


@pytest.mark.parametrize("exclusive", [False, True], ids=["scan", "exscan"])
@pytest.mark.parametrize("p", PS)
def test_every_combo(p, exclusive):
    case_list = cases(p)

    def fn(comm):
        return [call(comm, exclusive, O.make_input(seed, comm.rank, shape, dtype, op), op, mode)
                for seed, shape, dtype, op, mode in case_list]

    failures = check(run(p, fn), p, case_list, exclusive)
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:30])


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13])
def test_every_count_and_mode(p):
    """Each count of counts(p), 1-D and 2-D, in all three out= modes, with an integer sum (wraps
    exactly) and a float max: both collectives."""
    case_list = [(400 + i, shape, dtype, op, mode)
                 for i, (shape, dtype, op, mode) in enumerate(
                     (s, d, op, m) for n in counts(p) for s in ((n,), (n, 2))
                     for d, op in ((np.dtype(np.int32), "sum"), (np.dtype(np.float32), "max"))
                     for m in range(3))]

    def fn(comm):
        return {ex: [call(comm, ex, O.make_input(seed, comm.rank, shape, dtype, op), op, mode)
                     for seed, shape, dtype, op, mode in case_list] for ex in (False, True)}

    results = run(p, fn, segment_bytes=64 if p % 2 else None)
    failures = []
    for ex in (False, True):
        failures += check([res[ex] for res in results], p, case_list, ex)
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:30])


@pytest.mark.parametrize("p", [1, 3, 4, 6])
def test_mpi_ops(p):
    MPI = pytest.importorskip("mpi4py.MPI")
    ops = [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MAX, "max"), (MPI.MIN, "min")]
    case_list = [(500 + i, (7,), np.dtype(np.int64), name, i % 3)
                 for i, (_, name) in enumerate(ops)]

    def fn(comm):
        return {ex: [call(comm, ex, O.make_input(seed, comm.rank, shape, dtype, name), mpi_op,
                          mode)
                     for (seed, shape, dtype, name, mode), (mpi_op, _) in zip(case_list, ops)]
                for ex in (False, True)}

    results = run(p, fn)
    failures = []
    for ex in (False, True):
        failures += check([res[ex] for res in results], p, case_list, ex)
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 11, 16])
def test_lower_ranks_first(p):
    """Every op has the lower ranks' data first, seen through NumPy's max and min (the only
    ops where operand order shows; every bracketing of an ordered fold gives the same here):
    of two equal values they return the second, so signed zeros give the sign of the highest
    rank covered; of two NaNs they return the first, so NaN payloads give rank 0's. A swapped
    operand order anywhere brings in another rank's zero or payload."""
    def zeros(rank):
        signs = O.rng_for(77, rank).integers(0, 2, 64)
        return np.where(signs == 1, -0.0, 0.0)

    def nans(rank):  # quiet NaNs whose payload is rank + 1
        return np.full(8, 0x7FF8000000000000 + rank + 1, np.uint64).view(np.float64)

    def fn(comm):
        res = []
        for x in (zeros(comm.rank), nans(comm.rank)):
            for collective in (comm.scan, comm.exscan):
                for op in ("max", "min"):
                    y = collective(x, op=op)
                    res.append(None if y is None else y.copy())
        return res

    for r, res in enumerate(run(p, fn)):
        zs, zx, ns, nx = res[0:2], res[2:4], res[4:6], res[6:8]
        for got in zs:
            assert np.array_equal(np.signbit(got), np.signbit(zeros(r))), (r, got)
        for got in ns:
            assert got.view(np.uint64).tolist() == nans(0).view(np.uint64).tolist(), r
        if r == 0:
            assert zx == [None, None] and nx == [None, None]
            continue
        for got in zx:
            assert np.array_equal(np.signbit(got), np.signbit(zeros(r - 1))), (r, got)
        for got in nx:
            assert got.view(np.uint64).tolist() == nans(0).view(np.uint64).tolist(), r


@pytest.mark.parametrize("p", [3, 7, 16])
def test_random_floats_deterministic(p):
    """Non-exact data: within the sum's error bound of NumPy, and bitwise the same each run
    (and regardless of in place)."""
    def fn(comm):
        x = O.random_floats(33, comm.rank, (257,), np.float32)
        a, b = comm.scan(x), comm.exscan(x)
        c = x.copy()
        comm.scan(c, out=c)
        return a, b, c

    first, second = run(p, fn), run(p, fn)
    inputs = [O.random_floats(33, r, (257,), np.float32) for r in range(p)]
    for r in range(p):
        a, b, c = first[r]
        want = np.add.reduce(np.stack(inputs[:r + 1]).astype(np.float64), axis=0)
        assert np.all(np.abs(a - want) <= O.float_tolerance(inputs[:r + 1], np.float32))
        assert a.tobytes() == second[r][0].tobytes() == c.tobytes()
        if r:
            want = np.add.reduce(np.stack(inputs[:r]).astype(np.float64), axis=0)
            assert np.all(np.abs(b - want) <= O.float_tolerance(inputs[:r], np.float32))
            assert b.tobytes() == second[r][1].tobytes()
        else:
            assert b is None and second[r][1] is None


@pytest.mark.parametrize("p", [1, 2, 5])
def test_layouts_and_zero_dim(p):
    def fn(comm):
        base = np.arange(60).reshape(6, 10) * (comm.rank + 1)
        a = comm.scan(np.float64(comm.rank + 1))  # 0-d
        b = comm.scan(base[:, ::3])  # non-contiguous x
        c = comm.exscan(np.asfortranarray(base), op="max")  # F-ordered x
        out = np.asfortranarray(np.zeros((6, 10), base.dtype))
        d = comm.scan(base, out=out)  # C-ordered x into an F-ordered out (staged)
        return a, b, c, d, d is out

    base = np.arange(60).reshape(6, 10)
    for r, (a, b, c, d, same) in enumerate(run(p, fn)):
        s = (r + 1) * (r + 2) // 2
        assert a.shape == () and a == s
        assert np.array_equal(b, base[:, ::3] * s)
        assert c is None if r == 0 else (np.array_equal(c, base * r) and c.flags.f_contiguous)
        assert same and np.array_equal(d, base * s) and d.flags.f_contiguous


def test_one_rank():
    def fn(comm):
        x = np.arange(5.0)
        y = comm.scan(x)
        z = x.copy()
        w = comm.scan(z, out=z)
        out = np.full(5, -1.0)
        e = comm.exscan(x, out=out)
        return x, y, z, w, e, out

    [(x, y, z, w, e, out)] = run(1, fn)
    assert y is not x and np.array_equal(y, x)
    assert w is z and np.array_equal(z, x)
    assert e is None and np.array_equal(out, np.full(5, -1.0))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 11, 16])
@pytest.mark.parametrize("exclusive", [False, True], ids=["scan", "exscan"])
def test_messages_are_one_per_partner(p, exclusive):
    """Each rank sends one message of x.nbytes (no header) to each partner rank ^ 2^k < p, in
    step order, and receives one from each; nothing else is sent."""
    n = 13

    def fn(comm):
        x = np.ones(n, np.float64)
        with comm.trace() as t:
            (comm.exscan if exclusive else comm.scan)(x)
        return t

    for r, t in enumerate(run(p, fn)):
        want = partners(r, p)
        assert want == [r ^ (1 << k) for k in range(p.bit_length()) if r ^ (1 << k) < p]
        sent = t.messages
        assert [m.dst for m in sent] == want, (r, sent)
        assert all(m.src == r and m.nbytes == 8 * n and m.tag == "scan" for m in sent), sent
        assert sorted(x.src for x in t.receives) == sorted(want)
        assert t.collectives() == [(1, "exscan" if exclusive else "scan",
                                    "recursive_doubling")]


def test_debug_mode_agrees():
    """Debug mode's fingerprints agree although exscan's rank 0 passes no out and others do."""
    def fn(comm):
        x = np.arange(4) + comm.rank
        y = comm.exscan(x, out=None if comm.rank == 0 else np.empty_like(x))
        return comm.scan(x, algorithm="auto"), y

    res = run(4, fn, debug=True)
    for r, (s, e) in enumerate(res):
        assert s.tolist() == [sum(q + i for q in range(r + 1)) for i in range(4)]
        assert (e is None) if r == 0 else e.tolist() == [sum(q + i for q in range(r))
                                                         for i in range(4)]


def test_debug_mode_names_a_mismatch():
    mismatch = ringcoll.CollectiveMismatchError
    expect_error_on_every_rank(3, lambda c: c.scan(np.ones(2), op="sum" if c.rank else "max"),
                               mismatch, "op differ", debug=True)
    expect_error_on_every_rank(3, lambda c: (c.exscan if c.rank == 1 else c.scan)(np.ones(2)),
                               mismatch, "collective differ", debug=True)


@pytest.mark.parametrize("name", ["scan", "exscan"])
def test_errors(name):
    def c(comm, *args, **kw):
        return getattr(comm, name)(*args, **kw)

    fix = "comm.rank" if name == "exscan" else "comm.rank + 1"
    for x in (np.ones(3), np.ones(3, np.int32)):  # avg: for every dtype, before its own check
        errors = expect_error_on_every_rank(3, lambda comm: c(comm, x, op="avg"),
                                            ringcoll.InvalidArgumentError,
                                            "op 'avg' has no prefix meaning")
        assert all(f"use op='sum' and divide the result by {fix}" in str(e) for e in errors)
        assert all(f", {name}: " in str(e) for e in errors)
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(3), op="mean"), ValueError,
                               "no prefix meaning")
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(2), op="xor"), ValueError,
                               "unknown reduction op 'xor'")
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(2, np.complex64), op="max"),
                               TypeError, "not defined for complex")
    expect_error_on_every_rank(2, lambda comm: c(comm, np.array([None])), TypeError, "object")
    # out of the wrong shape: refused on every rank, exscan's rank 0 included
    expect_error_on_every_rank(3, lambda comm: c(comm, np.ones(3), out=np.empty(4)),
                               ValueError, "it must be shape (3,)")
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(3), out=np.empty(3, np.int64)),
                               ValueError, "dtype float64")
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(3), algorithm="ring"),
                               ValueError, "unknown algorithm 'ring'; use 'auto', "
                               "'recursive_doubling' or 'native'")
    # 'native' is MPI_Scan: the thread transport has none, and says so
    expect_error_on_every_rank(2, lambda comm: c(comm, np.ones(3), algorithm="native"),
                               ValueError, "algorithm 'native' needs the MPI transport")
    strided = np.ones((3, 4))[:, ::2]
    expect_error_on_every_rank(2, lambda comm: c(comm, strided, out=strided),
                               ValueError, "in-place (out=x) needs a contiguous x")


def test_in_the_registry_and_on_the_facade():
    from ringcoll.collectives import COLLECTIVES

    assert COLLECTIVES["scan"].ALGORITHMS == ("recursive_doubling", "native")
    assert COLLECTIVES["exscan"].ALGORITHMS == ("recursive_doubling", "native")
    assert ringcoll.Communicator.scan.__doc__.startswith("Inclusive prefix reduction")
    assert ringcoll.Communicator.exscan.__doc__.startswith("Exclusive prefix reduction")
    assert Tag.SCAN.name == "SCAN" and len({int(t) for t in Tag}) == len(Tag)
