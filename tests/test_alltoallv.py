"""Communicator.alltoallv and reduce_scatter(counts=) on thread ranks, p = 1..16, against NumPy
on every rank's inputs (rebuilt from their seeds, tests/_oracle.py).

The MPI tier is the "alltoallv" group of tests/mpi_checks.py (mpiexec -n 1, 2, 3, 4, 5, 8,
against mpi4py's own Alltoallv and Reduce_scatter on the same arrays).
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.transport.base import Tag

import _mpirun as mpirun
import _oracle as O
from test_threads import expect_error_after_exchange, expect_error_on_every_rank, per_rank, run

PS = list(range(1, 17))


# ---------------------------------------------------------------------------------------------
# alltoallv
# ---------------------------------------------------------------------------------------------
def sends(p):
    """[(name, C)]: C[i][j] = rows rank i sends rank j."""
    rng = np.random.default_rng([p, 0xA11])
    rand = rng.integers(0, 4, (p, p))
    rand[rng.random((p, p)) < 0.3] = 0  # plenty of empty blocks
    edge = [0, 1, max(p - 1, 0), p + 1]
    big = np.ones((p, p), int)
    big[p // 2, (p // 2 + 1) % p] = 1001  # one big block (to itself at p = 1)
    return [
        ("random", rand),
        ("all-zero", np.zeros((p, p), int)),
        ("one-big", big),
        ("0/1/p-1/p+1", np.array([[edge[(i + 2 * j) % 4] for j in range(p)] for i in range(p)])),
        ("one-sender", np.array([[3 * (i == 0) for j in range(p)] for i in range(p)])),
    ]


def cases(p):
    """[(seed, name, C, trailing shape, dtype, give out, give recv_counts)]."""
    found = []
    k = 0
    for name, C in sends(p):
        for trail in ((), (2, 3)):
            dtype = O.ALL_DTYPES[(3 * k + p) % len(O.ALL_DTYPES)]
            found.append((900 + k, name, C, trail, dtype, k % 2 == 1, k % 3 != 0))
            k += 1
    return found


def inputs(seed, C, trail, dtype, p):
    return [O.make_input(seed, i, (int(C[i].sum()),) + trail, dtype) for i in range(p)]


def expected(xs, C, p, j):
    """What rank j receives: block j of every rank's x, in rank order."""
    blocks = []
    for i in range(p):
        start = int(C[i, :j].sum())
        blocks.append(xs[i][start:start + int(C[i, j])])
    return np.concatenate(blocks)


