"""ringcoll.optim: SGD and Adam/AdamW against an independent reference, checkpoints, errors.

The reference below is written the other way round from the optimizers: one Python float
(float64) per element in plain loops, Adam in its textbook form (bias-corrected m_hat and
v_hat), so a shared mistake in vectorised NumPy cannot hide. float16 references round the
parameter to float16 after each step, which is what the optimizer documents it does.
"""

import doctest
import io
import json
import math
import sys
import tracemalloc

import numpy as np
import pytest

from ringcoll import optim
from ringcoll.errors import InvalidArgumentError, InvalidTypeError
from ringcoll.optim import SGD, Adam

import _fake_cupy

SHAPES = {"scalar": (), "vector": (5,), "matrix": (3, 4)}
STEPS = 4


# -- the reference ----------------------------------------------------------------------------

def ref_sgd(p0, grads, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
            round_to=None):
    p = [float(x) for x in np.ravel(p0)]
    buf = None
    for grad in grads:
        g = [float(x) for x in np.ravel(grad)]
        d = [g[i] + weight_decay * p[i] for i in range(len(p))]
        if momentum:
            if buf is None:
                buf = list(d)
            else:
                buf = [momentum * buf[i] + (1 - dampening) * d[i] for i in range(len(p))]
            d = [d[i] + momentum * buf[i] for i in range(len(p))] if nesterov else list(buf)
        p = [p[i] - lr * d[i] for i in range(len(p))]
        if round_to is not None:
            p = [float(round_to(x)) for x in p]
    return np.array(p).reshape(np.shape(p0))


def ref_adam(p0, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             decoupled=False, round_to=None):
    b1, b2 = betas
    p = [float(x) for x in np.ravel(p0)]
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    for t, grad in enumerate(grads, start=1):
        for i, gi in enumerate(np.ravel(grad)):
            gi = float(gi)
            if decoupled:
                p[i] -= lr * weight_decay * p[i]
            else:
                gi += weight_decay * p[i]
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            p[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
            if round_to is not None:
                p[i] = float(round_to(p[i]))
    return np.array(p).reshape(np.shape(p0))


def make_problem(dtype, seed=0, steps=STEPS):
    """Parameters of every shape, and `steps` gradient dicts for them."""
    rng = np.random.default_rng(seed)
    params = {k: np.asarray(rng.uniform(-2, 2, size=s)).astype(dtype)
              for k, s in SHAPES.items()}
    grads = [{k: np.asarray(rng.normal(size=s)).astype(dtype) for k, s in SHAPES.items()}
             for _ in range(steps)]
    return params, grads


def tolerance(dtype):
    return {np.float64: dict(rtol=1e-12, atol=1e-12),
            np.float32: dict(rtol=2e-5, atol=2e-5),
            np.float16: dict(rtol=2e-3, atol=2e-3)}[dtype]


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.02, momentum=0.5, nesterov=True, weight_decay=0.01),
    dict(lr=0.1, weight_decay=0.1),
]
ADAM_CASES = [
    dict(),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=0.01, weight_decay=0.05),
    dict(lr=0.01, weight_decay=0.1, decoupled=True),
    dict(lr=0.05, betas=(0.0, 0.5)),
]


