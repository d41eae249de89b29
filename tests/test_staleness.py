"""Bounded-staleness DistributedOptimizer (staleness=k) on the thread transport.

The oracle is one process with no communication: the same inner optimizer, applying at step
t the average of every rank's step t - k gradients (integer-valued: the average is the exact
sum divided by p, one rounding, as ringcoll computes it), and the last k at flush(). So every
comparison is bitwise, on every rank. tests/mpi_stale_local.py trains under mpiexec.
"""

import numpy as np
import pytest

import ringcoll
from ringcoll import InvalidArgumentError, RingcollError
from ringcoll.compression import Compression
from ringcoll.optim import SGD, Adam
from test_dp_units import (assert_same_params, expected_reduce, grads_for, make_params, outcomes,
                           run, same_bits, snapshot)


def make_inner(kind, params):
    if kind == "sgd":
        return SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    return Adam(params, lr=0.01, weight_decay=1e-3)


def oracle(kind, p, k, steps, passes=1, op="avg", averages=None):
    """Parameters after each step() (index t) and after flush() (index steps), one process."""
    params = make_params(seed=1)
    inner = make_inner(kind, params)
    if averages is None:
        averages = [expected_reduce(p, params, op, t, passes=passes) for t in range(steps)]
    history = []
    for t in range(steps):
        if t >= k:
            inner.step(averages[t - k])
        history.append(snapshot(params))
    for t in range(max(0, steps - k), steps):
        inner.step(averages[t])
    history.append(snapshot(params))
    return history


def train(comm, kind, k, steps, mode="overlap", passes=1, bucket_bytes=40, **options):
    params = make_params(seed=1)
    opt = ringcoll.DistributedOptimizer(make_inner(kind, params), comm, bucket_bytes=bucket_bytes,
                                        staleness=k, backward_passes_per_step=passes, **options)
    history, flights = [], []
    for t in range(steps):
        for q in range(passes):
            g = grads_for(params, comm.rank, t * passes + q)
            if mode == "step":
                opt.step(g)
                continue
            if mode == "views":  # write into opt.grads (looked up afresh), then hand over
                for name in reversed(list(g)):
                    opt.grads[name][...] = g[name]
                    opt.grad_ready(name)
            elif mode == "no_sync" and q < passes - 1:
                with opt.no_sync():
                    for name in reversed(list(g)):
                        opt.grad_ready(name, g[name])
            else:
                for name in reversed(list(g)):
                    opt.grad_ready(name, g[name])
        if mode != "step":
            opt.step()
        history.append(snapshot(params))
        flights.append(opt.in_flight)
    applied = opt.flush()
    history.append(snapshot(params))
    return history, flights, applied, opt


def check_history(got, want):
    assert len(got) == len(want)
    for t, (a, b) in enumerate(zip(got, want)):
        for n in a:
            assert same_bits(a[n], b[n]), (t, n)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_staleness_equals_the_oracle(p, k, kind):
    steps = 5
    want = oracle(kind, p, k, steps)

    def fn(comm):
        history, flights, applied, _ = train(comm, kind, k, steps, mode="overlap")
        check_history(history, want)  # on every rank: replicas bitwise equal too
        assert flights == [min(t + 1, k) for t in range(steps)]
        assert applied == min(k, steps)
        return history[-1]

    out = run(p, fn)
    for r in range(1, p):
        assert_same_params(out[0], out[r])


@pytest.mark.parametrize("mode", ["step", "views"])
def test_staleness_step_grads_and_written_views(mode):
    p, k, steps = 3, 2, 5
    want = oracle("adam", p, k, steps)

    def fn(comm):
        history, _, _, opt = train(comm, "adam", k, steps, mode=mode)
        check_history(history, want)
        return True

    assert run(p, fn) == [True] * p


def test_staleness_zero_is_todays_optimizer_bitwise():
    p, steps = 3, 4

    def fn(comm):
        out = []
        for options in ({}, {"staleness": 0}):
            params = make_params(seed=1)
            opt = ringcoll.DistributedOptimizer(make_inner("adam", params), comm,
                                                bucket_bytes=40, **options)
            for t in range(steps):
                opt.step(grads_for(params, comm.rank, t))
            assert opt.flush() == 0 and opt.in_flight == 0
            out.append(snapshot(params))
        assert_same_params(out[0], out[1])
        check_history([out[0]], [oracle("adam", p, 0, steps)[-1]])
        return True

    assert run(p, fn) == [True] * p


