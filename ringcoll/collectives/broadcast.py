"""Broadcast: copy root's x into x on every rank, in place.

The ringcoll algorithm is the binomial tree (algorithms/tree.py: ceil(log2 p) rounds, each
rank receiving once, ceil(log2 p)(a + n b) on the root's critical path); "node" the node
tier's (algorithms/node.py: the root copies its bytes into shared memory chunk by chunk and
every other rank copies them out, pipelined; the default for CuPy arrays on one node);
"native" is MPI_Bcast.
"""

import numpy as np

from ..algorithms import COLLECTIVE_ALGORITHMS, native, node, tree
from ..arrays import check_movable, flat_view, is_device, writeable
from ..errors import InvalidArgumentError, InvalidTypeError
from ..runner import Plan
from . import _args

NAME = "broadcast"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0,)


def plan(g, ctx, x, root, algorithm):
    if isinstance(x, np.ndarray):
        side = g.host
    elif is_device(x):
        side = g.sides.device(x, ctx)
    else:
        raise InvalidTypeError(f"{ctx}broadcast works in place and needs a NumPy (or CuPy) "
                               f"array, got {type(x).__name__}")
    check_movable(x.dtype, ctx)  # any fixed-size dtype: broadcast only copies bytes
    _args.check_root(g, root, ctx)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side, (NAME, x.nbytes, None))
    buf = flat_view(x)
    if buf is None:
        raise InvalidArgumentError(f"{ctx}x is not contiguous; broadcast into "
                                   "np.ascontiguousarray(x) and copy back")
    if g.rank != root and not writeable(x):
        raise InvalidArgumentError(f"{ctx}x is read-only; broadcast needs to write into it")
    fields = _args.fields(g, side, x=x, root=int(root))
    if name == "native":  # MPI's call is all of it
        native.check(side.t, None, ctx)
        return Plan(NAME, name, fields,
                    _args.on_side(native.bind(side.t, "native_bcast", buf, root), side),
                    repeatable=True, result=x)

    def run():
        (node if name == "node" else tree).broadcast(side.t, buf, root, side.ws)
        return x

    return Plan(NAME, name, fields, _args.on_side(run, side), repeatable=True)  # x, in place
