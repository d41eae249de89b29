"""Communicator.scatter on thread ranks, p = 1..16 and every root, against NumPy's split of x.

The MPI tier is the "scatter" group of tests/mpi_checks.py (mpiexec -n 1, 2, 3, 4, 5, 8, against
mpi4py's own Scatterv of the same arrays).
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.collectives import _args as A
from ringcoll.collectives import scatter as S
from ringcoll.transport.base import Tag

import _mpirun as mpirun
import _oracle as O
from test_threads import expect_error_on_every_rank, per_rank, run

PS = list(range(1, 17))
DT = O.ALL_DTYPES


def cases(p):
    """(seed, counts or None, rows of x, trailing shape, dtype, who passes out=):
    array_split's sizes for 0, 1, p - 1, p + 1 rows; uneven counts with zeros; one big block;
    all empty. out: 'none', 'all', 'odd' (odd ranks), 'in place' (root's own view of x, the
    others none) or 'in place, all'."""
    uneven = [(r * 7 + 3) % 4 for r in range(p)]
    big = [1001 if r == p // 2 else 0 for r in range(p)]
    return [
        (1, None, 0, (), DT[p % len(DT)], "none"),
        (2, None, 1, (2,), DT[(p + 3) % len(DT)], "all"),
        (3, None, p - 1, (), DT[(p + 5) % len(DT)], "in place"),
        (4, None, p + 1, (2, 3), DT[(p + 7) % len(DT)], "odd"),
        (5, uneven, sum(uneven), (3,), DT[(p + 9) % len(DT)], "in place, all"),
        (6, big, 1001, (), np.dtype(np.float64), "none"),
        (7, [0] * p, 0, (2,), np.dtype(np.int16), "all"),
    ]


def blocks(x, counts, p):
    """NumPy's own split of x: the oracle."""
    if counts is None:
        return np.array_split(x, p)
    return np.split(x, np.cumsum(counts)[:-1])


def call(comm, root, case):
    """Run one case on this rank: (result copy, returned out?, x unchanged?)."""
    seed, counts, nrows, trail, dtype, who = case
    p, r = comm.size, comm.rank
    x = O.make_input(seed, root, (nrows,) + trail, dtype) if r == root else None
    before = None if x is None else x.copy()
    mine = blocks(O.make_input(seed, root, (nrows,) + trail, dtype), counts, p)[r].shape
    if r == root and who.startswith("in place"):
        lo = sum((counts or [len(b) for b in blocks(x, None, p)])[:r])
        out = x[lo:lo + mine[0]]  # MPI's IN_PLACE: root's own block, in x
    elif who in ("all", "in place, all") or (who == "odd" and r % 2):
        out = np.full(mine, 7, dtype)
    else:
        out = None
    y = comm.scatter(x, root=root, counts=counts, out=out)
    unchanged = x is None or x.tobytes() == before.tobytes()
    return y.copy(), out is None or y is out, unchanged