@pytest.mark.parametrize("p", [1, 3])
def test_staleness_larger_than_the_number_of_steps(p):
    k, steps = 5, 3
    want = oracle("sgd", p, k, steps)

    def fn(comm):
        start = make_params(seed=1)
        history, flights, applied, _ = train(comm, "sgd", k, steps)
        for h in history[:-1]:  # nothing applied before flush
            assert_same_params(h, start)
        assert flights == [1, 2, 3] and applied == 3
        check_history(history, want)
        return True

    assert run(p, fn) == [True] * p


@pytest.mark.parametrize("mode", ["accumulate", "no_sync"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_staleness_with_accumulation(mode, p):
    k, steps, passes = 1, 4, 2
    want = oracle("sgd", p, k, steps, passes=passes)

    def fn(comm):
        history, _, _, _ = train(comm, "sgd", k, steps, mode=mode, passes=passes)
        check_history(history, want)
        return True

    assert run(p, fn) == [True] * p


def test_staleness_with_op_sum():
    p, k, steps = 3, 1, 4
    want = oracle("sgd", p, k, steps, op="sum")

    def fn(comm):
        history, _, _, _ = train(comm, "sgd", k, steps, op="sum")
        check_history(history, want)
        return True

    assert run(p, fn) == [True] * p


def test_staleness_with_fp16_applies_the_same_compressed_averages_later():
    p, k, steps = 3, 2, 4

    def fn(comm):  # the fp16 averages of a k = 0 run, recorded, are the oracle's inputs
        params = make_params(seed=1)
        opt = ringcoll.DistributedOptimizer(make_inner("sgd", params), comm, bucket_bytes=40,
                                            compression=Compression.fp16)
        averages = []
        for t in range(steps):
            for name, g in reversed(list(grads_for(params, comm.rank, t).items())):
                opt.grad_ready(name, g)
            opt.synchronize()
            averages.append(snapshot(opt.grads))
            with opt.skip_synchronize():
                opt.step()
        history, _, _, _ = train(comm, "sgd", k, steps, compression=Compression.fp16)
        check_history(history, oracle("sgd", p, k, steps, averages=averages))
        return True

    assert run(p, fn) == [True] * p


def test_grads_views_point_at_the_slot_being_filled():
    def fn(comm):
        params = make_params(seed=1)
        opt = ringcoll.DistributedOptimizer(make_inner("sgd", params), comm, bucket_bytes=40,
                                            staleness=2)
        grads = opt.grads
        seen = []
        for t in range(4):
            seen.append(opt.grads["w1"])
            opt.step(grads_for(params, comm.rank, t))
            assert opt.grads is grads  # the same dict, re-pointed values
        # 3 slots, used round-robin: step 3 fills step 0's slot again
        assert not np.shares_memory(seen[0], seen[1])
        assert not np.shares_memory(seen[1], seen[2])
        assert not np.shares_memory(seen[0], seen[2])
        assert np.shares_memory(seen[0], seen[3])
        opt.flush()
        return True

    assert run(2, fn) == [True, True]


def test_wait_seconds_counts_only_blocking_waits():
    def fn(comm):
        params = make_params(seed=1)
        stale = ringcoll.DistributedOptimizer(make_inner("sgd", params), comm, staleness=1)
        stale.step(grads_for(params, comm.rank, 0))
        assert stale.wait_seconds == 0.0  # step 0 applies nothing: waited for nothing
        stale.step(grads_for(params, comm.rank, 1))
        stale.flush()
        assert stale.wait_seconds > 0.0 and stale.comm_seconds > 0.0
        sync = ringcoll.DistributedOptimizer(make_inner("sgd", make_params()), comm)
        sync.step(grads_for(params, comm.rank, 0))
        assert sync.wait_seconds > 0.0
        return True

    assert run(2, fn) == [True, True]


def test_refused_combinations():
    def fn(comm):
        params = make_params(seed=1)
        for bad in (-1, 1.0, True, "1"):
            with pytest.raises(InvalidArgumentError, match="staleness must be an int"):
                ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, staleness=bad)
        with pytest.raises(InvalidArgumentError, match="carries state between steps"):
            ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, staleness=1,
                                          compression=Compression.topk(0.5))
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, staleness=1)
        with pytest.raises(InvalidArgumentError, match=f"rank {comm.rank}, synchronize: not"):
            opt.synchronize()
        with pytest.raises(InvalidArgumentError, match="skip_synchronize: not available"):
            with opt.skip_synchronize():
                pass
        opt.grad_ready("w1", np.ones((4, 3), np.float32))
        with pytest.raises(RingcollError, match="flush: a backward pass is in progress"):
            opt.flush()
        with pytest.raises(RingcollError, match="step: the backward pass is incomplete"):
            opt.step()
        return True

    assert run(2, fn) == [True, True]


