"""All-gather: every rank's x concatenated along axis 0, on every rank.

Ranks may pass different lengths on axis 0: the row counts (and a check that dtypes,
trailing shapes, out= and any counts= agree) travel first in a small all-gather of 6 numbers
per rank (rows), then the data. The ringcoll algorithm is the ring's all-gather half
(algorithms/ring.py: p-1 steps, (p-1)a + (p-1)/p n b for n the gathered bytes); "node" the
node tier's (algorithms/node.py: each rank copies the blocks it lacks from the others' shared
memory; the default for CuPy arrays on one node); "native" is MPI_Allgatherv.
"""

import zlib

import numpy as np

from .. import checks
from ..algorithms import native, node, ring
from ..arrays import Partition
from ..errors import CollectiveMismatchError, InvalidArgumentError, PeerFailedError
from ..runner import Plan
from . import _args

NAME = "allgather"
ALGORITHMS = ("ring", "node", "native")
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 1)


def plan(g, ctx, x, out, algorithm, counts=None):
    given = x
    x, side = _args.rows_input(g, x, ctx, movable=True)
    counts = expected_counts(g, counts, ctx)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side)
    if name == "native":
        native.check(side.t, None, ctx)
    if out is not None:  # all but its row count can be checked now; that comes later
        rows_out = out.shape[0] if getattr(out, "ndim", 0) else -1
        _args.output(out, (rows_out,) + x.shape[1:], x.dtype, ctx, side, rows=True)
    src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
    exchange = Rows(g, x, out, name, expect=counts)
    target = Target(out, x, ctx, side)

    def run():
        got = exchange()  # host numbers, over the host transport
        part, result, dst, copy_to = target(got)
        if name == "native":
            side.t.native_allgather(src, dst, part.counts)
        else:
            dst[part.slices[g.rank]] = src
            (node if name == "node" else ring).allgather(side.t, dst, part, side.ws)
        _args.copy_rows(dst, copy_to)
        return result

    # axis 0 may differ between ranks: the fingerprint leaves it out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]))
    return Plan(NAME, name, fields, _args.on_side(run, side),
                repeatable=x is given and out is not None)


def expected_counts(g, counts, ctx):
    """counts= (the rows a rank expects from every rank) as a list, checked locally; None
    stays None."""
    if counts is None:
        return None
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{ctx}counts must be a sequence of {g.size} row counts, "
                                   f"got {counts!r}") from None
    if len(counts) != g.size or min(counts, default=0) < 0:
        raise InvalidArgumentError(f"{ctx}counts={counts} must be {g.size} non-negative row "
                                   "counts, one per rank")
    return counts


def _crc(counts):
    """A fingerprint of a counts list (never -1, which means "no expectation")."""
    return zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes())


class Target:
    """Where a call's gathered rows go, for the row counts got: (their Partition, the result,
    the flat buffer the algorithm writes, the array to copy that into or None). With out=
    the last answer is kept and given again while the counts repeat (a repeated call
    allocates nothing); without, every call gets a new result. wanted=False: a rank that
    gets no result (gather's non-roots): only the Partition, (part, None, None, None)."""

    def __init__(self, out, x, ctx, side, wanted=True):
        self.out, self.x, self.ctx, self.side, self.wanted = out, x, ctx, side, wanted
        self.last, self.answer = None, None

    def __call__(self, got):
        if got is self.last:
            return self.answer
        x = self.x
        part = Partition([r * _args.row_elems(x) for r in got])
        answer = (part, None, None, None)
        if self.wanted:
            result = _args.output(self.out, (sum(got),) + x.shape[1:], x.dtype, self.ctx,
                                  self.side, rows=True)
            dst, copy_to = _args.rows_target(result)
            answer = (part, result, _args.raw(dst), copy_to)
        if self.out is not None or not self.wanted:
            self.last, self.answer = got, answer
        return answer


class Rows:
    """Every rank's row count, once all ranks know that dtypes, trailing shapes, the row
    counts of the out= arrays and any expected counts agree (else every rank raises, so none
    is left waiting): calling it runs the exchange and returns the counts.

    expect: this rank's counts= (what it expects each rank to send), or None. Only a
    fingerprint of it travels, so every rank can tell whether some rank expected otherwise.
    The 6 numbers per rank travel by ringcoll's ring all-gather, or by MPI's own for
    algorithm='native' (so the native baseline pays no ringcoll step).

    Built once per plan, so a repeated call (runner.Repeat) only exchanges: this rank's
    numbers are computed here, and when every rank's numbers come back as they were last
    time, the counts judged then are returned again (the very same list) unjudged.
    """

    def __init__(self, g, x, out, name, collective=NAME, expect=None):
        self.g, self.x, self.out, self.name = g, x, out, name
        self.collective, self.expect = collective, expect
        layout = _args.layout(x.dtype, x.shape[1:])
        out_rows = -1 if out is None else out.shape[0]
        self.mine = np.array([x.shape[0], _args.row_elems(x), x.ndim, layout, out_rows,
                              -1 if expect is None else _crc(expect)], dtype=np.int64)
        self.meta = np.empty((g.size, self.mine.size), dtype=np.int64)
        self.part = g.host.ws.partition(self.meta.size, g.size)
        self.agreed, self.got = None, None  # the last meta judged good, and its counts

    def __call__(self):
        g, meta = self.g, self.meta
        flat = meta.reshape(-1)
        if self.name == "native":
            g.t.native_allgather(self.mine, flat, self.part.counts)
        else:
            meta[g.rank] = self.mine
            ring.allgather(g.t, flat, self.part, g.host.ws)
        if self.agreed is not None and np.array_equal(meta, self.agreed):
            return self.got
        self.got = _judge(g, meta, self.mine, self.x, self.out, self.collective, self.expect)
        self.agreed = meta.copy()
        return self.got


def _judge(g, meta, mine, x, out, collective, expect):
    """Rows's verdict on every rank's numbers: the row counts, or the error every rank
    raises alike."""
    ctx = f"ringcoll rank {g.rank}, {g.progress.call()}: "
    bad = [r for r in range(g.size) if tuple(meta[r, 1:4]) != tuple(mine[1:4])]
    if bad:
        raise checks.agreed(CollectiveMismatchError(
            f"{ctx}rank(s) {bad} passed a different dtype or trailing shape than this rank "
            f"({x.dtype}, {x.shape[1:]}); only axis 0 may differ between ranks"))
    total = int(meta[:, 0].sum())
    wrong = [r for r in range(g.size) if meta[r, 4] not in (-1, total)]
    if g.rank in wrong:
        raise checks.agreed(InvalidArgumentError(
            f"{ctx}out has shape {out.shape}, but the ranks pass {total} rows in all; pass "
            f"out of shape {(total,) + x.shape[1:]} or out=None"))
    if wrong:
        raise checks.agreed(PeerFailedError(
            f"{ctx}rank(s) {wrong} passed out= with the wrong row count (the result has "
            f"{total} rows), so no rank runs this {collective}"))
    got = [int(v) for v in meta[:, 0]]
    differ = [r for r in range(g.size) if meta[r, 5] not in (-1, _crc(got))]
    if g.rank in differ:
        raise checks.agreed(InvalidArgumentError(
            f"{ctx}counts={expect} but the ranks pass {got} rows; pass the counts they send"))
    if differ:
        raise checks.agreed(PeerFailedError(
            f"{ctx}rank(s) {differ} passed counts= that differ from the rows the ranks pass "
            f"({got}), so no rank runs this {collective}"))
    return got
