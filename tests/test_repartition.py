"""Dynamic re-partitioning (ringcoll/repartition.py) and the straggler slowdown
(ringcoll/straggler.py), on thread ranks; tests/mpi_repartition.py checks the training
equality under mpiexec at -n 1..4 (launched at the end of this file).

Compute times are recorded, not slept (tests/_repartition_train.py): the splits are
deterministic, and the key property is exact: training with one rank slowed 2x and the split
moving (in the middle of epochs too) ends with the parameters of synchronous one-process
training on the same global batches, float64 within 1e-10, on every rank.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import _mpirun as mpirun
import _repartition_train as tr
import ringcoll
from ringcoll import InvalidArgumentError, RingcollError
from ringcoll.repartition import proportional_split, split_change
from ringcoll.straggler import Slowdown, parse_spec

TIMEOUT = 10
MPI_CHECKS = 3  # 'OK ...' lines of tests/mpi_repartition.py


def outcomes(p, fn):
    """fn(comm) on p thread ranks: each rank's result or the exception it raised."""
    def body(comm):
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return ringcoll.run_threads(p, body, timeout=TIMEOUT)


# -- the split arithmetic ------------------------------------------------------------------------
@pytest.mark.parametrize("total,weights,expected", [
    (10, [1], [10]),
    (10, [1, 1, 1], [4, 3, 3]),             # the leftover row to the lowest rank on a tie
    (30, [2, 1], [20, 10]),
    (30, [1, 2], [10, 20]),
    (7, [1, 1, 1, 1], [2, 2, 2, 1]),
    (30, [2, 2, 2, 1], [9, 9, 8, 4]),        # quotas 8.57 x3, 4.29: remainders .57 > .29
    (4, [1, 1, 1, 100], [1, 1, 1, 1]),       # the minimum of one row wins over proportion
    (5, [1, 1, 1, 100], [1, 1, 1, 2]),
    (2, [1, 1, 1], [1, 1, 0]),               # fewer rows than ranks: no minimum
    (0, [1, 2], [0, 0]),
])
def test_proportional_split(total, weights, expected):
    assert proportional_split(total, weights) == expected


def test_proportional_split_properties():
    rng = np.random.default_rng(0)
    for _ in range(500):
        p = int(rng.integers(1, 9))
        weights = list(rng.uniform(0.05, 5.0, p))
        total = int(rng.integers(p, 200))
        counts = proportional_split(total, weights)
        quota = [total * w / sum(weights) for w in weights]
        assert sum(counts) == total and min(counts) >= 1
        if min(quota) >= 1:  # the minimum never bit: within one row of the quota
            assert all(abs(c - q) < 1 for c, q in zip(counts, quota)), (counts, quota)


@pytest.mark.parametrize("weights", [[1, 0], [1, -1], [1, float("nan")], []])
def test_proportional_split_refuses_bad_weights(weights):
    with pytest.raises(InvalidArgumentError, match="proportional_split"):
        proportional_split(10, weights)


def test_split_change():
    assert split_change([10, 10], [10, 10]) == 0
    assert split_change([10, 20], [12, 18]) == pytest.approx(0.2)


# -- the Repartitioner on threads --------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_initial_split_is_equal_contiguous_and_covers_the_batch(p):
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 30)
        batch = np.arange(100, 130)
        return rp.counts, rp.offsets, rp.shard(batch).tolist(), rp.grad_scale

    results = ringcoll.run_threads(p, body, timeout=TIMEOUT)
    counts = results[0][0]
    assert counts == tuple(proportional_split(30, [1] * p))
    assert sum((r[2] for r in results), []) == list(range(100, 130))  # in rank order, contiguous
    for rank, (c, offsets, rows, scale) in enumerate(results):
        assert c == counts and len(rows) == counts[rank] and offsets[rank] == sum(counts[:rank])
        assert scale == 1 / 30


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_batch_smaller_than_the_ranks_is_refused_on_every_rank(p):
    got = outcomes(p, lambda comm: ringcoll.Repartitioner(comm, p - 1))
    for rank, exc in enumerate(got):
        assert isinstance(exc, InvalidArgumentError)
        assert str(exc).startswith(f"ringcoll rank {rank}, Repartitioner: global_batch")


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"hysteresis": -0.1},
                                    {"speeds": [1, 2, 3]}])
def test_bad_arguments(kwargs):
    got = outcomes(2, lambda comm: ringcoll.Repartitioner(comm, 10, **kwargs))
    assert all(isinstance(e, InvalidArgumentError) for e in got), got


def exchange(p, seconds_per_sample, hysteresis, every=2, steps=2, speeds=None):
    """Each rank records every step at its own seconds per sample; the counts after `steps`."""
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 60, every=every, hysteresis=hysteresis, speeds=speeds)
        changed = []
        for _ in range(steps):
            rp.record(seconds_per_sample[comm.rank] * rp.count)
            changed.append(rp.step())
        return rp.counts, changed, rp.per_sample
    return ringcoll.run_threads(p, body, timeout=TIMEOUT)