def run(opt_cls, hyper, params, grads):
    opt = opt_cls(params, **hyper)
    for g in grads:
        opt.step(g)
    return opt


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("hyper", SGD_CASES, ids=str)
def test_sgd_matches_reference(hyper, dtype):
    params, grads = make_problem(dtype)
    start = {k: p.copy() for k, p in params.items()}
    run(SGD, hyper, params, grads)
    rounding = np.float16 if dtype is np.float16 else None
    for k, p in params.items():
        want = ref_sgd(start[k], [g[k] for g in grads], round_to=rounding, **hyper)
        assert p.dtype == dtype and p.shape == SHAPES[k]
        np.testing.assert_allclose(p, want, **tolerance(dtype), err_msg=k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("hyper", ADAM_CASES, ids=str)
def test_adam_matches_reference(hyper, dtype):
    params, grads = make_problem(dtype)
    start = {k: p.copy() for k, p in params.items()}
    opt = run(Adam, hyper, params, grads)
    rounding = np.float16 if dtype is np.float16 else None
    for k, p in params.items():
        want = ref_adam(start[k], [g[k] for g in grads], round_to=rounding, **hyper)
        assert p.dtype == dtype and p.shape == SHAPES[k]
        np.testing.assert_allclose(p, want, **tolerance(dtype), err_msg=k)
        st = opt.state[k]
        assert st["step"] == STEPS
        # float16 keeps its moments in float32; the others in the parameter's dtype.
        want_state = np.float32 if dtype is np.float16 else dtype
        assert st["exp_avg"].dtype == want_state and st["exp_avg_sq"].dtype == want_state


def test_bfloat16_computes_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    params, grads = make_problem(np.float32)
    params = {k: p.astype(bf16) for k, p in params.items()}
    start = {k: p.astype(np.float64) for k, p in params.items()}
    grads = [{k: g.astype(bf16) for k, g in gs.items()} for gs in grads]
    opt = run(Adam, dict(lr=0.05), params, grads)
    for k, p in params.items():
        want = ref_adam(start[k], [g[k].astype(np.float64) for g in grads], lr=0.05,
                        round_to=lambda x: np.float64(np.array(x).astype(bf16)))
        assert p.dtype == bf16 and opt.state[k]["exp_avg"].dtype == np.float32
        np.testing.assert_allclose(p.astype(np.float64), want, rtol=2e-2, atol=2e-2)


def test_grad_dtype_may_differ_from_param():
    params, grads = make_problem(np.float64)
    start = {k: p.copy() for k, p in params.items()}
    grads32 = [{k: g.astype(np.float32) for k, g in gs.items()} for gs in grads]
    run(SGD, dict(lr=0.1, momentum=0.9), params, grads32)
    for k, p in params.items():
        want = ref_sgd(start[k], [g[k] for g in grads32], lr=0.1, momentum=0.9)
        assert p.dtype == np.float64
        np.testing.assert_allclose(p, want, rtol=1e-12, atol=1e-12)


def test_lr_schedule_through_hyper():
    params, grads = make_problem(np.float64)
    start = {k: p.copy() for k, p in params.items()}
    opt = SGD(params, lr=0.1)
    opt.step(grads[0])
    opt.hyper["lr"] = 0.01
    opt.step(grads[1])
    for k, p in params.items():
        want = ref_sgd(ref_sgd(start[k], [grads[0][k]], lr=0.1), [grads[1][k]], lr=0.01)
        np.testing.assert_allclose(p, want, rtol=1e-12, atol=1e-12)
    opt.hyper["lr"] = -1.0
    with pytest.raises(InvalidArgumentError, match="lr"):
        opt.step(grads[2])
    opt.hyper["lr"] = 0.1
    opt.hyper["LR"] = 0.1
    with pytest.raises(InvalidArgumentError, match="unknown: 'LR'"):
        opt.step(grads[2])


# -- in place, untouched, not allocating ------------------------------------------------------

@pytest.mark.parametrize("opt_cls", [SGD, Adam])
def test_updates_the_callers_arrays_in_place(opt_cls):
    flat = np.zeros(7)
    params = {"a": flat[:3], "b": flat[3:].reshape(2, 2)}  # views into one flat buffer
    ids = {k: id(p) for k, p in params.items()}
    opt = opt_cls(params, lr=0.1)
    assert list(opt.params) == ["a", "b"] and all(opt.params[k] is params[k] for k in params)
    grads = {"a": np.ones(3), "b": np.ones((2, 2))}
    before = {k: g.copy() for k, g in grads.items()}
    opt.step(grads)
    assert {k: id(p) for k, p in opt.params.items()} == ids
    assert np.all(flat < 0)  # the flat buffer itself moved
    for k in grads:
        np.testing.assert_array_equal(grads[k], before[k])  # gradients are never written


@pytest.mark.parametrize("opt_cls,hyper", [(SGD, dict(lr=0.1, momentum=0.9)), (Adam, {})])
def test_missing_gradient_leaves_param_and_state_alone(opt_cls, hyper):
    params, grads = make_problem(np.float64)
    opt = opt_cls(params, **hyper)
    opt.step(grads[0])
    saved = opt.state_dict()
    frozen, moving = params["vector"].copy(), params["matrix"].copy()
    partial = {k: g for k, g in grads[1].items() if k != "vector"}
    opt.step(partial)
    np.testing.assert_array_equal(params["vector"], frozen)
    now = opt.state_dict()["state"]
    for key, value in saved["state"]["vector"].items():
        np.testing.assert_array_equal(now["vector"][key], value)
    if opt_cls is Adam:
        assert now["vector"]["step"] == 1 and now["matrix"]["step"] == 2
    assert not np.array_equal(params["matrix"], moving)  # the others did step


@pytest.mark.parametrize("opt_cls,hyper", [
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    (Adam, dict(weight_decay=0.01)),
    (Adam, dict(weight_decay=0.01, decoupled=True)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_no_allocation_after_the_first_step(opt_cls, hyper, dtype):
    n = 100_000
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=n).astype(dtype)}
    grads = {"w": rng.normal(size=n).astype(dtype)}
    opt = opt_cls(params, **hyper)
    opt.step(grads)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            opt.step(grads)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # A temporary of the parameter's size would be >= 400 kB; Python bookkeeping is tiny.
    assert peak < 32_000, f"step allocated {peak} bytes"


# -- checkpoints ------------------------------------------------------------------------------

def save_without_pickle(state_dict):
    """npz for the arrays, JSON for the rest: the format the data-parallel wrapper writes."""
    arrays, counter = {}, iter(range(1 << 30))

    def strip(x):
        if isinstance(x, np.ndarray):
            key = f"a{next(counter)}"
            arrays[key] = x
            return {"__array__": key}
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, list):
            return [strip(v) for v in x]
        assert type(x) in (str, int, float, bool), f"not plain data: {type(x)}"
        return x

    meta = json.dumps(strip(state_dict))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return meta, buf.getvalue()


def load_without_pickle(meta, blob):
    arrays = np.load(io.BytesIO(blob), allow_pickle=False)

    def fill(x):
        if isinstance(x, dict):
            return arrays[x["__array__"]] if set(x) == {"__array__"} else {
                k: fill(v) for k, v in x.items()}
        return [fill(v) for v in x] if isinstance(x, list) else x

    return fill(json.loads(meta))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("opt_cls,hyper", [
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (Adam, dict(lr=0.01, weight_decay=0.1, decoupled=True)),
    (Adam, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.01)),
])
def test_state_dict_round_trip_is_bitwise(opt_cls, hyper, dtype):
    params, grads = make_problem(dtype, steps=6)
    opt = run(opt_cls, hyper, params, grads[:3])
    meta, blob = save_without_pickle(opt.state_dict())
    twin_params = {k: p.copy() for k, p in params.items()}
    twin = opt_cls(twin_params, lr=0.5)  # hyper-parameters come from the checkpoint
    twin.load_state_dict(load_without_pickle(meta, blob))
    assert twin.hyper == opt.hyper
    for g in grads[3:]:
        opt.step(g)
        twin.step(g)
    for k in params:
        assert params[k].tobytes() == twin_params[k].tobytes(), k
    for k, st in opt.state_dict()["state"].items():
        twin_st = twin.state_dict()["state"][k]
        assert st.keys() == twin_st.keys()
        for key, v in st.items():
            assert np.asarray(v).tobytes() == np.asarray(twin_st[key]).tobytes(), (k, key)


