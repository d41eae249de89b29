"""What one rank holds: its parameters (each a block of a global tensor), its optimizer's
state (blocks shaped like the parameters) and its DistributedOptimizer's own state (private
to the rank), as a list of (key, array, start) with global shapes; shared by save and load.

Keys name a tensor of the whole model, the same on every rank that holds a block of it:
    param/<name>              a parameter
    state/<name>/<key>        its optimizer state (momentum_buffer, exp_avg, ...)
    rank/<r>/<bucket>/<key>   rank r's DistributedOptimizer state (top-k residual,
                              gradients accumulated over backward passes): held by r only
"""

from collections.abc import Mapping
from contextlib import contextmanager

import numpy as np

from ..arrays import is_array, to_module
from ..communicator import Communicator
from ..distributed import DistributedOptimizer
from ..errors import CheckpointError
from .layout import Shard, dtype_name


def invalid(where, message):
    return CheckpointError(f"{where}{message}", problem="invalid")


@contextmanager
def world(comm, mesh):
    """The communicator of every rank: comm, else mesh.comm, else a new one over
    MPI.COMM_WORLD (closed again at the end)."""
    if comm is not None or mesh is not None:
        yield comm if comm is not None else mesh.comm
        return
    comm = Communicator()
    try:
        yield comm
    finally:
        comm.close()


def split_optimizer(optimizer):
    """(the optimizer with state_dict, the DistributedOptimizer around it or None)."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.optimizer, optimizer
    return optimizer, None


def targets(params, shards, where):
    """[(name, array, Shard)] for params, each checked: a dict of numeric NumPy (or CuPy)
    arrays, and `shards` (name -> Shard, or (global shape, start)) naming blocks that fit."""
    if not isinstance(params, Mapping):
        raise invalid(where, f"params must be a dict name -> array, got "
                             f"{type(params).__name__}")
    shards = {} if shards is None else shards
    if not isinstance(shards, Mapping):
        raise invalid(where, f"shards must be a dict name -> ringcoll.checkpoint.Shard, got "
                             f"{type(shards).__name__}")
    unknown = [n for n in shards if n not in params]
    if unknown:
        raise invalid(where, f"shards names {unknown}, which are not in params")
    out = []
    for name, p in params.items():
        if not isinstance(name, str):
            raise invalid(where, f"parameter names must be str, got {name!r}")
        if not is_array(p):
            raise invalid(where, f"parameter {name!r} is a {type(p).__name__}, not a NumPy "
                                 "or CuPy array")
        try:
            dtype_name(p.dtype)
        except ValueError as exc:
            raise invalid(where, f"parameter {name!r}: {exc}") from None
        spec = shards.get(name)
        if spec is None:
            spec = Shard(p.shape, (0,) * p.ndim)
        try:
            spec = Shard(tuple(int(n) for n in spec[0]), tuple(int(i) for i in spec[1]))
        except (TypeError, ValueError, IndexError):
            raise invalid(where, f"shards[{name!r}] must be a Shard(shape, start) (or "
                                 f"ringcoll.checkpoint.shard(shape, index)), got {spec!r}")
        if (len(spec.shape) != p.ndim or len(spec.start) != p.ndim
                or any(s < 0 or s + n > g for s, n, g in zip(spec.start, p.shape, spec.shape))):
            raise invalid(where, f"parameter {name!r} of shape {p.shape} does not fit at "
                                 f"{spec.start} in a global tensor of shape {spec.shape}")
        out.append((name, p, spec))
    return out


def holdings(rank, params, shards, optimizer, where):
    """(held, meta): held is [(key, array, Shard)] of everything this rank saves; meta the
    JSON-able rest (the optimizer's type, hyper-parameters and step counts; the wrapper's
    counters)."""
    inner, wrapper = split_optimizer(optimizer)
    mine = targets(params, shards, where)
    # what is written is host memory: GPU arrays are copied to the host here, once
    held = [(f"param/{name}", to_module(np, p), spec) for name, p, spec in mine]
    meta = {"optimizer": None, "wrapper": None}
    if inner is not None:
        if not hasattr(inner, "state_dict") or not hasattr(inner, "params"):
            raise invalid(where, f"optimizer must be a ringcoll.optim optimizer or a "
                                 f"DistributedOptimizer, got {type(inner).__name__}")
        if set(inner.params) != set(params) or any(
                inner.params[n] is not params[n] for n in params):
            raise invalid(where, "the optimizer's parameters are not params (pass the dict "
                                 "the optimizer was built over, or opt.params)")
        sd = inner.state_dict()
        per_param = {}
        for name, p, spec in mine:
            st = sd["state"].get(name, {})
            per_param[name] = {"scalars": {k: v for k, v in st.items() if not is_array(v)},
                               "arrays": sorted(k for k, v in st.items() if is_array(v))}
            held += [(f"state/{name}/{k}", to_module(np, st[k]), spec)
                     for k in per_param[name]["arrays"]]
        meta["optimizer"] = {"type": sd["type"], "hyper": sd["hyper"], "params": per_param}
    if wrapper is not None:
        try:
            state = wrapper.wrapper_state_dict()
        except ValueError as exc:
            raise invalid(where, str(exc)) from None
        arrays = state.pop("arrays")
        meta["wrapper"] = {**state, "arrays": sorted(arrays)}
        held += [(f"rank/{rank}/{key}", to_module(np, a), Shard(a.shape, (0,) * a.ndim))
                 for key, a in sorted(arrays.items())]
    return held, meta