@pytest.mark.parametrize("p", PS)
def test_alltoallv_matches_numpy(p):
    all_cases = cases(p)

    def fn(comm):
        r, res = comm.rank, []
        for seed, _, C, trail, dtype, give_out, give_recv in all_cases:
            x = O.make_input(seed, r, (int(C[r].sum()),) + trail, dtype)
            before = x.copy()
            got = [int(c) for c in C[:, r]]
            out = np.empty((sum(got),) + trail, dtype) if give_out else None
            y = comm.alltoallv(x, list(C[r]), out=out, recv_counts=got if give_recv else None)
            res.append((y.copy(), out is None or y is out, x.tobytes() == before.tobytes()))
        return res

    results = run(p, fn, segment_bytes=64 if p % 2 else None)
    failures = []
    for k, (seed, name, C, trail, dtype, give_out, give_recv) in enumerate(all_cases):
        xs = inputs(seed, C, trail, dtype, p)
        for j in range(p):
            want = expected(xs, C, p, j)
            got, returned_out, unchanged = results[j][k]
            where = (f"p={p} {name} trail={trail} {dtype} out={give_out} "
                     f"recv_counts={give_recv} rank {j}")
            if got.dtype != dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                failures.append(f"{where}: got {got.shape} {got.dtype}, want {want.shape}")
            if not returned_out:
                failures.append(f"{where}: did not return out")
            if not unchanged:
                failures.append(f"{where}: modified x")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_alltoallv_layouts_and_zero_dim(p):
    def fn(comm):
        r = comm.rank
        a = comm.alltoallv(np.float32(r), [1 if j == 0 else 0 for j in range(p)])  # 0-d
        base = np.arange(p * 2 * 8).reshape(p * 2, 8) + 1000 * r
        b = comm.alltoallv(base[:, ::3], [2] * p)  # non-contiguous x
        out = np.asfortranarray(np.empty((2 * p, 8), base.dtype))
        c = comm.alltoallv(base, [2] * p, out=out)  # an F-ordered out
        return a, b, c, c is out

    for r, (a, b, c, same) in enumerate(run(p, fn)):
        bases = [np.arange(p * 2 * 8).reshape(p * 2, 8) + 1000 * q for q in range(p)]
        assert a.tolist() == (list(range(p)) if r == 0 else []) and a.dtype == np.float32
        assert np.array_equal(b, np.concatenate([m[2 * r:2 * r + 2, ::3] for m in bases]))
        assert np.array_equal(c, np.concatenate([m[2 * r:2 * r + 2] for m in bases]))
        assert same and c.flags.f_contiguous


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 16])
def test_alltoallv_trace(p):
    """Data: rank r sends rank j one message of exactly counts[j] rows' bytes, none for an
    empty block or to itself. Counts: p - 1 messages of 56 bytes (7 int64) from each rank,
    one to every other rank. Verdict: none unless some rank passes recv_counts= or out=;
    then each rank sends ceil(log2 p) messages and receives 8 (p - 1) bytes (Bruck). The
    second call's blocks ride in the counts' slots (S bytes: the first call's largest block,
    rounded up to 8): no data messages, counts messages of 56 + S bytes."""
    rng = np.random.default_rng([p, 7])
    C = rng.integers(0, 3, (p, p))
    trail, item = (3,), 8
    slot = -(-int(C.max()) * 3 * item // 8) * 8
    assert p * slot <= ringcoll.collectives.alltoallv.CARRY_MAX  # (so the second call carries)

    def fn(comm):
        r = comm.rank
        x = np.zeros((int(C[r].sum()),) + trail)
        comm.alltoallv(x, list(C[r]))
        comm.alltoallv(x, list(C[r]), recv_counts=list(C[:, r]) if r == p - 1 else None)

    _, trace = ringcoll.simulate(p, fn)
    first, second = [s for s, c, _ in trace.collectives() if c == "alltoallv"]
    for seq in (first, second):
        part = trace.select(seq=seq)
        data = part.select(tag="alltoall").messages
        assert sorted((m.src, m.dst, m.nbytes) for m in data) == (sorted(
            (i, j, int(C[i, j]) * 3 * item) for i in range(p) for j in range(p)
            if i != j and C[i, j]) if seq == first else []), seq
        counts = part.select(tag="counts").messages
        assert sorted((m.src, m.dst, m.nbytes) for m in counts) == sorted(
            (i, j, 56 + (slot if seq == second else 0)) for i in range(p) for j in range(p)
            if i != j)
        verdict = part.select(tag="verdict")
        if seq == first:
            assert not verdict.messages and not verdict.receives
        else:
            steps = (p - 1).bit_length()
            for r in range(p):
                assert sum(m.src == r for m in verdict.messages) == steps
                assert verdict.bytes_received(r) == 8 * (p - 1)
        assert {m.tag for m in part.messages} <= {"alltoall", "counts", "verdict"}


def test_alltoallv_mismatches_raise_on_every_rank():
    mismatch = ringcoll.CollectiveMismatchError
    # a dtype or trailing shape that differs: every rank sees it in the count exchange
    expect_error_after_exchange(
        3, lambda c: c.alltoallv(np.ones(3, np.float32 if c.rank == 1 else np.float64),
                                 [1, 1, 1]), mismatch, "rank(s) [")
    expect_error_after_exchange(
        4, lambda c: c.alltoallv(np.ones((4, 2 if c.rank else 3)), [1] * 4), mismatch,
        "trailing shape")
    # recv_counts on rank 1 disagree with what rank 2 sends it
    errors = per_rank(3, lambda c: c.alltoallv(
        np.ones(3), [1, 1, 1], recv_counts=[1, 1, 2] if c.rank == 1 else None))
    assert isinstance(errors[1], mismatch), errors[1]
    assert "ringcoll rank 1, alltoallv" in str(errors[1]) and "recv_counts=[1, 1, 1]" in str(
        errors[1]) and "rank(s) [2] differ" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
        assert f"ringcoll rank {r}, alltoallv" in str(errors[r])
        assert "rank(s) [1] passed recv_counts" in str(errors[r])
    # rank 2's out has the wrong row count (and rank 0's recv_counts are wrong too)
    errors = per_rank(4, lambda c: c.alltoallv(
        np.ones(8), [2] * 4, out=np.empty(7) if c.rank == 2 else None,
        recv_counts=[2, 2, 2, 1] if c.rank == 0 else None))
    assert isinstance(errors[2], ringcoll.InvalidArgumentError), errors[2]
    assert "8 rows in all" in str(errors[2]) and "ringcoll rank 2," in str(errors[2])
    assert isinstance(errors[0], mismatch), errors[0]
    for r in (1, 3):
        assert isinstance(errors[r], ringcoll.PeerFailedError), errors[r]
        assert "rank(s) [0] passed recv_counts" in str(errors[r])
        assert "rank(s) [2] passed out=" in str(errors[r])


@pytest.mark.parametrize("p", [2, 3, 5])
def test_a_repeated_checked_alltoallv_skips_the_verdict_round_until_a_rank_changes(p):
    """The same checked call again on every rank (out= given: a repeat) sends no verdicts
    once every rank's count numbers say "again"; a rank that then passes an out= of the wrong
    row count is a new call: the verdict round runs again and every rank raises alike."""
    def fn(comm):
        r = comm.rank
        x = np.arange(float(p)) + 10 * r
        out = np.empty(p)
        got = []
        for _ in range(4):
            got.append(comm.alltoallv(x, [1] * p, out=out).tolist())
        bad = np.empty(p + 1) if r == p - 1 else out
        try:
            comm.alltoallv(x, [1] * p, out=bad)
        except ringcoll.RingcollError as exc:
            got.append(type(exc).__name__)
        got.append(comm.alltoallv(x, [1] * p, out=out).tolist())
        return got

    _, trace = ringcoll.simulate(p, fn)
    seqs = [s for s, c, _ in trace.collectives() if c == "alltoallv"]
    verdicts = [len(trace.select(seq=s).select(tag="verdict").messages) for s in seqs]
    # the first call runs the round (no rank repeats yet), calls 2-4 do not (every rank
    # repeats a call that ended fine); the changed call 5 and the call after it do
    assert [v > 0 for v in verdicts] == [True, False, False, False, True, True], verdicts
    results = run(p, fn)
    for r, got in enumerate(results):
        want = [float(r + 10 * i) for i in range(p)]
        assert got[:4] == [want] * 4 and got[5] == want, got
        assert got[4] == ("InvalidArgumentError" if r == p - 1 else "PeerFailedError"), got


def test_alltoallv_after_a_mismatch_the_communicator_still_works():
    """The errors above are raised on every rank alike before any data moves: nothing is
    left in flight, so the next call is fine."""
    def fn(comm):
        try:
            comm.alltoallv(np.ones(2), [1, 1], recv_counts=[1, 2] if comm.rank else None)
        except ringcoll.RingcollError as exc:
            caught = type(exc).__name__
        return caught, comm.alltoallv(np.arange(2) + 10 * comm.rank, [1, 1]).tolist()

    assert run(2, fn) == [("PeerFailedError", [0, 10]), ("CollectiveMismatchError", [1, 11])]


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: c.alltoallv(np.ones(3), [1, 2]), ValueError, "has 2 entries"),
    (lambda c: c.alltoallv(np.ones(3), [4, -1, 0]), ValueError, "counts[1] = -1"),
    (lambda c: c.alltoallv(np.ones(3), [1, 1, 0]), ValueError, "sum to 2 rows but x has 3"),
    (lambda c: c.alltoallv(np.ones(3), [1.0, 1, 1]), ValueError, "non-negative integers"),
    (lambda c: c.alltoallv(np.ones(3), 3), ValueError, "must be a sequence"),
    (lambda c: c.alltoallv(np.ones(3), [1, 1, 1], recv_counts=[1]), ValueError,
     "recv_counts has 1 entries"),
    (lambda c: c.alltoallv(np.ones(3), [1, 1, 1], algorithm="ring"), ValueError,
     "unknown algorithm 'ring'"),
    (lambda c: c.alltoallv(np.ones(3), [1, 1, 1], algorithm="native"), ValueError,
     "MPI transport"),
    (lambda c: c.alltoallv(np.ones(3), [1, 1, 1], out=np.empty(3, np.float32)), ValueError,
     "dtype float64"),
    (lambda c: c.alltoallv(np.array([1, "b", None], dtype=object), [1, 1, 1]), TypeError,
     "fixed-size dtype"),
])
def test_alltoallv_local_errors(call, exc, match):
    expect_error_on_every_rank(3, call, exc, match)


