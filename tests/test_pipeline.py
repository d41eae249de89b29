"""Pipeline schedules: their structure and simulated length (no clocks), and on thread ranks
the gradients of GPipe and 1F1B at pp = 2, 3, 4 and m = 1, 4, 8 against the unsplit model on
the whole batch (tests/_parallel_cases.check_pipeline), checked on every stage."""

import pytest

import ringcoll
from ringcoll.parallel import Pipeline, draw, gpipe, mlp, one_f_one_b, simulate

import _parallel_cases as C

TIMEOUT = 30


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_every_stage_runs_each_action_once_in_a_valid_order(schedule):
    for p in range(1, 7):
        for m in range(1, 10):
            for s in range(p):
                actions = schedule(p, s, m)
                assert sorted(actions) == sorted([("B", j) for j in range(m)]
                                                 + [("F", j) for j in range(m)])
                fs = [j for k, j in actions if k == "F"]
                bs = [j for k, j in actions if k == "B"]
                assert fs == sorted(fs) and bs == sorted(bs)  # the message streams in order
                in_flight, peak = 0, 0
                for kind, j in actions:
                    in_flight += 1 if kind == "F" else -1
                    assert in_flight >= 0, (p, s, m, actions)  # B(j) after F(j)
                    peak = max(peak, in_flight)
                assert peak == (m if schedule is gpipe else min(p - s, m))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("t_f,t_b", [(1, 1), (1, 2), (2, 3)])
def test_simulated_length_is_m_plus_p_minus_1_slots(schedule, t_f, t_b):
    """With instant messages and equal stages, both schedules take (m + p - 1)(t_f + t_b):
    a bubble of (p - 1)/(m + p - 1), the formula the bench compares its measurement with."""
    for p in range(1, 6):
        for m in (1, 2, 3, 4, 8, 9):
            lanes = simulate(schedule, p, m, t_f, t_b)
            length = max(end for lane in lanes for *_, end in lane)
            assert length == (m + p - 1) * (t_f + t_b), (schedule, p, m, length)
            busy = sum(end - begin for lane in lanes for _, _, begin, end in lane)
            assert busy == p * m * (t_f + t_b)


def test_drawings_match_the_docs():
    assert draw("gpipe", 4, 4) == "\n".join([
        "stage 0  0123.........aabbccdd",
        "stage 1  .0123......aabbccdd..",
        "stage 2  ..0123...aabbccdd....",
        "stage 3  ...0123aabbccdd......"])
    assert draw("1f1b", 4, 4) == "\n".join([
        "stage 0  0123......aa.bb.cc.dd",
        "stage 1  .012....aa3bb.cc.dd..",
        "stage 2  ..01..aa2bb3cc.dd....",
        "stage 3  ...0aa1bb2cc3dd......"])


def test_simulate_finds_a_deadlocking_schedule():
    def backward_first(p, s, m):  # the last stage cannot run B(0) before F(0)
        return [("B", j) for j in range(m)] + [("F", j) for j in range(m)]

    with pytest.raises(ringcoll.InvalidArgumentError, match="deadlocks at p=2, m=2"):
        simulate(backward_first, 2, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gradients_equal_the_unsplit_model(schedule, pp, m):
    assert ringcoll.run_threads(pp, lambda comm: C.check_pipeline(comm, schedule, m),
                                timeout=TIMEOUT) == [True] * pp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_stages_and_micro_batches(schedule):
    """3 stages over 8 layers (3, 3, 2), 10 rows in 4 micro-batches (3, 3, 2, 2), relu; and
    one stage alone (the whole model, no messages)."""
    ringcoll.run_threads(3, lambda comm: C.check_pipeline(comm, schedule, 4, n=10,
                                                          activation="relu"), timeout=TIMEOUT)
    ringcoll.run_threads(1, lambda comm: C.check_pipeline(comm, schedule, 3), timeout=TIMEOUT)


def test_missing_inputs_or_loss_are_refused():
    def body(comm):
        stage = mlp(C.model_params(), first=comm.rank * 4, last=comm.rank * 4 + 4)
        pipe = Pipeline(comm, stage)
        if comm.rank == 0:
            with pytest.raises(ringcoll.InvalidArgumentError, match="stage 0 needs inputs"):
                pipe.run([2, 2])
        else:
            with pytest.raises(ringcoll.InvalidArgumentError, match="needs loss"):
                pipe.run([2, 2])
        with pytest.raises(ringcoll.InvalidArgumentError, match="unknown schedule 'zb'"):
            Pipeline(comm, stage, schedule="zb")
        return True

    assert ringcoll.run_threads(2, body, timeout=TIMEOUT) == [True, True]