def test_state_dict_is_plain_data_and_every_param_has_an_entry():
    params, grads = make_problem(np.float32)
    opt = Adam(params)
    assert opt.state_dict() == {"type": "Adam", "state": {k: {} for k in SHAPES}, "hyper": {
        "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
        "decoupled": False}}
    opt.hyper["lr"] = np.float32(0.5)  # a schedule may write NumPy scalars
    opt.step(grads[0])
    sd = opt.state_dict()
    assert type(sd["hyper"]["lr"]) is float
    assert type(sd["state"]["vector"]["step"]) is int
    save_without_pickle(sd)  # asserts nothing but dict/list/str/int/float/bool/ndarray


@pytest.mark.parametrize("opt_cls,hyper", [(SGD, dict(lr=0.1, momentum=0.9)), (Adam, {})])
def test_state_dict_arrays_are_copies_both_ways(opt_cls, hyper):
    params, grads = make_problem(np.float64)
    twin_params = {k: p.copy() for k, p in params.items()}
    opt, twin = opt_cls(params, **hyper), opt_cls(twin_params, **hyper)
    opt.step(grads[0])
    twin.step(grads[0])
    out = opt.state_dict()
    for st in out["state"].values():  # scribbling on a saved state does not reach opt
        for v in st.values():
            if isinstance(v, np.ndarray):
                v[...] = 1e6
    given = twin.state_dict()
    other_params = {k: p.copy() for k, p in twin_params.items()}
    other = opt_cls(other_params, **hyper)
    other.load_state_dict(given)
    for st in given["state"].values():  # nor on a loaded one
        for v in st.values():
            if isinstance(v, np.ndarray):
                v[...] = -1e6
    for g in grads[1:]:
        opt.step(g)
        twin.step(g)
        other.step(g)
    for k in params:
        np.testing.assert_array_equal(params[k], twin_params[k])
        np.testing.assert_array_equal(other_params[k], twin_params[k])