def test_alltoallv_out_must_not_overlap_x():
    def call(c):
        buf = np.ones(6)
        return c.alltoallv(buf[:3], [1, 1, 1], out=buf[2:5])

    expect_error_on_every_rank(3, call, ValueError, "out overlaps x")


def test_alltoallv_in_the_registry_and_on_the_facade():
    from ringcoll.collectives import COLLECTIVES

    assert COLLECTIVES["alltoallv"].ALGORITHMS == ("pairwise", "native")
    assert ringcoll.Communicator.alltoallv.__doc__.startswith("Send counts[j] rows of x")
    assert (Tag.COUNTS.name, Tag.VERDICT.name) == ("COUNTS", "VERDICT")


# ---------------------------------------------------------------------------------------------
# reduce_scatter(counts=)
# ---------------------------------------------------------------------------------------------
def rs_counts(p, total, k):
    """Uneven row counts summing to total, zeros included (seeded by p and k)."""
    rng = np.random.default_rng([p, total, k])
    if k % 3 == 2:  # everything to one rank
        return [total if r == (k + p) % p else 0 for r in range(p)]
    cuts = np.sort(rng.integers(0, total + 1, p - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


@pytest.mark.parametrize("p", PS)
def test_reduce_scatter_counts(p):
    cases = []
    for i, (total, trail) in enumerate([(0, ()), (1, (3,)), (p + 1, ()), (2 * p + 3, (2, 2)),
                                        (3 * p, (3,)), (7, ())]):
        for j in range(2):
            k = 2 * i + j
            dtype, op = O.COMBOS[(7 * k + 11 * p) % len(O.COMBOS)]
            cases.append((5000 + 100 * p + k, (total,) + trail, dtype, op,
                          rs_counts(p, total, k), k % 2 == 0))

    def fn(comm):
        res = []
        for seed, shape, dtype, op, counts, give_out in cases:
            x = O.make_input(seed, comm.rank, shape, dtype, op)
            before = x.copy()
            out = np.empty((counts[comm.rank],) + shape[1:], dtype) if give_out else None
            y = comm.reduce_scatter(x, op=op, out=out, counts=counts)
            res.append((y.copy(), out is None or y is out, x.tobytes() == before.tobytes()))
        return res

    results = run(p, fn, segment_bytes=64 if p % 3 == 0 else None)
    failures = []
    for k, (seed, shape, dtype, op, counts, give_out) in enumerate(cases):
        full = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op) for r in range(p)],
                               op, dtype)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for r in range(p):
            got, returned_out, unchanged = results[r][k]
            want = full[starts[r]:starts[r + 1]]
            label = f"p={p} shape={shape} {dtype} {op} counts={counts} rank {r}"
            if got.shape != want.shape:
                failures.append(f"{label}: shape {got.shape}, want {want.shape}")
                continue
            bad = O.compare(got, want, op, dtype, nranks=p)
            if bad:
                failures.append(f"{label}: {bad}")
            if dtype.kind in "iu" and got.tobytes() != want.tobytes():
                failures.append(f"{label}: integers not exact")
            if not (returned_out and unchanged):
                failures.append(f"{label}: out not returned / x modified")
    assert not failures, "\n".join(failures[:20])


