"""Barrier: return only once every rank has entered it.

The ringcoll algorithm is dissemination (algorithms/barrier.py: ceil(log2 p) rounds, at
round k rank r signals r + 2^k and waits for r - 2^k, ceil(log2 p) a); "native" is
MPI_Barrier.
"""

from functools import partial

from ..algorithms import barrier as dissemination
from ..algorithms import COLLECTIVE_ALGORITHMS, native
from ..runner import Plan
from . import _args

NAME = "barrier"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = ()


def plan(g, ctx, algorithm):
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, None, (NAME, 0, None))
    if name == "native":  # MPI's call is all of it
        native.check(g.t, None, ctx)
        return Plan(NAME, name, _args.fields(g, None), native.bind(g.t, "native_barrier"),
                    repeatable=True, result=None)
    return Plan(NAME, name, _args.fields(g, None),
                partial(dissemination.barrier, g.t, g.host.ws), repeatable=True)
