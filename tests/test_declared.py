"""Declared counts (allgather.Rows, scatter's agreement, alltoallv's Counts): allgather, gather,
scatter and alltoallv with declared=True on every rank agree on counts, dtype and row shape once per distinct call, and
the same call again moves only the data. These tests hold every declared call to NumPy's
answer on every rank while counts, dtypes, roots and memory change between calls (declared
and undeclared calls of the same counts mixed, other collectives in between, fresh arrays
and repeated ones), check from the traced messages that a repeat does skip the exchange, and
that wrong arguments are refused on every rank on the first call and end the job later."""

import numpy as np
import pytest

import _mpirun as mpirun
import ringcoll
from ringcoll.collectives.allgather import META

from test_threads import expect_error_on_every_rank, per_rank

TIMEOUT = 30
REC = np.dtype([("a", np.int8), ("b", np.float64)])  # padded: its padding travels too


def run(p, fn, **options):
    return ringcoll.run_threads(p, fn, timeout=TIMEOUT, **options)


def rows(rank, k, n, dtype):
    """Rank `rank`'s n rows at call k, exact in every dtype used here."""
    if dtype == REC:
        x = np.zeros(n, REC)
        x["a"], x["b"] = rank + k, np.arange(n) + 0.25 * rank
        return x
    return (np.arange(2 * n).reshape(n, 2) * (rank + 2) + 7 * k + rank).astype(dtype)


def plans(p):
    """Counts lists: even, zeros, uneven (p-1, p+1 rows), and each repeated."""
    return [[2] * p, [2] * p, [0] * p, [r % 3 for r in range(p)], [r % 3 for r in range(p)],
            [p - 1] * p, [p + 1 if r % 2 else 1 for r in range(p)], [2] * p]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_declared_calls_give_numpys_answer(p):
    """Every call on every rank equals the concatenation (or root's split) of the ranks' rows,
    however counts, dtype, root, declared and the arrays change between calls."""
    def body(comm):
        r, ok = comm.rank, []
        keep = {}  # the same arrays for the same (counts, dtype): repeats
        for k, counts in enumerate(plans(p)):
            root = k % p
            for dtype in (np.int64, REC):
                every = [rows(q, k, counts[q], dtype) for q in range(p)]
                whole = np.concatenate(every)
                key = (tuple(counts), np.dtype(dtype).str, k % 2)
                if key not in keep:
                    keep[key] = (np.empty_like(every[r]), np.empty_like(whole),
                                 np.empty_like(every[r]), np.empty_like(whole))
                x, y, block, big = keep[key]
                for i in range(3):  # declared twice (the second skips), then undeclared
                    declared = i < 2
                    x[...], big[...] = every[r], whole
                    got = comm.allgather(x, out=y, counts=counts, declared=declared)
                    ok.append(("allgather", k, i, got.tobytes() == whole.tobytes()))
                    got = comm.gather(x, root=root, out=y if r == root else None,
                                      counts=counts, declared=declared)
                    ok.append(("gather", k, i, got is None if r != root
                               else got.tobytes() == whole.tobytes()))
                    own = block if (r != root or i == 1) else None  # root: out or not
                    got = comm.scatter(big if r == root else None, root=root, counts=counts,
                                       out=own, declared=declared)
                    ok.append(("scatter", k, i, got.tobytes() == every[r].tobytes()))
                comm.allreduce(np.ones(1))  # another collective in between
        return ok

    for rank, made in enumerate(run(p, body)):
        bad = [m[:3] for m in made if not m[3]]
        assert not bad, f"rank {rank}: wrong results at (collective, call, repeat) {bad}"


