"""ringcoll.LocalSGD on the thread transport, against oracles that simulate the p replicas
in one process (no communication): each replica its own inner optimizer on its own
gradients, and every H steps the parameters (and state) replaced by their average over the
replicas, then the outer update written out by hand here (not through ringcoll.optim).

Values: integer-valued gradients and parameters, dyadic learning rates: where every
intermediate value is a dyadic rational of a few bits (plain SGD, p in 1, 2, 4) the results
are compared bitwise; elsewhere (momentum, Adam, p = 3) within 1e-10 in float64 (the
all-reduce may add in another order than the oracle). Replicas are bitwise equal after
every round, always. tests/mpi_stale_local.py trains under mpiexec.
"""

import numpy as np
import pytest

import ringcoll
from ringcoll import InvalidArgumentError
from ringcoll.optim import SGD, Adam
from test_dp_units import MODEL, assert_same_params, grads_for, run, same_bits, snapshot

MODEL64 = [(n, s, np.float64) for n, s, _ in MODEL]
TOL = 1e-10


def start_params(model=MODEL64):
    rng = np.random.default_rng(0)
    return {n: rng.integers(-4, 5, s).astype(d) for n, s, d in model}


def inner(kind, params):
    return {"sgd": lambda: SGD(params, lr=0.5),
            "momentum": lambda: SGD(params, lr=0.25, momentum=0.5),
            "adam": lambda: Adam(params, lr=0.125)}[kind]()


def simulate(p, kind, steps, period, average_state=False, outer_lr=1.0, outer_momentum=0.0,
             nesterov=False, model=MODEL64):
    """Every replica's parameters after `steps` local steps (rounds every `period`)."""
    replicas = [start_params(model) for _ in range(p)]
    opts = [inner(kind, r) for r in replicas]
    anchor, buf = start_params(model), None
    for s in range(steps):
        for r in range(p):
            opts[r].step(grads_for(replicas[r], r, s))
        if (s + 1) % period:
            continue
        avg = {n: sum(rep[n] for rep in replicas) / p for n in anchor}  # one rounding
        if average_state:
            for n in anchor:
                for key, v in opts[0].state[n].items():
                    if isinstance(v, np.ndarray):
                        mean = sum(o.state[n][key] for o in opts) / p
                        for o in opts:
                            o.state[n][key][...] = mean
        if outer_lr == 1.0 and outer_momentum == 0.0:
            new = avg
        else:
            d = {n: anchor[n] - avg[n] for n in anchor}
            buf = d if buf is None else {n: outer_momentum * buf[n] + d[n] for n in d}
            upd = {n: d[n] + outer_momentum * buf[n] for n in d} if nesterov else buf
            anchor = {n: anchor[n] - outer_lr * upd[n] for n in d}
            new = anchor
        for rep in replicas:
            for n in rep:
                rep[n][...] = new[n]
    return replicas


def local(comm, kind, steps, period, model=MODEL64, **options):
    params = start_params(model)
    opt = ringcoll.LocalSGD(inner(kind, params), comm, period=period, **options)
    history = []
    for s in range(steps):
        opt.step(grads_for(params, comm.rank, s))
        history.append(snapshot(params))
    return params, opt, history


def assert_close(a, b, exact):
    for n in a:
        if exact:
            assert same_bits(a[n], b[n]), n
        else:
            np.testing.assert_allclose(a[n], b[n], rtol=0, atol=TOL, err_msg=n)


def assert_replicas_equal(out):
    for r in range(1, len(out)):
        assert_same_params(out[0], out[r])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_period_one_plain_sgd_is_the_average_of_the_stepped_replicas(p):
    steps = 3

    def fn(comm):
        params, opt, _ = local(comm, "sgd", steps, 1, model=MODEL)  # float32 and float64
        assert opt.rounds == steps
        return params

    out = run(p, fn)
    assert_replicas_equal(out)
    # float32 and float64 parameters: sums of these dyadic values are exact, / 2 and / 4
    # too; / 3 rounds (once per round in both, but later sums then round by order)
    want = simulate(p, "sgd", steps, 1, model=MODEL)
    for n in want[0]:
        if p != 3:
            assert same_bits(out[0][n], want[0][n]), n
        else:
            np.testing.assert_allclose(out[0][n], want[0][n], rtol=0, atol=1e-5, err_msg=n)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("kind,average_state", [("sgd", False), ("momentum", False),
                                                ("momentum", True)])
def test_period_one_equals_synchronous_data_parallelism_where_the_update_is_linear(
        p, kind, average_state):
    """H = 1 averages p stepped replicas; DP steps once on the averaged gradient: the same
    real number (SGD, with momentum too: linear in the gradients), up to rounding."""
    steps = 4

    def fn(comm):
        params, _, _ = local(comm, kind, steps, 1, average_state=average_state)
        dp = start_params()
        opt = ringcoll.DistributedOptimizer(inner(kind, dp), comm)
        for s in range(steps):
            opt.step(grads_for(dp, comm.rank, s))
        return params, dp

    out = run(p, fn)
    assert_replicas_equal([o[0] for o in out])
    for n in out[0][0]:
        np.testing.assert_allclose(out[0][0][n], out[0][1][n], rtol=0, atol=TOL)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("kind,average_state", [("sgd", False), ("momentum", False),
                                                ("momentum", True), ("adam", False),
                                                ("adam", True)])
