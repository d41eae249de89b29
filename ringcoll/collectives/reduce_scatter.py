"""Reduce-scatter: reduce x over all ranks, rank r keeps the r-th axis-0 block of the result.

Blocks are counts[r] rows for rank r when counts is given (MPI_Reduce_scatter's recvcounts:
the same list on every rank), else they follow np.array_split(x, size) (the first
x.shape[0] % size get one more row). The
ringcoll algorithm is the ring's reduce-scatter half (algorithms/ring.py: (p-1) steps of one
block each, (p-1)a + (p-1)/p n b + (p-1)/p n g); "node" is the node tier's (algorithms/node.py:
each rank reduces its block straight from every rank's shared memory; the default for CuPy
arrays on one node); "native" is MPI_Reduce_scatter.
"""

from .. import checks
from ..algorithms import COLLECTIVE_ALGORITHMS, native, node, ring
from ..arrays import Partition
from ..runner import Plan
from . import _args

NAME = "reduce_scatter"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 2)


def plan(g, ctx, x, op, out, algorithm, counts=None):
    given, given_out = x, out
    x, op, combine, side = _args.reduction(g, x, op, ctx)
    t, ws, size = side.t, side.ws, g.size
    x = _args.as_rows(x)
    aliased = out is not None and side.xp.may_share_memory(x, out)  # MPI forbids: ours then
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side,
                             None if aliased else (NAME, x.nbytes, x.dtype))
    row = _args.row_elems(x)
    if counts is None:
        part = ws.row_partition(x.shape[0], size, row)
        base, extra = divmod(x.shape[0], size)
        rows = base + (1 if g.rank < extra else 0)
    else:
        counts = _args.counts(counts, size, ctx, total=x.shape[0])
        part = ws.cached(("rows_by", tuple(counts), row),
                         lambda: Partition([c * row for c in counts]))
        rows = counts[g.rank]
    out = _args.output(out, (rows,) + x.shape[1:], x.dtype, ctx, side, rows=True)
    src, (dst, copy_to) = x.reshape(-1), _args.rows_target(out)
    if name == "native":
        native.check(t, x.dtype, ctx)
    # uneven blocks the caller chose travel in the neighbour check (None: the default split)
    blocks = (None if counts is None or counts == Partition.even(x.shape[0], size).counts
              else counts)
    neighbour_check = checks.bind_neighbour_check(t, "reduce_scatter", src.size, src.dtype,
                                                  op.name, blocks)
    # avg: the division in the last ring step
    fused = op.name == "avg" and name == "ring" and op.fuses_finish(x.dtype, size)

    def run():
        if name == "native":
            t.native_reduce_scatter(src, dst, part.counts, op.mpi_name)
        elif name == "node":  # (its header check stands in for the neighbour check)
            prescales = op.prescales(src.dtype, size)
            work = ws.scratch("rs.work", src.size if prescales else 0, src.dtype)
            mine = op.start(src, work, size, combine)  # work itself if avg prescales
            node.reduce_scatter(t, mine, dst, part, combine, ws)
        else:
            neighbour_check()
            # The last step reduces straight into dst; work carries the partial sums of
            # the other blocks, of which there are none at p = 2 (unless avg prescales).
            prescales = op.prescales(src.dtype, size)
            work = ws.scratch("rs.work", src.size if size > 2 or prescales else 0, src.dtype)
            mine = op.start(src, work, size, combine)  # work itself if avg prescales
            ring.reduce_scatter(t, mine, work, part, combine, ws, result=dst,
                                final=combine.final(size) if fused else None)
        if not fused:
            op.finish(dst, size, combine)
        _args.copy_rows(dst, copy_to)
        return out

    # debug mode compares the counts too; counts equal to the default split are the default
    more = {"counts": _args.counts_field(blocks)} if g.options.debug and blocks else {}
    fields, repeatable = _args.fields(g, side, op, x, **more), x is given and given_out is not None
    if name == "native" and op.name != "avg" and copy_to is None:  # MPI's call is all of it
        bound = native.bind(t, "native_reduce_scatter", src, dst, part.counts, op.mpi_name)
        return Plan(NAME, name, fields, _args.on_side(bound, side), repeatable=repeatable,
                    result=out)
    return Plan(NAME, name, fields, _args.on_side(run, side), repeatable=repeatable)
