"""`ringcoll explain`: run one collective on small numbers and show every step of it.

    python -m ringcoll explain allreduce --algorithm ring -p 4 -n 8
    python -m ringcoll explain allreduce --algorithm hierarchical -p 5 --local-size 3
    python -m ringcoll explain broadcast -p 6 --root 2 --png bcast.png

It runs the real algorithm on p thread ranks (ringcoll.simulate), on int64 inputs that are easy
to add up by hand (rank r's element i is 10 r + i, or 100 r + i from n = 11 on), and prints

1. the schedule: every message of the run, which block of whose inputs it carries, from which
   buffer into which, the bytes, the values, and what the receiver made of them;
2. every rank's buffer after every step, with the ranks whose inputs each block now holds;
3. the bytes each rank sent and received (from the trace) beside the closed form, and the
   alpha-beta-gamma cost with ringcoll.CostModel's default numbers;
4. with --png FILE, a picture: ranks as lanes, steps as columns, one arrow per message.

No schedule is modelled here: every row is read off the run itself. All the explainer knows
of an algorithm is how to name things (the blocks its docstring numbers, the phases its tags
stand for) and the closed forms the run is compared against.
- The collective runs twice, traced with payloads: once on the example values and once on
  labels. Rank r's label for element i is (i + 1) 2^32 + 2^r, so a sum over any set S of
  ranks reads back as |S| (i + 1) 2^32 + (the bitmask of S): every element of every message
  and buffer says which element it is and whose inputs it adds up. Both runs must send the
  same messages (checked), so the labels name the values of the first.
- A step (a column) comes from the order each rank did things in (the trace's event numbers):
  a message is one step after everything its sender did before sending it, and no earlier
  than one step after its receiver's previous receive, nor before its receiver's previous
  send (a rank sends and receives in the same step).
- The buffers after each step are copies the run took itself: the trace's watch hook copies
  a rank's x, out, and every scratch buffer it has sent from or received into, before each
  of its messages. For a reduction each element shows the most complete sum the rank holds
  in any of them (Rabenseifner and Bruck add up in scratch, not in out).
- Checked (exit status 1 on any difference): every value sent and every value shown is the
  sum of the inputs its label names; each rank's result is NumPy's on the inputs (in both
  runs, so every rank's input is in it exactly once); the bytes each rank sent and received
  are the closed form's.
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
from .algorithms.recursive_doubling import core_rank, fold
from .arrays import Partition
from .inprocess import run_threads, simulate

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
LABEL = 1 << 32  # a label is (element + 1) * LABEL + (bitmask of ranks)
MAX_P = 32  # the labels' low 32 bits: one per rank
HEADER_BYTES = 48  # checks.neighbour_check: (collective, count, op, dtype name x2, itemsize)
META_BYTES = 64  # allgather's row-count exchange on a first call: 8 int64 per rank (its META)
READABLE_P = 8  # beyond this the state tables are left out and the schedule is abbreviated
MAX_ROWS = 64  # schedule rows shown before abbreviating
MAX_STATE_ELEMS = 48
SNAPSHOTS = 1 << 20  # copy the buffers at every message while p * p * n is at most this
#: data messages: tag -> (the phase as the schedule names it, its first step's number or None)
PHASES = {"ring_reduce_scatter": ("reduce-scatter", 0), "ring_allgather": ("all-gather", 0),
          "rd_fold": ("fold", None), "rd_exchange": ("exchange", 0), "rd_unfold": ("unfold", None),
          "rab_halving": ("halving", 0), "rab_doubling": ("doubling", 0), "bruck": ("bruck", 0),
          "bcast": ("round", 0), "reduce": ("round", 0), "alltoall": ("exchange", 1)}
#: phases numbered by the step itself: a tree's rank sends in the round its place allows, not in
#: its own k-th round (elsewhere a phase's k-th step is each sender's k-th message of it)
ROUNDS = ("bcast", "reduce")
#: control messages, which carry the same bytes whatever the inputs: tag -> (phase, first step,
#: what the row calls it, what the receiver does; None: what it now knows, from the trace)
CONTROL = {"header": ("check", None, "-", "checks count, dtype, op match"),
           "ring_allgather": ("row counts", 0, "counts", "stores the sender's row count"),
           "barrier": ("round", 0, "token", None)}


class ExplainError(Exception):
    """The run disagrees with itself, with NumPy or with the closed form (a bug in the code or
    in the explainer)."""


# -- the example ------------------------------------------------------------------------------
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

    @property
    def size(self):
        """Elements of the buffer the explainer shows (allgather: the gathered one)."""
        return 0 if self.collective == "barrier" else self.n

    def owned(self, r):
        """The elements rank r puts in: all, its block (allgather), or none (a broadcast's
        other ranks, a barrier)."""
        if self.collective == "allgather":
            return Partition.even(self.n, self.p).slices[r]
        if self.collective == "barrier" or (self.collective == "broadcast" and r != self.root):
            return slice(0, 0)
        return slice(0, self.n)

    def value(self, r, i):
        """Rank r's input at element i (allgather: its block's element i - start)."""
        return self.base * r + i - self.owned(r).start

    def inputs(self, labels=False):
        """Every rank's x: the example values, or (labels=True) each element's label."""
        xs = []
        for r in range(self.p):
            own = self.owned(r)
            i = np.arange(own.start, own.stop, dtype=DTYPE)
            x = (i + 1) * LABEL + (1 << r) if labels else self.value(r, i)
            if self.collective == "broadcast" and r != self.root:
                x = np.zeros(self.n, DTYPE)  # every rank passes n elements; only the root's count
            xs.append(x)
        return xs

    def outputs(self):
        """Every rank's out= (zeros: 'nothing here yet'), or None where the call takes none."""
        if self.collective in ("broadcast", "barrier"):
            return [None] * self.p
        if self.collective == "reduce_scatter":
            return [np.zeros(c, DTYPE) for c in Partition.even(self.n, self.p).counts]
        return [np.zeros(self.n, DTYPE) for _ in range(self.p)]

    def call(self, comm, x, out):
        c, name, root = self.collective, self.algorithm, self.root
        if c == "allreduce":
            return comm.allreduce(x, algorithm=name, out=out)
        if c in ("reduce_scatter", "allgather", "alltoall"):
            return getattr(comm, c)(x, out=out)
        if c == "broadcast":
            return comm.broadcast(x, root=root)
        return comm.reduce(x, root=root, out=out) if c == "reduce" else comm.barrier()

    def numpy(self, xs):
        """Each rank's result as NumPy computes it from the inputs xs (None: returns None)."""
        p, c, part = self.p, self.collective, Partition.even(self.n, self.p)
        if c == "barrier":
            return [None] * p
        if c == "broadcast":
            return [xs[self.root]] * p
        if c == "allgather":
            return [np.concatenate(xs)] * p
        if c == "alltoall":
            return [np.concatenate([x[part.slices[r]] for x in xs]) for r in range(p)]
        total = np.sum(xs, axis=0)
        if c == "reduce_scatter":
            return [total[part.slices[r]] for r in range(p)]
        return [total if c == "allreduce" or r == self.root else None for r in range(p)]

    def blocks(self):
        """(names, Partition) of the blocks the algorithm cuts the buffer into, as its
        docstring numbers them; the state table separates them with '|'."""
        p, c, a = self.p, self.collective, self.algorithm
        if c in ("reduce_scatter", "allgather", "alltoall") or a == "ring":
            parts = p
        elif a in ("rabenseifner", "hierarchical"):
            parts = fold(p)[0] if a == "rabenseifner" else max(map(len, self.nodes))
        else:
            return ["all"], Partition([self.n])
        return [f"b{b}" for b in range(parts)], Partition.even(self.n, parts)

    def block(self, lo, hi):
        """'b2' or 'b1-b3' for elements [lo, hi), or 'in b2' for a part of a block."""
        names, part = self.blocks()
        full = [b for b in range(len(part)) if part.counts[b]]
        first = [b for b in full if part.starts[b] == lo]
        last = [b for b in full if part.starts[b + 1] == hi]
        if first and last:
            return names[first[0]] if first == last else f"{names[first[0]]}-{names[last[0]]}"
        return "in " + self.block_at(lo)

    def block_at(self, i):
        names, part = self.blocks()
        return names[max(b for b in range(len(part)) if part.counts[b] and part.starts[b] <= i)]