def _bad(sd, path, value=None, delete=False):
    """A deep copy of state dict `sd` with one entry replaced (or deleted)."""
    sd = {"type": sd["type"], "hyper": dict(sd["hyper"]),
          "state": {k: dict(v) for k, v in sd["state"].items()}}
    *head, last = path
    node = sd
    for key in head:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return sd


def test_load_state_dict_rejects_mismatches_and_changes_nothing():
    params, grads = make_problem(np.float64)
    opt = run(Adam, dict(lr=0.01), params, grads[:2])
    good = opt.state_dict()
    sgd_sd = run(SGD, dict(lr=0.1), make_problem(np.float64)[0], grads[:1]).state_dict()
    v = good["state"]["vector"]
    cases = [
        (sgd_sd, InvalidArgumentError, "is for 'SGD', not 'Adam'"),
        (_bad(good, ["state", "vector"], delete=True), InvalidArgumentError, "missing 'vector'"),
        (_bad(good, ["state", "extra"], {}), InvalidArgumentError, "unexpected 'extra'"),
        (_bad(good, ["state", "vector", "exp_avg"], np.zeros(4)), InvalidArgumentError,
         r"shape \(4,\)"),
        (_bad(good, ["state", "matrix", "exp_avg_sq"], np.zeros((4, 3))), InvalidArgumentError,
         "different model"),
        (_bad(good, ["state", "vector", "momentum_buffer"], v["exp_avg"]),
         InvalidArgumentError, "has keys"),
        (_bad(good, ["state", "vector", "step"], 0), InvalidArgumentError, "'step' is 0"),
        (_bad(good, ["state", "vector", "step"], 1.5), InvalidTypeError, "must be an int"),
        (_bad(good, ["state", "vector", "exp_avg"], [0.0] * 5), InvalidTypeError,
         "not a NumPy or CuPy array"),
        (_bad(good, ["state", "vector", "exp_avg"], np.zeros(5, int)), InvalidTypeError,
         "float array"),
        (_bad(good, ["hyper", "lr"], -1.0), InvalidArgumentError, "lr = -1.0"),
        (_bad(good, ["hyper", "betas"], [0.9, 1.0]), InvalidArgumentError, r"betas\[1\]"),
        (_bad(good, ["hyper", "momentum"], 0.9), InvalidArgumentError, "unknown: 'momentum'"),
        (_bad(good, ["type"], delete=True), InvalidArgumentError, "exactly the keys"),
        ([1, 2], InvalidTypeError, "expected the dict"),
    ]
    fresh_params = {k: p.copy() for k, p in params.items()}
    fresh = Adam(fresh_params, lr=0.5)
    fresh.step(grads[3])
    before = fresh.state_dict()
    for sd, error, message in cases:
        with pytest.raises(error, match=message):
            fresh.load_state_dict(sd)
    after = fresh.state_dict()  # an atomic load: nothing changed by any of the failures
    assert after["hyper"] == before["hyper"]
    for k, st in before["state"].items():
        for key, value in st.items():
            np.testing.assert_array_equal(after["state"][k][key], value)
    fresh.load_state_dict(good)  # and the good one still loads
    assert fresh.state["vector"]["step"] == 2


