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

Under auto, where the transport has the MPI library's own calls, steps 1 and 2 are
MPI_Gather and MPI_Scatter of the same numbers (one C call each instead of a Python tree);
algorithm='tree' keeps them ringcoll's.

Small blocks ride with the header instead (no step 3): after each scatter every rank knows
every block's bytes from the header, so all agree without a message on the next call's slot
size S (the largest block, if p S <= CARRY_MAX; else 0). Each rank's row of step 2 then has a
slot of S bytes after the numbers; root fills each with that rank's block when every block
fits (and its x is in host memory) and says so in the numbers, and each rank copies its
block out. A repeated small scatter costs the two steps of the agreement, not three, and
moves each block once, as MPI_Scatter does. Root judges the records again only when they
differ from the last ones, and every rank reads the header anew only when it differs from
the last.

Declared counts: with declared=True on every rank, every rank passes counts= (root's, which
the others then declare too, as wrap()'s Scatter does: MPI_Scatter's counts are all the same)
and every non-root out=; each record carries a fingerprint of its counts, root checks them
against its own, and the header says whether every rank declared (and whether every rank's
memory is host memory). Then every rank records the call's signature (counts, dtype and row
shape, memory kind, root) in g.declared, as allgather.Rows does, and the same call again skips
steps 1 and 2: only the data moves, as in MPI_Scatterv.

Step 3 is the tree, or MPI_Scatter(v) itself: with algorithm='native', and under auto where
every rank's block is host memory and the tuning table measured MPI's call faster at the
scattered bytes (_args.native_rows). Without a table entry for this p, auto takes MPI's call
for declared equal blocks of at most NATIVE_MAX bytes: MPICH's scatter beats the tree for
small blocks, the tree wins from about 32 KiB at -n 2 and 128 KiB-2 MiB at -n 4.

Cost: 2 ceil(log2 p) a for the agreement, plus ceil(log2 p) a + (n - c_root) b at the root
for n scattered bytes ((p-1)/p n b for even blocks): root sends every other block once.
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
CARRY_MAX = 16384  # bytes of blocks (p slots) that may ride in the header (see the module doc)
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
    src = judge = own = None  # root's: its flat rows, how it judges the records, its verdict
    if g.rank == root:
        rows, (code, own) = _root_verdict(x, given, counts, out, p, root)
        src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
        layout = _args.layout(x.dtype, x.shape[1:])

        def judge(meta):
            return _judge(meta, x, rows, code, p, root)

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
    # the agreement by MPI's own gather and scatter under auto where the transport has
    # them: two C calls instead of two Python trees (explicit 'tree': ringcoll's trees)
    mpi = algorithm in (None, "auto", "native") and hasattr(g.t, "native_gather")
    agree = Agreement(g, mine, root, judge, src, mpi)
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
        header = agree()
        numbers = header[:words].tobytes()
        if numbers != last[0]:
            verdicts, rows, (row_elems, _), _, _ = _parts(header, p)
            if verdicts.any():
                g.slots[NAME] = 0  # every rank refuses alike, and starts again from 0
                ctx_now = f"ringcoll rank {g.rank}, {g.progress.call()}: "  # "scatter #7"
                raise _refusal(header, p, g.rank, root, out, own, ctx_now)
            # (the numbers' last two words, read here once: the same while the numbers are)
            flags = int(header[words - 2]), bool(header[words - 1])
            last[:] = numbers, _reading(header, p, g.rank, root, x, out, side), None, flags
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
    """int64 numbers in root's header: _parts' (2 p + 4 + SLOTS), then root's itemsize,
    whether every rank declared its counts (bit 0) and has host memory (bit 1), and whether
    the blocks ride in it (the slots that follow)."""
    return 2 * p + 7 + SLOTS


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
    return block, dtype, part, slot if p * slot <= CARRY_MAX else 0