def cells(ex, values, labels):
    """(elements, ranks bitmasks): what each of an array of values from the run is, read off
    its label from the labelled run. Element -1 (ranks 0) where the label is none or the value
    is not the sum of the inputs it names: metadata, or memory nothing was written to yet."""
    values, labels = np.asarray(values, DTYPE), np.asarray(labels, DTYPE)
    masks, high = labels & (LABEL - 1), labels >> 32
    k = np.maximum(np.bitwise_count(masks), 1).astype(DTYPE)
    elements = high // k - 1
    ok = (labels >= LABEL) & (high % k == 0) & (elements >= 0) & (elements < ex.size)
    want = np.zeros_like(values)
    for r in range(ex.p):  # the sum the label names: rank r's input, where r is in the mask
        has, own = (masks >> r) & 1 == 1, ex.owned(r)
        ok &= ~has | (elements >= own.start) & (elements < own.stop)
        want += np.where(has, ex.value(r, elements), 0)
    ok &= values == want
    return np.where(ok, elements, -1), np.where(ok, masks, 0)


# -- running it -------------------------------------------------------------------------------
@dataclass
class Run:
    """One run of the example: results, the Trace (with payloads), each rank's x and out, and
    the copies of its buffers after the collective."""

    results: list
    trace: object
    arrays: list
    finals: list


def run(ex, labels, snapshots):
    """Run the example on its values (or labels), traced with payloads.

    With snapshots, the watch hook copies a rank's buffers before each of its messages: x and
    out first, then every buffer it has sent from or received into, a received one from its
    next message on (until the data lands it holds old memory).
    """
    xs, outs = ex.inputs(labels), ex.outputs()
    arrays = [[a for a in pair if a is not None] for pair in zip(xs, outs)]
    views, known = [list(a) for a in arrays], [{_key(a) for a in own} for own in arrays]
    landing, finals = [[] for _ in range(ex.p)], [None] * ex.p  # landing: receives in flight

    def admit(rank, bufs):
        for buf in bufs:
            if _key(buf) not in known[rank]:
                known[rank].add(_key(buf))
                views[rank].append(buf)

    def watch(rank, buf, sending):
        admit(rank, landing[rank] + ([buf] if sending else []))
        landing[rank] = [] if sending else [buf]
        return [v.copy() for v in views[rank]]

    def fn(comm):
        r = comm.rank
        result = ex.call(comm, xs[r], outs[r])
        admit(r, landing[r])
        finals[r] = [v.copy() for v in views[r]]
        return result

    results, trace = simulate(
        ex.p, fn, timeout=60, payloads=True, watch=watch if snapshots else None,
        local_size=len(ex.nodes[0]) if ex.algorithm == "hierarchical" else None, debug=False,
        segment_bytes=max(64, ex.n * DTYPE.itemsize),  # one message per block: no segments
        tuning=False, cost_model=CostModel(),
        node_tier=False)  # messages only: the schedules explained here are message schedules
    return Run(results, trace, arrays, finals)