def test_load_accepts_npz_style_step_and_resets_unstepped_params():
    params, grads = make_problem(np.float32)
    opt = run(Adam, {}, params, grads[:2])
    sd = opt.state_dict()
    sd["state"]["vector"]["step"] = np.array(2)  # np.load gives 0-d arrays back
    sd["state"]["scalar"] = {}
    opt.load_state_dict(sd)
    assert opt.state["vector"]["step"] == 2 and opt.state["scalar"] == {}


# -- argument errors --------------------------------------------------------------------------

def test_step_rejects_bad_gradients_before_changing_anything():
    params, grads = make_problem(np.float64)
    before = {k: p.copy() for k, p in params.items()}
    opt = Adam(params)
    ok = grads[0]["scalar"]
    cases = [
        ({"scalar": ok, "nope": ok}, InvalidArgumentError, "'nope' names no parameter"),
        ({"scalar": ok, "vector": np.zeros(4)}, InvalidArgumentError, r"shape \(4,\)"),
        ({"scalar": ok, "vector": np.zeros(5, np.int64)}, InvalidTypeError, "int64"),
        ({"scalar": ok, "vector": np.zeros(5, np.complex128)}, InvalidTypeError, "complex"),
        ({"scalar": ok, "vector": [0.0] * 5}, InvalidTypeError, "np.asarray"),
        ([ok], InvalidTypeError, "grads must be a dict"),
    ]
    for grads_, error, message in cases:
        with pytest.raises(error, match=message):
            opt.step(grads_)
    for k, p in params.items():
        np.testing.assert_array_equal(p, before[k])
    assert all(st == {} for st in opt.state.values())


@pytest.mark.parametrize("make,error,message", [
    (lambda p: SGD(p, lr=0.1, nesterov=True), InvalidArgumentError, "Nesterov"),
    (lambda p: SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     InvalidArgumentError, "dampening = 0"),
    (lambda p: SGD(p, lr=-0.1), InvalidArgumentError, "lr = -0.1"),
    (lambda p: SGD(p, lr=float("nan")), InvalidArgumentError, "lr = nan"),
    (lambda p: SGD(p, lr=True), InvalidTypeError, "real number"),
    (lambda p: SGD(p, lr=0.1, momentum=-0.5), InvalidArgumentError, "momentum"),
    (lambda p: SGD(p, lr=0.1, nesterov=1), InvalidTypeError, "True or False"),
    (lambda p: Adam(p, betas=(0.9, 1.0)), InvalidArgumentError, r"betas\[1\]"),
    (lambda p: Adam(p, betas=0.9), InvalidArgumentError, "pair"),
    (lambda p: Adam(p, eps=-1.0), InvalidArgumentError, "eps"),
    (lambda p: Adam(p, weight_decay=-0.1), InvalidArgumentError, "weight_decay"),
    (lambda p: Adam({}), InvalidArgumentError, "empty"),
    (lambda p: Adam(list(p.values())), InvalidTypeError, "dict"),
    (lambda p: Adam({"w": np.zeros(3, np.int32)}), InvalidTypeError, "int32"),
    (lambda p: Adam({"w": [0.0, 1.0]}), InvalidTypeError, "not a NumPy or CuPy array"),
    (lambda p: Adam({1: p["vector"]}), InvalidTypeError, "not a str"),
    (lambda p: Adam({"a": p["vector"], "b": p["vector"]}), InvalidArgumentError,
     "same array"),
])
def test_constructor_errors_name_the_fix(make, error, message):
    params = make_problem(np.float64)[0]
    with pytest.raises(error, match=message):
        make(params)


def test_read_only_parameter_is_rejected():
    w = np.zeros(3)
    w.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        SGD({"w": w}, lr=0.1)


def test_docstring_examples():
    result = doctest.testmod(optim)
    assert result.attempted > 0 and result.failed == 0


# -- the same optimizers on CuPy arrays (tests/_fake_cupy.py stands in on the CPU) ----------
@pytest.fixture
def cp(monkeypatch):
    """The fake CuPy as sys.modules['cupy']: ringcoll sees its arrays as device arrays."""
    fake = _fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


def to_device(cp, arrays):
    return {k: cp.asarray(v) for k, v in arrays.items()}


