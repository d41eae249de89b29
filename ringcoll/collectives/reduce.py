"""Reduce: reduce x over all ranks onto root (the result on root, None elsewhere).

The ringcoll algorithm is the binomial tree (algorithms/tree.py: broadcast's shape run
backwards, each rank combining what its children send, ceil(log2 p)(a + n b + n g) on the
root's critical path); "native" is MPI_Reduce.
"""

from ..algorithms import COLLECTIVE_ALGORITHMS, native, tree
from ..runner import Plan
from . import _args

NAME = "reduce"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 3)


def plan(g, ctx, x, op, root, out, algorithm):
    given, given_out = x, out
    x, op, combine, side = _args.reduction(g, x, op, ctx)
    t, ws, size = side.t, side.ws, g.size
    _args.check_root(g, root, ctx)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side, (NAME, x.nbytes, x.dtype))
    is_root = g.rank == root
    copy_out = None
    if is_root:
        out, src, dst, copy_out = _args.elementwise(x, out, ctx, side)
    else:
        src, dst = _args.send_view(x, side), None
    if name == "native":
        native.check(t, x.dtype, ctx)

    def run():
        if name == "native":
            t.native_reduce(src, dst, root, op.mpi_name)
        else:
            acc = dst if is_root else ws.scratch("reduce.acc", src.size, src.dtype)
            mine = op.start(src, acc, size, combine)  # acc itself if avg prescales
            tree.reduce(t, mine, acc, root, combine, ws)
        if not is_root:
            return None
        op.finish(dst, size, combine)
        if copy_out is not None:
            copy_out()
        return out

    # a repeat needs src to be x itself (not a copy) and root's result to be the caller's out
    repeatable = x is given and _args.flat_view(x) is not None and (not is_root or given_out is not None)
    fields = _args.fields(g, side, op, x, root=int(root))
    if name == "native" and op.name != "avg" and copy_out is None:  # MPI's call is all of it
        bound = native.bind(t, "native_reduce", src, dst, root, op.mpi_name)
        return Plan(NAME, name, fields, _args.on_side(bound, side), repeatable=repeatable,
                    result=out if is_root else None)
    return Plan(NAME, name, fields, _args.on_side(run, side), repeatable=repeatable)
