"""The non-blocking form of every collective, and gather/allgather's counts=, on thread ranks.

Every i-method is started with several others in flight, waited for in another order, and
its result compared on every rank with NumPy on all ranks' inputs (integers: exact). Bad
arguments raise at the call, not at wait(). counts= (MPI's recvcounts) that differ from what
the ranks send raise on every rank.
"""

import numpy as np
import pytest

import ringcoll

from test_threads import expect_error_on_every_rank, per_rank, run

PS = list(range(1, 17))


def inputs(p, r):
    """Rank r's arrays: uneven rows (zeros included), an equal-block one for alltoall."""
    rows = [(3 * q + 1) % 4 for q in range(p)]
    return {
        "rows": rows,
        "x": np.arange(6, dtype=np.int64) * (r + 1) - r,
        "mine": np.full((rows[r], 2), r, dtype=np.int32),
        "blocks": np.arange(2 * p, dtype=np.int16) + 100 * r,
        "send_counts": [(r + j) % 3 for j in range(p)],
        "table": np.arange(sum(rows) * 2, dtype=np.int64).reshape(-1, 2) * (r + 1),
    }


def expected(p, r, root):
    every = [inputs(p, q) for q in range(p)]
    mine = every[r]
    rows = mine["rows"]
    start = sum(rows[:r])
    xs = np.stack([e["x"] for e in every])
    sends = [np.arange(sum(e["send_counts"]), dtype=np.float64) + 1000 * q
             for q, e in enumerate(every)]
    received = [sends[q][sum(every[q]["send_counts"][:r]):][:every[q]["send_counts"][r]]
                for q in range(p)]
    return {
        "iallreduce": xs.sum(0),
        "ibroadcast": every[root]["x"],
        "ireduce": xs.sum(0) if r == root else None,
        "iallgather": np.concatenate([e["mine"] for e in every]),
        "igather": np.concatenate([e["mine"] for e in every]) if r == root else None,
        "iscatter": every[root]["table"][start:start + rows[r]],
        "ialltoall": np.concatenate([e["blocks"][2 * r:2 * r + 2] for e in every]),
        "ialltoallv": np.concatenate(received),
        "ireduce_scatter": sum(e["table"] for e in every)[start:start + rows[r]],
        "iscan": xs[:r + 1].sum(0),
        "iexscan": xs[:r].sum(0) if r else None,
        "ibarrier": None,
    }


@pytest.mark.parametrize("p", PS)
def test_every_i_form_against_numpy(p):
    root = p // 2

    def fn(comm):
        r = comm.rank
        d = inputs(p, r)
        sends = np.arange(sum(d["send_counts"]), dtype=np.float64) + 1000 * r
        started = {
            "iallreduce": comm.iallreduce(d["x"]),
            "ibroadcast": comm.ibroadcast(d["x"].copy(), root=root),
            "ireduce": comm.ireduce(d["x"], root=root),
            "iallgather": comm.iallgather(d["mine"]),
            "igather": comm.igather(d["mine"], root=root, counts=d["rows"]),
            "iscatter": comm.iscatter(d["table"] if r == root else None, root=root,
                                      counts=d["rows"] if r == root else None,
                                      out=np.empty((d["rows"][r], 2), np.int64)),
            "ialltoall": comm.ialltoall(d["blocks"]),
            "ialltoallv": comm.ialltoallv(sends, d["send_counts"]),
            "ireduce_scatter": comm.ireduce_scatter(d["table"], counts=d["rows"]),
            "iscan": comm.iscan(d["x"]),
            "iexscan": comm.iexscan(d["x"]),
            "ibarrier": comm.ibarrier(),
        }
        assert all(isinstance(q, ringcoll.Request) for q in started.values())
        # wait in reverse order of the calls: each already ran in call order behind the others
        got = {name: started[name].wait() for name in reversed(list(started))}
        assert all(q.test() for q in started.values())
        return got

    results = run(p, fn)
    for r in range(p):
        want = expected(p, r, root)
        for name, value in want.items():
            got = results[r][name]
            if value is None:
                assert got is None, f"p={p} rank {r} {name}: {got!r}, not None"
            else:
                assert got is not None and got.dtype == np.asarray(value).dtype, \
                    f"p={p} rank {r} {name}: {got!r}"
                np.testing.assert_array_equal(got, value, err_msg=f"p={p} rank {r} {name}")


@pytest.mark.parametrize("call", ["ibroadcast", "ireduce", "igather", "iscatter"])
def test_a_bad_argument_raises_at_the_call(call):
    def fn(comm):
        x = np.arange(3)
        with pytest.raises(ringcoll.InvalidArgumentError, match=f"{call}: root=7"):
            if call == "iscatter":
                comm.iscatter(x, root=7)
            else:
                getattr(comm, call)(x, root=7)
        return comm.iallreduce(x).wait()  # nothing was queued: the next call runs as usual

    for got in run(3, fn):
        np.testing.assert_array_equal(got, np.arange(3) * 3)


def expect_agreed(p, fn, culprit):
    """Every rank raises: the culprit InvalidArgumentError about its counts=, the others
    PeerFailedError naming the culprit (the verdict of the count exchange, on every rank)."""
    errors = per_rank(p, fn)
    for r, e in enumerate(errors):
        assert f"ringcoll rank {r}," in str(e), f"rank {r}: {e!r}"
        if r == culprit:
            assert type(e) is ringcoll.InvalidArgumentError and "counts=" in str(e), e
        else:
            assert isinstance(e, ringcoll.PeerFailedError), f"rank {r}: {e!r}"
            assert f"rank(s) [{culprit}] passed counts=" in str(e), f"rank {r}: {e}"


def test_an_error_while_running_comes_from_wait():
    """A mismatch found in the count exchange (on the background thread) raises in wait()."""
    def fn(comm):
        req = comm.iallgather(np.arange(comm.rank + 1), counts=[1, 2, 2] if comm.rank == 1
                              else None)
        return req.wait()

    expect_agreed(3, fn, culprit=1)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_counts_that_differ_raise_on_every_rank(p):
    rows = [(q + 1) % 3 for q in range(p)]
    wrong = rows[:-1] + [rows[-1] + 1]

    def allgather(comm):
        return comm.allgather(np.zeros(rows[comm.rank]), counts=wrong if comm.rank == 0
                              else rows)

    expect_agreed(p, allgather, culprit=0)

    def gather(comm):  # root's counts only: the others' are ignored, as MPI's recvcounts
        return comm.gather(np.zeros(rows[comm.rank]), root=p - 1,
                           counts=wrong if comm.rank == p - 1 else [99])

    expect_agreed(p, gather, culprit=p - 1)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 16])
def test_counts_that_agree_are_the_call_without_them(p):
    rows = [(q * 5 + 2) % 4 for q in range(p)]

    def fn(comm):
        x = np.full((rows[comm.rank], 3), comm.rank, dtype=np.uint8)
        return (comm.allgather(x, counts=rows), comm.allgather(x),
                comm.gather(x, root=0, counts=rows), comm.gather(x, root=0))

    for r, (a, b, c, d) in enumerate(run(p, fn)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, np.concatenate(
            [np.full((rows[q], 3), q, np.uint8) for q in range(p)]))
        if r == 0:
            np.testing.assert_array_equal(c, d)
            np.testing.assert_array_equal(c, a)
        else:
            assert c is None and d is None


def test_counts_must_be_one_per_rank():
    def fn(comm):
        return comm.allgather(np.zeros(2), counts=[2, 2])

    expect_error_on_every_rank(3, fn, ringcoll.InvalidArgumentError,
                               match="must be 3 non-negative row counts")
