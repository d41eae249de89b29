"""Scatter: root's x split along axis 0 into one block per rank; rank r gets block r.

counts=None splits like np.array_split (the first x.shape[0] % p blocks get one more row);
otherwise counts gives every rank's row count, as MPI_Scatterv's sendcounts. x and counts
matter on root only. Before any data moves the ranks agree on the call, so that a mismatch
raises on every rank alike instead of hanging one of them:

1. every rank's description of its out= (given or not, its row count, a crc of its dtype and
   trailing shape) goes up the binomial tree to root (tree.gather, 3 int64 per rank);
2. root judges them against x and counts and sends every rank the same fixed-size header
   (tree.broadcast): a verdict per rank, the counts, the row shape and root's dtype spelled
   in 16 bytes, from which a rank without out= allocates its block;
3. every rank raises alike if any verdict is not OK, else the data goes down the binomial
   tree (algorithms/tree.py scatter, gather's mirror image).

Under auto, where the transport has the MPI library's own calls, steps 1 and 2 are
MPI_Gather and MPI_Bcast of the same numbers (one C call each instead of a Python tree);
algorithm='tree' keeps them ringcoll's.

Small blocks ride with the header instead (no step 3): after each scatter every rank knows
every block's bytes from the header, so all agree without a message on the next call's slot
size S (the largest block, if p S <= CARRY_MAX; else 0). The header then has p slots of S bytes
after its numbers; root fills them when every block fits (and its x is in host memory) and
says so in the header, and each rank copies its block out. A repeated small scatter costs the
two steps of the agreement, not three. Root judges the records again only when they differ
from the last ones, and every rank reads the header anew only when it differs from the last.

Cost: 2 ceil(log2 p) a for the agreement, plus ceil(log2 p) a + (n - c_root) b at the root
for n scattered bytes ((p-1)/p n b for even blocks): root sends every other block once.
"""

import operator

import numpy as np

from .. import checks
from ..algorithms import COLLECTIVE_ALGORITHMS, tree
from ..arrays import Partition, array_module, is_device, writeable
from ..errors import CollectiveMismatchError, InvalidArgumentError, PeerFailedError
from ..runner import Plan
from . import _args

NAME = "scatter"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 3)

RECORD = 3  # a rank's out= as root sees it: (has out, its rows, crc of dtype + row shape)
SLOTS = 8  # trailing dimensions the header carries; rows of more need out= on non-roots
CARRY_MAX = 16384  # bytes of blocks (p slots) that may ride in the header (see the module doc)
NAME_BYTES = 16  # root's dtype, spelled as np.dtype() reads it back

# verdicts, one per rank in the header
OK, ROWS, LAYOUT, NEEDS_OUT, BAD_COUNTS, OVERLAP = range(6)


def plan(g, ctx, x, root, counts, out, algorithm):
    _args.check_root(g, root, ctx)
    _args.pick_simple(algorithm, ALGORITHMS, ctx)
    root, p = int(root), g.size
    if g.rank == root:
        if x is None:
            raise InvalidArgumentError(f"{ctx}x is None on the root; the root passes the rows "
                                       "to scatter (x is ignored on the other ranks only)")
        given = x
        x, side = _args.rows_input(g, x, ctx, movable=True)
    else:  # as MPI's sendbuf, x matters on root only: a non-root's block lives where its out does
        side = g.sides.device(out, ctx) if is_device(out) else g.host
    if out is not None:
        _args.same_memory(out, side, ctx)
        if out.ndim == 0:
            raise InvalidArgumentError(f"{ctx}out is 0-d; a block is rows of axis 0: pass out "
                                       "with at least one dimension, or out=None")
        if g.rank == root:  # all but its row count, which counts decides, is local to root
            _args.output(out, (out.shape[0],) + x.shape[1:], x.dtype, ctx, side, rows=True)
        elif not writeable(out):
            raise InvalidArgumentError(f"{ctx}out is read-only; pass a writeable array")
    mine = np.array([out is not None, -1 if out is None else out.shape[0],
                     0 if out is None else _args.layout(out.dtype, out.shape[1:])], dtype=np.int64)

    src = judge = own = None  # root's: its flat rows, how it judges the records, its verdict
    if g.rank == root:
        rows, (code, own) = _root_verdict(x, given, counts, out, p, root)
        src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too

        def judge(meta):
            return _judge(meta, x, rows, code, p, root)

    words = _header_size(p)
    # the agreement by MPI's own gather and broadcast under auto where the transport has
    # them: two C calls instead of two Python trees (explicit 'tree': ringcoll's trees)
    mpi = algorithm in (None, "auto") and hasattr(g.t, "native_gather")
    agree = Agreement(g, mine, root, judge, src, mpi)
    last = [None, None, None]  # the header's numbers last read, what they gave, out's targets

    def run():
        header, carried = agree()
        numbers = header[:words].tobytes()
        if numbers != last[0]:
            verdicts, rows, (row_elems, _), _, _ = _parts(header, p)
            if verdicts.any():
                g.slots[NAME] = 0  # every rank refuses alike, and starts again from 0
                ctx = f"ringcoll rank {g.rank}, {g.progress.call()}: "  # "scatter #7 (tree)"
                raise _refusal(header, p, g.rank, root, out, own, ctx)
            last[:] = numbers, _reading(header, p, g.rank, root, x, out, side), None
        block, dtype, part, next_slot = last[1]
        if last[2] is not None:  # out= again, for the same header: its targets as last time
            result, dst, copy_to = last[2]
        else:
            result = out if out is not None else side.xp.empty(block, dtype)
            dst, copy_to = _args.rows_target(result)
            dst = _args.raw(dst)
            if out is not None:
                last[2] = result, dst, copy_to
        if carried:
            agree.unpack(dst, part)
        else:
            tree.scatter(side.t, src, dst, part, root, side.ws)
        _args.copy_rows(dst, copy_to)
        g.slots[NAME] = next_slot  # the same on every rank: all read the same header
        return result

    # only root knows dtype, shape and counts: the fingerprint has root alone; where the
    # blocks live may differ too (a GPU root, host non-roots), so no memory field either
    fields = _args.fields(g, None, root=root)
    # a repeat needs root's src to be x itself (not a copy) and every result the caller's out
    repeatable = out is not None and (g.rank != root or x is given)
    return Plan(NAME, "tree", fields, _args.on_side(run, side), repeatable=repeatable)


