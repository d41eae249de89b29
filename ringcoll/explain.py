"""`ringcoll explain`: run one collective on small numbers and show every step of it.

    python -m ringcoll explain allreduce --algorithm ring -p 4 -n 8
    python -m ringcoll explain allreduce --algorithm hierarchical -p 5 --local-size 3
    python -m ringcoll explain broadcast -p 6 --root 2 --png bcast.png

It runs the real algorithm on p thread ranks (ringcoll.simulate), on int64 inputs that are easy
to add up by hand (rank r's element i is 10 r + i, or 100 r + i from n = 11 on), and prints

1. the schedule: for every step, who sends which block (element range) to whom, how many
   bytes, the values sent, and what the receiver does with them;
2. every rank's buffer after every step, with the ranks whose inputs each block now holds;
3. the bytes each rank sent and received (from the trace) beside the closed form, and the
   alpha-beta-gamma cost with ringcoll.CostModel's default numbers;
4. with --png FILE, a picture: ranks as lanes, steps as columns, one arrow per message.

The schedule is rebuilt here from the formulas in each algorithm's docstring, replayed on the
same inputs, and then checked against the run, message by message: every rank's messages must
match the trace in order, destination, tag and size, and the values in each message must be
the bytes that rank really sent (the explainer records each send's payload as it is posted).
The final buffers must equal what the collective returned and what NumPy computes from the
inputs. Any difference is an error (exit status 1), never a silently wrong table.
"""

import argparse
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field

import numpy as np

from .algorithms import CostModel, bruck as bruck_mod
from .algorithms.hierarchical import owned_blocks, owner
from .algorithms.recursive_doubling import core_rank, fold, real_rank
from .arrays import Partition
from .transport.base import Tag, Transport, describe_tag

COLLECTIVES = {  # collective -> (its algorithms, the default)
    "allreduce": (("ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical",
                   "auto"), "ring"),
    "reduce_scatter": (("ring",), "ring"),
    "allgather": (("ring",), "ring"),
    "broadcast": (("tree",), "tree"),
    "reduce": (("tree",), "tree"),
    "alltoall": (("pairwise",), "pairwise"),
    "barrier": (("dissemination",), "dissemination"),
}
REDUCTIONS = ("allreduce", "reduce_scatter", "reduce")
DTYPE = np.dtype(np.int64)
HEADER_BYTES = 48  # checks.neighbour_check: (collective, count, op, dtype name x2, itemsize)
META_BYTES = 40  # allgather's row-count exchange: 5 int64 per rank
MAX_P = 32
READABLE_P = 8  # beyond this the state tables are left out and the schedule is abbreviated
MAX_ROWS = 64  # schedule rows shown before abbreviating
MAX_STATE_ELEMS = 48


class ExplainError(Exception):
    """The rebuilt schedule disagrees with what ran (a bug in the explainer or the code)."""


# -- the model: each algorithm's schedule, replayed on the example values ---------------------
@dataclass
class Send:
    col: int  # the column (step) of the explained schedule
    label: str  # the phase and its step, e.g. "reduce-scatter 1"
    src: int
    dst: int
    tag: str  # as the trace names it (describe_tag)
    nbytes: int
    lo: int | None = None  # element range [lo, hi) of the buffer it carries, if data
    hi: int | None = None
    block: str = "-"
    action: str = ""
    payload: np.ndarray | None = None  # the values it must carry; None: a control message
    elems: str | None = None  # overrides the element range shown
    every: str | None = None  # a control message every rank sends alike: shown as one row
    traced: object = None  # the trace's Message, once verified


class Model:
    """Every rank's buffer (values, and a bitmask of the ranks whose inputs each element holds;
    0 = this rank holds nothing there), the sends so far, and notes for the state table."""

    def __init__(self, p, length):
        self.p = p
        self.vals = [np.zeros(length, DTYPE) for _ in range(p)]
        self.masks = [np.zeros(length, np.int64) for _ in range(p)]
        self.notes = [""] * p
        self.col = 0
        self.sends = []

    def take(self, r, lo, hi):
        return self.vals[r][lo:hi].copy(), self.masks[r][lo:hi].copy()

    def send(self, src, dst, tag, label, payload=None, lo=None, hi=None, block="-", action="",
             nbytes=None, elems=None, every=None):
        vals = None if payload is None else payload[0]
        if nbytes is None:
            nbytes = vals.size * DTYPE.itemsize
        self.sends.append(Send(self.col, label, src, dst, tag, nbytes, lo, hi, block, action,
                               vals, elems, every))

    def reduce_into(self, r, lo, hi, payload):
        self.vals[r][lo:hi] += payload[0]
        self.masks[r][lo:hi] |= payload[1]

    def copy_into(self, r, lo, hi, payload):
        self.vals[r][lo:hi] = payload[0]
        self.masks[r][lo:hi] = payload[1]

    def drop(self, r, lo, hi):
        """Rank r no longer holds a live value in [lo, hi) (it handed it on)."""
        self.masks[r][lo:hi] = 0


def tag_name(tag, offset=0):
    return describe_tag(int(tag) + offset * Tag.VIEW_STRIDE)


def block_range(names, first, last):
    """'b2' or 'b0-b3': the name of blocks [first, last)."""
    if last - first == 1:
        return names[first]
    return f"{names[first]}-{names[last - 1]}"


def header_check(M, p):
    """checks.neighbour_check: every rank sends its call's description to its right
    neighbour before a ring (allreduce ring/hierarchical, reduce_scatter)."""
    if p == 1:
        return
    for r in range(p):
        M.send(r, (r + 1) % p, "header", "check", nbytes=HEADER_BYTES, every="r -> r+1",
               action="checks count, dtype, op match")
    yield "check"


def ring_reduce_scatter(M, group, lo, counts, names, offset=0, phase="reduce-scatter"):
    """ring.reduce_scatter: at step s member i sends block (i - s - 1) % k to i + 1, which
    reduces its own input into it. Empty blocks send no message (no segments)."""
    k = len(group)
    if k == 1:
        return
    starts = Partition(counts).starts
    tag = tag_name(Tag.RING_REDUCE_SCATTER, offset)
    for s in range(k - 1):
        moves = []
        for i, r in enumerate(group):
            b = (i - s - 1) % k
            if counts[b]:
                a, z = lo + starts[b], lo + starts[b + 1]
                moves.append((r, group[(i + 1) % k], b, a, z, M.take(r, a, z)))
        for r, dst, b, a, z, pay in moves:
            M.send(r, dst, tag, f"{phase} {s}", pay, a, z, names[b],
                   f"reduce into {names[b]} (+ its input)")
            M.reduce_into(dst, a, z, pay)
        yield f"{phase} {s}"


def ring_allgather(M, group, lo, counts, names, offset=0, phase="all-gather"):
    """ring.allgather: at step s member i sends block (i - s) % k to i + 1, which stores it."""
    k = len(group)
    if k == 1:
        return
    starts = Partition(counts).starts
    tag = tag_name(Tag.RING_ALLGATHER, offset)
    for s in range(k - 1):
        moves = []
        for i, r in enumerate(group):
            b = (i - s) % k
            if counts[b]:
                a, z = lo + starts[b], lo + starts[b + 1]
                moves.append((r, group[(i + 1) % k], b, a, z, M.take(r, a, z)))
        for r, dst, b, a, z, pay in moves:
            M.send(r, dst, tag, f"{phase} {s}", pay, a, z, names[b], f"copy into {names[b]}")
            M.copy_into(dst, a, z, pay)
        yield f"{phase} {s}"