def test_hysteresis_keeps_the_split_against_noise_and_not_against_a_straggler():
    noisy = [1.0, 1.05, 0.97]  # a 5% difference in speed moves a count by about 5%
    for rank_result in exchange(3, noisy, hysteresis=0.1):
        assert rank_result[0] == (20, 20, 20) and rank_result[1] == [False, False]
    for rank_result in exchange(3, noisy, hysteresis=0.0):  # no hysteresis: it follows noise
        assert rank_result[0] != (20, 20, 20) and rank_result[1] == [False, True]
    for rank_result in exchange(3, [1.0, 2.0, 1.0], hysteresis=0.1):
        assert rank_result[0] == (24, 12, 24) and rank_result[1] == [False, True]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_rank_agrees_on_every_split(p):
    rng = np.random.default_rng(p)
    times = list(rng.uniform(0.5, 3.0, p))
    results = exchange(p, times, hysteresis=0.0, every=1, steps=3)
    assert all(r[0] == results[0][0] and r[2] == results[0][2] for r in results)
    expected = proportional_split(60, [1 / t for t in times])
    assert results[0][0] == tuple(expected)
    assert results[0][2] == pytest.approx(times)


def test_repeated_resplits_converge_to_equal_step_times_with_a_per_step_overhead():
    overhead, cost, factors = 5e-3, 1e-3, [1.0, 3.0]  # rank 1 three times slower

    def body(comm):
        rp = ringcoll.Repartitioner(comm, 60, every=1, hysteresis=0.02)
        for _ in range(30):
            rp.record(factors[comm.rank] * (overhead + cost * rp.count))
            rp.step()
        return rp.counts, len(rp.resplits)

    (counts, resplits), again = ringcoll.run_threads(2, body, timeout=TIMEOUT)
    assert again == (counts, resplits) and resplits >= 2  # one re-split undershoots
    step = [f * (overhead + cost * n) for f, n in zip(factors, counts)]
    # balanced to within a row (and the 2% hysteresis) of the ideal split
    assert abs(step[0] - step[1]) <= 3.0 * cost + 0.02 * max(step), (counts, step)


def test_a_rank_that_records_nothing_fails_every_rank_alike():
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 12, every=2)
        for _ in range(2):
            if comm.rank != 1:
                rp.record(1.0)
            rp.step()

    for rank, exc in enumerate(outcomes(3, body)):
        assert isinstance(exc, RingcollError) and "rank(s) [1] recorded no samples" in str(exc)
        assert str(exc).startswith(f"ringcoll rank {rank}, Repartitioner: ")


def test_timed_uses_the_clock_and_the_count():
    ticks = iter([10.0, 10.5, 20.0, 20.25])

    def body(comm):
        rp = ringcoll.Repartitioner(comm, 8, every=2, clock=lambda: next(ticks))
        with rp.timed():
            pass
        with rp.timed(samples=2):
            pass
        rp.step()
        rp.step()
        return rp.per_sample

    assert ringcoll.run_threads(1, body, timeout=TIMEOUT) == [((0.5 + 0.25) / (8 + 2),)]


def test_state_dict_round_trip():
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 30, every=1, hysteresis=0)
        rp.record([1.0, 2.0][comm.rank] * rp.count)
        rp.step()
        rp.record(0.5, 3)
        state = rp.state_dict()
        fresh = ringcoll.Repartitioner(comm, 30, every=1)
        fresh.load_state_dict(state)
        bad = ringcoll.Repartitioner(comm, 31)
        with pytest.raises(InvalidArgumentError, match="load_state_dict"):
            bad.load_state_dict(state)
        return fresh.state_dict() == state, fresh.counts, fresh.rows

    for rank, (same, counts, rows) in enumerate(ringcoll.run_threads(2, body, timeout=TIMEOUT)):
        assert same and counts == (20, 10) and rows == [slice(0, 20), slice(20, 30)][rank]


def test_the_optimizer_must_sum():
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 4)
        params = {"w": np.zeros(3)}
        with pytest.raises(InvalidArgumentError, match="op='sum'"):
            rp.distributed_optimizer(ringcoll.optim.SGD(params, lr=0.1), op="avg")
        return rp.distributed_optimizer(ringcoll.optim.SGD(params, lr=0.1)).op

    assert ringcoll.run_threads(2, body, timeout=TIMEOUT) == ["sum", "sum"]


