"""The replay fast path: allreduce called again with the very same arrays reruns the steps it
built last time instead of re-checking its arguments. These tests hold it to giving the same
answers as a fresh call whenever the values, the op, the algorithm, the dtype or the arrays
change between calls, and to keeping call order behind a pending iallreduce."""

import numpy as np
import pytest

import ringcoll

TIMEOUT = 20
ALGORITHMS = ["auto", "ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical"]


def run(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.run_threads(p, fn, **options)


def contribution(rank, call, n, dtype=np.int64):
    """Rank `rank`'s integer-valued input at call number `call`: exact sums in every dtype."""
    return ((np.arange(n) * (rank + 1) + 7 * call + rank) % 23).astype(dtype)


def expected(p, call, n, dtype=np.int64):
    return sum(contribution(r, call, n, np.int64) for r in range(p)).astype(dtype)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [0, 1, 4, 37])
def test_same_arrays_new_values_every_call(p, algorithm, n):
    """Out-of-place and in-place, three calls each on the same arrays, values changed between."""
    calls = 3

    def body(comm):
        x, y = np.empty(n, np.float64), np.empty(n, np.float64)
        got = []
        for call in range(calls):
            x[...] = contribution(comm.rank, call, n)
            assert comm.allreduce(x, algorithm=algorithm, out=y) is y
            got.append(y.copy())
        for call in range(calls):
            x[...] = contribution(comm.rank, call, n)
            assert comm.allreduce(x, algorithm=algorithm, out=x) is x
            got.append(x.copy())
        return got

    for rank, got in enumerate(run(p, body, local_size=2)):
        for k, y in enumerate(got):
            np.testing.assert_array_equal(y, expected(p, k % calls, n), err_msg=f"rank {rank}")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_replay_notices_a_changed_op_algorithm_or_array(p):
    n = 10

    def body(comm):
        x, y, z = (np.empty(n, np.float64) for _ in range(3))
        x[...] = contribution(comm.rank, 0, n)
        out = []
        calls = [("sum", "recursive_doubling", y), ("max", "recursive_doubling", y),
                 ("max", "ring", y), ("sum", "ring", z), ("sum", None, z), ("prod", None, z),
                 ("avg", None, z)]
        for op, algorithm, target in calls:
            comm.allreduce(x, op=op, algorithm=algorithm, out=target)
            out.append(target.copy())
        return out

    inputs = np.array([contribution(r, 0, n, np.float64) for r in range(p)])
    want = [inputs.sum(0), inputs.max(0), inputs.max(0), inputs.sum(0), inputs.sum(0),
            inputs.prod(0), inputs.sum(0) / p]
    for got in run(p, body):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12)


def test_replay_notices_a_dtype_change_of_the_same_array():
    """Reinterpreting x's bytes (x.dtype = ...) must not replay a schedule built for the old
    dtype: the sum of the new integers is computed, not of the old floats."""
    p, n = 2, 8

    def body(comm):
        x = np.zeros((2, n // 2), np.float64)  # 2-D: the schedule works on a flat view of it
        y = np.zeros((2, n // 2), np.float64)
        comm.allreduce(x, out=y)
        xi = x.view()
        yi = y.view()
        xi.dtype = yi.dtype = np.int64
        xi[...] = np.arange(n).reshape(2, -1) + comm.rank
        comm.allreduce(xi, out=yi)
        xi.dtype = np.float64  # same object, new dtype: the plan must not be reused
        yi.dtype = np.float64
        xi[...] = 1.5
        comm.allreduce(xi, out=yi)
        return yi.copy()

    for got in run(p, body):
        np.testing.assert_array_equal(got, np.full((2, n // 2), 3.0))


@pytest.mark.parametrize("p", [2, 4])
def test_blocking_replay_waits_for_a_pending_iallreduce(p):
    """A blocking call with the same arrays as a pending iallreduce runs after it, in order."""
    n = 1000

    def body(comm):
        x, y = np.empty(n), np.empty(n)
        x[...] = contribution(comm.rank, 0, n)
        comm.allreduce(x, out=y)  # builds the plan
        x[...] = contribution(comm.rank, 1, n)
        req = comm.iallreduce(x, out=y)
        first = req.wait().copy()
        x[...] = contribution(comm.rank, 2, n)
        req = comm.iallreduce(x.copy(), out=np.empty(n))
        comm.allreduce(x, out=y)  # queued behind req, then replays
        return first, req.wait().copy(), y.copy()

    for first, second, third in run(p, body):
        np.testing.assert_array_equal(first, expected(p, 1, n))
        np.testing.assert_array_equal(second, expected(p, 2, n))
        np.testing.assert_array_equal(third, expected(p, 2, n))


@pytest.mark.parametrize("p", [2, 3])
def test_no_replay_while_a_call_is_pending_and_it_comes_back_after(p):
    """While an iallreduce may be pending the replay is parked (a replayed call would overtake
    the queue); the first call that finds the queue drained brings it back. Every rank's trace
    shows the calls in program order."""
    from ringcoll.runner import NO_REPLAY

    n = 64

    def body(comm):
        x, y = np.full(n, comm.rank + 1.0), np.empty(n)
        comm.allreduce(x, out=y, algorithm="recursive_doubling")  # #1: the replay
        mine = comm._runner._replay
        big = np.ones(1 << 16)
        req = comm.iallreduce(big, out=np.empty_like(big))  # #2
        parked = comm._runner._replay is NO_REPLAY
        comm.allreduce(x, out=y, algorithm="recursive_doubling")  # #3, #4: queued, in order
        comm.allreduce(x, out=y, algorithm="recursive_doubling")
        req.wait()
        comm.barrier()  # #5 finds the queue drained: the replay is back
        back = comm._runner._replay
        comm.allreduce(x, out=y, algorithm="recursive_doubling")  # #6: replayed
        return parked, back is not NO_REPLAY and back.x is x and back is not mine, y.copy()

    results, trace = ringcoll.simulate(p, body)
    for parked, back, y in results:
        assert parked and back
        np.testing.assert_array_equal(y, np.full(n, p * (p + 1) / 2))
    seqs = [c[:2] for c in trace.collectives()]
    assert seqs == [(1, "allreduce"), (2, "allreduce"), (3, "allreduce"), (4, "allreduce"),
                    (5, "barrier"), (6, "allreduce")], seqs
