"""All-reduce: its argument checks, auto's algorithm choice, and its plan as a list of steps.

The plan is a list of zero-argument steps (recursive doubling, Rabenseifner and Bruck are
fully unrolled into bound sends and receives; the others are one step each). With out= the
list is kept as a Replay, so a repeated identical call runs it again with no checks at all
(the runner's replay). The ring's last reduction step also divides for 'avg' (one pass over
n/p, not a later one over n).
"""

from functools import partial

import numpy as np

from .. import checks
from ..algorithms import (ALLREDUCE, ALLREDUCE_NAMES, bruck, hierarchical, native, node,
                          rabenseifner, recursive_doubling, ring)
from ..errors import InvalidArgumentError
from ..runner import Plan, Replay, run_steps
from . import _args

NAME = "allreduce"
ALGORITHMS = tuple(n for n in ALLREDUCE_NAMES if n != "auto")  # auto: see auto()

#: all-reduce algorithms built as a list of steps that a repeated call replays
SCHEDULES = {"recursive_doubling": recursive_doubling.schedule,
             "rabenseifner": rabenseifner.schedule, "bruck": bruck.schedule}


def plan(g, ctx, x, op, algorithm, out):
    """The Plan of allreduce(x, op, algorithm, out), checked."""
    given, given_op = x, op  # a repeated call is recognised by these very objects
    x, op, combine, side = _args.reduction(g, x, op, ctx)
    out, src, dst, copy_out = _args.elementwise(x, out, ctx, side)
    name = pick(g, algorithm, dst.nbytes, ctx, inplace=src is dst, side=side)
    if name == "native":
        native.check(side.t, dst.dtype, ctx)
    fields = _args.fields(g, side, op, x, in_place=src is dst)
    steps = build_steps(g, name, op, combine, src, dst, side)
    if copy_out is not None:
        steps.append(copy_out)
    schedule = [getattr(s, "at", None) for s in steps]
    p = Plan(NAME, name, fields, _args.on_side(partial(run_steps, steps, out), side), schedule)
    if out is not None and (isinstance(given, np.ndarray) or side.device is not None):
        # replayed as is on the caller's thread, on its current stream
        p.replay = Replay(given, out, given_op, algorithm, steps, p)
    return p


def build_steps(g, name, op, combine, src, dst, side):
    """The checked call as a list of zero-argument steps (see the module doc)."""
    t, ws, size = side.t, side.ws, g.size
    fused = name == "ring" and op.name == "avg" and op.fuses_finish(dst.dtype, size)
    steps = []
    if name in ("ring", "hierarchical"):  # segments can hide a count mismatch: check it
        steps.append(checks.bind_neighbour_check(t, "allreduce", dst.size, dst.dtype, op.name))
    if name == "native":
        steps.append(native.bind_allreduce(t, src, dst, op.mpi_name))
    else:
        if op.prescales(dst.dtype, size):  # avg of float16/bfloat16: src / p into dst
            steps.append(partial(op.start, src, dst, size, combine))
            src = dst
        if name in SCHEDULES:
            steps += SCHEDULES[name](t, src, dst, combine, ws)
        elif name == "hierarchical":
            inner = ALLREDUCE[pick_inner(g, dst.nbytes)]
            steps.append(partial(hierarchical.allreduce, t, src, dst, combine, ws,
                                 g.nodes, inner))
        elif fused:
            steps.append(partial(ring.allreduce, t, src, dst, combine, ws,
                                 combine.final(size)))
        else:
            steps.append(partial(ALLREDUCE[name], t, src, dst, combine, ws))
    if op.name == "avg" and size > 1 and dst.size and not fused:
        steps.append(partial(op.finish, dst, size, combine))
    return steps


def pick(g, algorithm, nbytes, ctx, inplace=False, side=None):
    """The algorithm a call runs: its own, else the communicator's; auto resolved."""
    name = algorithm or g.options.algorithm
    if name not in ALLREDUCE_NAMES:
        raise InvalidArgumentError(
            f"{ctx}unknown algorithm {name!r}; choose one of {ALLREDUCE_NAMES}")
    if name == "auto":
        if side is not None and side.device is not None and g.size > 1 \
                and tier_possible(g, side):
            # GPU buffers: the tier moves them device to device (CUDA IPC), where every
            # message would cross PCIe twice and the host's MPI once (measured 28-80x)
            return "node"
        name = auto(g, nbytes, inplace)
    return name


def tier_possible(g, side):
    """May the node tier run on side's buffers: every rank on one node, the tier switched on
    and a transport with shared memory (it still falls back to the ring inside if the memory
    cannot be had, e.g. an MPI library without shared windows). The same on every rank."""
    return len(g.nodes) == 1 and node.available(side.t, side.ws)


def auto(g, nbytes, inplace=False):
    """auto's pick for nbytes (Communicator.auto_algorithm documents it), cached."""
    key = (nbytes, inplace)
    name = g.choices.get(key)
    if name is None:
        measured = (g.tuning.choose(nbytes, g.size, g.nodes, inplace)
                    if g.tuning is not None else None)
        if measured == "node" and not tier_possible(g, g.host):
            measured = None  # a table measured over MPI, used where the tier cannot run
        name = g.choices.put(key, measured or g.cost_model.choose_allreduce(
            nbytes, g.size, g.nodes, tier=tier_possible(g, g.host)))
    return name


def pick_inner(g, nbytes):
    """The cross-node algorithm of hierarchical, for a shard of nbytes / local size."""
    key = ("inner", nbytes)
    name = g.choices.get(key)
    if name is None:
        name = g.choices.put(key, g.cost_model.cross_node(nbytes, g.nodes)[0])
    return name