def _header_size(p):
    """int64 numbers in root's header: _parts' (2 p + 4 + SLOTS), then root's itemsize and
    whether the blocks ride in it (the slots that follow)."""
    return 2 * p + 6 + SLOTS


def _reading(header, p, rank, root, x, out, side):
    """What a rank takes from a header whose verdicts are all OK: (its block's shape, the
    dtype, every rank's Partition in elements, the next call's slot size)."""
    _, rows, (row_elems, _), _, _ = _parts(header, p)
    block = (int(rows[rank]),)
    if rank == root:
        dtype, block = x.dtype, block + x.shape[1:]
    elif out is not None:
        dtype, block = out.dtype, block + out.shape[1:]
    else:
        dtype, trail = _root_rows(header, p)
        block += trail
    part = Partition([int(c) * int(row_elems) for c in rows])
    largest = max(part.counts) * int(header[2 * p + 4 + SLOTS])  # bytes of the largest block
    slot = -(-largest // 8) * 8
    return block, dtype, part, slot if p * slot <= CARRY_MAX else 0


class Agreement:
    """Steps 1 and 2 of the module doc, built once per plan: calling it gathers the records,
    has root judge them (again only when they differ from the last) and broadcasts the
    header, with the blocks in its slots when they fit; returns (header, carried)."""

    def __init__(self, g, mine, root, judge, src, mpi=False):
        self.g, self.mine, self.root, self.judge, self.mpi = g, mine, root, judge, mpi
        p = g.size
        self.meta = np.empty((p, RECORD), dtype=np.int64) if judge is not None else None
        self.part = g.host.ws.partition(RECORD * p, p)
        self.src = src.view(np.uint8) if isinstance(src, np.ndarray) else None
        self.seen, self.numbers = None, None  # root: the last records, and their header
        self.header = None  # the header buffer for the current slot size
        self.fill = None  # root: the copies that fill the slots, for the current header
        self.mine_view = None  # (header, part, the bytes of this rank's slot) for unpack

    def __call__(self):
        g, p, words = self.g, self.g.size, _header_size(self.g.size)
        slot = g.slots.get(NAME, 0)
        fresh = self.header is None or self.header.size != words + p * slot // 8
        if fresh:
            self.header = np.zeros(words + p * slot // 8, np.int64)
        header = self.header
        meta = self.meta
        if self.mpi:
            g.t.native_gather(self.mine, None if meta is None else meta.reshape(-1), self.root)
        else:
            tree.gather(g.t, self.mine, None if meta is None else meta.reshape(-1), self.part,
                        self.root, g.host.ws)
        if self.judge is not None:  # root
            records = meta.tobytes()
            if records != self.seen or fresh:  # (else the header holds its numbers still)
                if records != self.seen:
                    self.numbers, self.seen = self.judge(meta), records
                header[:words] = self.numbers
                self.fill = self._fill(header, slot)
                header[words - 1] = self.fill is not None
            for into, source in self.fill or ():
                into[...] = source
        if self.mpi:
            g.t.native_bcast(header, self.root)
        else:
            tree.broadcast(g.t, header, self.root, g.host.ws)  # host numbers, host transport
        return header, header[words - 1] != 0

    def _fill(self, header, slot):
        """Root: the copies of every block into its slot, if all fit (and x is host memory);
        else None."""
        p, words = self.g.size, _header_size(self.g.size)
        verdicts, rows, (row_elems, _), _, _ = _parts(header, p)
        if slot == 0 or self.src is None or verdicts.any():
            return None
        item = int(header[words - 2])
        sizes = [int(r) * int(row_elems) * item for r in rows]
        if max(sizes) > slot:
            return None
        slots = header[words:].view(np.uint8).reshape(p, slot)
        offsets = np.cumsum([0] + sizes).tolist()
        return [(slots[r, :sizes[r]], self.src[offsets[r]:offsets[r + 1]]) for r in range(p)]

    def unpack(self, dst, part):
        """This rank's block, from its slot of the header, into dst (flat, raw)."""
        if self.mine_view is None or self.mine_view[0] is not self.header \
                or self.mine_view[1] is not part:
            p, words, rank = self.g.size, _header_size(self.g.size), self.g.rank
            slot = (self.header.size - words) * 8 // p
            nbytes = part.counts[rank] * dst.itemsize
            self.mine_view = (self.header, part,
                              self.header[words:].view(np.uint8)[rank * slot:rank * slot + nbytes])
        mine = self.mine_view[2]
        if isinstance(dst, np.ndarray):
            dst.view(np.uint8)[...] = mine
        else:  # a device block: one copy up
            xp = array_module(dst)
            dst.view(xp.uint8)[...] = xp.asarray(mine)


def _parts(header, p):
    """Views of root's header: (a verdict per rank, rows per rank, (elements in a row,
    trailing ndim), root's dtype spelled in NAME_BYTES, its trailing shape in SLOTS words)."""
    return (header[:p], header[p:2 * p], header[2 * p:2 * p + 2], header[2 * p + 2:2 * p + 4],
            header[2 * p + 4:])


def _spell(dtype):
    """dtype in NAME_BYTES that np.dtype() reads back as dtype, or None. .str round-trips
    bool, 'S' and 'U' and byte order; the name covers bfloat16 (whose .str is '<V2');
    a structured dtype has neither, so a non-root must pass out= for it."""
    for text in (dtype.str, dtype.name):
        raw = text.encode()
        try:
            if len(raw) <= NAME_BYTES and np.dtype(text) == dtype:
                return raw
        except TypeError:
            continue
    return None


def _counts(counts, nrows, p):
    """(every rank's row count, None), or (None, what is wrong with counts)."""
    if counts is None:
        return Partition.even(nrows, p).counts, None
    try:
        rows = [operator.index(c) for c in counts]
    except TypeError:
        return None, f"counts={counts!r} is not a sequence of ints"
    if len(rows) != p:
        return None, f"counts has {len(rows)} entries where this communicator has {p} ranks"
    if min(rows) < 0:
        return None, f"counts={rows} has a negative entry"
    if sum(rows) != nrows:
        return None, f"counts={rows} adds up to {sum(rows)} rows, but x has {nrows}"
    return rows, None


def _root_verdict(x, given, counts, out, p, root):
    """(the row counts or None, (root's own verdict, what to tell its caller)): root's own
    arguments, judged before any message but raised only once every rank knows."""
    rows, problem = _counts(counts, x.shape[0], p)
    if rows is None:
        return None, (BAD_COUNTS, f"{problem}; pass counts=None (np.array_split's sizes) or "
                      f"{p} non-negative ints, one per rank, that add up to x.shape[0] "
                      f"({x.shape[0]})")
    if out is None:
        return rows, (OK, None)
    lo, hi = sum(rows[:root]), sum(rows[:root + 1])
    block = (rows[root],) + x.shape[1:]
    if out.shape[0] != rows[root]:
        return rows, (ROWS, f"out has shape {out.shape}, but the root's block has "
                      f"{rows[root]} rows (counts {rows}); pass out of shape {block}, "
                      f"x[{lo}:{hi}] for in place, or out=None")
    xp = array_module(out)
    if (hasattr(given, "shape") and xp.may_share_memory(given, out)
            and xp.shares_memory(given, out) and not _is_view(out, given, lo, hi)):
        return rows, (OVERLAP, f"out overlaps x without being the root's own block "
                      f"x[{lo}:{hi}]; pass out=x[{lo}:{hi}] for in place, or a separate "
                      "buffer")
    return rows, (OK, None)


def _is_view(out, x, lo, hi):
    """out is exactly x[lo:hi] (MPI's IN_PLACE on root, as our mpi4py adapter spells it)."""
    if x.ndim == 0:
        return False
    view = x[lo:hi]
    return (out.shape == view.shape and out.strides == view.strides
            and _address(out) == _address(view))


def _address(a):
    return a.data.ptr if is_device(a) else a.ctypes.data


def _judge(meta, x, rows, own, p, root):
    """Root's header: [verdict per rank | rows per rank | row elements, trailing ndim,
    dtype (2 words), trailing shape (SLOTS words)]."""
    header = np.zeros(_header_size(p), dtype=np.int64)
    verdicts, counts, sizes, name, shape = _parts(header, p)
    trail, spelled = x.shape[1:], _spell(x.dtype)
    describable = spelled is not None and len(trail) <= SLOTS
    verdicts[root] = own
    if rows is not None:  # with bad counts, no other rank's out can be judged
        counts[:] = rows
        layout = _args.layout(x.dtype, trail)
        for r in range(p):
            has_out, out_rows, out_layout = meta[r]
            if r == root:
                continue
            if has_out and out_layout != layout:
                verdicts[r] = LAYOUT
            elif has_out and out_rows != rows[r]:
                verdicts[r] = ROWS
            elif not has_out and not describable:
                verdicts[r] = NEEDS_OUT
    sizes[:] = _args.row_elems(x), len(trail)
    header[2 * p + 4 + SLOTS] = x.dtype.itemsize
    if spelled is not None:
        name[:] = np.frombuffer(spelled.ljust(NAME_BYTES, b"\0"), np.int64)
    if len(trail) <= SLOTS:
        shape[:len(trail)] = trail
    return header


def _root_rows(header, p):
    """(root's dtype or None, its trailing shape or None), as the header describes them."""
    _, _, (_, ndim), name, shape = _parts(header, p)
    raw = name.tobytes().rstrip(b"\0")
    trail = tuple(int(d) for d in shape[:ndim]) if ndim <= SLOTS else None
    return (np.dtype(raw.decode()) if raw else None), trail


def _refusal(header, p, rank, root, out, own, ctx):
    """The error every rank raises alike when some verdict is not OK: the offending rank
    its own, the others PeerFailedError naming who and why."""
    verdicts, counts, (_, ndim), _, _ = _parts(header, p)
    verdict = [int(v) for v in verdicts]
    mine = verdict[rank]
    if mine and rank == root:
        return checks.agreed(InvalidArgumentError(f"{ctx}{own}"))
    dtype, trail = _root_rows(header, p)
    if mine == LAYOUT:
        theirs = (f"{dtype} rows of shape {trail}" if dtype is not None and trail is not None
                  else "rows of another dtype or trailing shape")
        return checks.agreed(CollectiveMismatchError(
            f"{ctx}out has dtype {out.dtype} and rows of shape {out.shape[1:]}, but root "
            f"{root} scatters {theirs}; pass out of root's dtype and row shape, or out=None"))
    if mine == ROWS:
        want = int(counts[rank])
        return checks.agreed(InvalidArgumentError(
            f"{ctx}out has shape {out.shape}, but this rank's block has {want} rows (root "
            f"{root}'s counts: {[int(c) for c in counts]}); pass out of shape "
            f"{(want,) + out.shape[1:]} or out=None"))
    if mine == NEEDS_OUT:
        why = ("a dtype np.dtype() cannot rebuild from its name (structured?)" if dtype is None
               else f"rows of {int(ndim)} trailing dimensions (over {SLOTS})")
        return checks.agreed(InvalidArgumentError(
            f"{ctx}root {root} scatters {why}, which the other ranks cannot allocate from "
            "its description; pass out= of this rank's block shape and root's dtype"))
    said = {ROWS: "passed out= with another row count than their block's",
            LAYOUT: f"passed out= whose dtype or row shape differs from root {root}'s x",
            NEEDS_OUT: "need out= (root's dtype or row shape cannot be described to them)",
            BAD_COUNTS: "passed an invalid counts list",
            OVERLAP: "passed out= overlapping x without being root's own block"}
    why = "; ".join(f"rank(s) {[r for r in range(p) if verdict[r] == code]} {text}"
                    for code, text in said.items() if code in verdict)
    return checks.agreed(PeerFailedError(
        f"{ctx}{why}, so no rank runs this scatter (their own errors say what to pass)"))