def _sub_names(name, parts):
    """Block names: b0, b1, ... at the top; b2.0, b2.1, ... inside hierarchical's block b2."""
    return [f"b{b}" if name == "all" else f"{name}.{b}" for b in range(parts)]


def ring_allreduce(M, group, lo, m, offset=0, prefix="", name="all"):
    k = len(group)
    counts = Partition.even(m, k).counts
    names = _sub_names(name, k)
    yield from ring_reduce_scatter(M, group, lo, counts, names, offset,
                                   f"{prefix}reduce-scatter")
    yield from ring_allgather(M, group, lo, counts, names, offset, f"{prefix}all-gather")


def _fold_in(M, group, lo, m, offset, prefix, name):
    """recursive_doubling.fold_in: even members below 2 rem hand everything to the odd one
    above and sit out until the unfold."""
    k = len(group)
    _, rem = fold(k)
    if not rem:
        return
    for i in range(0, 2 * rem, 2):
        r, up = group[i], group[i + 1]
        pay = M.take(r, lo, lo + m)
        M.send(r, up, tag_name(Tag.RD_FOLD, offset), f"{prefix}fold", pay, lo, lo + m, name,
               f"reduce into {name} (+ its own)")
        M.reduce_into(up, lo, lo + m, pay)
        M.drop(r, lo, lo + m)
        M.notes[r] = f"sits out (folded into rank {up})"
    yield f"{prefix}fold"


def _fold_out(M, group, lo, m, offset, prefix, name):
    k = len(group)
    _, rem = fold(k)
    if not rem:
        return
    for i in range(1, 2 * rem, 2):
        r, down = group[i], group[i - 1]
        pay = M.take(r, lo, lo + m)
        M.send(r, down, tag_name(Tag.RD_UNFOLD, offset), f"{prefix}unfold", pay, lo, lo + m,
               name, f"copy into {name} (the result)")
        M.copy_into(down, lo, lo + m, pay)
        M.notes[down] = ""
    yield f"{prefix}unfold"


def rd_allreduce(M, group, lo, m, offset=0, prefix="", name="all"):
    """recursive_doubling: fold, log2 p' whole-buffer exchanges with r XOR 2^k, unfold."""
    k = len(group)
    if k == 1:
        return
    core, rem = fold(k)
    yield from _fold_in(M, group, lo, m, offset, prefix, name)
    mask, step = 1, 0
    while mask < core:
        moves = []
        for me in range(core):
            r, peer = group[real_rank(me, rem)], group[real_rank(me ^ mask, rem)]
            moves.append((r, peer, M.take(r, lo, lo + m)))
        for r, peer, pay in moves:
            M.send(r, peer, tag_name(Tag.RD_EXCHANGE, offset), f"{prefix}exchange {step}", pay,
                   lo, lo + m, name, f"reduce into {name} (+ its own)")
            M.reduce_into(peer, lo, lo + m, pay)
        yield f"{prefix}exchange {step}"
        mask, step = mask << 1, step + 1
    yield from _fold_out(M, group, lo, m, offset, prefix, name)


def rab_allreduce(M, group, lo, m, offset=0, prefix="", name="all"):
    """rabenseifner: fold; recursive halving over p' blocks (mask p'/2 .. 1, the member with
    the mask bit keeps the upper half); recursive doubling back (mask 1 .. p'/2); unfold."""
    k = len(group)
    if k == 1:
        return
    core, rem = fold(k)
    yield from _fold_in(M, group, lo, m, offset, prefix, name)
    start = Partition.even(m, core).starts
    names = _sub_names(name, core)
    held = {me: (0, core) for me in range(core)}
    mask, step = core >> 1, 0
    while mask:
        moves = []
        for me in range(core):
            r, peer = group[real_rank(me, rem)], group[real_rank(me ^ mask, rem)]
            first, last = held[me]
            mid = (first + last) // 2
            keep, give = ((mid, last), (first, mid)) if me & mask else ((first, mid),
                                                                        (mid, last))
            a, z = lo + start[give[0]], lo + start[give[1]]
            moves.append((me, r, peer, keep, give, a, z, M.take(r, a, z)))
        for me, r, peer, keep, give, a, z, pay in moves:
            blocks = block_range(names, *give)
            M.send(r, peer, tag_name(Tag.RAB_HALVING, offset), f"{prefix}halving {step}", pay,
                   a, z, blocks, f"reduce into {blocks} (+ its own)")
            M.reduce_into(peer, a, z, pay)
        for me, r, peer, keep, give, a, z, pay in moves:
            M.drop(r, a, z)
            held[me] = keep
        yield f"{prefix}halving {step}"
        mask, step = mask >> 1, step + 1
    mask, step = 1, 0
    while mask < core:
        moves = []
        for me in range(core):
            r, peer = group[real_rank(me, rem)], group[real_rank(me ^ mask, rem)]
            first, last = held[me]
            a, z = lo + start[first], lo + start[last]
            moves.append((me, r, peer, first, last, a, z, M.take(r, a, z)))
        for me, r, peer, first, last, a, z, pay in moves:
            blocks = block_range(names, first, last)
            M.send(r, peer, tag_name(Tag.RAB_DOUBLING, offset), f"{prefix}doubling {step}",
                   pay, a, z, blocks, f"copy into {blocks}")
            M.copy_into(peer, a, z, pay)
        for me in range(core):
            first, last = held[me]
            other = held[me ^ mask]
            held[me] = (min(first, other[0]), max(last, other[1]))
        yield f"{prefix}doubling {step}"
        mask, step = mask << 1, step + 1
    yield from _fold_out(M, group, lo, m, offset, prefix, name)


def bruck_allreduce(M, group, lo, m, offset=0, prefix="", name="all"):
    """bruck: at step k (d = 2^k) member i sends its first c = min(d, k - have) slots to
    i - d and receives c slots from i + d; slot j then holds member (i + j)'s input. After
    the last step every member adds its slots up itself, in member order."""
    k = len(group)
    if k == 1:
        return
    # slots[r][j] = (member whose data it is, values, masks); slot j is member (i + j) % k's
    slots = {r: [(i, *M.take(r, lo, lo + m))] for i, r in enumerate(group)}
    have, d, step = 1, 1, 0
    while have < k:
        c = min(d, k - have)
        moves = [(r, group[(i - d) % k], slots[r][:c]) for i, r in enumerate(group)]
        for r, to, pay in moves:
            vals = np.concatenate([s[1] for s in pay])
            M.send(r, to, tag_name(Tag.BRUCK, offset), f"{prefix}bruck {step}", (vals, None),
                   lo, lo + m, f"slots 0-{c - 1}" if c > 1 else "slot 0",
                   f"copy into slots {have}-{have + c - 1}" if c > 1
                   else f"copy into slot {have}", elems=f"{c} x [{lo}:{lo + m})")
        for r, to, pay in moves:
            slots[to] = slots[to] + list(pay)  # slots[to] had `have` entries
        have, d = have + c, 2 * d
        for r in group:
            M.notes[r] = "holds the data of ranks " + _ranks(group[s[0]] for s in slots[r])
        if have == k:
            for r in group:
                by_member = sorted(slots[r], key=lambda s: s[0])
                total = np.sum([s[1] for s in by_member], axis=0)
                mask = np.bitwise_or.reduce([s[2] for s in by_member], axis=0)
                M.copy_into(r, lo, lo + m, (total, mask))
                M.notes[r] = "added up its slots, in rank order"
        yield f"{prefix}bruck {step}"
        step += 1