class Agreement:
    """Steps 1 and 2 of the module doc, built once per plan: calling it gathers the records,
    has root judge them (again only when they differ from the last) and scatters the header
    (its numbers, and this rank's block in its slot when all fit) to every rank; returns this
    rank's header (whether the blocks came in it is its numbers' last word).

    Root's send buffer is p rows, one per rank: the same numbers in each (written when they
    change), then that rank's slot. A scatter, not a broadcast of all p slots: each rank
    receives its own block only, and MPICH's broadcast from a root other than 0 is slow (at -n
    2, 256 B: 4.7 us against 2.0 for MPI_Scatter; 8 KiB: 22 us against 4.5)."""

    def __init__(self, g, mine, root, judge, src, mpi=False):
        self.g, self.mine, self.root, self.judge, self.mpi = g, mine, root, judge, mpi
        p = g.size
        self.meta = np.empty((p, RECORD), dtype=np.int64) if judge is not None else None
        self.part = g.host.ws.partition(RECORD * p, p)
        self.src = src.view(np.uint8) if isinstance(src, np.ndarray) else None
        self.seen, self.numbers = None, None  # root: the last records, and their header
        self.rows = None  # root: p rows of (numbers, slot), for the current slot size
        self.header = None  # this rank's row for the current slot size
        self.fill = None  # root: the copies that fill the slots, for the current header
        self.mine_view = None  # (header, part, this rank's slot bytes, dst, its bytes): unpack
        # MPI's gather of the records bound once, its scatter once per slot size: a repeated
        # call parses no arguments
        self.gather = native_calls.bind(g.t, "native_gather", mine, None if self.meta is None
                                        else self.meta.reshape(-1), root) if mpi else None
        self.send = None

    def _buffers(self, width):
        """The header rows for `width` int64 per rank, and MPI's scatter bound to them."""
        g, p = self.g, self.g.size
        if self.judge is not None:  # root: its own row is its header (in place)
            self.rows = np.zeros((p, width), np.int64)
            self.header = self.rows[self.root]
        else:
            self.header = np.zeros(width, np.int64)
        self.row_part = g.host.ws.partition(p * width, p)
        if self.mpi:
            self.send = native_calls.bind(
                g.t, "native_scatterv", None if self.rows is None else self.rows.reshape(-1),
                None if self.rows is not None else self.header, [width] * p, self.root)

    def __call__(self):
        g, p, words = self.g, self.g.size, _header_size(self.g.size)
        slot = g.slots.get(NAME, 0)
        fresh = self.header is None or self.header.size != words + slot // 8
        if fresh:
            self._buffers(words + slot // 8)
        header = self.header
        meta = self.meta
        if self.mpi:
            self.gather()
        else:
            tree.gather(g.t, self.mine, None if meta is None else meta.reshape(-1), self.part,
                        self.root, g.host.ws)
        if self.judge is not None:  # root
            records = meta.tobytes()
            if records != self.seen or fresh:  # (else the rows hold their numbers still)
                if records != self.seen:
                    self.numbers, self.seen = self.judge(meta), records
                self.rows[:, :words] = self.numbers
                self.fill = self._fill(slot)
                self.rows[:, words - 1] = self.fill is not None
            for into, source in self.fill or ():
                into[...] = source
        if self.mpi:
            self.send()
        else:  # host numbers, host transport
            tree.scatter(g.t, None if self.rows is None else self.rows.reshape(-1), header,
                         self.row_part, self.root, g.host.ws, Tag.VERDICT)
        return header  # (its numbers' last word: whether the blocks ride in the slots)

    def _fill(self, slot):
        """Root: the copies of every block into its rank's slot, if all fit (and x is host
        memory); else None."""
        p, words = self.g.size, _header_size(self.g.size)
        verdicts, rows, (row_elems, _), _, _ = _parts(self.numbers, p)
        if slot == 0 or self.src is None or verdicts.any():
            return None
        item = int(self.numbers[2 * p + 4 + SLOTS])
        sizes = [int(r) * int(row_elems) * item for r in rows]
        if max(sizes) > slot:
            return None
        slots = self.rows[:, words:].view(np.uint8)
        offsets = np.cumsum([0] + sizes).tolist()
        return [(slots[r, :sizes[r]], self.src[offsets[r]:offsets[r + 1]]) for r in range(p)]

    def unpack(self, dst, part):
        """This rank's block, from its slot of the header, into dst (flat, raw)."""
        if self.mine_view is None or self.mine_view[0] is not self.header \
                or self.mine_view[1] is not part:
            words, rank = _header_size(self.g.size), self.g.rank
            nbytes = part.counts[rank] * dst.itemsize
            self.mine_view = (self.header, part, self.header[words:].view(np.uint8)[:nbytes],
                              None, None)
        if self.mine_view[3] is not dst:  # (dst's bytes viewed once while dst repeats)
            xp = array_module(dst)
            self.mine_view = self.mine_view[:3] + (dst, dst.view(xp.uint8))
        mine, into = self.mine_view[2], self.mine_view[4]
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
    sizes[:] = _args.row_elems(x), len(trail)
    header[2 * p + 4 + SLOTS] = x.dtype.itemsize
    header[2 * p + 5 + SLOTS] = (meta[:, 4] & 2).all() + 2 * (meta[:, 4] & 1).all()
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
