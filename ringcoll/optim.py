"""Optimizers for NumPy and CuPy parameters: SGD (with momentum / Nesterov) and Adam / AdamW.

NumPy has no optimizer of its own, and the data-parallel wrapper needs one whose state it can
checkpoint and whose learning rate a schedule can change. These follow torch.optim's update
rules operation for operation, so a model trained here and one trained with torch on the same
gradients agree to rounding.

Parameters are a dict ``name -> array`` (float16, bfloat16, float32 or float64, any shape)
updated *in place*: the arrays the caller passed are the ones that change, so views into a flat
buffer (the layout a fused all-reduce wants) stay views. Gradients are a dict of the same names;
a name left out is not updated that step, exactly as torch skips a parameter whose ``.grad`` is
None.

One code path serves both memories: each parameter's update runs in its own array module
(``xp``: NumPy for host arrays, CuPy for GPU arrays, found per parameter once per step), with
the same ufuncs in the same order, so a CuPy parameter gets NumPy's update up to the GPU's
rounding of the same operations. A gradient must live where its parameter does; its state and
scratch are made there too. tests/test_optim.py runs its cases on NumPy and on
tests/_fake_cupy.py (a CPU stand-in that refuses NumPy functions and mixed arrays, as CuPy
does), bitwise equal; scripts/gpu_check.sh trains with them on a real GPU (tests/mpi_dp_xp.py).

    opt = Adam(model_params, lr=1e-3)
    for batch in data:
        grads = backward(batch)          # {name: array shaped like the parameter}
        comm.allreduce(flat_grads, op="avg")
        opt.step(grads)
    opt.hyper["lr"] = 1e-4               # schedules just write the dict
    ckpt = opt.state_dict()              # dicts, lists, str, int, float, bool, arrays only

Hot path: after the first step of a parameter no array is allocated for float32/float64
parameters whose gradients have the parameter's dtype; every update is a NumPy ufunc writing
into the parameter, its state, or a scratch array kept per parameter. float16/bfloat16
parameters are computed in float32 (state kept in float32) and rounded back once per step.
"""

import math
from collections.abc import Mapping

import numpy as np

from .arrays import (HALF_TYPES, array_module, is_array, is_device, memory_of, to_module,
                     writeable)
from .errors import InvalidArgumentError, InvalidTypeError

#: float dtypes a parameter may have; the half types compute in float32.
_FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64)) + HALF_TYPES


def _is_float(dtype):
    return dtype in _FLOAT_TYPES


def _compute_dtype(dtype):
    """The dtype a parameter's update and state use: float32 for float16/bfloat16, because
    their 10/7-bit mantissas would round an update of lr*g away against a much larger p."""
    return np.dtype(np.float32) if dtype in HALF_TYPES else dtype


def _real(value, name, where):
    # bool is an int subclass; lr=True is a bug, not 1.0.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise InvalidTypeError(f"{where}{name} must be a real number, got {value!r} "
                               f"({type(value).__name__})")
    return float(value)


def _flag(value, name, where):
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidTypeError(f"{where}{name} must be True or False, got {value!r}")
    return bool(value)