INNER = {"ring": ring_allreduce, "recursive_doubling": rd_allreduce,
         "rabenseifner": rab_allreduce, "bruck": bruck_allreduce}


def concurrent(M, jobs):
    """Run generators side by side, one step per column: jobs is a list of (ranks, generator)
    in program order; a job starts once every earlier job sharing a rank with it is done."""
    pending, active, busy = list(jobs), [], set()
    while pending or active:
        blocked = set()
        for job in list(pending):
            ranks = set(job[0])
            if not (ranks & busy) and not (ranks & blocked):
                pending.remove(job)
                active.append(job)
                busy |= ranks
            blocked |= ranks
        labels = []
        for job in list(active):
            try:
                labels.append(next(job[1]))
            except StopIteration:
                active.remove(job)
                busy -= set(job[0])
        if labels:
            yield _merge(labels)


def _merge(labels):
    """['b0 cross-node exchange 0', 'b1 cross-node exchange 0'] -> 'cross-node exchange 0
    (b0, b1)': one column's label when several groups take the same step side by side."""
    groups = {}
    for label in labels:
        head, _, rest = label.partition(" ")
        if head[:1] == "b" and head[1:].isdigit() and rest:
            groups.setdefault(rest, []).append(head)
        else:
            groups.setdefault(label, [])
    return "; ".join(f"{rest} ({', '.join(heads)})" if heads else rest
                     for rest, heads in groups.items())


def hierarchical_allreduce(M, p, n, nodes, inner):
    """hierarchical: ring reduce-scatter inside each node over L = max node size blocks (local
    rank i of a k-rank node owns blocks [i L // k, (i + 1) L // k)), one `inner` all-reduce
    per block among its owners on every node, ring all-gather inside each node."""
    L = max(len(m) for m in nodes)
    part = Partition.even(n, L)
    names = [f"b{b}" for b in range(L)]
    yield from header_check(M, p)
    local = []
    for m in nodes:
        k = len(m)
        owned = [owned_blocks(i, k, L) for i in range(k)]
        local.append((m, [part.starts[z] - part.starts[a] for a, z in owned],
                      [block_range(names, a, z) for a, z in owned]))
    yield from concurrent(M, [(m, ring_reduce_scatter(M, m, 0, counts, labels, 1,
                                                      "node reduce-scatter"))
                              for m, counts, labels in local])
    jobs = []
    for b in range(L):
        group = [m[owner(b, len(m), L)] for m in nodes]
        jobs.append((group, INNER[inner](M, group, part.starts[b], part.counts[b], 2 + b,
                                         f"{names[b]} cross-node ", names[b])))
    yield from concurrent(M, jobs)
    yield from concurrent(M, [(m, ring_allgather(M, m, 0, counts, labels, 1, "node all-gather"))
                              for m, counts, labels in local])


def allgather_meta(M, p):
    """Communicator._exchange_rows: a ring all-gather of 5 int64 per rank (row count, row
    size, ndim, layout, out rows) before the data, with the same tag."""
    for s in range(p - 1):
        for r in range(p):
            M.send(r, (r + 1) % p, "ring_allgather", f"row counts {s}", nbytes=META_BYTES,
                   every="r -> r+1", block="counts",
                   action=f"stores rank (r - {s})'s row count")
        yield f"row counts {s}"


def tree_broadcast(M, p, root):
    """tree.broadcast: v = (rank - root) % p; in round j (mask = top >> j) every v that is a
    multiple of 2 mask sends the whole buffer to v + mask."""
    if p == 1:
        return
    mask, j = 1 << ((p - 1).bit_length() - 1), 0
    while mask:
        moves = []
        for v in range(0, p, 2 * mask):
            if v + mask < p:
                r = (v + root) % p
                moves.append((r, (v + mask + root) % p, M.take(r, 0, len(M.vals[r]))))
        for r, dst, pay in moves:
            M.send(r, dst, "bcast", f"round {j}", pay, 0, len(pay[0]), "all", "copy into all")
            M.copy_into(dst, 0, len(pay[0]), pay)
        yield f"round {j}"
        mask, j = mask >> 1, j + 1


def tree_reduce(M, p, root):
    """tree.reduce: in round j (mask = 2^j) every v = mask (mod 2 mask) sends its partial
    result to v - mask, which adds it to its own (lower v first)."""
    mask, j = 1, 0
    while mask < p:
        moves = []
        for v in range(mask, p, 2 * mask):
            r = (v + root) % p
            moves.append((r, (v - mask + root) % p, M.take(r, 0, len(M.vals[r]))))
        for r, dst, pay in moves:
            M.send(r, dst, "reduce", f"round {j}", pay, 0, len(pay[0]), "all",
                   "reduce into its partial result")
            M.reduce_into(dst, 0, len(pay[0]), pay)
        for r, dst, pay in moves:
            M.drop(r, 0, len(pay[0]))
            M.notes[r] = f"done (sent its partial result to rank {dst})"
        yield f"round {j}"
        mask, j = mask << 1, j + 1


def pairwise_alltoall(M, p, inputs, part):
    """alltoall: at step s (1 .. p-1) rank r sends its block (r + s) % p to rank r + s and
    receives rank r - s's block for it."""
    for s in range(1, p):
        for r in range(p):
            to = (r + s) % p
            sl = part.slices[to]
            pay = (inputs[r][sl].copy(), np.full(part.counts[to], 1 << r, np.int64))
            dst_sl = part.slices[r]
            M.send(r, to, "alltoall", f"exchange {s}", pay, sl.start, sl.stop, f"b{to}",
                   f"copy into its b{r}",
                   elems=f"[{sl.start}:{sl.stop}) -> [{dst_sl.start}:{dst_sl.stop})")
            M.copy_into(to, dst_sl.start, dst_sl.stop, pay)
        yield f"exchange {s}"


def dissemination_barrier(M, p, known):
    """barrier: in round k (d = 2^k) rank r sends a 1-byte token to r + d and waits for one
    from r - d; it then knows everyone r - d knew had arrived."""
    d, k = 1, 0
    while d < p:
        before = list(known)
        for r in range(p):
            to = (r + d) % p
            M.send(r, to, "barrier", f"round {k}", nbytes=1, block="token",
                   action=f"now knows ranks {_ranks(_bits(before[r]))} arrived")
            known[to] |= before[r]
        for r in range(p):
            M.notes[r] = f"knows ranks {_ranks(_bits(known[r]))} have arrived"
        yield f"round {k}"
        d, k = d << 1, k + 1