@pytest.mark.parametrize("p", PS)
def test_scatter_every_root(p):
    roots = range(p) if p <= 8 else sorted({0, 1, p // 2, p - 1})

    def fn(comm):
        return [(root, i, *call(comm, root, case)) for root in roots
                for i, case in enumerate(cases(p))]

    results = run(p, fn)
    failures = []
    for r in range(p):
        for root, i, got, returned_out, unchanged in results[r]:
            seed, counts, nrows, trail, dtype, who = cases(p)[i]
            want = blocks(O.make_input(seed, root, (nrows,) + trail, dtype), counts, p)[r]
            where = f"p={p} root={root} case {i} ({who}) rank {r}"
            if got.dtype != dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                failures.append(f"{where}: got {got.shape} {got.dtype} {got.ravel()[:4]}, "
                                f"want {want.shape} {want.ravel()[:4]}")
            if not (returned_out and unchanged):
                failures.append(f"{where}: out not returned ({returned_out}) / x changed "
                                f"({not unchanged})")
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("p", [3, 6, 9, 13])
def test_scatter_random_calls(p):
    """25 calls drawn at random (the same draws on every rank): root, counts with zeros (or
    None), trailing shape (zero-size rows included), dtype, who passes out=."""
    rng = np.random.default_rng(p)
    draws = []
    for k in range(25):
        counts = [int(c) for c in rng.integers(0, 4, p) * (rng.random(p) < 0.7)]
        trail = [(), (3,), (2, 0), (1, 2, 2)][k % 4]
        draws.append((int(rng.integers(p)), counts if k % 5 else None, sum(counts),
                      trail, DT[int(rng.integers(len(DT)))], rng.random(p) < 0.5))

    def fn(comm):
        got = []
        for k, (root, counts, nrows, trail, dtype, has_out) in enumerate(draws):
            full = O.make_input(900 + k, root, (nrows,) + trail, dtype)
            mine = blocks(full, counts, p)[comm.rank]
            out = np.empty_like(mine) if has_out[comm.rank] else None
            y = comm.scatter(full if comm.rank == root else None, root, counts, out)
            got.append((y.tobytes() == mine.tobytes() and y.shape == mine.shape
                        and y.dtype == dtype and (out is None or y is out)))
        return got

    for r, got in enumerate(run(p, fn)):
        assert all(got), f"rank {r}: wrong in calls {[k for k, ok in enumerate(got) if not ok]}"


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_scatter_layouts_and_zero_dim(p):
    root = p - 1
    big = np.arange(40 * p).reshape(4 * p, 10)

    def fn(comm):
        is_root = comm.rank == root
        a = comm.scatter(np.float32(5) if is_root else None, root=root)  # 0-d: one row
        b = comm.scatter(big[:, ::3] if is_root else None, root=root)  # non-contiguous x
        f = np.asfortranarray(big)
        c = comm.scatter(f if is_root else None, root=root)
        out = (f[4 * root:4 * root + 4] if is_root  # in place in an F-ordered x: a strided view
               else np.asfortranarray(np.empty((4, 10), big.dtype)))
        d = comm.scatter(f if is_root else None, root=root, out=out)
        return a, b, c, d, d is out, np.array_equal(f, big)

    for r, (a, b, c, d, same, unchanged) in enumerate(run(p, fn)):
        assert a.shape == ((1,) if r == 0 else (0,)) and a.dtype == np.float32
        assert a.tolist() == ([5.0] if r == 0 else [])
        assert np.array_equal(b, big[4 * r:4 * r + 4, ::3])
        assert np.array_equal(c, big[4 * r:4 * r + 4]) and c.flags.c_contiguous
        assert np.array_equal(d, big[4 * r:4 * r + 4]) and same and unchanged


def test_scatter_rows_of_many_dimensions_need_out_on_non_roots():
    """Rows of more than SLOTS trailing dimensions travel fine; a non-root without out=
    cannot allocate them from the header, and every rank is told so."""
    trail = (1,) * (S.SLOTS + 1)
    x = np.arange(3 * 2).reshape((6,) + trail)

    def with_out(comm):
        out = np.empty((2,) + trail, x.dtype)
        return comm.scatter(x if comm.rank == 0 else None, out=out)

    for r, y in enumerate(run(3, with_out)):
        assert y.tobytes() == x[2 * r:2 * r + 2].tobytes()
    errors = per_rank(3, lambda c: c.scatter(x if c.rank == 0 else None,
                                             out=np.empty((2,) + trail, x.dtype)
                                             if c.rank != 2 else None))
    assert isinstance(errors[2], ringcoll.InvalidArgumentError), errors[2]
    assert "9 trailing dimensions" in str(errors[2]) and "pass out=" in str(errors[2])
    for r in (0, 1):
        assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
        assert "rank(s) [2] need out=" in str(errors[r]), errors[r]


def test_scatter_header_spells_dtypes_that_round_trip():
    """The header carries root's dtype in 16 bytes: .str for bool/'S'/'U'/byte order, the
    name for bfloat16; nothing for a structured dtype (then non-roots must pass out=)."""
    for dtype in [*O.ALL_DTYPES, np.dtype(bool), np.dtype("S5"), np.dtype("<U3"),
                  np.dtype(">i4"), np.dtype("M8[ns]")]:
        raw = S._spell(dtype)
        assert raw is not None and np.dtype(raw.decode()) == dtype, dtype
    assert S._spell(np.dtype([("a", "<i4"), ("b", "<f8")])) is None
    if O.BFLOAT16 is not None:  # its descr is a plain 2-byte void's: the crc tells them apart
        assert A.layout(O.BFLOAT16, ()) != A.layout(np.dtype("V2"), ())
    assert A.layout(np.dtype("<i4"), (2,)) != A.layout(np.dtype(">i4"), (2,))
    assert A.layout(np.dtype("<i4"), (2,)) != A.layout(np.dtype("<i4"), (2, 1))


def test_scatter_debug_mode_runs_and_names_a_root_mismatch(capsys):
    def fn(comm):
        return comm.scatter(np.arange(6) if comm.rank == 1 else None, root=1)

    for r, y in enumerate(run(3, fn, debug=True)):
        assert y.tolist() == [2 * r, 2 * r + 1]
    assert "scatter #1 (root=1) on 3 ranks -> tree" in capsys.readouterr().err
    errors = expect_error_on_every_rank(
        3, lambda c: c.scatter(np.ones(3), root=c.rank % 2), ringcoll.CollectiveMismatchError,
        "root", debug=True)
    assert all("scatter" in str(e) for e in errors)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("root", [0, 1, "last"])
def test_scatter_is_a_binomial_tree(p, root):
    """p - 1 data messages in all, ceil(log2 p) out of the root (largest subtree first), which
    sends every other rank's rows exactly once (its bytes out = all but its own); every other
    rank receives its binomial subtree's rows from its parent in one message. The agreement
    adds one record (5 int64) per subtree member up the tree and one header row (2p + 15
    int64) per subtree member down it."""
    root = (p - 1 if root == "last" else root) % p
    rows = [r % 3 + 1 for r in range(p)]
    lg = (p - 1).bit_length()

    def fn(comm):
        x = np.arange(sum(rows), dtype=np.int64) if comm.rank == root else None
        comm.scatter(x, root=root, counts=rows)

    _, trace = ringcoll.simulate(p, fn)
    if p == 1:
        assert len(trace.messages) == 0  # no message at all
        return
    data = trace.select(tag="scatter").messages
    assert len(data) == p - 1
    assert {m.dst for m in data} == set(range(p)) - {root}
    from_root = [m for m in data if m.src == root]
    assert len(from_root) == lg  # to v = 2^j, largest subtree first: it has most to forward
    assert [m.dst for m in from_root] == [(root + (1 << j)) % p for j in reversed(range(lg))]
    assert sum(m.nbytes for m in from_root) == 8 * (sum(rows) - rows[root])
    for r in range(p):  # each other rank receives its whole subtree from its parent, once
        if r == root:
            continue
        v = (r - root) % p
        low = v & -v
        [got] = [m for m in data if m.dst == r]
        subtree = [(u + root) % p for u in range(v, min(v + low, p))]
        assert got.src == (v - low + root) % p, (r, got)
        assert got.nbytes == 8 * sum(rows[q] for q in subtree), (r, got)
    # the header: one row per rank (a first call: no slots for blocks yet), scattered down
    # the same tree, so root sends every other rank's row once
    row = 8 * S._header_size(p)
    header = trace.select(tag="verdict").messages
    assert [m.dst for m in header if m.src == root] == [m.dst for m in from_root]
    assert sum(m.nbytes for m in header if m.src == root) == row * (p - 1)
    assert len(header) == p - 1 and not trace.select(tag="bcast").messages
    assert len(trace.select(tag="gather").messages) == p - 1
    assert trace.bytes_sent(root) == 8 * (sum(rows) - rows[root]) + row * (p - 1)


def test_scatter_out_mismatches_raise_on_every_rank():
    x = np.arange(12.0).reshape(6, 2)  # 3 ranks: 2 rows each

    def scatter(out_of, root=0, **kw):
        return lambda c: c.scatter(x if c.rank == root else None, root=root,
                                   out=out_of(c.rank), **kw)

    cases = [  # (out per rank, the offender's error type, what its message says)
        (lambda r: np.empty((3, 2)) if r == 2 else None, ringcoll.InvalidArgumentError,
         "this rank's block has 2 rows", "passed out= with another row count"),
        (lambda r: np.empty((2, 2), np.float32) if r == 2 else None,
         ringcoll.CollectiveMismatchError, "root 0 scatters float64 rows of shape (2,)",
         "passed out= whose dtype or row shape differs"),
        (lambda r: np.empty((2, 3)) if r == 2 else None, ringcoll.CollectiveMismatchError,
         "rows of shape (3,)", "passed out= whose dtype or row shape differs"),
    ]
    for out_of, exc_type, own, told in cases:
        errors = per_rank(3, scatter(out_of))
        assert isinstance(errors[2], exc_type) and own in str(errors[2]), errors[2]
        assert "ringcoll rank 2, scatter" in str(errors[2])
        for r in (0, 1):
            e = errors[r]
            assert isinstance(e, ringcoll.PeerFailedError), e
            assert f"ringcoll rank {r}, scatter" in str(e) and f"rank(s) [2] {told}" in str(e)
    # root's own out: wrong row count, or overlapping x without being its block
    for out_of, own in [(lambda r: np.empty((3, 2)) if r == 1 else None, "has 2 rows"),
                        (lambda r: x[1:3] if r == 1 else None, "overlaps x")]:
        errors = per_rank(3, scatter(out_of, root=1))
        assert isinstance(errors[1], ringcoll.InvalidArgumentError), errors[1]
        assert own in str(errors[1]) and "x[2:4]" in str(errors[1]), errors[1]
        for r in (0, 2):
            assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
            assert "rank(s) [1] passed out=" in str(errors[r]), errors[r]


@pytest.mark.parametrize("counts, says", [
    ([2, 2], "counts has 2 entries where this communicator has 3 ranks"),
    ([3, -1, 4], "has a negative entry"),
    ([2, 2, 1], "adds up to 5 rows, but x has 6"),
    ([2.0, 2, 2], "is not a sequence of ints"),
    (6, "is not a sequence of ints"),
])
def test_scatter_bad_counts_raise_on_every_rank(counts, says):
    errors = per_rank(3, lambda c: c.scatter(np.arange(6) if c.rank == 2 else None, root=2,
                                             counts=counts if c.rank == 2 else None))
    assert isinstance(errors[2], ringcoll.InvalidArgumentError), errors[2]
    assert says in str(errors[2]) and "counts=None" in str(errors[2]), errors[2]
    for r in (0, 1):
        assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
        assert "rank(s) [2] passed an invalid counts list" in str(errors[r]), errors[r]


def test_scatter_counts_matter_on_root_only():
    def fn(comm):  # non-roots pass nonsense counts and x: both ignored, as MPI's sendcounts
        x = np.arange(5) if comm.rank == 0 else np.ones(99)
        return comm.scatter(x, counts=[1, 0, 4] if comm.rank == 0 else [7])

    assert [y.tolist() for y in run(3, fn)] == [[0], [], [1, 2, 3, 4]]


def test_scatter_local_errors():
    expect_error_on_every_rank(2, lambda c: c.scatter(np.ones(2), root=2), ValueError,
                               "root=2 is not a rank")
    expect_error_on_every_rank(2, lambda c: c.scatter(np.ones(2), algorithm="ring"),
                               ValueError, "unknown algorithm 'ring'; use 'auto', 'tree' or 'native'")
    expect_error_on_every_rank(2, lambda c: c.scatter(np.ones(2), out=np.empty(())),
                               ValueError, "out is 0-d")
    ro = np.empty(1)
    ro.flags.writeable = False
    expect_error_on_every_rank(2, lambda c: c.scatter(np.ones(2), out=ro), ValueError,
                               "read-only")
    expect_error_on_every_rank(2, lambda c: c.scatter(np.ones(2), out=[0.0]), TypeError,
                               "must be a NumPy array")
    # root-only problems raise on root before anything is sent (the others are released)
    for x, exc_type, says in [(None, ringcoll.InvalidArgumentError, "x is None on the root"),
                              (np.array([None]), ringcoll.InvalidTypeError, "object")]:
        errors = per_rank(2, lambda c: c.scatter(x if c.rank == 0 else None))
        assert isinstance(errors[0], exc_type) and says in str(errors[0]), errors[0]
        assert "ringcoll rank 0, scatter" in str(errors[0])
        assert isinstance(errors[1], ringcoll.PeerFailedError), errors[1]
    errors = per_rank(2, lambda c: c.scatter(np.ones((4, 2)), out=np.empty((2, 2), np.float32)
                                             if c.rank == 0 else None))
    assert "it must be shape (2, 2) and dtype float64" in str(errors[0]), errors[0]


def test_scatter_in_the_registry_and_on_the_facade():
    from ringcoll.collectives import COLLECTIVES

    assert COLLECTIVES["scatter"] is S and S.ALGORITHMS == ("tree", "native")
    assert ringcoll.Communicator.scatter.__doc__.startswith("Split root's x along axis 0")
    assert Tag.SCATTER.name == "SCATTER" and len({int(t) for t in Tag}) == len(Tag)


ONE_CALL_SCRIPT = r"""
import numpy as np, ringcoll
from mpi4py import MPI
from ringcoll.collectives.scatter import CARRY_MAX
comm = ringcoll.Communicator(MPI.COMM_WORLD)
p, r = comm.size, comm.rank
rec = np.dtype([("a", np.int8), ("b", np.float64)])
ride = CARRY_MAX // (8 * p * p)  # int64 rows that still ride at p ranks; one more does not
plans = [[2] * p, [2] * p, [3] * p, [3] * p, [0] * p, [1] * p, list(range(p)),
         list(range(p)), [ride] * p, [ride] * p, [ride + 1] * p, [ride + 1] * p, [1] * p]
def rows(k, n, dtype):
    x = np.zeros(n, dtype)
    if dtype == rec:
        x["a"], x["b"] = k, np.arange(n) + 0.25
    else:
        x[...] = np.arange(n) * 3 + k
    return x
bad = []
for k, counts in enumerate(plans):
    root = (k // 2) % p
    for dtype in (np.int64, rec):
        full = rows(k, sum(counts), dtype)
        x = full if r == root else None
        out = np.empty(counts[r], dtype) if (k + r) % 3 or dtype == rec else None
        for again in range(3):  # the same call again: the later ones may carry the blocks
            if r == root:
                full["a" if dtype == rec else ...] += 1  # new values each call, same x
            got = comm.scatter(x, root=root, counts=counts, out=out)
            full_now = MPI.COMM_WORLD.bcast(full if r == root else None, root=root)
            lo = sum(counts[:r])
            if got.tobytes() != full_now[lo:lo + counts[r]].tobytes():
                bad.append((k, str(dtype), again))
# a wrong out= on the last rank after small repeated calls: every rank raises, then goes on
errors = []
for _ in range(2):
    n = 3 if r == p - 1 and p > 1 else 2
    try:
        comm.scatter(np.arange(2.0 * p) if r == 0 else None, out=np.empty(n))
        errors.append(None)
    except ringcoll.RingcollError as e:
        errors.append(type(e).__name__)
got = comm.scatter(np.arange(2.0 * p) if r == 0 else None, out=np.empty(2))
assert (got == [2.0 * r, 2.0 * r + 1]).all(), got
want = ["InvalidArgumentError" if r == p - 1 else "PeerFailedError"] * 2 if p > 1 else [None] * 2
assert not bad and errors == want, (r, bad, errors)
print("one call ok", r)
"""


@mpirun.needs_mpi
@pytest.mark.parametrize("p", [1, 2, 3])
def test_scatter_agreed_in_one_mpi_allgather_carries_blocks_as_sizes_change(tmp_path, p):
    """Under real MPI the agreement is one MPI_Allgather (OneCall) in which every rank judges
    every record: block sizes changing call to call (past the slot, zero, uneven, the last
    size that rides and the first that does not), roots changing, a padded structured dtype,
    new values in the same x: every block equals root's rows on every rank; a bad out= after
    small repeated calls is refused on every rank alike, and the next call works."""
    script = tmp_path / "one_call.py"
    script.write_text(ONE_CALL_SCRIPT)
    rc, log, _ = mpirun.launch(p, [str(script)], timeout=120)
    assert rc == 0, log
    assert log.count("one call ok") == p, log
