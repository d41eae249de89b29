"""Scatter: root's x split along axis 0 into one block per rank; rank r gets block r.

counts=None splits like np.array_split (the first x.shape[0] % p blocks get one more row);
otherwise counts gives every rank's row count, as MPI_Scatterv's sendcounts. x and counts
matter on root only. Before any data moves the ranks agree on the call, so that a mismatch
raises on every rank alike instead of hanging one of them:

1. every rank's description of its out= (given or not, its row count, a crc of its dtype and
   trailing shape) goes up the binomial tree to root (tree.gather, 5 int64 per rank);
2. root judges them against x and counts and scatters to every rank the same fixed-size
   header (tree.scatter of p equal rows): a verdict per rank, the counts, the row shape and
   root's dtype spelled in 16 bytes, from which a rank without out= allocates its block;
3. every rank raises alike if any verdict is not OK, else the data goes down the binomial
   tree (algorithms/tree.py scatter, gather's mirror image).

Under auto, where the transport has the MPI library's own calls, steps 1 and 2 are one
MPI_Allgather instead (OneCall): every rank's record and root's description of its call (the
header but for the other ranks' verdicts) reach every rank, and every rank judges every
record alike (_judge is a function of those numbers alone), so all raise alike or none with
one collective instead of two (MPICH at -n 2: about 2.2 us against 1.8 + 2.0 for a gather
and a scatter). algorithm='tree', and more than ONE_CALL_MAX ranks (every rank
receives p slots as wide as root's description: p^2 numbers), keep ringcoll's two trees.

Small blocks ride with the header instead (no step 3): after each scatter every rank knows
every block's bytes from the header, so all agree without a message on the next call's slot
size S (the largest block, if p p S <= CARRY_MAX; else 0). In the tree's header each rank's
row has a slot of S bytes after the numbers, root filling each with that rank's block; in
the one MPI call root's slot has p of them (every slot is as wide, hence p p S received per
rank). Root fills them when every block fits (and its x is in host memory) and says so in
the numbers, and each rank copies its block out. A repeated small scatter costs the
agreement alone, not a data step too. The records are judged again only when they differ
from the last ones, and every rank reads the header anew only when it differs from the last.

Declared counts: with declared=True on every rank, every rank passes counts= (root's, which
the others then declare too, as wrap()'s Scatter does: MPI_Scatter's counts are all the same)
and every non-root out=; each record carries a fingerprint of its counts, judged against
root's, and the header says whether every rank declared (and whether every rank's
memory is host memory). Then every rank records the call's signature (counts, dtype and row
shape, memory kind, root) in g.declared, as allgather.Rows does, and the same call again skips
steps 1 and 2: only the data moves, as in MPI_Scatterv.

Step 3 is the tree, or MPI_Scatter(v) itself: with algorithm='native', and under auto where
every rank's block is host memory and the tuning table measured MPI's call faster at the
scattered bytes (_args.native_rows). Without a table entry for this p, auto takes MPI's call
for declared equal blocks of at most NATIVE_MAX bytes: MPICH's scatter beats the tree for
small blocks, the tree wins from about 32 KiB at -n 2 and 128 KiB-2 MiB at -n 4.

Cost: 2 ceil(log2 p) a for the agreement by the trees (one MPI_Allgather of a few numbers
per rank under auto), plus ceil(log2 p) a + (n - c_root) b at the root for n scattered bytes
((p-1)/p n b for even blocks): root sends every other block once.
"""

import operator

import numpy as np

from .. import checks
from ..algorithms import COLLECTIVE_ALGORITHMS, native as native_calls, tree
from ..arrays import Partition, array_module, is_device, writeable
from ..errors import CollectiveMismatchError, InvalidArgumentError, PeerFailedError
from ..runner import Plan
from ..transport import Tag
from . import _args

NAME = "scatter"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 3)