# -- the example, and the real run ------------------------------------------------------------
@dataclass
class Example:
    collective: str
    algorithm: str
    p: int
    n: int
    root: int = 0
    nodes: list = field(default_factory=list)
    inner: str | None = None  # hierarchical's cross-node algorithm

    @property
    def base(self):
        return 10 ** max(1, len(str(max(self.n - 1, 0))))

    def inputs(self):
        """Rank r's input: element i is base r + i (allgather: rank r's block only)."""
        if self.collective == "allgather":
            counts = Partition.even(self.n, self.p).counts
            return [self.base * r + np.arange(counts[r], dtype=DTYPE) for r in range(self.p)]
        if self.collective == "barrier":
            return [np.zeros(0, DTYPE) for _ in range(self.p)]
        return [self.base * r + np.arange(self.n, dtype=DTYPE) for r in range(self.p)]

    def call(self):
        """fn(comm) that runs the collective on this rank's input and returns its result."""
        xs, name, root = self.inputs(), self.algorithm, self.root

        def run(comm):
            x = xs[comm.rank].copy()
            c = self.collective
            if c == "allreduce":
                return comm.allreduce(x, op="sum", algorithm=name)
            if c == "reduce_scatter":
                return comm.reduce_scatter(x, op="sum")
            if c == "allgather":
                return comm.allgather(x)
            if c == "broadcast":
                if comm.rank != root:
                    x[...] = -1
                return comm.broadcast(x, root=root)
            if c == "reduce":
                return comm.reduce(x, op="sum", root=root)
            if c == "alltoall":
                return comm.alltoall(x)
            return comm.barrier()
        return run

    def display_blocks(self):
        """(names, Partition) of the blocks the state table separates with '|'."""
        p, n, c, a = self.p, self.n, self.collective, self.algorithm
        if c in ("reduce_scatter", "allgather", "alltoall") or a == "ring":
            return [f"b{b}" for b in range(p)], Partition.even(n, p)
        if a == "rabenseifner":
            core = fold(p)[0]
            return [f"b{b}" for b in range(core)], Partition.even(n, core)
        if a == "hierarchical":
            L = max(len(m) for m in self.nodes)
            return [f"b{b}" for b in range(L)], Partition.even(n, L)
        return ["all"], Partition([n])


class _Payloads(Transport):
    """Forwards everything to `inner` (the tracing transport) and keeps a copy of each message
    this rank sends, as it is posted: (dst, tag, bytes). Views made from it pass through it,
    so their peers are already the real ranks."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.rank, self.size, self.progress = inner.rank, inner.size, inner.progress

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _note(self, buf, peer, tag):
        self.log.append((peer, describe_tag(tag), np.array(buf, copy=True)))

    def isend(self, buf, peer, tag):
        self._note(buf, peer, tag)
        return self.inner.isend(buf, peer, tag)

    def send(self, buf, peer, tag):
        self._note(buf, peer, tag)
        self.inner.send(buf, peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._note(sendbuf, dest, tag)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def bind_send(self, buf, peer, tag):
        call = self.inner.bind_send(buf, peer, tag)

        def step():
            self._note(buf, peer, tag)
            call()
        return _keep_at(step, call)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        call = self.inner.bind_sendrecv(sendbuf, dest, recvbuf, source, tag)

        def step():
            self._note(sendbuf, dest, tag)
            call()
        return _keep_at(step, call)

    def bind_recv(self, buf, peer, tag):
        return self.inner.bind_recv(buf, peer, tag)

    def irecv(self, buf, peer, tag):
        return self.inner.irecv(buf, peer, tag)

    def recv(self, buf, peer, tag):
        self.inner.recv(buf, peer, tag)

    def wait(self, req):
        self.inner.wait(req)

    def waitall(self, reqs):
        self.inner.waitall(reqs)

    def test(self, req):
        return self.inner.test(req)

    def fail(self, exc, why=None):
        return self.inner.fail(exc, why)


def _keep_at(step, call):
    at = getattr(call, "at", None)
    if at is not None:
        step.at = at
    return step


def run(ex, local_size=None):
    """Run the example for real: (results by rank, Trace, payload logs by rank)."""
    from .communicator import simulate

    logs = [[] for _ in range(ex.p)]
    call = ex.call()

    def fn(comm):
        # Communicator internals: put the payload recorder in front of simulate's tracing
        # transport for this one call (the trace records nothing of the payloads).
        tracing = comm._t
        comm._swap_transport(_Payloads(tracing, logs[comm.rank]))
        try:
            return call(comm)
        finally:
            comm._swap_transport(tracing)

    segment = max(64, ex.n * DTYPE.itemsize)  # one message per block: no pipeline segments
    results, trace = simulate(ex.p, fn, timeout=60, local_size=local_size, debug=False,
                              segment_bytes=segment, tuning=False, cost_model=CostModel())
    return results, trace, logs


def build_model(ex):
    """The schedule and the buffers after each step: (Model, [(label, state rows)])."""
    p, n = ex.p, ex.n
    xs = ex.inputs()
    length = n if ex.collective != "barrier" else 0
    M = Model(p, length)
    known = [1 << r for r in range(p)]
    c, a = ex.collective, ex.algorithm
    if c in ("allreduce", "reduce_scatter", "reduce"):
        for r in range(p):
            M.vals[r][:] = xs[r]
            M.masks[r][:] = 1 << r
    if c == "allreduce":
        if a == "hierarchical":
            gen = hierarchical_allreduce(M, p, n, ex.nodes, ex.inner)
        else:
            checked = a == "ring"

            def gen_flat():
                if checked:
                    yield from header_check(M, p)
                yield from INNER[a](M, list(range(p)), 0, n)
            gen = gen_flat()
    elif c == "reduce_scatter":
        counts = Partition.even(n, p).counts

        def gen_rs():
            yield from header_check(M, p)
            yield from ring_reduce_scatter(M, list(range(p)), 0, counts,
                                           [f"b{b}" for b in range(p)])
        gen = gen_rs()
    elif c == "allgather":
        part = Partition.even(n, p)
        for r in range(p):
            M.vals[r][part.slices[r]] = xs[r]
            M.masks[r][part.slices[r]] = 1 << r

        def gen_ag():
            yield from allgather_meta(M, p)
            yield from ring_allgather(M, list(range(p)), 0, part.counts,
                                      [f"b{b}" for b in range(p)])
        gen = gen_ag()
    elif c == "broadcast":
        M.vals[ex.root][:] = xs[ex.root]
        M.masks[ex.root][:] = 1 << ex.root
        gen = tree_broadcast(M, p, ex.root)
    elif c == "reduce":
        gen = tree_reduce(M, p, ex.root)
    elif c == "alltoall":
        part = Partition.even(n, p)
        for r in range(p):
            M.vals[r][part.slices[r]] = xs[r][part.slices[r]]
            M.masks[r][part.slices[r]] = 1 << r
        gen = pairwise_alltoall(M, p, xs, part)
    else:
        gen = dissemination_barrier(M, p, known)
    states = [("start", _snapshot(M))]
    M.col = 0
    for label in gen:
        states.append((label, _snapshot(M)))
        M.col += 1
    M.known = known
    return M, states


def _snapshot(M):
    return [(M.vals[r].copy(), M.masks[r].copy(), M.notes[r]) for r in range(M.p)]


# -- checking the model against the run -------------------------------------------------------
def verify(ex, M, results, trace, logs):
    """Raise ExplainError unless every message of the run is the model's, in order, with the
    model's values, and the final buffers are the run's results and NumPy's."""
    p = ex.p
    for msg in trace.messages:
        if msg.collective != ex.collective:
            raise ExplainError(f"the trace has a message of {msg.collective!r}, not "
                               f"{ex.collective!r}: {msg}")
    by_src = {r: sorted((m for m in trace.messages if m.src == r), key=lambda m: m.index)
              for r in range(p)}
    for r in range(p):
        ran, sent = by_src[r], logs[r]
        want = [s for s in M.sends if s.src == r]
        if len(ran) != len(sent) or any((m.dst, m.tag, m.nbytes) != (d, t, b.nbytes)
                                        for m, (d, t, b) in zip(ran, sent)):
            raise ExplainError(f"rank {r}: the payload recorder and the trace disagree")
        for i in range(max(len(ran), len(want))):
            got = ran[i] if i < len(ran) else None
            exp = want[i] if i < len(want) else None
            if got is None or exp is None or (got.dst, got.tag, got.nbytes) != (
                    exp.dst, exp.tag, exp.nbytes):
                raise ExplainError(
                    f"rank {r}'s message #{i}: the schedule says {_describe(exp)}, the run "
                    f"sent {_describe_msg(got)}")
            if exp.payload is not None:
                data = sent[i][2]
                if data.dtype != DTYPE or not np.array_equal(data, exp.payload):
                    raise ExplainError(
                        f"rank {r}'s message #{i} ({_describe(exp)}): the schedule says it "
                        f"carries {_values(exp.payload)}, the run sent {_values(data)}")
            exp.traced = got
    for (src, dst, tag) in {(s.src, s.dst, s.tag) for s in M.sends}:
        want = [s.nbytes for s in M.sends if (s.src, s.dst, s.tag) == (src, dst, tag)]
        got = [x.nbytes for x in sorted(trace.receives, key=lambda x: x.order)
               if (x.src, x.dst, x.tag) == (src, dst, tag)]
        if want != got:
            raise ExplainError(f"rank {dst} posted receives of {got} bytes from rank {src} "
                               f"({tag}); the schedule sends {want}")
    if len(trace.receives) != len(M.sends):
        raise ExplainError(f"the run posted {len(trace.receives)} receives for "
                           f"{len(M.sends)} messages")
    _check_results(ex, M, results)