def _names(names, limit=5):
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Optimizer:
    """Base class: parameter bookkeeping, gradient checks, state_dict / load_state_dict.

    Args:
        params (dict[str, array]): the parameters (NumPy or CuPy arrays), updated in place by
            :meth:`step`. Kept in insertion order as ``self.params`` (a new dict holding the
            same arrays).
        **hyper: the optimizer's hyper-parameters, kept as the mutable dict ``self.hyper``.
            They are re-read and re-checked at every step, so ``opt.hyper["lr"] = 0.01``
            between steps is how a learning-rate schedule works.

    Attributes:
        params (dict[str, array]): name -> parameter (the caller's arrays).
        hyper (dict): hyper-parameters, mutable between steps.
        state (dict[str, dict]): name -> per-parameter state (empty until its first step).

    Subclasses set ``_HYPER`` (hyper-parameter names), ``_STATE_KEYS`` (the keys of a
    non-empty per-parameter state; ``"step"`` is an int, the others arrays shaped like the
    parameter) and implement ``_update(name, p, g, h)``.
    """

    _HYPER = ()
    _STATE_KEYS = ()

    def __init__(self, params, **hyper):
        kind = type(self).__name__
        where = f"ringcoll {kind}: "
        if not isinstance(params, Mapping):
            raise InvalidTypeError(f"{where}params must be a dict name -> array, got "
                                   f"{type(params).__name__}; for a list use "
                                   "{str(i): p for i, p in enumerate(params)}")
        if not params:
            raise InvalidArgumentError(f"{where}params is empty; pass at least one parameter")
        seen = {}
        for name, p in params.items():
            if not isinstance(name, str):
                raise InvalidTypeError(f"{where}parameter name {name!r} is not a str; names "
                                       "are state_dict keys and must survive a JSON file")
            if not is_array(p):
                raise InvalidTypeError(f"{where}parameter {name!r} is a {type(p).__name__}, "
                                       "not a NumPy or CuPy array; the optimizer updates "
                                       "arrays in place, so pass the array itself")
            if not _is_float(p.dtype):
                raise InvalidTypeError(f"{where}parameter {name!r} has dtype {p.dtype}; use "
                                       "float16, bfloat16, float32 or float64")
            if not writeable(p):
                raise InvalidArgumentError(f"{where}parameter {name!r} is read-only; pass a "
                                           "writeable array (np.array(p) makes a copy)")
            if id(p) in seen:
                # Two names for one array would update it twice per step.
                raise InvalidArgumentError(f"{where}parameters {seen[id(p)]!r} and {name!r} "
                                           "are the same array; pass each array once")
            seen[id(p)] = name
        self.params = dict(params)
        self.hyper = dict(hyper)
        self._checked_hyper(self.hyper, where)
        self.state = {name: {} for name in self.params}
        # name -> {role: array}: per-parameter scratch, allocated on first use.
        self._scratch = {name: {} for name in self.params}

    def __repr__(self):
        hyper = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"{type(self).__name__}({len(self.params)} params, {hyper})"

    # -- hyper-parameters -------------------------------------------------------------------

    def _checked_hyper(self, hyper, where):
        """The hyper-parameters as plain Python floats/bools (tuples for pairs), after checking
        names and ranges. Python floats matter: a np.float64 lr would make NumPy compute a
        float32 update in float64 and allocate for it."""
        if not isinstance(hyper, Mapping):
            raise InvalidTypeError(f"{where}hyper must be a dict, got {type(hyper).__name__}")
        missing, unknown = set(self._HYPER) - set(hyper), set(hyper) - set(self._HYPER)
        if missing or unknown:
            raise InvalidArgumentError(
                f"{where}hyper-parameters " + (f"missing: {_names(missing)}; " if missing else "")
                + (f"unknown: {_names(unknown)}; " if unknown else "")
                + f"{type(self).__name__} takes exactly {', '.join(self._HYPER)}")
        return self._check_values(hyper, where)

    def _check_values(self, hyper, where):  # pragma: no cover - subclasses override
        raise NotImplementedError

    # -- step -------------------------------------------------------------------------------

    def step(self, grads):
        """Update every parameter named in ``grads`` in place, one step of the update rule.

        Args:
            grads (dict[str, array]): name -> gradient, shaped like the parameter and in its
                memory (NumPy for a NumPy parameter, CuPy on the parameter's GPU), any float
                dtype (cast to the parameter's compute dtype if it differs). Names left
                out are not updated and their state does not change. The gradients themselves
                are never modified.

        Raises:
            InvalidArgumentError: an unknown name or a gradient of the wrong shape, or a
                hyper-parameter out of range. Checked for every gradient before any parameter
                changes, so a bad call leaves everything as it was.
            InvalidTypeError: a gradient that is not a float array.
        """
        where = f"ringcoll {type(self).__name__}.step: "
        h = self._checked_hyper(self.hyper, where)
        if not isinstance(grads, Mapping):
            raise InvalidTypeError(f"{where}grads must be a dict name -> array, got "
                                   f"{type(grads).__name__}")
        todo = []
        for name, g in grads.items():
            p = self.params.get(name)
            if p is None:
                raise InvalidArgumentError(f"{where}gradient {name!r} names no parameter; the "
                                           f"parameters are {_names(self.params)}")
            if not (is_array(g) or isinstance(g, np.generic)):
                raise InvalidTypeError(f"{where}gradient {name!r} is a {type(g).__name__}; "
                                       "pass an array like the parameter (np.asarray(g), or "
                                       "cupy.asarray(g) for a GPU parameter)")
            if is_device(g) != is_device(p):
                raise InvalidTypeError(f"{where}gradient {name!r} is {memory_of(g)} but its "
                                       f"parameter is {memory_of(p)}; move it there first "
                                       "(cupy.asarray(g) or cupy.asnumpy(g)): the update "
                                       "runs where the parameter lives")
            if not _is_float(g.dtype):
                raise InvalidTypeError(f"{where}gradient {name!r} has dtype {g.dtype}; use a "
                                       "float dtype (float16, bfloat16, float32, float64)")
            if g.shape != p.shape:
                raise InvalidArgumentError(f"{where}gradient {name!r} has shape {g.shape} but "
                                           f"the parameter has shape {p.shape}")
            todo.append((name, p, g))
        for name, p, g in todo:
            xp = array_module(p)
            c = _compute_dtype(p.dtype)
            work = p
            if p.dtype != c:
                work = self._buffer(name, "param", p)
                xp.copyto(work, p, casting="unsafe")
            if g.dtype != c:
                cast = self._buffer(name, "grad", p)
                xp.copyto(cast, g, casting="unsafe")
                g = cast
            self._update(xp, name, work, g, h)
            if work is not p:
                xp.copyto(p, work, casting="unsafe")

    def _buffer(self, name, role, p):
        """Scratch array `role` for parameter `name`, in its compute dtype and memory, made
        once."""
        scratch = self._scratch[name]
        buf = scratch.get(role)
        if buf is None:
            buf = scratch[role] = array_module(p).empty(p.shape, _compute_dtype(p.dtype))
        return buf

    def _update(self, xp, name, p, g, h):  # pragma: no cover - subclasses override
        raise NotImplementedError

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self):
        """The optimizer as plain data: a checkpoint that needs no pickle.

        Returns:
            dict: ``{"type": "SGD" | "Adam", "hyper": {name: float | bool | [float, ...]},
            "state": {param name: {key: array | int}}}``. Every parameter has an entry
            (``{}`` until its first step). Arrays are copies in the compute dtype (float32 for
            float16/bfloat16 parameters), in the parameter's memory (CuPy arrays for GPU
            parameters, as torch's state_dict keeps CUDA tensors); nothing else but dict,
            list, str, int, float and bool appears, so ``np.savez`` for the arrays (brought to
            the host) plus JSON for the rest round-trips it.
        """
        where = f"ringcoll {type(self).__name__}.state_dict: "
        hyper = {k: list(v) if isinstance(v, tuple) else v
                 for k, v in self._checked_hyper(self.hyper, where).items()}
        state = {name: {k: v.copy() if is_array(v) else int(v)
                        for k, v in st.items()}
                 for name, st in self.state.items()}
        return {"type": type(self).__name__, "hyper": hyper, "state": state}

    def load_state_dict(self, state_dict):
        """Restore hyper-parameters and per-parameter state from :meth:`state_dict`'s output.

        Everything is checked before anything changes: the type, the hyper-parameter names and
        ranges, that the state names are exactly this optimizer's parameter names, and each
        array's shape. Arrays are copied (cast to the compute dtype) into the parameter's
        memory, never aliased, so the caller may reuse or mutate the dict afterwards; a
        checkpoint read from disk (NumPy) loads onto GPU parameters, and one saved from the GPU
        onto host parameters.

        Raises:
            InvalidArgumentError: a different optimizer type, missing or unknown names, a wrong
                shape, a bad step count or hyper-parameter.
            InvalidTypeError: something that is not a dict / array / int where one belongs.
        """
        hyper, loaded = self._checked_state_dict(state_dict, "load_state_dict")
        # Nothing raised: now change the optimizer.
        self.hyper = hyper
        for name, st in loaded.items():
            p = self.params[name]
            xp = array_module(p)
            old, new = self.state[name], {}
            for k, v in st.items():
                if not is_array(v):
                    new[k] = v
                    continue
                v = to_module(xp, v)
                if is_array(old.get(k)):
                    xp.copyto(old[k], v, casting="unsafe")  # keep the buffer, copy the values
                    new[k] = old[k]
                else:
                    new[k] = xp.array(v, dtype=_compute_dtype(p.dtype), copy=True)
            self.state[name] = new

    def check_state_dict(self, state_dict):
        """Raise what load_state_dict(state_dict) would raise, changing nothing (a
        distributed load checks every rank before any rank loads)."""
        self._checked_state_dict(state_dict, "check_state_dict")

    def _checked_state_dict(self, state_dict, method):
        kind = type(self).__name__
        where = f"ringcoll {kind}.{method}: "
        if not isinstance(state_dict, Mapping):
            raise InvalidTypeError(f"{where}expected the dict state_dict() returns, got "
                                   f"{type(state_dict).__name__}")
        keys = set(state_dict)
        if keys != {"type", "hyper", "state"}:
            raise InvalidArgumentError(f"{where}a state dict has exactly the keys 'type', "
                                       f"'hyper', 'state'; got {_names(keys)}")
        if state_dict["type"] != kind:
            raise InvalidArgumentError(f"{where}this state dict is for {state_dict['type']!r}, "
                                       f"not {kind!r}; load it into a {state_dict['type']}(...) "
                                       "optimizer")
        hyper = self._checked_hyper(state_dict["hyper"], where)
        state = state_dict["state"]
        if not isinstance(state, Mapping):
            raise InvalidTypeError(f"{where}'state' must be a dict param name -> dict, got "
                                   f"{type(state).__name__}")
        missing, unknown = set(self.params) - set(state), set(state) - set(self.params)
        if missing or unknown:
            raise InvalidArgumentError(
                f"{where}the state dict does not match this optimizer's parameters: "
                + (f"missing {_names(missing)}; " if missing else "")
                + (f"unexpected {_names(unknown)}; " if unknown else "")
                + "build the optimizer over the same parameter names the checkpoint was saved "
                "with")
        loaded = {name: self._checked_param_state(name, p, state[name], where)
                  for name, p in self.params.items()}
        return hyper, loaded

    def _checked_param_state(self, name, p, st, where):
        if not isinstance(st, Mapping):
            raise InvalidTypeError(f"{where}state of {name!r} must be a dict, got "
                                   f"{type(st).__name__}")
        if st and set(st) != set(self._STATE_KEYS):
            raise InvalidArgumentError(f"{where}state of {name!r} has keys {_names(st)}; a "
                                       f"{type(self).__name__} state is empty or has exactly "
                                       f"{', '.join(self._STATE_KEYS)}")
        out = {}
        for k, v in st.items():
            if k == "step":
                if isinstance(v, np.ndarray) and v.shape == ():
                    v = v[()]  # npz hands back 0-d arrays
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise InvalidTypeError(f"{where}state {name!r}/'step' must be an int, got "
                                           f"{v!r}")
                if v < 1:
                    raise InvalidArgumentError(f"{where}state {name!r}/'step' is {int(v)}; a "
                                               "saved state has taken at least one step")
                out[k] = int(v)
                continue
            if not is_array(v):
                raise InvalidTypeError(f"{where}state {name!r}/{k!r} is a {type(v).__name__}, "
                                       "not a NumPy or CuPy array")
            if not _is_float(v.dtype):
                raise InvalidTypeError(f"{where}state {name!r}/{k!r} has dtype {v.dtype}; "
                                       "expected a float array")
            if v.shape != p.shape:
                raise InvalidArgumentError(f"{where}state {name!r}/{k!r} has shape {v.shape} "
                                           f"but the parameter has shape {p.shape}; the "
                                           "checkpoint is for a different model")
            out[k] = v
        return out