def _key(a):
    return a.__array_interface__["data"][0], a.nbytes, a.dtype.str


def check_results(ex, values, labels):
    """Each rank's result against NumPy on the inputs, in both runs: on the labels that means
    every element holds every contributing rank's input exactly once."""
    for run, flag in ((values, False), (labels, True)):
        for r, (got, want) in enumerate(zip(run.results, ex.numpy(ex.inputs(flag)))):
            if (got is None) != (want is None) or want is not None and not np.array_equal(
                    np.asarray(got).reshape(-1), want):
                raise ExplainError(f"rank {r}: the {ex.collective} returned {_values(got)}, "
                                   f"NumPy says {_values(want)}" + " (labels)" * flag)


# -- reading the run: steps, messages, buffers ------------------------------------------------
@dataclass
class Step:
    """One message of the run, as the schedule shows it."""

    column: int
    phase: str  # "reduce-scatter 1", "b0 cross-node exchange 0", "check"
    src: int
    dst: int
    tag: str
    nbytes: int
    cells: tuple | None  # (elements, ranks bitmasks) of what it carries; None: control
    values: np.ndarray  # what it carried in the run on the example values
    frm: tuple | None  # where it was sent from: ("x", offset) or ("out", offset); None: scratch
    to: tuple | None  # where it was received
    action: str = "-"  # what the receiver made of it


def columns(messages, receives):
    """Each message's step, from the order each rank did things in (Message.event and
    Receive.event): one step after everything its sender did before sending it; no earlier
    than one step after its receiver's previous receive, nor before its receiver's previous
    send (a rank sends and receives one message of a step at once). So a step holds what the
    run could do at the same time, whatever formula produced it."""
    receive = {(x.src, x.dst, x.tag, x.order): x for x in receives}
    done = {}  # rank -> [(event, "send" or "recv", message number)]
    for k, m in enumerate(messages):
        done.setdefault(m.src, []).append((m.event, "send", k))
        done.setdefault(m.dst, []).append(
            (receive[(m.src, m.dst, m.tag, m.order)].event, "recv", k))
    before = {}  # (kind, k) -> {"send": the last message sent, "recv": received} before it
    for events in done.values():
        last = {"send": None, "recv": None}
        for _, kind, k in sorted(events):
            before[(kind, k)] = dict(last)
            last[kind] = k
    # The longest path through those constraints: relax until nothing moves. (A ring's sends
    # hold each other back in a circle, each no later than the next: no order to recurse in.)
    column, moved = [0] * len(messages), True
    while moved:
        moved = False
        for k in range(len(messages)):
            sender, receiver = before[("send", k)], before[("recv", k)]
            later = [column[j] + 1 for j in (sender["send"], sender["recv"], receiver["recv"])
                     if j is not None]
            later += [column[receiver["send"]]] if receiver["send"] is not None else []
            if max(later, default=0) > column[k]:
                column[k], moved = max(later), True
    return column


def read_steps(ex, values, labels):
    """(Steps, moments): the run's messages as Steps, and for each rank the copies of its
    buffers taken at each of its messages, [(event, step, (value copies, label copies))].

    Raises ExplainError unless both runs sent the same messages and every data message carries
    exactly the sums its labels name."""
    def key(m):
        return m.src, m.index

    ma, mb = sorted(values.trace.messages, key=key), sorted(labels.trace.messages, key=key)
    if [(m.src, m.dst, m.tag, m.nbytes, m.event) for m in ma] != [
            (m.src, m.dst, m.tag, m.nbytes, m.event) for m in mb]:
        raise ExplainError("the runs on the example values and on the labels sent different "
                           "messages")
    got = [{(x.src, x.dst, x.tag, x.order): x for x in run.trace.receives}
           for run in (values, labels)]
    cols = columns(ma, values.trace.receives)
    start = {m.tag: min(c for c, x in zip(cols, ma) if x.tag == m.tag) for m in ma}
    steps, moments, count = [], {r: [] for r in range(ex.p)}, {}
    for m, b, col in zip(ma, mb, cols):
        tag = m.tag.partition(" (")[0]
        control = m.payload.dtype != DTYPE or bool(m.nbytes) and np.array_equal(m.payload,
                                                                                b.payload)
        found = None if control else cells(ex, m.payload, b.payload)
        if (found[0] < 0).any() if found is not None else tag not in CONTROL:
            raise ExplainError(f"rank {m.src}'s message #{m.index} to rank {m.dst} ({m.tag}) "
                               f"carries {_values(m.payload)}, not the sums its labels name")
        name, first = CONTROL[tag][:2] if control else PHASES[tag]
        k = count[(m.src, m.tag, control)] = count.get((m.src, m.tag, control), -1) + 1
        if first is not None:  # a tree's round is the step; elsewhere the sender's k-th
            name += f" {first + (col - start[m.tag] if tag in ROUNDS else k)}"
        if m.tag != tag:  # hierarchical's sub-groups: a node's ring, or a block's cross-node
            node = any(m.src in nodes and m.dst in nodes for nodes in ex.nodes)
            name = ("node " if node or not m.nbytes else
                    f"{ex.block_at(int(found[0][0]))} cross-node ") + name
        ra, rb = (g[(m.src, m.dst, m.tag, m.order)] for g in got)
        steps.append(Step(col, name, m.src, m.dst, m.tag, m.nbytes, found, m.payload,
                          _where(m, values.arrays[m.src]), _where(ra, values.arrays[m.dst])))
        moments[m.src].append((m.event, col, (m.seen, b.seen)))
        moments[m.dst].append((ra.event, col, (ra.seen, rb.seen)))
    return steps, {r: sorted(mine, key=lambda e: e[0]) for r, mine in moments.items()}