#: a rank's record as root sees it: (has out, its rows, crc of dtype + row shape, crc of its
#: declared counts or -1, bits: its block is host memory (1), it declared (2))
RECORD = 5
#: the largest block (bytes) a declared, equal-count scatter sends by MPI's own call under auto
NATIVE_MAX = 65536
SLOTS = 8  # trailing dimensions the header carries; rows of more need out= on non-roots
CARRY_MAX = 8192  # p * p * S: bytes a rank receives when blocks ride (see OneCall)
#: the most ranks that agree in one MPI_Allgather (OneCall): each receives p slots as wide as
#: root's 2 p + 22 numbers, p^2 words in all, so past this the trees' O(p) header is cheaper
ONE_CALL_MAX = 16
NAME_BYTES = 16  # root's dtype, spelled as np.dtype() reads it back

# verdicts, one per rank in the header
OK, ROWS, LAYOUT, NEEDS_OUT, BAD_COUNTS, OVERLAP, OTHER_COUNTS = range(7)


def plan(g, ctx, x, root, counts, out, algorithm, declared=False):
    _args.check_root(g, root, ctx)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx)  # (auto picks per counts: move)
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
    if name == "native":
        native_calls.check(side.t, None, ctx)
    layout = 0 if out is None else _args.layout(out.dtype, out.shape[1:])
    src = described = own = None  # root's: its flat rows, its header numbers, its verdict
    if g.rank == root:
        rows, (code, own) = _root_verdict(x, given, counts, out, p, root)
        src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
        layout = _args.layout(x.dtype, x.shape[1:])
        described = _describe(x, rows, code, p, root)

    # declared counts (see the module doc): the signature, and what this rank's own
    # arguments contradict in them, raised only when the call skips the agreement
    host = side.device is None
    sig = problem = crc = None
    if declared:
        if counts is None or (out is None and g.rank != root):
            raise InvalidArgumentError(f"{ctx}declared=True needs counts= on every rank "
                                       "(root's list) and out= on every rank but root; pass "
                                       "them or leave declared out")
        try:
            listed = tuple(operator.index(c) for c in counts)
        except TypeError:
            raise InvalidArgumentError(f"{ctx}counts={counts!r} is not a sequence of ints") \
                from None
        crc = _args.counts_crc(listed)
        if not g.options.debug:  # (debug mode agrees on every call: it never skips)
            sig = (NAME, listed, layout, host, root)
            problem = own if g.rank == root else _block_problem(out, listed, g.rank, root)
    mine = np.array([out is not None, -1 if out is None else out.shape[0], layout,
                     -1 if crc is None else crc, host + 2 * bool(declared)], dtype=np.int64)
    in_place = g.rank == root and out is not None and side.xp.may_share_memory(x, out)
    chosen = [None, None, False]  # (part, all_host, whether MPI's call moves them)
    bound = [None, None, None]  # MPI's scatter bound to (part, dst)

    def move(part, dst, all_host):
        """The data step, into dst: by MPI's scatter (returned, bound) where native_rows
        says so, the same on every rank (part and all_host are); else by the tree (None)."""
        if part is not chosen[0] or all_host is not chosen[1]:
            blocks = [c * dst.itemsize for c in part.counts]
            small = len(set(blocks)) <= 1 and max(blocks, default=0) <= NATIVE_MAX
            chosen[:] = part, all_host, _args.native_rows(g, NAME, algorithm, sum(blocks),
                                                          all_host, fallback=small)
        if not chosen[2]:
            tree.scatter(side.t, src, dst, part, root, side.ws)
            return None
        if bound[0] is not part or bound[1] is not dst:  # root's own block in x: IN_PLACE
            bound[:] = part, dst, native_calls.bind(side.t, "native_scatterv", src,
                                                    None if in_place else dst, part.counts,
                                                    root)
        bound[2]()
        return bound[2]

    # once the call is agreed and its block goes by MPI's scatter into out: that call bound.
    # Then a repeat is one dict lookup and MPI's call, while the agreement holds (every
    # rank's g.declared forgets it alike)
    hot = [None]
    agreed = g.declared.get
    direct = _direct(g, side, sig, x, out, move, hot)

    words = _header_size(p)
    # the agreement by one MPI_Allgather under auto where the transport has MPI's calls
    # and p is small enough (explicit 'tree': ringcoll's two trees)
    mpi = algorithm in (None, "auto", "native") and hasattr(g.t, "native_allgather")
    agree = (OneCall if mpi and p <= ONE_CALL_MAX else Agreement)(g, mine, root, described,
                                                                  src)
    # the header's numbers last read, what they gave, out's targets, (everyone, carried)
    last = [None, None, None, None]

    def run():
        if hot[0] is not None and agreed(sig):  # (True: agreed, every rank on the host)
            hot[0]()
            return out
        host_all = None if sig is None else g.declared.get(sig)
        if host_all is not None:  # declared and agreed on before
            if problem is not None:
                raise InvalidArgumentError(f"{ctx}{problem}")  # (the others move data: abort)
            return direct(host_all)
        header = agree()  # (the very same array while the numbers stay the same)
        if header is not last[0]:
            verdicts, rows, (row_elems, _), _, _ = _parts(header, p)
            if verdicts.any():
                g.slots[NAME] = 0  # every rank refuses alike, and starts again from 0
                ctx_now = f"ringcoll rank {g.rank}, {g.progress.call()}: "  # "scatter #7"
                raise _refusal(header, p, g.rank, root, out, own, ctx_now)
            # (the numbers' last two words, read here once: the same while the numbers are)
            flags = int(header[words - 2]), bool(header[words - 1])
            last[:] = header, _reading(header, p, g.rank, root, x, out, side), None, flags
        everyone, carried = last[3]  # everyone: bit 0 all declared, bit 1 all host memory
        if sig is not None and everyone & 1:
            g.declared[sig] = bool(everyone & 2)
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
            move(part, dst, bool(everyone & 2))
        if copy_to is not None:
            _args.copy_rows(dst, copy_to)
        g.slots[NAME] = next_slot  # the same on every rank: all read the same header
        return result

    # only root knows dtype, shape and counts: the fingerprint has root alone; where the
    # blocks live may differ too (a GPU root, host non-roots), so no memory field either
    fields = _args.fields(g, None, root=root, **_args.declared_field(declared))
    # a repeat needs root's src to be x itself (not a copy) and every result the caller's out
    repeatable = out is not None and (g.rank != root or x is given)
    return Plan(NAME, name, fields, _args.on_side(run, side), repeatable=repeatable)