def test_period_four_equals_the_simulated_replicas(p, kind, average_state):
    steps, period = 10, 4  # 2 rounds, then 2 local steps: replicas differ again
    want = simulate(p, kind, steps, period, average_state)

    def fn(comm):
        params, opt, history = local(comm, kind, steps, period, average_state=average_state)
        assert opt.rounds == 2 and opt.steps == steps
        assert_close(params, want[comm.rank], exact=kind == "sgd" and p != 3)
        return history

    out = run(p, fn)
    for s in (3, 7):  # after each round: bitwise equal replicas
        assert_replicas_equal([h[s] for h in out])
    if p > 1 and kind != "sgd":  # between rounds they differ (own gradients)
        assert not same_bits(out[0][9]["w1"], out[1][9]["w1"])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("outer_lr,outer_momentum,nesterov", [(0.5, 0.0, False),
                                                              (0.7, 0.9, False),
                                                              (0.7, 0.9, True)])
def test_outer_momentum_equals_the_oracle(p, outer_lr, outer_momentum, nesterov):
    steps, period = 12, 3
    options = dict(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov)
    want = simulate(p, "momentum", steps, period, **options)

    def fn(comm):
        params, opt, history = local(comm, "momentum", steps, period, **options)
        assert_close(params, want[comm.rank], exact=False)
        return history[-1]

    assert_replicas_equal(run(p, fn))


def test_average_at_the_end_and_the_bytes():
    p, steps, period = 3, 6, 4

    def fn(comm):
        params, opt, _ = local(comm, "adam", steps, period, average_state=True, model=MODEL)
        assert opt.rounds == 1
        opt.average()  # the 2 local steps since the round: averaged now
        assert opt.rounds == 2
        model_bytes = sum(a.nbytes for a in params.values())
        # Adam's state: exp_avg and exp_avg_sq per parameter, in the parameter's dtype
        assert opt.bytes_sent == 2 * 3 * model_bytes
        assert opt.comm_seconds > 0
        return params

    out = run(p, fn)
    assert_replicas_equal(out)
    want = simulate(p, "adam", steps, period, True, model=MODEL)
    avg = {n: sum(w[n].astype(np.float64) for w in want) / p for n in want[0]}
    for n in avg:
        np.testing.assert_allclose(out[0][n], avg[n], rtol=0, atol=1e-5)  # float32


def test_bad_arguments():
    def fn(comm):
        params = start_params()
        for bad in (0, -1, 1.5, True):
            with pytest.raises(InvalidArgumentError, match=f"rank {comm.rank}, LocalSGD: "
                                                           "period must be"):
                ringcoll.LocalSGD(SGD(params, lr=0.1), comm, period=bad)
        with pytest.raises(InvalidArgumentError, match="outer_lr > 0"):
            ringcoll.LocalSGD(SGD(params, lr=0.1), comm, outer_lr=0)
        with pytest.raises(InvalidArgumentError, match="outer_momentum < 1"):
            ringcoll.LocalSGD(SGD(params, lr=0.1), comm, outer_momentum=1.0)
        with pytest.raises(InvalidArgumentError, match="nesterov needs"):
            ringcoll.LocalSGD(SGD(params, lr=0.1), comm, nesterov=True)
        return True

    assert run(2, fn) == [True, True]


def test_different_models_are_refused():
    def fn(comm):
        model = MODEL64 if comm.rank == 0 else MODEL
        ringcoll.LocalSGD(SGD(start_params(model), lr=0.1), comm)

    with pytest.raises(ringcoll.CollectiveMismatchError, match="registered other parameters"):
        run(2, fn)


def test_plain_averaging_is_the_average_bitwise():
    """outer_lr = 1, no momentum: the parameters ARE the all-reduced average (no
    x - (x - a) arithmetic, which rounds). Random floats, p = 2: (a + b) / 2 is one
    commutative sum and one division, the same in any order."""
    p = 2

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        params = {n: rng.standard_normal(s) for n, s, _ in MODEL64}
        before = snapshot(params)
        opt = ringcoll.LocalSGD(SGD(params, lr=0.1), comm, period=1)
        g = {n: rng.standard_normal(a.shape) for n, a in params.items()}
        opt.step(g)
        return before, g, snapshot(params)

    out = run(p, fn)
    for n in out[0][0]:
        stepped = [out[r][0][n] - 0.1 * out[r][1][n] for r in range(p)]
        want = (stepped[0] + stepped[1]) / 2
        for r in range(p):
            assert same_bits(out[r][2][n], want), n