@pytest.mark.parametrize("p", [2, 3])
def test_a_repeated_declared_call_sends_only_its_data(p):
    """The traced messages: the first declared call exchanges counts (allgather and gather:
    META int64 per rank; scatter: the records up and the header down), the second sends no
    message but the rows themselves."""
    def body(comm):
        r, counts = comm.rank, [3] * p
        x, y, blk = np.full(3, float(r)), np.empty(3 * p), np.empty(3)
        big = np.arange(3.0 * p)
        sent = []
        for _ in range(2):
            with comm.trace() as trace:
                comm.allgather(x, out=y, counts=counts, declared=True)
                comm.gather(x, root=0, out=y if r == 0 else None, counts=counts, declared=True)
                comm.scatter(big if r == p - 1 else None, root=p - 1, counts=counts, out=blk,
                             declared=True)
            sent.append(sorted(m.nbytes for m in trace.messages if m.src == r))
        assert (blk == big[3 * r:3 * r + 3]).all()
        return sent

    for rank, (first, second) in enumerate(run(p, body)):
        assert any(n >= META * 8 for n in first), f"rank {rank}: no exchange first: {first}"
        # the rows only: 24-byte blocks, or a tree's bundle of several (multiples of 24)
        assert second and all(n % 24 == 0 and n <= 24 * p for n in second), \
            f"rank {rank}: the repeat sent more than rows: {second}"


def matrix(p, k):
    """Rows rank i sends rank j at call k (zeros among them): M[i][j]."""
    return [[(i + 2 * j + k) % 3 for j in range(p)] for i in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_declared_alltoallv_gives_numpys_answer(p):
    """alltoallv with declared=True (and recv_counts=) on every rank, the counts matrix
    changing between calls and each call made three times (declared twice: the second skips
    the exchange; then undeclared), with the same arrays: every rank gets its column of
    blocks, in rank order, in int64 and in a padded struct; and traced, a repeat sends only
    the data blocks (no count exchange, no verdict)."""
    def body(comm):
        r, ok, keep = comm.rank, [], {}
        for k in range(5):
            m = matrix(p, k % 3)  # calls 3 and 4 repeat calls 0 and 1's counts
            counts, recv = m[r], [m[q][r] for q in range(p)]
            for dtype in (np.int64, REC):
                key = (k % 3, np.dtype(dtype).str)
                mine = rows(r, k, sum(counts), dtype)
                if key not in keep:
                    keep[key] = (np.empty_like(mine), np.empty(sum(recv), mine.dtype)
                                 if dtype == REC else np.empty((sum(recv), 2), dtype))
                x, y = keep[key]
                x[...] = mine
                starts = [[sum(m[q][:j]) for j in range(p)] for q in range(p)]
                want = np.concatenate(
                    [rows(q, k, sum(m[q]), dtype)[starts[q][r]:starts[q][r] + m[q][r]]
                     for q in range(p)])
                for i in range(3):
                    with comm.trace() as trace:
                        got = comm.alltoallv(x, counts, out=y, recv_counts=recv,
                                             declared=i < 2)
                    ok.append((k, np.dtype(dtype).str, i, got is y
                               and got.tobytes() == want.tobytes()))
                    if i == 1:  # the repeat: the data blocks alone (none to itself)
                        sent = sorted(m_.nbytes for m_ in trace.messages)
                        item = x.dtype.itemsize * (1 if dtype == REC else 2)
                        data = sorted(c * item for j, c in enumerate(counts) if c and j != r)
                        ok.append((k, "repeat traffic", sent, sent == data))
        return ok

    for rank, made in enumerate(run(p, body)):
        bad = [m[:-1] for m in made if not m[-1]]
        assert not bad, f"rank {rank}: wrong at {bad}"


def test_declared_alltoallv_needs_and_checks_recv_counts():
    """declared=True without recv_counts is refused before anything is sent; recv_counts that
    contradict what the others send are refused on every rank on the first call; once
    agreed, an out= that contradicts the agreed recv_counts raises on its rank (the job
    ends: the others get PeerFailedError from the thread world)."""
    expect_error_on_every_rank(3, lambda c: c.alltoallv(np.zeros(3), [1, 1, 1], declared=True),
                               ringcoll.InvalidArgumentError, "declared=True needs recv_counts")

    def wrong_recv(comm):
        recv = [1, 2, 1] if comm.rank == 2 else [1, 1, 1]
        return comm.alltoallv(np.zeros(3), [1, 1, 1], recv_counts=recv, declared=True)

    errors = per_rank(3, wrong_recv)
    assert isinstance(errors[2], ringcoll.CollectiveMismatchError), errors[2]
    for r in (0, 1):
        assert isinstance(errors[r], ringcoll.PeerFailedError) and "[2]" in str(errors[r])

    def contradicts(comm):
        comm.alltoallv(np.zeros(3), [1, 1, 1], out=np.empty(3), recv_counts=[1, 1, 1],
                       declared=True)
        out = np.empty(4 if comm.rank == 1 else 3)
        return comm.alltoallv(np.zeros(3), [1, 1, 1], out=out, recv_counts=[1, 1, 1],
                              declared=True)

    errors = per_rank(3, contradicts)
    assert isinstance(errors[1], ringcoll.InvalidArgumentError), errors[1]
    assert "recv_counts adds up to 3 rows" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ringcoll.PeerFailedError), f"rank {r}: {errors[r]!r}"


