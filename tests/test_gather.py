"""Communicator.gather on thread ranks, p = 1..16 and every root, against NumPy on the inputs.

The MPI tier is the "gather" group of tests/mpi_checks.py (mpiexec -n 1, 2, 3, 4, 5, 8, against
mpi4py's own gather of the same arrays).
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.transport.base import Tag

import _oracle as O
from test_threads import expect_error_after_exchange, expect_error_on_every_rank, per_rank, run

PS = list(range(1, 17))


def cases(p):
    """(seed, rows per rank, trailing shape, dtype): uneven, empty, one big rank, 2-D rows."""
    return [
        (1, [(r * 7 + 3) % 4 for r in range(p)], (), O.ALL_DTYPES[p % len(O.ALL_DTYPES)]),
        (2, [(r * 5 + 1) % 3 for r in range(p)], (2, 3),
         O.ALL_DTYPES[(p + 5) % len(O.ALL_DTYPES)]),
        (3, [0] * p, (2,), np.dtype(np.int16)),
        (4, [1001 if r == p // 2 else 1 for r in range(p)], (), np.dtype(np.float64)),
    ]


def expected(seed, rows, trail, dtype, p):
    return np.concatenate([O.make_input(seed, r, (rows[r],) + trail, dtype) for r in range(p)])


@pytest.mark.parametrize("p", PS)
def test_gather_every_root(p):
    roots = range(p) if p <= 8 else sorted({0, 1, p // 2, p - 1})

    def fn(comm):
        res = []
        for root in roots:
            for i, (seed, rows, trail, dtype) in enumerate(cases(p)):
                x = O.make_input(seed, comm.rank, (rows[comm.rank],) + trail, dtype)
                before = x.copy()
                out = (np.empty((sum(rows),) + trail, dtype)
                       if i % 2 and comm.rank == root else None)
                y = comm.gather(x, root=root, out=out)
                res.append((root, i, None if y is None else y.copy(),
                            out is None or y is out, np.array_equal(x, before)))
        return res

    results = run(p, fn, segment_bytes=64 if p % 2 else None)
    failures = []
    for r in range(p):
        for root, i, got, returned_out, unchanged in results[r]:
            seed, rows, trail, dtype = cases(p)[i]
            where = f"p={p} root={root} case {i} rank {r}"
            if r != root:
                if got is not None:
                    failures.append(f"{where}: a non-root got {got!r}, not None")
                continue
            want = expected(seed, rows, trail, dtype, p)
            if got.dtype != dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                failures.append(f"{where}: got {got.shape} {got.dtype}, want {want.shape}")
            if not (returned_out and unchanged):
                failures.append(f"{where}: out not returned / input modified")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_gather_layouts_and_zero_dim(p):
    root = p - 1

    def fn(comm):
        big = np.arange(40).reshape(4, 10) + 100 * comm.rank
        a = comm.gather(np.float32(comm.rank), root=root)  # 0-d: one row each
        b = comm.gather(big[:, ::3], root=root)  # non-contiguous x
        c = comm.gather(np.asfortranarray(big), root=root)
        out = np.asfortranarray(np.empty((4 * p, 10), big.dtype)) if comm.rank == root else None
        d = comm.gather(big, root=root, out=out)  # an F-ordered out
        return a, b, c, d, d is out

    for r, (a, b, c, d, same) in enumerate(run(p, fn)):
        if r != root:
            assert (a, b, c, d) == (None, None, None, None)
            continue
        rows = [np.arange(40).reshape(4, 10) + 100 * q for q in range(p)]
        assert a.shape == (p,) and a.dtype == np.float32 and a.tolist() == list(range(p))
        assert np.array_equal(b, np.concatenate([m[:, ::3] for m in rows]))
        assert np.array_equal(c, np.concatenate(rows))
        assert np.array_equal(d, np.concatenate(rows)) and same and d.flags.f_contiguous


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("root", [0, 1, "last"])
def test_gather_is_a_binomial_tree(p, root):
    """p - 1 data messages in all, ceil(log2 p) into the root, which receives every other
    rank's rows exactly once (its bytes in = all but its own); every other rank sends its
    binomial subtree's rows to its parent in one message."""
    root = p - 1 if root == "last" else root
    rows = [r % 3 + 1 for r in range(p)]

    def fn(comm):
        comm.gather(np.full(rows[comm.rank], comm.rank, np.int64), root=root)

    _, trace = ringcoll.simulate(p, fn)
    data = trace.select(tag="gather").messages
    assert len(data) == p - 1
    assert all(m.dst != m.src for m in data) and {m.src for m in data} == set(range(p)) - {root}
    into_root = [m for m in data if m.dst == root]
    assert len(into_root) == (p - 1).bit_length()
    assert sum(m.nbytes for m in into_root) == 8 * (sum(rows) - rows[root])
    for r in range(p):  # each other rank sends its whole subtree to its parent, once
        if r == root:
            continue
        v = (r - root) % p
        low = v & -v
        [sent] = [m for m in data if m.src == r]
        subtree = [(u + root) % p for u in range(v, min(v + low, p))]
        assert sent.dst == (v - low + root) % p, (r, sent)
        assert sent.nbytes == 8 * sum(rows[q] for q in subtree), (r, sent)


def test_gather_errors():
    mismatch = ringcoll.CollectiveMismatchError
    expect_error_after_exchange(3, lambda c: c.gather(np.ones((2, 3 if c.rank != 1 else 4))),
                                mismatch, "trailing shape")
    expect_error_after_exchange(3, lambda c: c.gather(
        np.ones(2, np.float32 if c.rank == 2 else np.float64), root=2), mismatch, "rank(s) [")
    # root's out has the wrong row count: root raises InvalidArgumentError, the others are told
    errors = per_rank(3, lambda c: c.gather(np.ones(2), root=1,
                                            out=np.empty(5) if c.rank == 1 else None))
    assert isinstance(errors[1], ringcoll.InvalidArgumentError) and "6 rows" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
        assert f"ringcoll rank {r}," in str(errors[r]) and "rank(s) [1]" in str(errors[r])
    expect_error_on_every_rank(2, lambda c: c.gather(np.ones(2), root=2), ValueError,
                               "root=2 is not a rank")
    expect_error_on_every_rank(2, lambda c: c.gather(np.ones(2), algorithm="ring"), ValueError,
                               "unknown algorithm 'ring'")
    expect_error_on_every_rank(2, lambda c: c.gather(np.array([None])), TypeError, "object")


def test_gather_debug_mode_names_a_root_mismatch():
    errors = expect_error_on_every_rank(
        3, lambda c: c.gather(np.ones(2), root=c.rank % 2), ringcoll.CollectiveMismatchError,
        "root", debug=True)
    assert all("gather" in str(e) for e in errors)


def test_gather_in_the_registry_and_on_the_facade():
    from ringcoll.collectives import COLLECTIVES

    module = COLLECTIVES["gather"]
    assert module.ALGORITHMS == ("tree", "native")
    assert ringcoll.Communicator.gather.__doc__.startswith("Concatenate every rank's x")
    assert Tag.GATHER.name == "GATHER"
