"""Scan: the inclusive prefix reduction, rank r gets op(x_0, ..., x_r).

Elementwise like allreduce (x of the same shape, dtype and layout on every rank; out=x in
place). The ringcoll algorithm is recursive doubling (algorithms/scan.py: ceil(log2 p)
exchanges of the whole x); "native" is MPI_Scan (MPI_Exscan, rank 0 receiving into scratch so
that its out stays as it was). exscan.py is the exclusive form and shares build() below.
"""

from ..algorithms import COLLECTIVE_ALGORITHMS, native
from ..algorithms import scan as prefix
from ..errors import InvalidArgumentError
from ..ops import get_op
from ..runner import Plan
from . import _args

NAME = "scan"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 2)


def plan(g, ctx, x, op, out, algorithm):
    return build(g, ctx, NAME, x, op, out, algorithm, exclusive=False)


def build(g, ctx, name, x, op, out, algorithm, exclusive):
    """The Plan of scan (exclusive=False) or exscan (True) under the collective name `name`."""
    if get_op(op, ctx).name == "avg":  # before the dtype check: avg is refused for every dtype
        count = "comm.rank" if exclusive else "comm.rank + 1"  # the ranks a result covers
        raise InvalidArgumentError(
            f"{ctx}op 'avg' has no prefix meaning: each rank's result covers a different "
            f"number of ranks; use op='sum' and divide the result by {count}")
    given, given_out = x, out
    x, op, combine, side = _args.reduction(g, x, op, ctx)
    algo = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side, (name, x.nbytes, x.dtype))
    t, ws = side.t, side.ws
    if algo == "native":
        native.check(t, x.dtype, ctx)
        if not hasattr(t, "native_" + name):
            raise InvalidArgumentError(f"{ctx}algorithm 'native' needs MPI_{name.title()}, "
                                       "which this transport does not have; use "
                                       "'recursive_doubling'")
    gets_none = exclusive and g.rank == 0  # MPI leaves it undefined: we leave out as it was
    copy_out = None
    if gets_none and out is None:
        src, dst = _args.send_view(x, side), None  # nothing to allocate: it is never written
    else:  # out checked on every rank alike, exscan's rank 0 included
        out, src, dst, copy_out = _args.elementwise(x, out, ctx, side)

    def run():
        if algo != "native":
            prefix.scan(t, src, dst, combine, ws, exclusive)
        elif not exclusive:
            t.native_scan(src, dst, op.mpi_name)
        else:  # MPI_Exscan leaves rank 0's receive buffer undefined: never the caller's there
            into = ws.scratch("exscan.rank0", src.size, src.dtype) if gets_none else dst
            t.native_exscan(src, into, op.mpi_name)
        if gets_none:
            return None
        if copy_out is not None:
            copy_out()
        return out

    # a repeat needs src to be x itself (not a copy) and the result to be the caller's out
    repeatable = x is given and _args.flat_view(x) is not None and (given_out is not None or gets_none)
    fields = _args.fields(g, side, op, x)
    if algo == "native" and copy_out is None:  # MPI's call is all of it
        into = ws.scratch("exscan.rank0", src.size, src.dtype) if gets_none else dst
        bound = native.bind(t, "native_" + name, src, into, op.mpi_name)
        return Plan(name, algo, fields, _args.on_side(bound, side), repeatable=repeatable,
                    result=None if gets_none else out)
    return Plan(name, algo, fields, _args.on_side(run, side), repeatable=repeatable)