def test_reduce_scatter_counts_none_is_the_default_split():
    def fn(comm):
        x = np.arange(7.0) * (comm.rank + 1)
        return comm.reduce_scatter(x).tolist(), comm.reduce_scatter(x, counts=None).tolist()

    for a, b in run(3, fn):
        assert a == b


@pytest.mark.parametrize("call, match", [
    (lambda c: c.reduce_scatter(np.ones(4), counts=[4]), "counts has 1 entries"),
    (lambda c: c.reduce_scatter(np.ones(4), counts=[5, -1]), "counts[1] = -1"),
    (lambda c: c.reduce_scatter(np.ones(4), counts=[1, 1]), "sum to 2 rows but x has 4"),
    (lambda c: c.reduce_scatter(np.ones(4), counts=[2, 2], algorithm="native"),
     "MPI transport"),
])
def test_reduce_scatter_counts_local_errors(call, match):
    expect_error_on_every_rank(2, call, ValueError, match)


def test_reduce_scatter_debug_mode_names_counts_that_differ():
    errors = expect_error_on_every_rank(
        3, lambda c: c.reduce_scatter(np.ones(6), counts=[2, 2, 2] if c.rank else [1, 2, 3]),
        ringcoll.CollectiveMismatchError, "counts", debug=True)
    assert all("reduce_scatter" in str(e) for e in errors)
    # the default split spelt out agrees with counts=None
    res = run(3, lambda c: c.reduce_scatter(np.ones(7), counts=[3, 2, 2] if c.rank else None),
              debug=True)
    assert [r.tolist() for r in res] == [[3.0] * 3, [3.0] * 2, [3.0] * 2]