def _header_size(p):
    """int64 numbers in root's header: _parts' (2 p + 4 + SLOTS), then root's itemsize, its
    layout crc, whether a rank can allocate its block from the header (describable), whether
    every rank declared its counts (bit 0) and has host memory (bit 1), and whether the
    blocks ride with it (carried)."""
    return 2 * p + 9 + SLOTS


def _block_problem(out, counts, rank, root):
    """Why a non-root's out= contradicts its declared counts (None if it does not)."""
    if len(counts) <= rank:
        return f"counts={list(counts)} has no entry for this rank; pass root {root}'s counts"
    if out.shape[0] != counts[rank]:
        return (f"out has shape {out.shape}, but counts[{rank}] = {counts[rank]}; pass root "
                f"{root}'s counts and out of that many rows")
    return None


def _direct(g, side, sig, x, out, move, hot):
    """The data step alone, for a declared call every rank agreed on before: a function of
    the agreed "all host memory" that moves this rank's block (move) and returns the result.
    hot[0] becomes MPI's bound call once that has run into out, with nothing to copy after."""
    if sig is None:
        return None
    counts, rank, root = sig[1], g.rank, sig[4]
    if len(counts) != g.size or min(counts, default=0) < 0:
        return None  # (a bad list: the agreement refuses it, so it is never agreed)
    rows = x if rank == root else out
    part = Partition([c * _args.row_elems(rows) for c in counts])
    targets = None  # out's (flat raw buffer, array to copy that into or None), made once
    if out is not None:
        flat, copy_to = _args.rows_target(out)
        targets = _args.raw(flat), copy_to

    def direct(all_host):
        if targets is None:  # root without out: a new block each call
            result = side.xp.empty((counts[rank],) + x.shape[1:], x.dtype)
            dst, copy_to = _args.rows_target(result)
            dst = _args.raw(dst)
        else:
            result, (dst, copy_to) = out, targets
        mpi_call = move(part, dst, all_host)
        if mpi_call is not None and targets is not None and copy_to is None:
            hot[0] = mpi_call
        _args.copy_rows(dst, copy_to)
        return result

    return direct


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
    return block, dtype, part, slot if p * p * slot <= CARRY_MAX else 0


