"""One-sided windows (Communicator.window, transport/*.py) and asynchronous SGD over the sharded
parameter store (ringcoll/async_sgd.py), on thread ranks at p = 1..4; tests/mpi_async.py runs
the same properties under mpiexec (tests/test_async_mpi.py).

Oracles: exact integer sums (every pushed integer gradient, summed with NumPy, must equal what
the shards received), ringcoll.optim.SGD at p = 1 (the store then applies the same arithmetic,
bitwise), and every rank's copy after finish() (bitwise equal).
"""

import numpy as np
import pytest

import ringcoll
from ringcoll import AsyncSGD, InvalidArgumentError, InvalidTypeError, ParameterStore

SIZES = [1, 2, 3, 4]


def gather_sum(comm, x):
    return comm.allreduce(np.array(x).reshape(-1)).reshape(np.shape(x))


# -- windows --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", ["int64", "float64", "int32", "float32", "uint64", "uint32"])
def test_window_add_fetch_and_counter(p, dtype):
    """Uneven parts (rank r holds r elements: rank 0's part is empty); every rank adds r + 1
    into every element of every part and bumps rank p-1's counter; the sums are exact."""

    def body(comm):
        r = comm.rank
        win = comm.window(np.full(r, 10 * r, dtype))
        counter = comm.window(np.zeros(1, np.int64))
        assert win.counts == tuple(range(p)) and win.dtype == np.dtype(dtype)
        for t in range(p):
            if t:
                win.add(np.full(t, r + 1, dtype), t, 0)
        tickets = [counter.fetch_add(1, p - 1, 0) for _ in range(3)]
        comm.barrier()
        got = []
        for t in range(1, p):
            out = np.empty(t, dtype)
            win.fetch(out, t, 0)
            got.append(out)
            part = np.empty(1, dtype)  # one element at an offset
            win.fetch(part, t, t - 1)
            assert part[0] == out[-1]
        assert np.array_equal(win.local, np.full(r, 10 * r + p * (p + 1) // 2, dtype))
        final = counter.fetch_add(0, p - 1, 0)
        comm.barrier()
        win.close()
        counter.close()
        return got, tickets, final

    results = ringcoll.run_threads(p, body)
    total = p * (p + 1) // 2
    for got, tickets, final in results:
        for t, out in zip(range(1, p), got):
            assert np.array_equal(out, np.full(t, 10 * t + total, dtype))
        assert final == 3 * p
    every_ticket = sorted(t for _, tickets, _ in results for t in tickets)
    assert every_ticket == list(range(3 * p))  # fetch_add hands out each value once


@pytest.mark.parametrize("p", [2, 3])
def test_window_refuses_bad_calls_with_a_clear_error(p):
    def body(comm):
        win = comm.window(np.zeros(4, np.float64))
        errors = []
        for call in (lambda: win.add(np.ones(5), 0, 0),            # past the end
                     lambda: win.add(np.ones(2), 0, 3),            # past the end at offset 3
                     lambda: win.add(np.ones(2), p, 0),            # no such rank
                     lambda: win.add(np.ones(2), -1, 0),
                     lambda: win.add(np.ones(2, np.float32), 0, 0),  # another dtype
                     lambda: win.fetch(np.empty((2, 2)), 0, 0),   # not 1-D
                     lambda: win.fetch(np.empty(1), 0, -1),
                     lambda: win.fetch_add(1, 0, 4)):
            with pytest.raises(InvalidArgumentError) as info:
                call()
            errors.append(str(info.value))
        win.fetch(np.empty(2), p - 1, 2)  # still usable after the refusals
        comm.barrier()
        win.close()
        return errors

    for errors in ringcoll.run_threads(p, body):
        assert all(e.startswith("ringcoll rank ") and "Window." in e for e in errors), errors
        assert "outside rank 0's part of 4 elements" in errors[0]
        assert f"a rank 0..{p - 1}" in errors[2]
        assert "float64" in errors[4]


@pytest.mark.parametrize("bad", [np.zeros((2, 2)), np.zeros(3, np.float16), [1.0, 2.0],
                                 np.zeros(2, bool), np.zeros(2, complex)])
def test_window_refuses_unsupported_initial_arrays(bad):
    def body(comm):
        with pytest.raises(InvalidArgumentError, match="1-D NumPy array of one of int32"):
            comm.window(bad)

    ringcoll.run_threads(2, body)


@pytest.mark.parametrize("p", [2, 3])
def test_window_dtype_disagreement_raises_on_every_rank(p):
    def body(comm):
        dtype = np.float32 if comm.rank == p - 1 else np.float64
        with pytest.raises(InvalidArgumentError, match="the same dtype"):
            comm.window(np.zeros(2, dtype))
        return comm.allreduce(np.ones(1))[0]  # the communicator still works

    assert ringcoll.run_threads(p, body) == [p] * p


# -- the parameter store: every pushed integer lands exactly once ---------------------------------
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("shapes", [{"a": (1,)}, {"a": (3,), "b": ()}, {"a": (2, 3), "b": (5,)},
                                    {"w": (7, 11), "b": (11,), "c": (1,)}],
                         ids=lambda s: "+".join(f"{k}{v}" for k, v in s.items()))
def test_store_receives_exactly_the_sum_of_every_push(p, shapes):
    """Integer arithmetic: start + sum of every rank's pushes == the store, element for element,
    with N = 1, 4, 11, 89 elements over p shards (some empty when N < p)."""
    pushes = 25

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        start = {k: np.arange(int(np.prod(s)), dtype=np.int64).reshape(s) * (comm.rank + 3)
                 for k, s in shapes.items()}  # only rank 0's is used
        store = ParameterStore(start, comm)
        pushed = {k: np.zeros(s, np.int64) for k, s in shapes.items()}
        for i in range(pushes):
            delta = {k: rng.integers(-2**40, 2**40, s) for k, s in shapes.items()}
            store.add(delta)
            for k in delta:
                pushed[k] += delta[k]
        comm.barrier()
        final = {k: np.empty(s, np.int64) for k, s in shapes.items()}
        version = store.pull(final)
        total = {k: gather_sum(comm, v) for k, v in pushed.items()}
        comm.barrier()
        store.close()
        return final, total, version

    for final, total, version in ringcoll.run_threads(p, body):
        assert version == p * pushes
        for k, s in shapes.items():
            start = np.arange(int(np.prod(s)), dtype=np.int64).reshape(s) * 3  # rank 0's
            assert np.array_equal(final[k], start + total[k]), k


def test_store_refuses_mixed_or_empty_values():
    def body(comm):
        with pytest.raises(InvalidArgumentError, match="one dtype"):
            ParameterStore({"a": np.zeros(2), "b": np.zeros(2, np.float32)}, comm)
        with pytest.raises(InvalidTypeError, match="non-empty dict"):
            ParameterStore({}, comm)
        with pytest.raises(InvalidArgumentError, match="1-D NumPy array of one of"):
            ParameterStore({"a": np.zeros(2, np.float16)}, comm)

    ringcoll.run_threads(2, body)


# -- asynchronous SGD ----------------------------------------------------------------------------
def quadratic_grads(params, target):
    """The gradient of 0.5 |params - target|^2."""
    return {k: v - target[k] for k, v in params.items()}


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_one_rank_is_plain_sgd_bitwise(momentum, weight_decay):
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
    target = {k: rng.standard_normal(v.shape) for k, v in start.items()}
    ref = {k: v.copy() for k, v in start.items()}
    sgd = ringcoll.optim.SGD(ref, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for _ in range(20):
        sgd.step(quadratic_grads(ref, target))

    def body(comm):
        params = {k: v.copy() for k, v in start.items()}
        opt = AsyncSGD(params, comm, lr=0.1, momentum=momentum, weight_decay=weight_decay)
        for _ in range(20):
            opt.pull()
            opt.push(quadratic_grads(params, target))
        assert opt.finish() == 20 and opt.staleness == [0] * 20
        opt.close()
        return params

    (got,) = ringcoll.run_threads(1, body)
    for k in start:
        assert np.array_equal(got[k], ref[k]), k


@pytest.mark.parametrize("p", SIZES)
def test_replicas_equal_after_finish_and_every_update_counted(p):
    """Integer-valued float64 gradients with lr = 1: the final parameters are the start minus
    the sum of every push, exactly, and every rank holds them bitwise; the update counter and
    the staleness add up."""
    steps = 15

    def body(comm):
        rng = np.random.default_rng(10 + comm.rank)
        params = {"w": np.full((3, 5), 100.0 * comm.rank), "b": np.zeros(2)}  # rank 0's start
        opt = AsyncSGD(params, comm, lr=1.0)
        pushed = {k: np.zeros_like(v) for k, v in params.items()}
        for _ in range(steps):
            opt.pull()
            g = {k: rng.integers(-50, 50, v.shape).astype(np.float64) for k, v in params.items()}
            s = opt.push(g)
            assert 0 <= s <= p * steps - 1
            for k in g:
                pushed[k] += g[k]
        total = opt.finish()
        summed = {k: gather_sum(comm, v) for k, v in pushed.items()}
        stale = list(opt.staleness)
        opt.close()
        return params, summed, total, stale, opt.pushes

    results = ringcoll.run_threads(p, body)
    first = results[0][0]
    for params, summed, total, stale, pushes in results:
        assert total == p * steps and pushes == steps and len(stale) == steps
        for k in params:
            assert np.array_equal(params[k], first[k])  # replicas equal, bitwise
            assert np.array_equal(params[k], -summed[k])  # start 0 on rank 0
    if p == 1:
        assert results[0][3] == [0] * steps


@pytest.mark.parametrize("p", [2, 3])
def test_staleness_counts_the_pushes_between_pull_and_push(p):
    """Rank 0 pulls, waits while every other rank pushes twice, then pushes: its staleness is
    2 (p - 1) exactly (the barriers order the calls)."""

    def body(comm):
        params = {"x": np.zeros(4)}
        opt = AsyncSGD(params, comm, lr=0.5)
        grads = {"x": np.ones(4)}
        if comm.rank == 0:
            opt.pull()
        comm.barrier()
        if comm.rank:
            for _ in range(2):
                opt.pull()
                opt.push(grads)
        comm.barrier()
        if comm.rank == 0:
            opt.push(grads)
        opt.finish()
        opt.close()
        return opt.staleness, params["x"]

    results = ringcoll.run_threads(p, body)
    assert results[0][0] == [2 * (p - 1)]
    for stale, x in results[1:]:
        assert all(0 <= s <= 2 * p for s in stale)
    for _, x in results:
        assert np.array_equal(x, np.full(4, -0.5 * (2 * (p - 1) + 1)))


def test_async_sgd_refuses_misuse_with_clear_errors():
    def body(comm):
        params = {"w": np.zeros(3)}
        with pytest.raises(InvalidArgumentError, match="lr > 0"):
            AsyncSGD(params, comm, lr=0)
        with pytest.raises(InvalidArgumentError, match="momentum < 1"):
            AsyncSGD(params, comm, lr=0.1, momentum=1.0)
        with pytest.raises(InvalidTypeError, match="non-empty dict"):
            AsyncSGD([np.zeros(3)], comm, lr=0.1)
        with pytest.raises(InvalidArgumentError, match="float32 or float64"):
            AsyncSGD({"i": np.zeros(3, np.int64)}, comm, lr=0.1)
        opt = AsyncSGD(params, comm, lr=0.1)
        with pytest.raises(InvalidArgumentError, match="needs a pull"):
            opt.push({"w": np.ones(3)})
        opt.pull()
        with pytest.raises(InvalidArgumentError, match=r"no gradient for \['w'\]"):
            opt.push({})
        with pytest.raises(InvalidArgumentError, match="has shape"):
            opt.push({"w": np.ones(4)})
        opt.push({"w": np.ones(3)})  # still usable
        opt.finish()
        opt.close()
        return params["w"]

    for w in ringcoll.run_threads(2, body):
        assert np.array_equal(w, np.full(3, -0.2))


@pytest.mark.parametrize("p", [2, 3])
def test_async_sgd_learns_a_linear_model_with_a_straggler(p):
    """Least squares on a planted model, the last rank 3x slower (a fake clock: it simply
    pulls and pushes less often); the store converges to the plant."""
    rng = np.random.default_rng(0)
    w_true = rng.standard_normal(6)
    x = rng.standard_normal((400, 6))
    y = x @ w_true

    def body(comm):
        params = {"w": np.zeros(6)}
        opt = AsyncSGD(params, comm, lr=0.05, momentum=0.5)
        local = np.random.default_rng(comm.rank)
        every = 3 if comm.rank == p - 1 else 1
        for step in range(300):
            if step % every:
                continue
            opt.pull()
            rows = local.integers(0, len(x), 16)
            err = x[rows] @ params["w"] - y[rows]
            opt.push({"w": x[rows].T @ err / len(rows)})
        opt.finish()
        opt.close()
        return params["w"], max(opt.staleness)

    for w, _ in ringcoll.run_threads(p, body):
        assert np.max(np.abs(w - w_true)) < 0.01 * np.max(np.abs(w_true))