def _where(record, arrays):
    """("x" or "out", element offset) where a message was sent from or received into, or None
    for one of the communicator's scratch buffers."""
    return next(((name, at) for name, at in
                 zip(("x", "out"), (record.offset_in(a) for a in arrays)) if at is not None),
                None)


def _runs(cells):
    """[(lo, hi, ranks)]: a message's cells as ranges of consecutive elements with the same
    ranks."""
    elements, masks = cells
    cut = np.flatnonzero((np.diff(elements) != 1) | (np.diff(masks) != 0)) + 1
    bounds = [0, *cut.tolist(), elements.size] if elements.size else []
    return [(int(elements[a]), int(elements[b - 1]) + 1, int(masks[a]))
            for a, b in zip(bounds, bounds[1:])]


class Buffers:
    """Every rank's buffer after each step, from the copies the run took."""

    def __init__(self, ex, moments, values, labels):
        self.ex, self.moments = ex, moments
        self.finals = list(zip(values.finals, labels.finals))
        self._read = {}

    def after(self, rank, step):
        """Rank r's buffer after `step` (-1: before the first), (values, ranks bitmasks) per
        element: from the copies it took at its first message of a later step, before touching
        it, or else after the collective; ranks 0 where it holds nothing yet."""
        if (rank, step) not in self._read:
            copies = next((seen for _, col, seen in self.moments[rank] if col > step),
                          self.finals[rank])
            self._read[(rank, step)] = self.holding(*copies)
        return self._read[(rank, step)]

    def holding(self, vals, labs):
        """(values, ranks) of the most complete sum the rank holds for each element in any of
        its buffers, its own x and out winning ties. An all-to-all's elements change places:
        for it, simply its out buffer."""
        ex = self.ex
        if ex.collective == "alltoall":
            return vals[1], cells(ex, vals[1], labs[1])[1]
        va, la = np.concatenate(vals), np.concatenate(labs)  # x and out first
        elements, masks = cells(ex, va, la)
        ranks = np.bitwise_count(masks).astype(DTYPE)
        order = np.lexsort((np.arange(va.size), -ranks, elements))  # most ranks, then earliest
        pick = order[np.unique(elements[order], return_index=True)[1]]
        pick = pick[elements[pick] >= 0]
        best = np.zeros(ex.size, DTYPE), np.zeros(ex.size, DTYPE)
        best[0][elements[pick]], best[1][elements[pick]] = va[pick], masks[pick]
        return best


def knowledge(ex, steps):
    """knows[c + 1][r]: the ranks (a bitmask) whose data has reached rank r by the end of step
    c, through data messages (a barrier's: its tokens); knows[0] is before the first step."""
    knows = [[1 << r for r in range(ex.p)]]
    for c in range(max((s.column for s in steps), default=-1) + 1):
        now = list(knows[-1])
        for s in steps:
            if s.column == c and (s.cells is not None or ex.collective == "barrier"):
                now[s.dst] |= knows[-1][s.src]
        knows.append(now)
    return knows


def action(ex, s, knows, buffers):
    """What the receiver made of a message, from its buffer before and after the step."""
    if s.cells is None:
        did = CONTROL[s.tag][3]
        return did or f"now knows ranks {_ranks(_bits(knows[s.column][s.src]))} arrived"
    if buffers is None or not s.nbytes:
        return "-"
    if ex.collective == "alltoall":  # it lands elsewhere than where its sender had it
        return f"copy into its {ex.block(s.to[1], s.to[1] + s.values.size)}"
    block = ", ".join(ex.block(lo, hi) for lo, hi, _ in _runs(s.cells))
    elements, masks = s.cells
    now = buffers.after(s.dst, s.column)[1][elements]
    if (now == masks).all():
        return f"copy into {block}"
    if ((now & masks) == masks).all() and (now != masks).all():
        own = (buffers.after(s.dst, s.column - 1)[1][elements] == 1 << s.dst).all()
        return f"reduce into {block} (+ its {'input' if own else 'own'})"
    return "keep in scratch"


# -- closed forms: bytes per rank, and the alpha-beta-gamma cost ------------------------------
def _ring_elems(p, i, n):
    c = Partition.even(n, p).counts
    return 2 * n - c[i] - c[(i + 1) % p], 2 * n - c[(i - 1) % p] - c[i]


def _rd_elems(p, i, n):
    core, rem = fold(p)
    each = n if i < 2 * rem and i % 2 == 0 else (core.bit_length() - 1 + (i < 2 * rem)) * n
    return each, each


def _rab_elems(p, i, n):
    if p == 1:
        return 0, 0
    core, rem = fold(p)
    me = core_rank(i, rem)
    if me < 0:
        return n, n
    start = Partition.even(n, core).starts
    groups = sum(start[((me >> k) << k) + (1 << k)] - start[(me >> k) << k]
                 for k in range(core.bit_length() - 1))
    each = n - (start[me + 1] - start[me]) + groups + (n if i < 2 * rem else 0)
    return each, each