def test_declared_needs_its_counts():
    """declared=True without counts (or, for scatter, without out on a non-root) is refused
    before anything is sent: on every rank that lacks them (a scatter's root needs no out: it
    is left waiting, here released by the thread world with PeerFailedError)."""
    x = np.zeros(2)
    for call in (lambda c: c.allgather(x, declared=True),
                 lambda c: c.gather(x, declared=True)):
        expect_error_on_every_rank(3, call, ringcoll.InvalidArgumentError, "declared=True")
    errors = per_rank(3, lambda c: c.scatter(np.zeros(6) if c.rank == 0 else None,
                                             counts=[2] * 3, declared=True))
    for r in (1, 2):
        assert isinstance(errors[r], ringcoll.InvalidArgumentError), f"rank {r}: {errors[r]!r}"
        assert "out= on every rank but root" in str(errors[r])
    assert isinstance(errors[0], ringcoll.PeerFailedError), errors[0]


def test_declared_counts_that_differ_are_refused_on_every_rank():
    """The first declared call checks the counts: a rank whose list differs raises
    InvalidArgumentError, the others PeerFailedError (or all the same error)."""
    def allgather(comm):
        counts = [2, 2, 3] if comm.rank == 1 else [2, 2, 2]
        return comm.allgather(np.zeros(2), counts=counts, declared=True)

    errors = per_rank(3, allgather)
    assert isinstance(errors[1], ringcoll.InvalidArgumentError) and "counts=" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ringcoll.PeerFailedError) and "[1]" in str(errors[r]), \
            errors[r]

    def scatter(comm):
        counts = [1, 2, 3] if comm.rank == 2 else [2, 2, 2]
        x = np.zeros(6) if comm.rank == 0 else None
        return comm.scatter(x, counts=counts, out=np.empty(counts[comm.rank]), declared=True)

    errors = per_rank(3, scatter)
    assert isinstance(errors[2], ringcoll.InvalidArgumentError) and "root 0's" in str(errors[2])
    for r in (0, 1):
        assert isinstance(errors[r], ringcoll.PeerFailedError) and "[2]" in str(errors[r]), \
            errors[r]


def test_a_rank_that_contradicts_agreed_counts_ends_the_call():
    """After the ranks agreed on a declared call, rank 1 passes rows that its counts do not
    describe, under the same signature: it raises naming the fix (no exchange would tell the
    others, so the job ends: here the thread world fails them with PeerFailedError)."""
    def body(comm):
        counts = [2, 2, 2]
        comm.allgather(np.zeros(2), counts=counts, declared=True)
        x = np.zeros(3 if comm.rank == 1 else 2)
        return comm.allgather(x, counts=counts, declared=True)

    errors = per_rank(3, body)
    assert isinstance(errors[1], ringcoll.InvalidArgumentError), errors[1]
    assert "x has 3 rows, but counts[1] = 2" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ringcoll.PeerFailedError), f"rank {r}: {errors[r]!r}"


