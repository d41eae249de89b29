"""Gather: every rank's x concatenated along axis 0, on root only (None elsewhere).

Ranks may pass different lengths on axis 0, as in allgather: the row counts (and a check
that dtypes, trailing shapes, root's out= and counts= agree) travel first, in allgather's
small exchange of a few numbers per rank (allgather.Rows), so that every rank raises alike
when they do not; under auto they go by MPI's own all-gather where the transport has it, and
the small rows of a repeated call ride with them (then there is no second step). The data
then goes up the binomial tree (algorithms/tree.py gather: broadcast's shape with the data
flowing towards the root): ceil(log2 p) a + (p-1)/p n b at the root for n gathered bytes,
plus the counts' exchange, (p-1) a by ringcoll's ring."""

from ..algorithms import COLLECTIVE_ALGORITHMS, tree
from ..runner import Plan
from . import _args
from .allgather import Rows, Target, expected_counts

NAME = "gather"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 2)


def plan(g, ctx, x, root, out, algorithm, counts=None):
    given = x
    x, side = _args.rows_input(g, x, ctx, movable=True)
    _args.check_root(g, root, ctx)
    _args.pick_simple(algorithm, ALGORITHMS, ctx)
    is_root = g.rank == root
    expect = expected_counts(g, counts, ctx) if is_root else None  # as MPI's recvcounts
    out = out if is_root else None  # as MPI's recvbuf, out matters on root only
    if out is not None:  # all but its row count can be checked now; that comes later
        rows_out = out.shape[0] if getattr(out, "ndim", 0) else -1
        _args.output(out, (rows_out,) + x.shape[1:], x.dtype, ctx, side, rows=True)
    src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
    # the counts (and small rows with them) by MPI's own all-gather under auto where the
    # transport has it: one C call instead of a Python ring (explicit 'tree': ringcoll's ring)
    mpi = algorithm in (None, "auto") and hasattr(g.t, "native_allgather")
    exchange = Rows(g, x, out, "native" if mpi else "ring", collective=NAME, expect=expect,
                    src=src)
    target = Target(out, x, ctx, side, wanted=is_root)

    def run():
        counts, carried = exchange()  # host numbers
        part, result, dst, copy_to = target(counts)
        if not carried:
            tree.gather(side.t, src, dst, part, root, side.ws)
        elif is_root:  # every rank's rows came with the counts (small rows, repeated)
            exchange.unpack(dst)
        _args.copy_rows(dst, copy_to)
        return result

    # axis 0 may differ between ranks: the fingerprint leaves it out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]),
                          root=int(root))
    return Plan(NAME, "tree", fields, _args.on_side(run, side),
                repeatable=x is given and (out is not None or not is_root))