class SGD(Optimizer):
    r"""Stochastic gradient descent with optional momentum, Nesterov and weight decay,
    with torch.optim.SGD's update rule.

    For each parameter p with gradient g, at step t (1-based, per parameter):

        g   <- g + weight_decay * p                          (if weight_decay != 0)
        buf <- g                                             (momentum != 0, first step)
        buf <- momentum * buf + (1 - dampening) * g          (momentum != 0, later steps)
        g   <- g + momentum * buf   if nesterov   else   buf (momentum != 0)
        p   <- p - lr * g

    State per parameter: ``momentum_buffer`` (only once momentum != 0 has been used), in the
    parameter's dtype, or float32 for float16/bfloat16 parameters (computed in float32 and
    rounded back to the parameter each step).

    Args:
        params (dict[str, array]): the parameters (NumPy or CuPy), updated in place.
        lr (float): learning rate, >= 0.
        momentum (float): momentum factor, >= 0. Default 0 (plain SGD, no state).
        dampening (float): dampening of the gradient entering the momentum buffer. Default 0.
        nesterov (bool): Nesterov momentum; needs momentum > 0 and dampening == 0.
        weight_decay (float): L2 penalty, >= 0. Default 0.

    Example::

        >>> import numpy as np
        >>> from ringcoll.optim import SGD
        >>> w = np.array([1.0, 2.0])
        >>> opt = SGD({"w": w}, lr=0.1, momentum=0.9)
        >>> opt.step({"w": np.array([1.0, -1.0])})   # buf = g
        >>> w
        array([0.9, 2.1])
        >>> opt.step({"w": np.array([1.0, -1.0])})   # buf = 0.9 * buf + g = 1.9 * g
        >>> w
        array([0.71, 2.29])
    """

    _HYPER = ("lr", "momentum", "dampening", "nesterov", "weight_decay")
    _STATE_KEYS = ("momentum_buffer",)

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, nesterov=False,
                 weight_decay=0.0):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         nesterov=nesterov, weight_decay=weight_decay)

    def _check_values(self, hyper, where):
        h = {k: _real(hyper[k], k, where) for k in ("lr", "momentum", "dampening",
                                                     "weight_decay")}
        h["nesterov"] = _flag(hyper["nesterov"], "nesterov", where)
        for k in ("lr", "momentum", "weight_decay"):
            if not h[k] >= 0.0 or math.isinf(h[k]):  # `not >=` also catches NaN
                raise InvalidArgumentError(f"{where}{k} = {h[k]!r}; it must be a finite "
                                           "number >= 0")
        if not math.isfinite(h["dampening"]):
            raise InvalidArgumentError(f"{where}dampening = {h['dampening']!r}; it must be "
                                       "finite")
        if h["nesterov"] and (h["momentum"] <= 0.0 or h["dampening"] != 0.0):
            raise InvalidArgumentError(f"{where}Nesterov momentum requires momentum > 0 and "
                                       f"dampening = 0 (got momentum={h['momentum']}, "
                                       f"dampening={h['dampening']}); set nesterov=False or "
                                       "change them")
        return h

    def _update(self, xp, name, p, g, h):
        lr, momentum, dampening = h["lr"], h["momentum"], h["dampening"]
        wd = h["weight_decay"]
        tmp = self._buffer(name, "tmp", p)
        if wd != 0.0:
            # g + wd * p goes to scratch: the caller's gradient is never written.
            xp.multiply(p, wd, out=tmp)
            g = xp.add(g, tmp, out=self._buffer(name, "grad", p))
        if momentum != 0.0:
            st = self.state[name]
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = st["momentum_buffer"] = xp.array(g, dtype=_compute_dtype(p.dtype))
            else:
                xp.multiply(buf, momentum, out=buf)
                if dampening != 0.0:
                    xp.multiply(g, 1.0 - dampening, out=tmp)
                    xp.add(buf, tmp, out=buf)
                else:
                    xp.add(buf, g, out=buf)
            if h["nesterov"]:
                xp.multiply(buf, momentum, out=tmp)
                g = xp.add(g, tmp, out=self._buffer(name, "grad", p))
            else:
                g = buf
        xp.multiply(g, lr, out=tmp)
        xp.subtract(p, tmp, out=p)