REC = np.dtype([("a", np.int8), ("b", np.float64)])  # padded: its padding travels too


def carried_sequence(comm):
    """alltoallv calls whose blocks ride in the count exchange's slots, and some that do not:
    sizes changing call to call (growing past the slot and past CARRY_MAX, shrinking, zero,
    uneven), a padded structured dtype, recv_counts= and out= given or not, new values in
    the same x each time. Returns this rank's [(label, ok)], then its errors from a wrong
    recv_counts= on the last rank after carried calls, then whether a right call works."""
    from ringcoll.collectives.alltoallv import CARRY_MAX
    p, r = comm.size, comm.rank
    big = CARRY_MAX // (8 * p) + 1  # int64 rows past what may ride
    plans = [lambda i, j: 1, lambda i, j: 1, lambda i, j: (i + 2 * j) % 3,
             lambda i, j: (i + 2 * j) % 3, lambda i, j: 0, lambda i, j: 0,
             lambda i, j: big, lambda i, j: big, lambda i, j: 2, lambda i, j: 2]
    results = []
    for k, rows in enumerate(plans):
        for dtype in (np.int64, REC):
            send = [rows(r, j) for j in range(p)]
            recv = [rows(i, r) for i in range(p)]
            x = np.zeros(sum(send), dtype)
            out = np.empty(sum(recv), dtype) if k % 2 else None
            for again in range(3):  # the same call again: the later ones may carry
                value = (10 * k + 3 * again) % 120  # (int8 in REC)
                col = x["a"] if dtype == REC else x
                col[:] = value + r  # every block from rank i holds value + i
                got = comm.alltoallv(x, send, out=out, recv_counts=recv if k % 4 < 2 else None)
                want = np.concatenate([np.full(recv[i], value + i) for i in range(p)])
                mine = got["a"] if dtype == REC else got
                results.append((f"{k} {np.dtype(dtype)} {again}",
                                got.shape == (sum(recv),) and mine.tolist() == want.tolist()
                                and (out is None or got is out)))
    errors = []
    for _ in range(2):
        wrong = [1] * p if r != p - 1 else [2] + [1] * (p - 1)
        try:
            comm.alltoallv(np.zeros(p), [1] * p, recv_counts=wrong)
            errors.append(None)
        except ringcoll.RingcollError as e:
            errors.append(type(e).__name__)
    got = comm.alltoallv(np.full(p, float(r)), [1] * p)
    return results, errors, got.tolist() == [float(i) for i in range(p)]


def check_carried(p, results, errors, works):
    bad = [label for label, ok in results if not ok]
    assert not bad, bad
    return errors, works


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_alltoallv_blocks_that_ride_in_the_count_exchange_as_sizes_change(p):
    """carried_sequence on threads: every result right, whether the blocks came in the
    count exchange's slots or by the data step; a wrong recv_counts= after carried calls is
    refused on every rank alike, and a right call then works."""
    for r, (results, errors, works) in enumerate(run(p, carried_sequence)):
        check_carried(p, results, errors, works)
        want = "CollectiveMismatchError" if r == p - 1 else "PeerFailedError"
        assert errors == [want, want], (r, errors)
        assert works


CARRIED_SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import numpy as np, ringcoll
from mpi4py import MPI
from test_alltoallv import carried_sequence
comm = ringcoll.Communicator(MPI.COMM_WORLD)
results, errors, works = carried_sequence(comm)
bad = [label for label, ok in results if not ok]
p, r = comm.size, comm.rank
want = ["CollectiveMismatchError" if r == p - 1 else "PeerFailedError"] * 2
assert not bad and errors == want and works, (r, bad, errors, works)
print("carried ok", r)
"""


@mpirun.needs_mpi
@pytest.mark.parametrize("p", [1, 2, 3])
def test_alltoallv_blocks_ride_in_mpis_count_alltoall(tmp_path, p):
    """carried_sequence under real MPI (the counts by MPI_Alltoall, the verdict by
    MPI_Allgather, the data by MPI_Alltoallv or the pairwise exchange)."""
    script = tmp_path / "carried.py"
    script.write_text(CARRIED_SCRIPT)
    rc, log, _ = mpirun.launch(p, [str(script)], timeout=180)
    assert rc == 0, log
    assert log.count("carried ok") == p, log
