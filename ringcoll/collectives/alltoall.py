"""All-to-all: rank i sends block j of x (axis 0 in size equal blocks) to rank j.

The ringcoll algorithm is the pairwise exchange (algorithms/alltoall.py: p-1 steps, at step s
rank r sends block r+s to rank r+s and receives from r-s: (p-1) a + (p-1)/p n b); "native"
is MPI_Alltoall.
"""

from ..algorithms import alltoall as pairwise
from ..algorithms import COLLECTIVE_ALGORITHMS, native
from ..errors import InvalidArgumentError
from ..runner import Plan
from . import _args

NAME = "alltoall"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 1)


def plan(g, ctx, x, out, algorithm):
    given, given_out = x, out
    x, side = _args.rows_input(g, x, ctx, movable=True)
    if x.shape[0] % g.size:
        raise InvalidArgumentError(
            f"{ctx}x.shape[0] = {x.shape[0]} must be a multiple of the communicator size "
            f"{g.size} (one equal block per rank)")
    aliased = out is not None and side.xp.may_share_memory(x, out)  # MPI forbids: ours then
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side,
                             None if aliased else (NAME, x.nbytes, None))
    out = _args.output(out, x.shape, x.dtype, ctx, side, rows=True)
    src, (dst, copy_to) = x.reshape(-1), _args.rows_target(out)
    src, dst = _args.raw(src), _args.raw(dst)  # raw: a struct's padding travels too
    part = side.ws.row_partition(x.shape[0], g.size, _args.row_elems(x))
    if name == "native":
        native.check(side.t, None, ctx)

    def run():
        if name == "native":
            side.t.native_alltoall(src, dst)
        else:
            pairwise.alltoall(side.t, src, dst, part)
        _args.copy_rows(dst, copy_to)
        return out

    fields, repeatable = _args.fields(g, side, x=x), x is given and given_out is not None
    if name == "native" and copy_to is None:  # MPI's call is all of it
        return Plan(NAME, name, fields,
                    _args.on_side(native.bind(side.t, "native_alltoall", src, dst), side),
                    repeatable=repeatable, result=out)
    return Plan(NAME, name, fields, _args.on_side(run, side), repeatable=repeatable)