class Adam(Optimizer):
    r"""Adam (torch.optim.Adam), or AdamW (torch.optim.AdamW) with ``decoupled=True``.

    For each parameter p with gradient g, at its step t = 1, 2, ... (b1, b2 = betas):

        p   <- p * (1 - lr * weight_decay)                   (decoupled: AdamW)
        g   <- g + weight_decay * p                          (not decoupled: L2, Adam)
        m   <- m + (1 - b1) * (g - m)                        (= b1 m + (1 - b1) g, torch's lerp)
        v   <- b2 * v + (1 - b2) * g * g
        p   <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    m and v start at zero. State per parameter: ``exp_avg`` (m), ``exp_avg_sq`` (v) and the
    int ``step`` (t), each parameter counting its own steps, so one skipped in a step (no
    gradient) keeps its t. m and v have the parameter's dtype; for float16/bfloat16 parameters
    they are float32, the whole update is computed in float32 and the result rounded back to
    the parameter once per step (v would underflow in float16: g^2 below 6e-8 is zero).

    Args:
        params (dict[str, array]): the parameters (NumPy or CuPy), updated in place.
        lr (float): learning rate, >= 0. Default 1e-3.
        betas (tuple[float, float]): decay rates of m and v, each in [0, 1).
        eps (float): added to the denominator, >= 0. Default 1e-8.
        weight_decay (float): >= 0. Default 0. An L2 term in the gradient (Adam), or, with
            ``decoupled=True``, a shrink of p before the update (AdamW; torch's AdamW default
            weight_decay is 1e-2, pass it explicitly).
        decoupled (bool): AdamW's decoupled weight decay. Default False.

    Example::

        >>> import numpy as np
        >>> from ringcoll.optim import Adam
        >>> w = np.array([1.0, 2.0])
        >>> opt = Adam({"w": w}, lr=0.1)
        >>> opt.step({"w": np.array([3.0, -0.5])})   # step 1 moves each entry by ~lr
        >>> w.round(6)
        array([0.9, 2.1])
        >>> opt.state["w"]["step"]
        1
    """

    _HYPER = ("lr", "betas", "eps", "weight_decay", "decoupled")
    _STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled=decoupled)

    def _check_values(self, hyper, where):
        h = {k: _real(hyper[k], k, where) for k in ("lr", "eps", "weight_decay")}
        h["decoupled"] = _flag(hyper["decoupled"], "decoupled", where)
        for k in ("lr", "eps", "weight_decay"):
            if not h[k] >= 0.0 or math.isinf(h[k]):  # `not >=` also catches NaN
                raise InvalidArgumentError(f"{where}{k} = {h[k]!r}; it must be a finite "
                                           "number >= 0")
        betas = hyper["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidArgumentError(f"{where}betas = {betas!r}; pass a pair (b1, b2), "
                                       "e.g. (0.9, 0.999)")
        h["betas"] = tuple(_real(b, f"betas[{i}]", where) for i, b in enumerate(betas))
        for i, b in enumerate(h["betas"]):
            if not 0.0 <= b < 1.0:
                raise InvalidArgumentError(f"{where}betas[{i}] = {b!r}; each beta must be in "
                                           "[0, 1)")
        return h

    def _update(self, xp, name, p, g, h):
        lr, (b1, b2), eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
        st = self.state[name]
        if not st:
            c = _compute_dtype(p.dtype)
            st.update(step=0, exp_avg=xp.zeros(p.shape, c), exp_avg_sq=xp.zeros(p.shape, c))
        st["step"] += 1
        t, m, v = st["step"], st["exp_avg"], st["exp_avg_sq"]
        tmp = self._buffer(name, "tmp", p)
        if wd != 0.0:
            if h["decoupled"]:
                xp.multiply(p, 1.0 - lr * wd, out=p)
            else:
                xp.multiply(p, wd, out=tmp)
                g = xp.add(g, tmp, out=self._buffer(name, "grad", p))
        xp.subtract(g, m, out=tmp)
        xp.multiply(tmp, 1.0 - b1, out=tmp)
        xp.add(m, tmp, out=m)
        xp.multiply(v, b2, out=v)
        # (1 - b2) * g * g, left to right as torch's addcmul evaluates it.
        xp.multiply(g, 1.0 - b2, out=tmp)
        xp.multiply(tmp, g, out=tmp)
        xp.add(v, tmp, out=v)
        step_size = lr / (1.0 - b1 ** t)
        xp.sqrt(v, out=tmp)
        xp.divide(tmp, math.sqrt(1.0 - b2 ** t), out=tmp)
        xp.add(tmp, eps, out=tmp)  # tmp = denominator
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, step_size, out=tmp)
        xp.subtract(p, tmp, out=p)