def _check_results(ex, M, results):
    p, xs = ex.p, ex.inputs()
    full = (1 << p) - 1
    c = ex.collective
    if c == "barrier":
        if any(k != full for k in M.known):
            raise ExplainError("the barrier's schedule lets a rank leave early")
        return
    if c in ("allreduce", "reduce_scatter", "reduce"):
        oracle = np.sum(xs, axis=0) if p else None
    elif c == "allgather":
        oracle = np.concatenate(xs)
    elif c == "broadcast":
        oracle = xs[ex.root]
    part = Partition.even(ex.n, p)
    for r in range(p):
        if c == "alltoall":
            want = np.concatenate([xs[j][part.slices[r]] for j in range(p)])
            model, where = M.vals[r], slice(None)
        elif c == "reduce_scatter":
            want, where = oracle[part.slices[r]], part.slices[r]
        elif c == "reduce" and r != ex.root:
            if results[r] is not None:
                raise ExplainError(f"reduce returned {results[r]!r} on rank {r}, not None")
            continue
        else:
            want, where = oracle, slice(None)
        model = M.vals[r][where]
        got = np.asarray(results[r]).reshape(-1)
        if not np.array_equal(got, want):
            raise ExplainError(f"rank {r}: the {c} returned {_values(got)}, NumPy says "
                               f"{_values(want)}")
        if not np.array_equal(model, want):
            raise ExplainError(f"rank {r}: the replayed schedule ends with {_values(model)}, "
                               f"the {c} returned {_values(got)}")
        expect_mask = full if c in ("allreduce", "reduce_scatter", "reduce") else None
        if expect_mask is not None and ex.n and not (M.masks[r][where] == expect_mask).all():
            raise ExplainError(f"rank {r}: the replayed schedule misses some rank's input")


def _describe(s):
    if s is None:
        return "no message"
    return f"{s.src} -> {s.dst} {s.tag} {s.nbytes} B"


def _describe_msg(m):
    if m is None:
        return "no message"
    return f"{m.src} -> {m.dst} {m.tag} {m.nbytes} B"


# -- closed forms: bytes per rank, and the alpha-beta-gamma cost ------------------------------
def _ring_elems(p, i, n):
    c = Partition.even(n, p).counts
    return 2 * n - c[i] - c[(i + 1) % p], 2 * n - c[(i - 1) % p] - c[i]


def _rd_elems(p, i, n):
    if p == 1:
        return 0, 0
    core, rem = fold(p)
    steps = core.bit_length() - 1
    if i < 2 * rem:
        return ((n, n) if i % 2 == 0 else ((steps + 1) * n, (steps + 1) * n))
    return steps * n, steps * n


def _rab_elems(p, i, n):
    if p == 1:
        return 0, 0
    core, rem = fold(p)
    me = core_rank(i, rem)
    if me < 0:
        return n, n
    start = Partition.even(n, core).starts
    steps = core.bit_length() - 1
    groups = sum(start[((me >> k) << k) + (1 << k)] - start[(me >> k) << k]
                 for k in range(steps))
    total = n - (start[me + 1] - start[me]) + groups + (n if i < 2 * rem else 0)
    return total, total


def _bruck_elems(p, i, n):
    return (p - 1) * n, (p - 1) * n


ELEMS = {"ring": _ring_elems, "recursive_doubling": _rd_elems, "rabenseifner": _rab_elems,
         "bruck": _bruck_elems}

FORMULA_TEXT = {
    "ring": "2n - c[r] - c[r+1] elements sent, 2n - c[r-1] - c[r] received (c[b]: block b's "
            "size, np.array_split; = 2(p-1)/p n each when p divides n), plus the 48-byte "
            "header check each way",
    "recursive_doubling": "log2(p') n each way (p' = largest power of two <= p); with a fold, "
                          "the even ranks below 2(p-p') send and receive n once, their odd "
                          "partners (log2(p') + 1) n",
    "rabenseifner": "n - c[me] + sum over k < log2 p' of the elements of the 2^k-block group "
                    "holding block me, each way (= 2(p'-1)/p' n when p' divides n); with a "
                    "fold, the even ranks below 2(p-p') n each way, their odd partners n more",
    "bruck": "(p-1) n each way",
    "hierarchical": "the 48-byte header check, plus a ring over the node's shards (as for ring: "
                    "2S - s[i] - s[i+1] sent, 2S - s[i-1] - s[i] received, s = shard sizes, "
                    "S = n), plus the cross-node algorithm's closed form on each block this "
                    "rank owns",
}


def _children(v, p):
    low = v & -v if v else 1 << (p - 1).bit_length()
    return sum(1 for k in range(low.bit_length()) if (1 << k) < low and v + (1 << k) < p)