def test_debug_mode_checks_every_declared_call_and_names_who_did_not_declare():
    """Debug mode never skips (every call agreed anew), and its fingerprint names a rank that
    passed declared=True where another did not."""
    def body(comm):
        x, y = np.full(2, comm.rank), np.empty(2 * comm.size, np.int64)
        for _ in range(3):
            comm.allgather(x, out=y, counts=[2] * comm.size, declared=True)
        return y.tolist()

    for got in run(3, body, debug=True):
        assert got == [0, 0, 1, 1, 2, 2]
    expect_error_on_every_rank(
        3, lambda c: c.allgather(np.zeros(2), counts=[2] * 3, declared=c.rank != 1),
        ringcoll.CollectiveMismatchError, debug=True)


def test_the_agreed_calls_a_communicator_keeps_are_bounded():
    """More distinct declared calls than the communicator keeps: the oldest is agreed again
    (an exchange), every result stays right, and the record never outgrows its limit."""
    from ringcoll.group import DECLARED_LIMIT

    def body(comm):
        ok = []
        for n in list(range(1, DECLARED_LIMIT + 8)) + [1, 2]:
            x = np.full(n, comm.rank, np.int16)
            got = comm.allgather(x, counts=[n] * comm.size, declared=True)
            ok.append(got.tolist() == np.repeat(np.arange(comm.size), n).tolist())
        return all(ok), len(comm._g.declared)

    for ok, kept in run(2, body):
        assert ok and kept == DECLARED_LIMIT


IN_PLACE_SCRIPT = r"""
import numpy as np, ringcoll
from mpi4py import MPI
comm = ringcoll.Communicator(MPI.COMM_WORLD)
p, r, k = comm.size, comm.rank, 4096  # 32 KiB blocks: past Rows' slots, MPI's call moves them
t = comm._g.t
t.in_place_allgather = False  # as under Open MPI: only the ranks' agreed bits may say so
bind, calls = t.bind_native_allgather, []
def spy(sendbuf, recvbuf, counts):  # what each data call was bound with: IN_PLACE or not
    if recvbuf.nbytes == 8 * k * p:
        calls.append(sendbuf is None)
    return bind(sendbuf, recvbuf, counts)
t.bind_native_allgather = spy
out = np.empty(k * p)
# (declared, rank 0 sends from a copy): the first two exchange (undeclared: every call), the
# last skips it, agreed by the first, so every rank goes in place and rank 0 copies in first
steps = [(True, False), (False, True), (False, False), (True, True)]
for call, (declared, mixed) in enumerate(steps):
    out[:] = -1
    mine = out[r * k:(r + 1) * k]  # (a new view each call: a new plan, bound anew)
    mine[:] = r + 10 * call
    x = mine.copy() if mixed and r == 0 else mine
    got = comm.allgather(x, out=out, counts=[k] * p, declared=declared, algorithm="native")
    assert got is out and (out == np.repeat(np.arange(p) + 10.0 * call, k)).all(), (r, call)
every = MPI.COMM_WORLD.allgather(calls)
assert all(c == every[0] for c in every), every  # IN_PLACE on every rank or on none
assert every[0] == [True, False, True, True], every
print("in-place bits ok", r, calls)
"""


@mpirun.needs_mpi
@pytest.mark.parametrize("p", [2, 3])
def test_an_allgather_whose_rows_sit_in_out_on_every_rank_goes_in_place_on_every_rank(
        tmp_path, p):
    """Where the MPI library gets no MPI_IN_PLACE by default (Open MPI: in_place_allgather is
    False), a declared all-gather whose rows are each rank's block of out on every rank (as
    wrap()'s Allgather(IN_PLACE)) is MPI's call with MPI_IN_PLACE on every rank, with no
    copy; when one rank's rows come from elsewhere, no rank passes it (MPI wants it on all or
    none), and results stay right either way."""
    script = tmp_path / "inplace.py"
    script.write_text(IN_PLACE_SCRIPT)
    rc, log, _ = mpirun.launch(p, [str(script)], timeout=120)
    assert rc == 0, log
    assert log.count("in-place bits ok") == p, log