ELEMS = {"ring": _ring_elems, "recursive_doubling": _rd_elems, "rabenseifner": _rab_elems,
         "bruck": lambda p, i, n: ((p - 1) * n, (p - 1) * n)}
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
    "hierarchical": "the 48-byte header check, plus a ring over the node's shards (where the "
                    "node's ranks share memory, ringcoll runs this stage through the node tier "
                    "instead, which sends no message: explain shows the ring; as for ring: "
                    "2S - s[i] - s[i+1] sent, 2S - s[i-1] - s[i] received, s = shard sizes, "
                    "S = n), plus the cross-node algorithm's closed form on each block this "
                    "rank owns",
    "reduce_scatter": "n - c[r] elements sent, n - c[r-1] received (c[b]: block b's size; "
                      "(p-1)/p n when p divides n), plus the 48-byte header check each way",
    "allgather": "n - c[r+1] elements sent, n - c[r] received (n: the gathered size; (p-1)/p n "
                 "when p divides n), plus p-1 row-count messages of 56 bytes each way (a "
                 "repeated call of small rows carries them in those messages instead)",
    "tree": "n times the number of children in the binomial tree (v = (rank - root) % p: v + "
            "2^j for each 2^j below v's lowest set bit), and n from the parent",
    "alltoall": "(p-1)/p n each way (n: one rank's input)",
    "barrier": "ceil(log2 p) one-byte tokens each way",
}