CASES = [(SGD, h) for h in SGD_CASES] + [(Adam, h) for h in ADAM_CASES]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("opt_cls,hyper", CASES, ids=str)
def test_device_parameters_update_bitwise_like_numpy(cp, opt_cls, hyper, dtype):
    """One code path: the device run does the NumPy run's operations in its order, so on the
    fake (NumPy's kernels underneath) parameters and state agree bit for bit, and every array
    the optimizer made lives on the device."""
    params, grads = make_problem(dtype)
    dev = to_device(cp, params)
    host_opt = run(opt_cls, hyper, params, grads)
    dev_opt = run(opt_cls, hyper, dev, [to_device(cp, g) for g in grads])
    for k, p in params.items():
        assert type(dev[k]) is cp.ndarray and dev[k].dtype == dtype
        assert dev[k].get().tobytes() == p.tobytes(), k
        assert set(dev_opt.state[k]) == set(host_opt.state[k])
        for key, v in dev_opt.state[k].items():
            want = host_opt.state[k][key]
            if key == "step":
                assert v == want
            else:
                assert type(v) is cp.ndarray and v.get().tobytes() == want.tobytes(), (k, key)
        for buf in dev_opt._scratch[k].values():
            assert type(buf) is cp.ndarray


def test_device_state_dict_stays_on_the_device_and_loads_across_memories(cp):
    params, grads = make_problem(np.float32)
    dev_grads = [to_device(cp, g) for g in grads]
    opt = run(Adam, dict(lr=0.01), to_device(cp, params), dev_grads[:2])
    sd = opt.state_dict()
    arrays = [v for st in sd["state"].values() for k, v in st.items() if k != "step"]
    assert arrays and all(type(v) is cp.ndarray for v in arrays)
    # as a checkpoint file holds it: host arrays; loaded onto fresh device parameters ...
    on_disk = {**sd, "state": {n: {k: v if k == "step" else cp.asnumpy(v) for k, v in st.items()}
                               for n, st in sd["state"].items()}}
    resumed = Adam(to_device(cp, {k: opt.params[k].get() for k in params}), lr=0.01)
    resumed.load_state_dict(on_disk)
    # ... and the device state dict itself onto host parameters
    host = Adam({k: opt.params[k].get() for k in params}, lr=0.01)
    host.load_state_dict(sd)
    for k in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(resumed.state[k][key]) is cp.ndarray
            assert type(host.state[k][key]) is np.ndarray
    for g in dev_grads[2:]:  # all three continue alike, bit for bit
        opt.step(g)
        resumed.step(g)
        host.step({k: v.get() for k, v in g.items()})
    for k in params:
        assert resumed.params[k].get().tobytes() == opt.params[k].get().tobytes()
        assert host.params[k].tobytes() == opt.params[k].get().tobytes()


def test_gradient_in_the_other_memory_is_refused_before_any_update(cp):
    params, grads = make_problem(np.float64)
    dev = to_device(cp, params)
    opt = SGD(dev, lr=0.1, momentum=0.9)
    before = {k: v.get() for k, v in dev.items()}
    bad = dict(to_device(cp, grads[0]), matrix=grads[0]["matrix"])  # one host gradient
    with pytest.raises(InvalidTypeError, match="'matrix' is on the host .* parameter is on the "
                                               "GPU"):
        opt.step(bad)
    assert all(dev[k].get().tobytes() == before[k].tobytes() for k in dev)
    assert opt.state == {k: {} for k in dev}
    host_opt = SGD({"w": np.zeros(3)}, lr=0.1)
    with pytest.raises(InvalidTypeError, match="'w' is on the GPU .* parameter is on the host"):
        host_opt.step({"w": cp.zeros(3)})


def test_one_optimizer_may_hold_host_and_device_parameters(cp):
    """Each parameter updates in its own memory: a model split between CPU and GPU."""
    params, grads = make_problem(np.float32)
    mixed = dict(params, matrix=cp.asarray(params["matrix"]))
    plain = {k: v.copy() for k, v in params.items()}
    run(Adam, {}, plain, grads)
    run(Adam, {}, mixed, [dict(g, matrix=cp.asarray(g["matrix"])) for g in grads])
    assert type(mixed["matrix"]) is cp.ndarray and type(mixed["vector"]) is np.ndarray
    for k in params:
        got = mixed[k].get() if k == "matrix" else mixed[k]
        assert got.tobytes() == plain[k].tobytes(), k