class Agreement:
    """Steps 1 and 2 of the module doc by ringcoll's own trees (algorithm='tree', or a
    transport without MPI's calls), built once per plan: calling it gathers the records up
    the tree to root, has root judge them (again only when they differ from the last) and
    scatters the header down it, p equal rows: the same numbers in each, then that rank's
    slot for its block. Returns this rank's numbers, the very same array while they stay the
    same (whether the blocks came is their last word); unpack() copies this rank's block.
    A scatter, not a broadcast of all p slots: each rank receives its own block only."""

    def __init__(self, g, mine, root, described, src):
        self.g, self.mine, self.root, self.described = g, mine, root, described
        p = g.size
        self.is_root = g.rank == root
        self.meta = np.empty((p, RECORD), dtype=np.int64) if self.is_root else None
        self.part = g.host.ws.partition(RECORD * p, p)
        self.src = src.view(np.uint8) if isinstance(src, np.ndarray) else None
        self.seen, self.judged = None, None  # root: the last records, and their numbers
        self.rows = None  # root: p rows of (numbers, slot), for the current slot size
        self.header = None  # this rank's row for the current slot size
        self.fill = None  # root: the copies that fill the slots, for the current numbers
        self.read = None  # (the bytes of the numbers last returned, a copy of them)
        self.mine_view = None  # (header, part, this rank's slot bytes, dst, its bytes): unpack

    def _buffers(self, width):
        p = self.g.size
        if self.is_root:  # root: its own row is its header (in place)
            self.rows = np.zeros((p, width), np.int64)
            self.header = self.rows[self.root]
        else:
            self.header = np.zeros(width, np.int64)
        self.row_part = self.g.host.ws.partition(p * width, p)
        self.slot_bytes = self.header[_header_size(p):].view(np.uint8)  # this rank's slot

    def __call__(self):
        g, p, words = self.g, self.g.size, _header_size(self.g.size)
        slot = g.slots.get(NAME, 0)
        fresh = self.header is None or self.header.size != words + slot // 8
        if fresh:
            self._buffers(words + slot // 8)
        meta = self.meta
        tree.gather(g.t, self.mine, None if meta is None else meta.reshape(-1), self.part,
                    self.root, g.host.ws)
        if self.is_root:
            records = meta.tobytes()
            if records != self.seen or fresh:  # (else the rows hold their numbers still)
                if records != self.seen:
                    self.judged, self.seen = _judge(self.described, meta, p, self.root), records
                self.rows[:, :words] = self.judged
                self.fill = _fill(self.judged, self.rows[:, words:].view(np.uint8), self.src,
                                  p, slot)
                self.rows[:, words - 1] = self.fill is not None
            for into, source in self.fill or ():
                into[...] = source
        tree.scatter(g.t, None if self.rows is None else self.rows.reshape(-1), self.header,
                     self.row_part, self.root, g.host.ws, Tag.VERDICT)
        numbers = self.header[:words].tobytes()
        if self.read is None or numbers != self.read[0]:
            self.read = numbers, self.header[:words].copy()
        return self.read[1]

    def unpack(self, dst, part):
        """This rank's block, from its slot of the header, into dst (flat, raw)."""
        _unpack(self, dst, part)


class OneCall:
    """Steps 1 and 2 of the module doc as one MPI_Allgather, under auto where the transport
    has MPI's calls: every rank's slot holds its record; root's also holds its description
    (_describe: everything but the other ranks' verdicts) and, when they fit, every block.
    Every rank then judges every record alike (_judge is a function of what all received),
    so all raise alike or none, with one collective instead of a gather and a scatter (MPICH
    at -n 2: about 2.2 us against 1.8 + 2.0). The numbers are judged again only when the
    records or root's description differ from the last. Returns this rank's numbers, the very
    same array while they stay the same; unpack() copies this rank's block from root's slot.

    Every slot is as wide as root's, so each rank receives p of them: blocks ride only while
    p * p * S <= CARRY_MAX (_reading)."""

    def __init__(self, g, mine, root, described, src):
        self.g, self.mine, self.root, self.described = g, mine, root, described
        self.is_root = g.rank == root
        self.src = src.view(np.uint8) if isinstance(src, np.ndarray) else None
        self.width = None  # int64 per slot, for the current slot size
        self.seen, self.judged = None, None  # the last slots' numbers, and their verdict
        self.fill = None  # root: the copies of the blocks into its slot
        self.mine_view = None

    def _buffers(self, slot):
        g, p, words = self.g, self.g.size, _header_size(self.g.size)
        self.width = RECORD + words + p * slot // 8
        self.send = np.zeros(self.width, np.int64)
        self.send[:RECORD] = self.mine
        self.recv = np.empty((p, self.width), np.int64)
        self.numbers = self.recv[:, :RECORD + words]  # every record, root's description
        # this rank's block's place in root's slot
        self.slot_bytes = self.recv[self.root, RECORD + words:].view(np.uint8)[g.rank * slot:]
        self.fill = None
        if self.is_root:
            described = self.send[RECORD:RECORD + words]
            described[:] = self.described
            blocks = self.send[RECORD + words:].view(np.uint8).reshape(p, slot)
            self.fill = _fill(described, blocks, self.src, p, slot)
            described[words - 1] = self.fill is not None
        self.call = native_calls.bind(g.t, "native_allgather", self.send, self.recv.reshape(-1),
                                      [self.width] * p)
        self.seen = None

    def __call__(self):
        g, p, words = self.g, self.g.size, _header_size(self.g.size)
        slot = g.slots.get(NAME, 0)
        if self.width != RECORD + words + p * slot // 8:
            self._buffers(slot)
        for into, source in self.fill or ():
            into[...] = source
        self.call()
        seen = self.numbers.tobytes()
        if seen != self.seen:
            described = self.recv[self.root, RECORD:RECORD + words]
            self.judged = _judge(described, self.recv[:, :RECORD], p, self.root)
            self.judged[words - 1] = described[words - 1]  # (root's: the blocks are here)
            self.seen = seen
        return self.judged

    def unpack(self, dst, part):
        """This rank's block, from its place in root's slot, into dst (flat, raw)."""
        _unpack(self, dst, part)


def _fill(numbers, slots, src, p, slot):
    """Root: the copies of every block into its slot (slots[r]: rank r's, bytes), if all fit
    (and x is host memory: src); else None. One copy where the blocks lie in x as in the
    slots (equal blocks of whole slots, back to back)."""
    verdicts, rows, (row_elems, _), _, _ = _parts(numbers, p)
    if slot == 0 or src is None or verdicts.any():
        return None
    item = int(numbers[2 * p + 4 + SLOTS])
    sizes = [int(r) * int(row_elems) * item for r in rows]
    if max(sizes) > slot:
        return None
    if sizes == [slot] * p and slots.flags.c_contiguous:
        return [(slots.reshape(-1), src[:p * slot])]
    offsets = np.cumsum([0] + sizes).tolist()
    return [(slots[r, :sizes[r]], src[offsets[r]:offsets[r + 1]]) for r in range(p)]


def _unpack(agreement, dst, part):
    """Copy this rank's block from agreement.slot_bytes (its slot's bytes onwards) into dst;
    the views made once while the slot buffer, part and dst repeat (agreement.mine_view)."""
    view, slot_bytes = agreement.mine_view, agreement.slot_bytes
    if view is None or view[0] is not part or view[1] is not dst or view[4] is not slot_bytes:
        nbytes = part.counts[agreement.g.rank] * dst.itemsize
        view = agreement.mine_view = (part, dst, slot_bytes[:nbytes],
                                      dst.view(array_module(dst).uint8), slot_bytes)
    mine, into = view[2], view[3]
    if isinstance(dst, np.ndarray):
        into[...] = mine
    else:  # a device block: one copy up
        into[...] = array_module(dst).asarray(mine)


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


def _describe(x, rows, own, p, root):
    """Root's numbers before any record: [verdicts (root's own; 0 for the others) | rows per
    rank | row elements, trailing ndim | dtype (2 words) | trailing shape (SLOTS words) |
    itemsize, layout crc, describable, flags, carried]; see _header_size."""
    header = np.zeros(_header_size(p), dtype=np.int64)
    verdicts, counts, sizes, name, shape = _parts(header, p)
    trail, spelled = x.shape[1:], _spell(x.dtype)
    verdicts[root] = own
    if rows is not None:  # (None: bad counts, root's own verdict says so)
        counts[:] = rows
    sizes[:] = _args.row_elems(x), len(trail)
    at = 2 * p + 4 + SLOTS
    header[at] = x.dtype.itemsize
    header[at + 1] = _args.layout(x.dtype, trail)
    header[at + 2] = spelled is not None and len(trail) <= SLOTS
    if spelled is not None:
        name[:] = np.frombuffer(spelled.ljust(NAME_BYTES, b"\0"), np.int64)
    if len(trail) <= SLOTS:
        shape[:len(trail)] = trail
    return header


def _judge(described, meta, p, root):
    """The header: root's description with a verdict for every other rank's record (meta, p
    rows of RECORD) and the flags of all of them. A function of these numbers alone, so every
    rank that has them judges alike."""
    header = np.array(described, dtype=np.int64)
    verdicts, counts, _, _, _ = _parts(header, p)
    at = 2 * p + 4 + SLOTS
    if verdicts[root] != BAD_COUNTS:  # with bad counts, no other rank's out can be judged
        rows = [int(c) for c in counts]
        layout, describable = header[at + 1], header[at + 2]
        declared = _args.counts_crc(rows)
        for r in range(p):
            has_out, out_rows, out_layout, counts_crc, _ = meta[r]
            if r == root:
                continue
            if counts_crc not in (-1, declared):
                verdicts[r] = OTHER_COUNTS
            elif has_out and out_layout != layout:
                verdicts[r] = LAYOUT
            elif has_out and out_rows != rows[r]:
                verdicts[r] = ROWS
            elif not has_out and not describable:
                verdicts[r] = NEEDS_OUT
    header[at + 3] = (meta[:, 4] & 2).all() + 2 * (meta[:, 4] & 1).all()
    header[at + 4] = 0  # (the caller sets "carried")
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
    if mine == OTHER_COUNTS:
        return checks.agreed(InvalidArgumentError(
            f"{ctx}counts differ from root {root}'s ({[int(c) for c in counts]}); pass root's "
            "counts, or counts=None on this rank"))
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
            OVERLAP: "passed out= overlapping x without being root's own block",
            OTHER_COUNTS: f"passed counts= other than root {root}'s"}
    why = "; ".join(f"rank(s) {[r for r in range(p) if verdict[r] == code]} {text}"
                    for code, text in said.items() if code in verdict)
    return checks.agreed(PeerFailedError(
        f"{ctx}{why}, so no rank runs this scatter (their own errors say what to pass)"))