def byte_formula(ex):
    """(text, [(sent, received) bytes per rank]) from the closed forms."""
    p, n, c, a, w = ex.p, ex.n, ex.collective, ex.algorithm, DTYPE.itemsize
    hdr, cnt = HEADER_BYTES if p > 1 else 0, Partition.even(n, p).counts
    if c == "allreduce" and a != "hierarchical":
        extra = hdr if a == "ring" else 0
        return FORMULA_TEXT[a], [(s * w + extra, g * w + extra)
                                 for s, g in (ELEMS[a](p, r, n) for r in range(p))]
    if c == "allreduce":
        L, rows = max(map(len, ex.nodes)), []
        part = Partition.even(n, L)
        for r in range(p):
            m = next(m for m in ex.nodes if r in m)
            k, i = len(m), m.index(r)
            shards = [part.starts[z] - part.starts[y]
                      for y, z in (owned_blocks(j, k, L) for j in range(k))]
            sent = 2 * n - shards[i] - shards[(i + 1) % k]  # the ring, over the node's shards
            got = 2 * n - shards[(i - 1) % k] - shards[i]
            for b in range(*owned_blocks(i, k, L)):
                g = [mm[owner(b, len(mm), L)] for mm in ex.nodes]
                more = ELEMS[ex.inner](len(g), g.index(r), part.counts[b])
                sent, got = sent + more[0], got + more[1]
            rows.append((sent * w + hdr, got * w + hdr))
        return FORMULA_TEXT[a] + f" (here {ex.inner})", rows
    if c == "reduce_scatter":
        return FORMULA_TEXT[c], [((n - cnt[r]) * w + hdr, (n - cnt[(r - 1) % p]) * w + hdr)
                                 for r in range(p)]
    if c == "allgather":
        meta = (p - 1) * META_BYTES
        return FORMULA_TEXT[c], [((n - cnt[(r + 1) % p]) * w + meta, (n - cnt[r]) * w + meta)
                                 for r in range(p)]
    if c in ("broadcast", "reduce"):
        rows = []
        for r in range(p):
            v = (r - ex.root) % p
            low = v & -v if v else 1 << (p - 1).bit_length()  # children: v + 2^j, 2^j < low
            kids = sum(1 for j in range(low.bit_length()) if 1 << j < low and v + (1 << j) < p)
            down, up = kids * n * w, (n * w if v else 0)
            rows.append((down, up) if c == "broadcast" else (up, down))
        return FORMULA_TEXT["tree"] + (" received" if c == "broadcast" else " sent"), rows
    each = (p - 1) * (n // p) * w if c == "alltoall" else math.ceil(math.log2(p)) if p > 1 else 0
    return FORMULA_TEXT[c], [(each, each)] * p


COST_TEXT = {
    "ring": "2(p-1) a + 2(p-1)/p n b + (p-1)/p n g",
    "recursive_doubling": "log2(p') (a + n b + n g) + fold (2 a + 2 n b + n g if p != p')",
    "rabenseifner": "2 log2(p') a + 2(p'-1)/p' n b + (p'-1)/p' n g + fold (2 a + 2 n b + n g)",
    "bruck": "ceil(log2 p) a + (p-1) n b + (p-1) n g",
    "hierarchical": "2(k-1) a + 2(k-1)/k n b + (k-1)/k n g inside the node, + the cheapest flat "
                    "all-reduce of n/k bytes across the N nodes",
    "reduce_scatter": "(p-1) a + (p-1)/p n b + (p-1)/p n g",
    "allgather": "(p-1) a + (p-1)/p n b",
    "broadcast": "ceil(log2 p) (a + n b)",
    "reduce": "ceil(log2 p) (a + n b + n g)",
    "alltoall": "(p-1) a + (p-1)/p n b",
    "barrier": "ceil(log2 p) a",
}


def cost(ex):
    """(formula, [(term, count, unit, seconds)], total seconds) with CostModel's defaults. A
    flat all-reduce's counts are CostModel's own: its formula read with one unit of a, b or g
    at a time."""
    cm, p, nb, c, a = CostModel(), ex.p, ex.n * DTYPE.itemsize, ex.collective, ex.algorithm
    lg, k = math.ceil(math.log2(p)) if p > 1 else 0, max(map(len, ex.nodes or [[0]]))
    text = COST_TEXT[a if c == "allreduce" else c]
    if c == "allreduce" and a != "hierarchical":
        counts = [CostModel(*unit).allreduce(a, nb, p) for unit in ((1, 0, 0), (0, 1, 0),
                                                                    (0, 0, 1))]
        if math.isinf(counts[0]):  # Bruck above MAX_BYTES: the model rules it out
            counts = [lg, (p - 1) * nb, (p - 1) * nb]
            text += f" (CostModel: inf above {bruck_mod.MAX_BYTES} B, auto never picks it)"
    else:  # (alphas, bytes moved, bytes reduced); hierarchical: inside the node
        counts = {"hierarchical": (2 * (k - 1), 2 * (k - 1) / k * nb, (k - 1) / k * nb),
                  "reduce_scatter": (p - 1, (p - 1) / p * nb, (p - 1) / p * nb),
                  "allgather": (p - 1, (p - 1) / p * nb, 0), "broadcast": (lg, lg * nb, 0),
                  "reduce": (lg, lg * nb, lg * nb), "alltoall": (p - 1, (p - 1) / p * nb, 0),
                  "barrier": (lg, 0, 0)}[a if c == "allreduce" else c]
    terms = [(name, x, unit, x * rate) for (name, unit, rate), x in
             zip((("a", "", cm.alpha), ("b", " B", cm.beta), ("g", " B", cm.gamma)), counts)]
    if c == "allreduce" and a == "hierarchical":
        inner, secs = cm.cross_node(nb, ex.nodes) if p > 1 else ("-", 0.0)
        terms.append((f"cross-node {inner} of {nb // k} B on {len(ex.nodes)} ranks", None, "",
                      secs))
    if c == "allreduce":
        return text, terms, cm.allreduce(a, nb, p, ex.nodes if a == "hierarchical" else None)
    return text, terms, sum(t[3] for t in terms)


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


def _who(mask, p):
    """'all', '0+2+3', or for more than four ranks '0-5+7': whose inputs a sum holds."""
    ranks = _bits(mask)
    if len(ranks) == p:
        return "all"
    return "+".join(map(str, ranks)) if len(ranks) <= 4 else _ranks(ranks).replace(",", "+")


def _values(a, limit=40):
    if a is None:
        return "None"
    text = "[" + " ".join(str(v) for v in np.asarray(a).reshape(-1).tolist()) + "]"
    return text if len(text) <= limit else text[:limit - 4] + " ..]"


def _table(header, rows, right=()):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = ["{:>%d}" % w if i in right else "{:<%d}" % w for i, w in enumerate(widths)]
    return ["  ".join(f.format(str(x)) for f, x in zip(fmt, row)).rstrip()
            for row in [header, *rows]]


def step_label(steps, column):
    """A step's label, from the phases of its messages: 'b0 cross-node exchange 0' and 'b1
    cross-node exchange 0' make 'cross-node exchange 0 (b0, b1)'."""
    groups = {}
    for label in dict.fromkeys(s.phase for s in sorted(steps, key=lambda s: s.src)
                               if s.column == column):
        head, _, rest = label.partition(" ")
        if head[:1] == "b" and head[1:].isdigit() and rest:
            groups.setdefault(rest, []).append(head)
        else:
            groups.setdefault(label, [])
    return "; ".join(f"{rest} ({', '.join(heads)})" if heads else rest
                     for rest, heads in groups.items())


def _place(where, nbytes):
    return "scratch" if where is None else \
        f"{where[0]}[{where[1]}:{where[1] + nbytes // DTYPE.itemsize})"


def schedule_rows(ex, steps):
    """One row per message, in step order; control messages that every rank sends alike to
    its right neighbour (the header check, allgather's row counts) are one row 'r -> r+1'."""
    rows = []
    for c in sorted({s.column for s in steps}):
        here = sorted((s for s in steps if s.column == c), key=lambda s: s.src)
        control = [s for s in here if s.cells is None]
        if ({(s.src, s.dst) for s in control} == {(r, (r + 1) % ex.p) for r in range(ex.p)}
                and len({(s.phase, s.nbytes, s.action) for s in control}) == 1):
            s, here = control[0], [s for s in here if s.cells is not None]
            rows.append((c, s.phase, "r -> r+1", CONTROL[s.tag][2], "-", s.nbytes, "-",
                         s.action))
        for s in here:
            send = f"{s.src} -> {s.dst}"
            if s.cells is None:
                rows.append((c, s.phase, send, CONTROL[s.tag][2], "-", s.nbytes, "-", s.action))
                continue
            sums = ex.collective in REDUCTIONS  # name whose inputs each block adds up
            block = ", ".join(ex.block(lo, hi) + (f"={_who(m, ex.p)}" if sums else "")
                              for lo, hi, m in _runs(s.cells))
            where = f"{_place(s.frm, s.nbytes)} -> {_place(s.to, s.nbytes)}" if s.nbytes else "-"
            rows.append((c, s.phase, send, block or "-", where, s.nbytes, _values(s.values, 28),
                         s.action))
    return rows


def schedule_lines(ex, steps):
    rows = schedule_rows(ex, steps)
    lines = _table(("step", "phase", "send", "block", "from -> into", "bytes", "values",
                    "receiver does"), rows, right=(0, 5))
    if len(rows) > MAX_ROWS:
        lines[MAX_ROWS - 7:-8] = [f"... {len(rows) - MAX_ROWS} more rows (all checked) ..."]
    return lines


def state_lines(ex, steps, knows, buffers):
    """Every rank's buffer before the first step that moves data, and after each such step."""
    data = sorted({s.column for s in steps if s.cells is not None or ex.collective == "barrier"})
    shown = [(data[0] - 1 if data else -1, "start")] + [
        (c, f"after step {c} ({step_label(steps, c)})") for c in data]
    names, part = ex.blocks()
    width = max([len(str(v)) for c, _ in shown for r in range(ex.p)
                 for v, m in zip(*map(np.ndarray.tolist, buffers.after(r, c))) if m] + [1])
    lines = []
    for c, title in shown:
        lines.append(title + ":")
        for r in range(ex.p):
            known, (vals, masks) = knows[c + 1][r], buffers.after(r, c)
            if ex.collective == "barrier":
                lines.append(f"  r{r}  " + ("has arrived" if known == 1 << r else
                                            f"knows ranks {_ranks(_bits(known))} have arrived"))
                continue
            cells, notes, holds = [], [], 0
            for b, sl in enumerate(part.slices):
                cells.append(" ".join(f"{v:>{width}}" if m else "." * width
                                      for v, m in zip(vals[sl].tolist(), masks[sl].tolist())))
                here = set(masks[sl].tolist())
                for m in here:
                    holds |= m
                if ex.collective in REDUCTIONS and sl.stop > sl.start and here - {0, 1 << r}:
                    who = _who(here.pop(), ex.p) if len(here) == 1 else "mixed"
                    notes.append(f"{names[b]}={who}" if len(names) > 1 else f"sum of {who}")
            rest = _bits(known & ~holds) if ex.collective in REDUCTIONS else []
            if rest:  # Bruck: other ranks' inputs it has, in scratch, not yet added
                s = "s" * (len(rest) > 1)
                notes.append(f"has rank{s} {_ranks(rest)}'s input{s} in scratch, not yet added")
            lines.append(f"  r{r}  [ {' | '.join(cells)} ]"
                         + (f"   {'  '.join(notes)}" if notes else ""))
    return lines


def bytes_lines(ex, trace):
    text, rows = byte_formula(ex)
    table = [(r, sent, fs, got, fg, "ok" if (sent, got) == (fs, fg) else "DIFFERS")
             for r, (fs, fg) in enumerate(rows)
             for sent, got in [(trace.bytes_sent(r), trace.bytes_received(r))]]
    out = [f"Bytes per rank (int64: {DTYPE.itemsize} B an element, n = {ex.n} elements = "
           f"{ex.n * DTYPE.itemsize} B):",
           *textwrap.wrap(f"closed form: {text}", 94, initial_indent="  ",
                          subsequent_indent="    "),
           *("  " + x for x in _table(("rank", "sent (trace)", "formula", "received (trace)",
                                       "formula", ""), table, right=(0, 1, 2, 3, 4)))]
    bad = [row[0] for row in table if row[5] != "ok"]
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
    shown = [(name if count is None else f"{count:.6g}{unit} {name}", secs)
             for name, count, unit, secs in terms if count is None or count]
    if shown:
        out.append("  = " + " + ".join(d for d, _ in shown))
        out.append("  = " + " + ".join(f"{s * 1e6:.4f} us" for _, s in shown)
                   + f" = {total * 1e6:.4f} us")
    else:
        out.append("  = 0 (one rank: nothing to send)")
    if ex.p > 1 and (ex.collective == "reduce_scatter" or ex.collective == "allreduce"
                     and ex.algorithm in ("ring", "hierarchical")):
        out.append("  (the model leaves out the 48-byte header check, one more a)")
    return out


RESULTS = {  # what the result line says, checked against NumPy on every rank
    "allreduce": "Result on every rank: {0} = np.sum(inputs, axis=0) (checked on every rank)",
    "reduce_scatter": "Result: rank r holds block r of np.sum(inputs, axis=0) (checked on "
                      "every rank)",
    "allgather": "Result on every rank: {0} = np.concatenate(inputs) (checked on every rank)",
    "broadcast": "Result on every rank: {0}, the root's input (checked)",
    "reduce": "Result on rank {root}: {1} = np.sum(inputs, axis=0); None on the others "
              "(checked)",
    "alltoall": "Result: rank r's block j is rank j's block r (checked on every rank)",
    "barrier": "Result: every rank has heard, directly or through others, from every rank.",
}


@dataclass
class Explanation:
    """What explain() read off the run: the messages as Steps, the ranks each rank has heard
    from after each step, every rank's buffer after each step (None if too big to copy), and
    the two runs."""

    steps: list
    knows: list
    buffers: Buffers | None
    values: Run
    labels: Run


def explain(ex, out=print):
    """Run, check and print one example; returns its Explanation."""
    p, n, c = ex.p, ex.n, ex.collective
    snapshots = p * p * max(n, 1) <= SNAPSHOTS
    values, labels = (run(ex, flag, snapshots) for flag in (False, True))
    check_results(ex, values, labels)
    steps, moments = read_steps(ex, values, labels)
    knows = knowledge(ex, steps)
    buffers = Buffers(ex, moments, values, labels) if snapshots else None
    for s in steps:
        s.action = action(ex, s, knows, buffers)
    out(f"ringcoll explain: {c} ({ex.algorithm}) on p = {p} ranks"
        + (f", n = {n} int64 elements" if c != "barrier" else "")
        + (f", nodes {ex.nodes}, cross-node algorithm {ex.inner}"
           if ex.algorithm == "hierarchical" else "")
        + (f", root {ex.root}" if c in ("broadcast", "reduce") else ""))
    readable = p <= READABLE_P and n <= MAX_STATE_ELEMS
    if c != "barrier":
        out(f"Inputs: rank r's element i is {ex.base} r + i"
            + {"allgather": " (allgather: rank r contributes block r)",
               "broadcast": " (only the root's matters)"}.get(c, ""))
        for r, x in enumerate(ex.inputs() if readable else []):
            out(f"  r{r}  {_values(x[ex.owned(r)], 10 ** 6)}")
    names, part = ex.blocks()
    if len(names) > 1 and c != "barrier":
        out("Blocks: " + ", ".join(f"{nm} = [{sl.start}:{sl.stop})"
                                   for nm, sl in zip(names, part.slices)))
    out("")
    out(f"Schedule: {len(steps)} messages in {max((s.column for s in steps), default=-1) + 1} "
        "steps, as the run sent them (every value checked: the sum of the inputs its label "
        "names)")
    for line in schedule_lines(ex, steps):
        out("  " + line)
    out("")
    if readable:
        out("After each round:" if c == "barrier" else
            "Buffers after each step, as the run left them ('.': nothing there yet"
            + ("; for each element the\nmost complete sum the rank holds, in x, out or "
               "scratch; b2=0+3: block b2 holds the sum of\nranks 0 and 3's inputs; all: of "
               "every rank's):" if c in REDUCTIONS else "):"))
        for line in state_lines(ex, steps, knows, buffers):
            out("  " + line)
    else:
        out(f"(buffers after each step left out for p > {READABLE_P} or n > {MAX_STATE_ELEMS}"
            + ("; what each receiver did too, above\np^2 n = 2^20: copying every buffer at "
               "every message would take too much memory)" if buffers is None else ")"))
    results = values.results
    out("")
    out(RESULTS[c].format(_values(results[0], 200), _values(results[ex.root], 200),
                          root=ex.root))
    for line in ["", *bytes_lines(ex, values.trace), "", *cost_lines(ex)]:
        out(line)
    return Explanation(steps, knows, buffers, values, labels)


def figure(ex, steps, path):
    """Ranks as lanes (rank 0 on top), steps as columns, an arrow per message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, ncols = ex.p, max((s.column for s in steps), default=0) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * ncols + 1.5), max(2.5, 0.8 * p + 1.2)))
    for r in range(p):
        ax.axhline(r, color="0.85", lw=1, zorder=0)
    if ex.algorithm == "hierarchical":  # the nodes, shaded in turn
        for node in ex.nodes[::2]:
            ax.axhspan(node[0] - 0.5, node[-1] + 0.5, color="0.96", zorder=-1)
    for s in steps:
        x0, x1 = s.column + 0.1, s.column + 0.9
        ax.annotate("", xy=(x1, s.dst), xytext=(x0, s.src),
                    arrowprops=dict(arrowstyle="->", lw=1.2,
                                    color="C0" if s.cells is not None else "0.5"))
        if s.cells is not None:  # a third of a lane from the sender: labels stay apart
            f = min(0.5, 0.35 / abs(s.dst - s.src)) if s.dst != s.src else 0.5
            ax.text(x0 + f * (x1 - x0), s.src + f * (s.dst - s.src),
                    ", ".join(ex.block(lo, hi) for lo, hi, _ in _runs(s.cells)), fontsize=7,
                    ha="center", va="center",
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none"))
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, ncols)
    labels = [step_label(steps, c) for c in range(ncols)]
    ax.set_xticks([c + 0.5 for c in range(ncols)],
                  [x if len(x) <= 28 else x[:26] + ".." for x in labels], fontsize=7,
                  rotation=30, ha="right")
    for c in range(ncols + 1):
        ax.axvline(c, color="0.92", lw=0.8, zorder=0)
    ax.set_title(f"{ex.collective} ({ex.algorithm}), p = {p}, n = {ex.n}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------------
def parser():
    ap = argparse.ArgumentParser(
        prog="ringcoll explain",
        description="Run one collective on small example numbers (thread ranks) and print "
                    "its schedule step by step, every rank's buffer after each step, the "
                    "bytes per rank beside the closed form, and the alpha-beta-gamma cost. "
                    "Every row is read off the messages that really ran.")
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
        name = run_threads(p, lambda c: c.auto_algorithm(n * DTYPE.itemsize), tuning=False,
                           local_size=local, cost_model=CostModel())[0]
        print(f"ringcoll explain: auto picks {name} for {n * DTYPE.itemsize} B on {p} ranks "
              "(the cost model; no tuning table on thread ranks)")
    inner = None
    if name == "hierarchical":
        inner = CostModel().cross_node(n * DTYPE.itemsize, nodes)[0] if p > 1 else "ring"
    return Example(args.collective, name, p, n, args.root, nodes, inner)


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        ex = example_from_args(args)
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
        steps = explain(ex).steps
    except BrokenPipeError:  # | head: stop quietly, as other commands do
        sys.stdout = open(os.devnull, "w")
        return 0
    except ExplainError as exc:
        print(f"ringcoll explain: the run disagrees with itself, NumPy or the closed form:\n"
              f"{exc}", file=sys.stderr)
        return 1
    if args.png:
        figure(ex, steps, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