# -- the key property: the trajectory of synchronous training --------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("overhead", [0.0, 2e-3])
def test_training_with_a_straggler_equals_synchronous_training(p, overhead):
    ref = tr.reference()
    slow = [1.0] * p
    slow[min(1, p - 1)] = 2.0  # rank 1 (the only rank at p = 1) computes 2x slower

    results = ringcoll.run_threads(
        p, lambda comm: tr.train(comm, slow, overhead=overhead), timeout=TIMEOUT)
    used = results[0][2]
    for rank, (params, rp, counts) in enumerate(results):
        d = tr.max_diff(params, ref)
        assert d < 1e-10, f"rank {rank}: max abs diff {d:.2e}"
        assert counts == used and rp.counts == results[0][1].counts  # every rank agrees
        assert all(np.array_equal(params[k], results[0][0][k]) for k in params)  # bitwise
    assert all(sum(c) == tr.BATCH and min(c) >= 1 for c in used)
    if p == 1:
        assert set(used) == {(tr.BATCH,)}
        return
    rp = results[0][1]
    assert rp.resplits, "a 2x straggler must move the split"
    assert used[-1][1] < min(c for r, c in enumerate(used[-1]) if r != 1)  # it got fewer rows
    # a re-split in the middle of an epoch: the split changed between two steps of one epoch
    mid = [s for s in range(1, len(used)) if used[s] != used[s - 1]
           and s % tr.STEPS_PER_EPOCH != 0]
    assert mid, f"no re-split inside an epoch: {rp.resplits}"


# -- the straggler slowdown ------------------------------------------------------------------------
def test_slowdown_sleeps_factor_minus_one_times_the_block():
    ticks, naps = iter([1.0, 1.5, 3.0, 3.25]), []
    slow = Slowdown(3, clock=lambda: next(ticks), sleep=naps.append)
    with slow:
        pass
    assert slow.elapsed == 0.5 and naps == [1.0]
    with slow:
        pass
    assert naps == [1.0, 0.5] and slow.slept == 1.5


def test_factor_one_never_sleeps_and_an_error_does_not_sleep():
    naps = []
    with Slowdown(1.0, sleep=naps.append):
        sum(range(1000))
    slow = Slowdown(2.0, sleep=naps.append)
    with pytest.raises(KeyError):
        with slow:
            raise KeyError("x")
    assert naps == []


def test_slowdown_really_takes_factor_times_as_long():
    slow = Slowdown(3.0)
    start = time.perf_counter()
    with slow:
        time.sleep(0.01)
    total = time.perf_counter() - start
    assert total >= 3.0 * slow.elapsed * 0.999 and slow.elapsed >= 0.01


def test_spec():
    assert parse_spec("1:2") == {1: 2.0}
    assert parse_spec(" 0:1.5, 3:4 ") == {0: 1.5, 3: 4.0}
    assert parse_spec(None) == {} == parse_spec("")
    assert Slowdown.for_rank("1:2,3:4", 3).factor == 4.0
    assert Slowdown.for_rank("1:2", 0).factor == 1.0
    for bad in ("1", "x:2", "1:0.5", "-1:2", "1:two"):
        with pytest.raises(InvalidArgumentError, match="RANK:FACTOR"):
            parse_spec(bad, rank=0)
    with pytest.raises(InvalidArgumentError, match="ringcoll rank 2, Slowdown: factor"):
        Slowdown(0.5, rank=2)


# -- the mpiexec tier ------------------------------------------------------------------------
@mpirun.needs_mpi
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_repartitioned_training_under_mpiexec(p, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_repartition.py"],
                                  env={"RINGCOLL_TIMEOUT": "60"}, timeout=120)
    mpi_timings[f"mpi_repartition -n {p}"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == MPI_CHECKS, out[-4000:]


@mpirun.needs_mpi
def test_straggler_bench_runs_every_mode_and_judges_its_targets(tmp_path):
    """bench/straggler.py (the driver, launching its own -n 2 job), a few steps of a small
    model: every mode at every slowdown runs, repartition ends with sync's parameters, every
    target is judged, the plot is written and the exit status is its JSON's. The timing
    targets themselves are not judged here (exit 3 is allowed): they are the bench's job."""
    pytest.importorskip("sklearn", reason="the bench trains on scikit-learn's digits")
    pytest.importorskip("matplotlib", reason="the bench plots with matplotlib")
    out, png = tmp_path / "straggler.json", tmp_path / "straggler.png"
    cmd = [sys.executable, "bench/straggler.py", "--sizes", "2", "--steps", "8", "--batch",
           "96", "--hidden", "32", "--repeat", "1", "--job-timeout", "150", "--json", str(out),
           "--plot", str(png)]
    run = subprocess.run(cmd, cwd=mpirun.ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = run.stdout + run.stderr
    assert run.returncode in (0, 3), log[-4000:]
    data = json.loads(out.read_text())
    assert data["exit_status"] == run.returncode, log[-4000:]
    rows = data["rows"]
    modes = ["sync", "repartition", "stale1", "local4", "local16", "async"]
    assert [(r["slow"], r["mode"]) for r in rows] == [(s, m) for s in (1.0, 2.0, 4.0)
                                                        for m in modes]
    assert all(0 <= r["accuracy"] <= 1 and r["samples"] > 0 and r["curve"] for r in rows)
    assert all(r["diff_vs_sync"] < 1e-4 for r in rows if r["mode"] == "repartition")
    assert all(sum(r["final_split"]) == 96 for r in rows if r["mode"] != "async")
    assert sorted(t[0] for t in data["targets"]) == ["A", "R", "S"], data["targets"]
    assert png.stat().st_size > 1000
    assert "target R -n 2:" in log and "async" in log