def byte_formula(ex):
    """(text, [(sent, received) bytes per rank]) from the closed forms."""
    p, n, c, a, w = ex.p, ex.n, ex.collective, ex.algorithm, DTYPE.itemsize
    hdr = HEADER_BYTES if p > 1 else 0
    if c == "allreduce" and a != "hierarchical":
        rows = [ELEMS[a](p, r, n) for r in range(p)]
        extra = hdr if a == "ring" else 0
        return FORMULA_TEXT[a], [(s * w + extra, g * w + extra) for s, g in rows]
    if c == "allreduce":
        nodes, L = ex.nodes, max(len(m) for m in ex.nodes)
        part = Partition.even(n, L)
        rows = []
        for r in range(p):
            m = next(m for m in nodes if r in m)
            k, i = len(m), m.index(r)
            shards = [part.starts[z] - part.starts[y]
                      for y, z in (owned_blocks(j, k, L) for j in range(k))]
            sent = 2 * n - shards[i] - shards[(i + 1) % k]
            got = 2 * n - shards[(i - 1) % k] - shards[i]
            first, last = owned_blocks(i, k, L)
            for b in range(first, last):
                g = [mm[owner(b, len(mm), L)] for mm in nodes]
                s2, g2 = ELEMS[ex.inner](len(g), g.index(r), part.counts[b])
                sent, got = sent + s2, got + g2
            rows.append((sent * w + hdr, got * w + hdr))
        return FORMULA_TEXT[a] + f" (here {ex.inner})", rows
    cnt = Partition.even(n, p).counts
    if c == "reduce_scatter":
        return ("n - c[r] elements sent, n - c[r-1] received (c[b]: block b's size; "
                "(p-1)/p n when p divides n), plus the 48-byte header check each way",
                [((n - cnt[r]) * w + hdr, (n - cnt[(r - 1) % p]) * w + hdr) for r in range(p)])
    if c == "allgather":
        meta = (p - 1) * META_BYTES
        return ("n - c[r+1] elements sent, n - c[r] received (n: the gathered size; "
                "(p-1)/p n when p divides n), plus p-1 row-count messages of 40 bytes each way",
                [((n - cnt[(r + 1) % p]) * w + meta, (n - cnt[r]) * w + meta)
                 for r in range(p)])
    if c in ("broadcast", "reduce"):
        rows = []
        for r in range(p):
            v = (r - ex.root) % p
            kids, up = _children(v, p) * n * w, (n * w if v else 0)
            rows.append((kids, up) if c == "broadcast" else (up, kids))
        return ("n times the number of children in the binomial tree (v = (rank - root) % p: "
                "v + 2^j for each 2^j below v's lowest set bit), and n from the parent"
                + (" received" if c == "broadcast" else " sent"), rows)
    if c == "alltoall":
        each = (p - 1) * (n // p) * w
        return "(p-1)/p n each way (n: one rank's input)", [(each, each)] * p
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return "ceil(log2 p) one-byte tokens each way", [(rounds, rounds)] * p


def cost(ex, model=None):
    """(formula, [(term, count, unit, seconds)], total seconds) with CostModel's defaults."""
    cm = model or CostModel()
    p, nb, c, a = ex.p, ex.n * DTYPE.itemsize, ex.collective, ex.algorithm
    al, be, ga = cm.alpha, cm.beta, cm.gamma
    lg = math.ceil(math.log2(p)) if p > 1 else 0

    def terms(na, nbeta, ngamma):
        return [("a", na, "", na * al), ("b", nbeta, " B", nbeta * be),
                ("g", ngamma, " B", ngamma * ga)]

    core, rem = fold(p)
    steps = core.bit_length() - 1
    f = 1 if rem else 0
    if c == "allreduce":
        if a == "ring":
            text = "2(p-1) a + 2(p-1)/p n b + (p-1)/p n g"
            t = terms(2 * (p - 1), 2 * (p - 1) / p * nb, (p - 1) / p * nb)
        elif a == "recursive_doubling":
            text = "log2(p') (a + n b + n g) + fold (2 a + 2 n b + n g if p != p')"
            t = terms(steps + 2 * f, steps * nb + 2 * nb * f, steps * nb + nb * f)
        elif a == "rabenseifner":
            text = "2 log2(p') a + 2(p'-1)/p' n b + (p'-1)/p' n g + fold (2 a + 2 n b + n g)"
            t = terms(2 * steps + 2 * f, 2 * (core - 1) / core * nb + 2 * nb * f,
                      (core - 1) / core * nb + nb * f)
        elif a == "bruck":
            text = "ceil(log2 p) a + (p-1) n b + (p-1) n g"
            t = terms(lg, (p - 1) * nb, (p - 1) * nb)
        else:
            k = max(len(m) for m in ex.nodes)
            text = ("2(k-1) a + 2(k-1)/k n b + (k-1)/k n g inside the node, + the cheapest "
                    "flat all-reduce of n/k bytes across the N nodes")
            t = terms(2 * (k - 1), 2 * (k - 1) / k * nb, (k - 1) / k * nb)
            inner, secs = cm.cross_node(nb, ex.nodes) if p > 1 else ("-", 0.0)
            t.append((f"cross-node {inner} of {nb // k} B on {len(ex.nodes)} ranks", None, "",
                      secs))
        total = cm.allreduce(a, nb, p, ex.nodes if a == "hierarchical" else None)
        if p == 1:
            t = [(name, 0 if cnt is not None else None, u, 0.0) for name, cnt, u, _ in t]
        if a == "bruck" and nb > bruck_mod.MAX_BYTES:
            text += f" (CostModel: inf above {bruck_mod.MAX_BYTES} B, auto never picks it)"
        elif not math.isclose(sum(x[3] for x in t), total, rel_tol=1e-9, abs_tol=1e-15):
            raise ExplainError(f"the cost terms add up to {sum(x[3] for x in t)} s, "
                               f"CostModel.allreduce says {total} s")
        return text, t, total
    if c == "reduce_scatter":
        text, t = "(p-1) a + (p-1)/p n b + (p-1)/p n g", terms(p - 1, (p - 1) / p * nb,
                                                             (p - 1) / p * nb)
    elif c == "allgather":
        text, t = "(p-1) a + (p-1)/p n b", terms(p - 1, (p - 1) / p * nb, 0)
    elif c == "broadcast":
        text, t = "ceil(log2 p) (a + n b)", terms(lg, lg * nb, 0)
    elif c == "reduce":
        text, t = "ceil(log2 p) (a + n b + n g)", terms(lg, lg * nb, lg * nb)
    elif c == "alltoall":
        text, t = "(p-1) a + (p-1)/p n b", terms(p - 1, (p - 1) / p * nb, 0)
    else:
        text, t = "ceil(log2 p) a", terms(lg, 0, 0)
    return text, t, sum(x[3] for x in t)


# -- printing ---------------------------------------------------------------------------------
def _bits(mask):
    return [r for r in range(int(mask).bit_length()) if mask >> r & 1]


def _ranks(ranks):
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks, out, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _values(a, limit=40):
    text = "[" + " ".join(str(v) for v in np.asarray(a).tolist()) + "]"
    return text if len(text) <= limit else text[:limit - 4] + " ..]"


def _table(header, rows, right=()):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = ["{:>%d}" % w if i in right else "{:<%d}" % w for i, w in enumerate(widths)]
    lines = ["  ".join(f.format(str(x)) for f, x in zip(fmt, row)).rstrip()
             for row in [header, *rows]]
    return lines


def schedule_rows(M):
    """The schedule table's rows: one per message, in step order, except that a control
    message every rank sends alike (the header check, allgather's row counts) is one row."""
    rows, seen = [], set()
    for s in sorted(M.sends, key=lambda s: (s.col, s.src)):
        if s.every is not None:
            if (s.col, s.label) in seen:
                continue
            seen.add((s.col, s.label))
            rows.append((s.col, s.label, s.every, s.block, "-", s.nbytes, "-", s.action))
            continue
        elems = s.elems or (f"[{s.lo}:{s.hi})" if s.lo is not None else "-")
        vals = _values(s.payload, 28) if s.payload is not None else "-"
        rows.append((s.col, s.label, f"{s.src} -> {s.dst}", s.block, elems, s.nbytes, vals,
                     s.action))
    return rows


def schedule_lines(M):
    rows = schedule_rows(M)
    header = ("step", "phase", "send", "block", "elements", "bytes", "values", "receiver does")
    lines = _table(header, rows, right=(0, 5))
    if len(rows) > MAX_ROWS:
        left = len(rows) - MAX_ROWS
        lines = (lines[:1 + MAX_ROWS - 8]
                 + [f"... {left} more rows (all checked against the trace) ..."] + lines[-8:])
    return lines


def _who(mask, p):
    ranks = _bits(mask)
    return "all" if len(ranks) == p else "+".join(map(str, ranks))


def state_lines(ex, states, M):
    """Every rank's buffer after every step that moved data."""
    names, part = ex.display_blocks()
    data_cols = {s.col for s in M.sends if s.every is None}
    lines = []
    width = max([len(str(int(v))) for _, rows in states for vals, _, _ in rows
                 for v in vals] + [1])
    for step, (label, rows) in enumerate(states):
        if step and step - 1 not in data_cols:
            continue  # a control step (header check, row counts): no buffer changed
        lines.append("start:" if step == 0 else f"after step {step - 1} ({label}):")
        for r, (vals, masks, note) in enumerate(rows):
            if ex.collective == "barrier":
                lines.append(f"  r{r}  {note or 'has arrived'}")
                continue
            cells, sums = [], []
            for b, sl in enumerate(part.slices):
                cells.append(" ".join("." * width if not masks[i] else
                                      f"{int(vals[i]):>{width}}"
                                      for i in range(sl.start, sl.stop)))
                held = set(masks[sl].tolist())
                if ex.collective in REDUCTIONS and sl.stop > sl.start and held - {0, 1 << r}:
                    who = _who(held.pop(), ex.p) if len(held) == 1 else "mixed"
                    sums.append(f"{names[b]}={who}" if len(names) > 1 else f"sum of {who}")
            tail = "   ".join(x for x in ("  ".join(sums), note) if x)
            lines.append(f"  r{r}  [ {' | '.join(cells)} ]" + (f"   {tail}" if tail else ""))
    return lines


def bytes_lines(ex, trace):
    text, rows = byte_formula(ex)
    out = [f"Bytes per rank (int64: {DTYPE.itemsize} B an element, n = {ex.n} elements = "
           f"{ex.n * DTYPE.itemsize} B):"]
    out += textwrap.wrap(f"closed form: {text}", 94, initial_indent="  ",
                         subsequent_indent="    ")
    table, bad = [], []
    for r in range(ex.p):
        sent, got = trace.bytes_sent(r), trace.bytes_received(r)
        fs, fg = rows[r]
        ok = (sent, got) == (fs, fg)
        if not ok:
            bad.append(r)
        table.append((r, sent, fs, got, fg, "ok" if ok else "DIFFERS"))
    out += ["  " + x for x in _table(("rank", "sent (trace)", "formula", "received (trace)",
                                      "formula", ""), table, right=(0, 1, 2, 3, 4))]
    if bad:
        raise ExplainError("\n".join(out) + f"\nranks {bad}: the trace's bytes differ from "
                           "the closed form")
    return out


def cost_lines(ex):
    text, terms, total = cost(ex)
    cm = CostModel()
    out = [f"Cost (alpha-beta-gamma; ringcoll.CostModel defaults a = {cm.alpha * 1e6:g} us, "
           f"b = {cm.beta * 1e9:g} ns/B, g = {cm.gamma * 1e9:g} ns/B):",
           *textwrap.wrap(text, 94, initial_indent="  ", subsequent_indent="    "),
           f"  with p = {ex.p}, n = {ex.n * DTYPE.itemsize} B:"]
    shown = [(name if count is None else f"{_num(count)}{unit} {name}", secs)
             for name, count, unit, secs in terms if count is None or count]
    if shown:
        out.append("  = " + " + ".join(d for d, _ in shown))
        out.append("  = " + " + ".join(f"{s * 1e6:.4f} us" for _, s in shown)
                   + f" = {total * 1e6:.4f} us")
    else:
        out.append("  = 0 (one rank: nothing to send)")
    if _has_header(ex) and ex.p > 1:
        out.append("  (the model leaves out the 48-byte header check, one more a)")
    return out


def _has_header(ex):
    return ex.collective == "reduce_scatter" or (
        ex.collective == "allreduce" and ex.algorithm in ("ring", "hierarchical"))


def _num(x):
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def explain(ex, out=print, local_size=None):
    """Run, check and print one example; returns (Model, states, trace)."""
    results, trace, logs = run(ex, local_size)
    M, states = build_model(ex)
    verify(ex, M, results, trace, logs)
    p, n = ex.p, ex.n
    what = f"{ex.collective} ({ex.algorithm}) on p = {p} ranks"
    if ex.collective != "barrier":
        what += f", n = {n} int64 elements"
    if ex.algorithm == "hierarchical":
        what += f", nodes {ex.nodes}, cross-node algorithm {ex.inner}"
    if ex.collective in ("broadcast", "reduce"):
        what += f", root {ex.root}"
    out(f"ringcoll explain: {what}")
    xs = ex.inputs()
    if ex.collective != "barrier":
        base = ex.base
        out(f"Inputs: rank r's element i is {base} r + i"
            + (" (allgather: rank r contributes block r)" if ex.collective == "allgather"
               else "") + (" (only the root's matters)" if ex.collective == "broadcast"
                           else ""))
        if p <= READABLE_P and n <= MAX_STATE_ELEMS:
            for r in range(p):
                out(f"  r{r}  {_values(xs[r], 10 ** 6)}")
    names, part = ex.display_blocks()
    if len(names) > 1 and ex.collective != "barrier":
        out("Blocks: " + ", ".join(f"{nm} = [{sl.start}:{sl.stop})"
                                   for nm, sl in zip(names, part.slices)))
    out("")
    ncols = len(states) - 1
    out(f"Schedule: {len(M.sends)} messages in {ncols} steps (each checked against the run: "
        "order, peer, tag, bytes, values)")
    for line in schedule_lines(M):
        out("  " + line)
    out("")
    if p <= READABLE_P and n <= MAX_STATE_ELEMS:
        legend = {"barrier": "After each round:"}.get(ex.collective, (
            "Buffers after each step ('.': nothing held there"
            + ("; b2=0+3: block b2 holds the sum of\nranks 0 and 3's inputs; all: of every "
               "rank's):" if ex.collective in REDUCTIONS else "):")))
        out(legend)
        for line in state_lines(ex, states, M):
            out("  " + line)
        out("")
    else:
        out(f"(buffers after each step left out for p > {READABLE_P} or n > "
            f"{MAX_STATE_ELEMS}; they were checked all the same)")
        out("")
    out(_result_line(ex, results))
    out("")
    for line in bytes_lines(ex, trace):
        out(line)
    out("")
    for line in cost_lines(ex):
        out(line)
    return M, states, trace


def _result_line(ex, results):
    c = ex.collective
    if c == "barrier":
        return "Result: every rank has heard, directly or through others, from every rank."
    if c == "allreduce":
        return (f"Result on every rank: {_values(results[0], 200)} = np.sum(inputs, axis=0) "
                "(checked on every rank)")
    if c == "reduce_scatter":
        return "Result: rank r holds block r of np.sum(inputs, axis=0) (checked on every rank)"
    if c == "allgather":
        return (f"Result on every rank: {_values(results[0], 200)} = np.concatenate(inputs) "
                "(checked on every rank)")
    if c == "broadcast":
        return f"Result on every rank: {_values(results[0], 200)}, the root's input (checked)"
    if c == "reduce":
        return (f"Result on rank {ex.root}: {_values(results[ex.root], 200)} = "
                "np.sum(inputs, axis=0); None on the others (checked)")
    return "Result: rank r's block j is rank j's block r (checked on every rank)"


def figure(ex, M, states, path):
    """ranks as lanes (rank 0 on top), steps as columns, an arrow per message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, ncols = ex.p, max(1, len(states) - 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * ncols + 1.5), max(2.5, 0.8 * p + 1.2)))
    for r in range(p):
        ax.axhline(r, color="0.85", lw=1, zorder=0)
    if ex.algorithm == "hierarchical":  # the nodes, shaded in turn
        for i, node in enumerate(ex.nodes):
            if i % 2 == 0:
                ax.axhspan(node[0] - 0.5, node[-1] + 0.5, color="0.96", zorder=-1)
    for s in M.sends:
        x0, x1 = s.col + 0.1, s.col + 0.9
        ax.annotate("", xy=(x1, s.dst), xytext=(x0, s.src),
                    arrowprops=dict(arrowstyle="->", lw=1.2,
                                    color="C0" if s.payload is not None else "0.5"))
        if s.block != "-":  # a third of a lane from the sender: crossing labels stay apart
            f = min(0.5, 0.35 / abs(s.dst - s.src)) if s.dst != s.src else 0.5
            ax.text(x0 + f * (x1 - x0), s.src + f * (s.dst - s.src), s.block, fontsize=7,
                    ha="center", va="center",
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none"))
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, ncols)
    ax.set_xticks([c + 0.5 for c in range(ncols)],
                  [_short(label) for label, _ in states[1:]] or [""], fontsize=7, rotation=30,
                  ha="right")
    for c in range(ncols + 1):
        ax.axvline(c, color="0.92", lw=0.8, zorder=0)
    title = f"{ex.collective} ({ex.algorithm}), p = {p}, n = {ex.n}"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _short(label, limit=28):
    return label if len(label) <= limit else label[:limit - 2] + ".."


# -- the command ------------------------------------------------------------------------------
def parser():
    ap = argparse.ArgumentParser(
        prog="ringcoll explain",
        description="Run one collective on small example numbers (thread ranks) and print "
                    "its schedule step by step, every rank's buffer after each step, the "
                    "bytes per rank beside the closed form, and the alpha-beta-gamma cost. "
                    "Every row is checked against the messages that really ran.")
    ap.add_argument("collective", choices=list(COLLECTIVES))
    ap.add_argument("--algorithm", "-a", help="allreduce: ring (default), recursive_doubling, "
                    "rabenseifner, bruck, hierarchical, auto; the others have one")
    ap.add_argument("-p", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("-n", type=int, default=None,
                    help="elements (int64) per rank; allgather: of the gathered result; "
                         "alltoall: a multiple of p (default 2p)")
    ap.add_argument("--local-size", type=int, default=None,
                    help="hierarchical: ranks per node (default ceil(p/2))")
    ap.add_argument("--root", type=int, default=0, help="broadcast, reduce: the root")
    ap.add_argument("--png", metavar="FILE", help="also draw the schedule into FILE "
                    "(needs matplotlib: pip install -e '.[bench]')")
    return ap


def example_from_args(args):
    """An Example from parsed arguments, or raise ValueError with what is wrong."""
    algos, default = COLLECTIVES[args.collective]
    name = args.algorithm or default
    if name not in algos:
        raise ValueError(f"{args.collective} has no algorithm {name!r}; choose one of "
                         f"{', '.join(algos)}")
    p = args.p
    if not 1 <= p <= MAX_P:
        raise ValueError(f"-p must be between 1 and {MAX_P}, got {p}")
    n = 2 * p if args.n is None else args.n
    if not 0 <= n <= 1 << 16:
        raise ValueError(f"-n must be between 0 and 65536, got {n}")
    if args.collective == "alltoall" and n % p:
        raise ValueError(f"alltoall sends one equal block to each rank: n must be a multiple "
                         f"of p = {p} (try -n {p * max(1, -(-n // p))})")
    if args.collective in ("broadcast", "reduce") and not 0 <= args.root < p:
        raise ValueError(f"--root must be a rank, 0 .. {p - 1}")
    local = None
    if args.local_size is not None and name not in ("hierarchical", "auto"):
        raise ValueError("--local-size is for --algorithm hierarchical")
    if name in ("hierarchical", "auto"):
        local = args.local_size or (-(-p // 2) if name == "hierarchical" else None)
        if local is not None and local < 1:
            raise ValueError(f"--local-size must be >= 1, got {local}")
    nodes = ([list(range(i, min(i + local, p))) for i in range(0, p, local)] if local
             else [list(range(p))])
    if name == "auto":
        from .communicator import run_threads

        name = run_threads(p, lambda c: c.auto_algorithm(n * DTYPE.itemsize), tuning=False,
                           local_size=local, cost_model=CostModel())[0]
        print(f"ringcoll explain: auto picks {name} for {n * DTYPE.itemsize} B on {p} ranks "
              "(the cost model; no tuning table on thread ranks)")
    inner = None
    if name == "hierarchical":
        inner = CostModel().cross_node(n * DTYPE.itemsize, nodes)[0] if p > 1 else "ring"
    ex = Example(args.collective, name, p, n, args.root, nodes, inner)
    return ex, (local if name == "hierarchical" else None)


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        ex, local = example_from_args(args)
    except ValueError as exc:
        print(f"ringcoll explain: {exc}", file=sys.stderr)
        return 2
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ringcoll explain: --png needs matplotlib: pip install -e '.[bench]' "
                  "(or pip install matplotlib)", file=sys.stderr)
            return 2
    if ex.p > READABLE_P:
        print(f"ringcoll explain: p = {ex.p} > {READABLE_P}: the buffers are left out and "
              f"the schedule shows {MAX_ROWS} rows", file=sys.stderr)
    try:
        M, states, _ = explain(ex, local_size=local)
    except BrokenPipeError:  # | head: stop quietly, as other commands do
        sys.stdout = open(os.devnull, "w")
        return 0
    except ExplainError as exc:
        print(f"ringcoll explain: the explained schedule disagrees with the run:\n{exc}",
              file=sys.stderr)
        return 1
    if args.png:
        figure(ex, M, states, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