def _continue(comm, params, opt, start, steps):
    for t in range(start, start + steps):
        opt.step(grads_for(params, comm.rank, t))
    opt.flush()
    return snapshot(params)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_wrapper_state_saves_the_updates_in_flight_exactly(p, k):
    before = 3  # steps before the save: min(k, 3) updates in flight

    def fn(comm):
        params = make_params(seed=1)
        opt = ringcoll.DistributedOptimizer(make_inner("adam", params), comm, bucket_bytes=40,
                                            staleness=k)
        for t in range(before):
            opt.step(grads_for(params, comm.rank, t))
        saved = opt.wrapper_state_dict()
        assert saved["staleness"] == k and saved["pending"] == min(k, before)
        assert len([a for a in saved["arrays"] if "/pending" in a]) == \
            saved["pending"] * len(opt.buckets)
        saved_params, saved_inner = snapshot(params), opt.optimizer.state_dict()
        straight = _continue(comm, params, opt, before, 3)

        fresh = make_params(seed=7)
        for n in fresh:
            fresh[n][...] = saved_params[n]
        fresh_opt = ringcoll.DistributedOptimizer(make_inner("adam", fresh), comm,
                                                  bucket_bytes=40, staleness=k)
        fresh_opt.optimizer.load_state_dict(saved_inner)
        fresh_opt.load_wrapper_state_dict(saved)
        assert fresh_opt.in_flight == saved["pending"]
        assert_same_params(_continue(comm, fresh, fresh_opt, before, 3), straight)

        # refused: another staleness, or a wrapper with updates of its own in flight
        other = ringcoll.DistributedOptimizer(make_inner("adam", make_params()), comm,
                                              bucket_bytes=40, staleness=k + 1)
        with pytest.raises(InvalidArgumentError, match="staleness"):
            other.load_wrapper_state_dict(saved)
        busy = ringcoll.DistributedOptimizer(make_inner("adam", make_params()), comm,
                                             bucket_bytes=40, staleness=k)
        busy.step(grads_for(params, comm.rank, 0))
        with pytest.raises(InvalidArgumentError, match="in flight; load into a fresh"):
            busy.load_wrapper_state_dict(saved)
        busy.flush()
        return straight

    out = run(p, fn)
    check_history([out[-1]], [oracle("adam", p, k, before + 3)[-1]])


def test_checkpoint_round_trip_with_updates_in_flight(tmp_path):
    p, k = 2, 2
    path = str(tmp_path / "ckpt")

    def fn(comm):
        params = make_params(seed=1)
        opt = ringcoll.DistributedOptimizer(make_inner("sgd", params), comm, bucket_bytes=40,
                                            staleness=k)
        for t in range(3):
            opt.step(grads_for(params, comm.rank, t))
        ringcoll.save_checkpoint(path, params, opt, comm=comm)
        straight = _continue(comm, params, opt, 3, 2)
        fresh = make_params(seed=5)
        fresh_opt = ringcoll.DistributedOptimizer(make_inner("sgd", fresh), comm,
                                                  bucket_bytes=40, staleness=k)
        ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm)
        assert fresh_opt.in_flight == k
        assert_same_params(_continue(comm, fresh, fresh_opt, 3, 2), straight)
        return True

    assert run(p, fn) == [True] * p


def test_wrapper_state_refused_mid_pass():
    def fn(comm):
        params = make_params(seed=1)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, staleness=1)
        opt.step(grads_for(params, comm.rank, 0))
        opt.grad_ready("b3", np.ones(2, np.float32))
        with pytest.raises(InvalidArgumentError, match="in progress"):
            opt.wrapper_state_dict()
        return True

    res = outcomes(2, fn)
    assert res == [True, True], res
