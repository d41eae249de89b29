"""Gather: every rank's x concatenated along axis 0, on root only (None elsewhere).

Ranks may pass different lengths on axis 0, as in allgather: the row counts (and a check
that dtypes, trailing shapes, root's out= and counts= agree) travel first, in allgather's
small exchange of a few numbers per rank (allgather.Rows), so that every rank raises alike
when they do not; under auto they go by MPI's own all-gather where the transport has it, and
the small rows of a repeated call ride with them (then there is no second step). The data
then goes up the binomial tree (algorithms/tree.py gather: broadcast's shape with the data
flowing towards the root): ceil(log2 p) a + (p-1)/p n b at the root for n gathered bytes,
plus the counts' exchange, (p-1) a by ringcoll's ring.

With declared=True on every rank, every rank passes counts= (root's expectations, which the
others then declare too, as wrap()'s Gather does: MPI_Gather's counts are all the same), and
the exchange runs once per distinct call (allgather.Rows: declared counts); the same call
again sends only the data. Under auto, equal blocks of at most NATIVE_MAX bytes in host memory
then go by MPI_Gather itself, one C call. NATIVE_MAX is a fixed 64 KiB from the sweep in
bench/README.md: there MPICH's gather beats the tree for small blocks at -n 2 and -n 4 and
the tree wins from about 128 KiB-2 MiB at -n 4 (at -n 2 it never does: one message either way).
"""

from ..algorithms import COLLECTIVE_ALGORITHMS, native as native_calls, tree
from ..errors import InvalidArgumentError
from ..runner import Plan
from . import _args
from .allgather import Rows, Target, declared_problem, expected_counts

NAME = "gather"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 2)
#: the largest block (bytes) a declared, equal-count gather sends by MPI's own call under auto
NATIVE_MAX = 65536


def plan(g, ctx, x, root, out, algorithm, counts=None, declared=False):
    given = x
    x, side = _args.rows_input(g, x, ctx, movable=True)
    _args.check_root(g, root, ctx)
    _args.pick_simple(algorithm, ALGORITHMS, ctx)
    is_root = g.rank == root
    # root's counts are MPI's recvcounts; the others' count only when declared
    expect = expected_counts(g, counts, ctx, declared) if is_root or declared else None
    out = out if is_root else None  # as MPI's recvbuf, out matters on root only
    if out is not None:  # all but its row count can be checked now; that comes later
        rows_out = out.shape[0] if getattr(out, "ndim", 0) else -1
        _args.output(out, (rows_out,) + x.shape[1:], x.dtype, ctx, side, rows=True)
    src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
    # the counts (and small rows with them) by MPI's own all-gather under auto where the
    # transport has it: one C call instead of a Python ring (explicit 'tree': ringcoll's ring)
    mpi = algorithm in (None, "auto") and hasattr(g.t, "native_allgather")
    host = side.device is None
    exchange = Rows(g, x, out, "native" if mpi else "ring", collective=NAME, expect=expect,
                    src=src, key=(int(root),), host=host, declared=declared)
    target = Target(out, x, ctx, side, wanted=is_root)
    problem = declared_problem(ctx, x, out, expect, g.rank)
    # MPI_Gather for a declared call's small equal blocks, where every rank's are host memory
    # (the same on every rank: expect, x's row bytes and the agreed host flag are)
    block = None if expect is None else expect[0] * _args.row_elems(x) * x.dtype.itemsize
    native = mpi and expect is not None and len(set(expect)) == 1 and block <= NATIVE_MAX
    # (MPI forbids a send buffer inside the receive buffer: root's x viewed in out is copied)
    aliased = out is not None and side.xp.may_share_memory(x, out)
    bound = [(), None]  # MPI_Gather bound to this dst (None on non-roots; never ())
    # once the call is agreed and its result is the same every time (out given, or not root):
    # MPI_Gather bound and that result. Then a repeat is one dict lookup and MPI's call, while
    # the agreement still holds (every rank's g.declared forgets it alike: see Rows).
    hot = [None, None]
    sig, agreed = exchange.signature, g.declared.get

    def run():
        if hot[0] is not None and agreed(sig):  # (True: agreed, every rank's rows on the host)
            hot[0]()
            return hot[1]
        host_all = exchange.agreed()  # counts declared by every rank and agreed on before
        direct = host_all is not None
        if direct:
            if problem is not None:
                raise InvalidArgumentError(problem)  # (the others are sending: abort)
            counts, carried = expect, False
        else:
            counts, carried = exchange()  # host numbers
        part, result, dst, copy_to = target(counts)
        if carried:  # every rank's rows came with the counts (small rows, repeated)
            if is_root:
                exchange.unpack(dst)
        elif direct and native and host_all:
            if aliased:
                g.t.native_gather(src.copy(), dst, root)
            else:
                if bound[0] is not dst:
                    bound[:] = dst, native_calls.bind(g.t, "native_gather", src, dst, root)
                bound[1]()
                if copy_to is None and (out is not None or not is_root):
                    hot[:] = bound[1], result
        else:
            tree.gather(side.t, src, dst, part, root, side.ws)
        _args.copy_rows(dst, copy_to)
        return result

    # axis 0 may differ between ranks: the fingerprint leaves it out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]),
                          root=int(root), **_args.declared_field(declared))
    return Plan(NAME, "tree", fields, _args.on_side(run, side),
                repeatable=x is given and (out is not None or not is_root))
