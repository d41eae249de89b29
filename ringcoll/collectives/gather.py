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
again sends only the data.

The data step is the tree, or MPI_Gather(v) itself (one C call): with algorithm='native', and
under auto where every rank's rows are host memory and the tuning table measured MPI's call
faster at the gathered bytes (_args.native_rows; bench/collectives_sweep.py --write-tuning).
Without a table entry for this p, auto takes MPI's call for declared equal blocks of at most
NATIVE_MAX bytes, where the sweep in bench/README.md found it faster at -n 2 and -n 4.
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
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx)  # (auto picks per counts: run)
    if name == "native":
        native_calls.check(side.t, None, ctx)
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
    mpi = algorithm in (None, "auto", "native") and hasattr(g.t, "native_allgather")
    host = side.device is None
    exchange = Rows(g, x, out, "native" if mpi else "ring", collective=NAME, expect=expect,
                    src=src, key=(int(root),), host=host, declared=declared)
    target = Target(out, x, ctx, side, wanted=is_root)
    problem = declared_problem(ctx, x, out, expect, g.rank)
    row_bytes = _args.row_elems(x) * x.dtype.itemsize
    chosen = [None, None, False]  # (counts, host_all, whether MPI's call moves them)
    # root's x viewed in out (wrap()'s Gather(IN_PLACE)): see _mpi_step
    aliased = out is not None and side.xp.may_share_memory(x, out)
    bound = [None, None, None]  # MPI's gather bound to (these counts, this dst)
    # once the call is agreed and its result is the same every time (out given, or not root):
    # MPI's gather bound and that result. Then a repeat is one dict lookup and MPI's call, while
    # the agreement still holds (every rank's g.declared forgets it alike: see Rows).
    hot = [None, None]
    sig, agreed = exchange.signature, g.declared.get

    def run():
        if hot[0] is not None and agreed(sig):  # (True: agreed, every rank's rows on the host)
            hot[0]()
            return hot[1]
        # counts declared by every rank and agreed on before (exchange.agreed() inlined)
        host_all = None if sig is None else agreed(sig)
        direct = host_all is not None
        if direct:
            if problem is not None:
                raise InvalidArgumentError(problem)  # (the others are sending: abort)
            counts, carried = expect, False
        else:
            counts, carried = exchange()  # host numbers
            host_all = exchange.everyone[1]
        part, result, dst, copy_to = target(counts)
        if counts is not chosen[0] or host_all is not chosen[1]:  # (alike on every rank)
            small = len(set(counts)) <= 1 and max(counts, default=0) * row_bytes <= NATIVE_MAX
            chosen[:] = counts, host_all, _args.native_rows(g, NAME, algorithm,
                                                            sum(counts) * row_bytes, host_all,
                                                            fallback=small)
        if carried:  # every rank's rows came with the counts (small rows, repeated)
            if is_root:
                exchange.unpack(dst)
        elif chosen[2]:
            if bound[0] is not counts or bound[1] is not dst:
                bound[:] = counts, dst, _mpi_step(side, src, dst, part, root, aliased)
            bound[2]()
            if direct and copy_to is None and (out is not None or not is_root):
                hot[:] = bound[2], result
        else:
            tree.gather(side.t, src, dst, part, root, side.ws)
        if copy_to is not None:
            _args.copy_rows(dst, copy_to)
        return result

    # axis 0 may differ between ranks: the fingerprint leaves it out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]),
                          root=int(root), **_args.declared_field(declared))
    return Plan(NAME, name, fields, _args.on_side(run, side),
                repeatable=x is given and (out is not None or not is_root))


def _mpi_step(side, src, dst, part, root, aliased):
    """MPI's gather of src into dst (root's flat result; None elsewhere) as one zero-argument
    call. MPI forbids a send buffer inside the receive buffer: root's rows that are its block
    of dst already go as MPI_IN_PLACE (wrap()'s Gather(IN_PLACE): no copy at all), rows
    elsewhere in dst as a copy, made anew each call (as MPI reads it)."""
    if not aliased:
        return native_calls.bind(side.t, "native_gatherv", src, dst, part.counts, root)
    if _args.same_bytes(src, dst[part.slices[root]]):
        return native_calls.bind(side.t, "native_gatherv", None, dst, part.counts, root)
    spare = src.copy()
    return _args.copy_first(spare, src, native_calls.bind(side.t, "native_gatherv", spare, dst,
                                                          part.counts, root))
