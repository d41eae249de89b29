"""All-to-all with uneven blocks (MPI_Alltoallv): rank i sends counts[j] rows of x to rank j.

x holds this rank's blocks back to back along axis 0 (block j: counts[j] rows, for rank j);
the result holds the blocks this rank receives, in rank order. Ranks may send different row
counts, but dtype and trailing shape (all but axis 0) must agree.

Schedule, every rank (p ranks, n_s / n_r the bytes this rank sends to / receives from the
others):
1. counts: a pairwise exchange (algorithms/alltoall.py, Tag.COUNTS) of 7 int64 per pair: the
   rows this rank sends that peer, its row size, ndim and a CRC of dtype and trailing shape,
   bits (it passed recv_counts= or out=, it declared, its rows are host memory), all the
   rows it sends and its largest block's bytes. Cost (p-1) a + 56 (p-1) b. Every rank sent its
   layout to every rank, so if any two ranks disagree on it, every rank sees a peer that
   differs and all raise CollectiveMismatchError here. Small blocks ride in it (Counts): then
   there is no step 3.
2. verdict, only if some rank passed recv_counts= or out= (every rank knows that after step
   1, so all take this step or none): Bruck's all-gather (algorithms/bruck.py, Tag.VERDICT) of
   one int64 per rank saying whether its recv_counts match what the senders send and out= has
   their row total. Cost ceil(log2 p) a + 8 (p-1) b. A rank whose own is wrong raises
   CollectiveMismatchError (recv_counts) or InvalidArgumentError (out=); the others raise
   PeerFailedError naming it; no data has moved. Skipped when every rank repeats its last
   alltoallv, which ended fine (a bit of step 1's numbers says so: each rank sees every
   rank's): the call is then that one again on every rank, whose verdicts were all fine.
3. data: the pairwise exchange of the blocks (algorithms/alltoall.py alltoallv): at most
   (p-1) a + sum over steps s of max(bytes to r+s, bytes from r-s) b, which lies between
   max(n_s, n_r) b and (n_s + n_r) b; empty blocks are skipped on both sides.
In all, at most 2(p-1) a + 56 (p-1) b + the data's bytes without recv_counts=/out= on any
rank, and ceil(log2 p) a + 8 (p-1) b more with them; (p-1) a + the slots' bytes when the
blocks ride in step 1.

"native": step 1 by MPI_Alltoall, step 2 by MPI_Allgather, step 3 by MPI_Alltoallv (the
bytes as MPI.BYTE, so any dtype travels), so the native baseline pays no ringcoll step. Under
auto, steps 1 and 2 (a few numbers each) go by those MPI calls too where the transport has
them, and step 3 is MPI_Alltoallv where every rank's rows are host memory and the tuning
table measured it faster at the bytes all ranks send (every rank knows them after step 1;
without a table entry, up to NATIVE_MAX bytes), else the pairwise exchange. The steps are
built once per plan (Counts): a repeated call judges the exchanged numbers again only when
they differ from the last ones.

Declared counts: with declared=True on every rank, each passing recv_counts= (MPI's contract:
every rank knows what it sends and what it receives), the ranks agree once per distinct call:
after steps 1 and 2 found every rank's call right, each records the call's signature (its
counts and recv_counts, dtype and row shape, memory kind) in g.declared, as allgather.Rows
does, and the same call again is step 3 alone. What a rank that then passes something else
breaks is in docs/errors.md.
"""


import numpy as np

from .. import checks
from ..algorithms import alltoall as pairwise
from ..algorithms import COLLECTIVE_ALGORITHMS, bruck, native
from ..arrays import Partition
from ..errors import CollectiveMismatchError, InvalidArgumentError, PeerFailedError
from ..runner import Plan
from ..transport import Tag
from . import _args

NAME = "alltoallv"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 2)

#: the most bytes (all ranks' blocks together) auto sends by MPI_Alltoallv where the tuning
#: table has no alltoallv entry for this p (and every rank's rows are host memory)
NATIVE_MAX = 65536

# a rank's verdict on its own call after the count exchange (step 2)
FINE, WRONG_RECV_COUNTS, WRONG_OUT = 0, 1, 2
#: the bit of a rank's count numbers saying its call repeats its last one, which ended fine
AGAIN = 8
#: int64 numbers per pair in step 1, before the slot that may carry the block
NUMBERS = 7
#: p * S at most: the bytes of blocks a rank sends in step 1's slots (see Counts)
CARRY_MAX = 16384


def plan(g, ctx, x, counts, out, recv_counts, algorithm, declared=False):
    given = x
    x, side = _args.rows_input(g, x, ctx, movable=True)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx)
    counts = _args.counts(counts, g.size, ctx, total=x.shape[0])
    if recv_counts is not None:
        recv_counts = _args.counts(recv_counts, g.size, ctx, name="recv_counts")
    elif declared:
        raise InvalidArgumentError(f"{ctx}declared=True needs recv_counts= (the rows each rank "
                                   "sends this one), on every rank; pass them or leave "
                                   "declared out")
    if name == "native":
        native.check(side.t, None, ctx)
    if out is not None:  # all but its row count can be checked now; that comes in step 2
        rows_out = out.shape[0] if getattr(out, "ndim", 0) else -1
        _args.output(out, (rows_out,) + x.shape[1:], x.dtype, ctx, side, rows=True)
        if side.xp.may_share_memory(x, out) and side.xp.shares_memory(x, out):
            raise InvalidArgumentError(
                f"{ctx}out overlaps x; alltoallv has no in-place form: pass a separate out "
                "(for MPI_IN_PLACE, pass a copy of the buffer as x)")
    row = _args.row_elems(x)
    row_bytes = row * x.dtype.itemsize
    send = side.ws.cached(("alltoallv", tuple(counts), row),
                          lambda: Partition([c * row for c in counts]))
    src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
    host = side.device is None
    # declared (see the module doc): the signature, and what this rank's out= contradicts in
    # its recv_counts, raised only when the call skips the exchange
    sig = problem = None
    if declared and not g.options.debug:  # (debug mode agrees on every call)
        sig = (NAME, tuple(counts), tuple(recv_counts), _args.layout(x.dtype, x.shape[1:]),
               host)
        if out is not None and out.shape[0] != sum(recv_counts):
            problem = (f"{ctx}out has shape {out.shape}, but recv_counts adds up to "
                       f"{sum(recv_counts)} rows; pass out of shape "
                       f"{(sum(recv_counts),) + x.shape[1:]} or out=None")

    mpi = name == "native" or (algorithm in (None, "auto") and hasattr(g.t, "native_alltoall"))
    exchange = Counts(g, x, counts, out, recv_counts, "native" if mpi else name, host,
                      declared, sig, src if host else None, send)
    last = [None, None]  # the counts last got, and (recv, result, dst, copy_to) for out=
    chosen = [None, None, False]  # (got, (all host, total bytes), whether MPI's call moves)
    bound = [None, None, None]  # MPI_Alltoallv bound to (got, dst)
    # once the call is agreed and MPI's call moves it into out: that call bound, and the
    # agreement it was decided under. Then a repeat is one dict lookup and MPI's call
    hot = [None, None]
    agreed = g.declared.get

    def run():
        if hot[0] is not None and agreed(sig) is hot[1]:
            hot[0]()
            return out
        found = None if sig is None else agreed(sig)  # (all host memory, total bytes)
        carried = False
        if found is not None:  # declared and agreed on before: no exchange
            if problem is not None:
                raise InvalidArgumentError(problem)  # (the others are sending: abort)
            got, everyone = recv_counts, found
        else:
            got = exchange()  # host numbers, host transport
            everyone, carried = exchange.everyone, exchange.carried
        if got is last[0]:
            recv, result, dst, copy_to = last[1]
        else:
            recv = Partition([c * row for c in got])
            result = _args.output(out, (sum(got),) + x.shape[1:], x.dtype, ctx, side,
                                  rows=True)
            dst, copy_to = _args.rows_target(result)
            dst = _args.raw(dst)
            if out is not None:
                last[:] = got, (recv, result, dst, copy_to)
        if got is not chosen[0] or everyone != chosen[1]:  # (alike on every rank)
            host_all, total = everyone
            chosen[:] = got, everyone, _args.native_rows(
                g, NAME, algorithm, total * row_bytes, host_all,
                fallback=total * row_bytes <= NATIVE_MAX)
        if carried:  # every block came in step 1's slots: no data step on any rank
            exchange.unpack(dst, recv)
        elif chosen[2]:
            if bound[0] is not got or bound[1] is not dst:
                bound[:] = got, dst, native.bind(side.t, "native_alltoallv", src, send.counts,
                                                 dst, recv.counts)
            bound[2]()
            if found is not None and out is not None and copy_to is None:
                hot[:] = bound[2], found
        else:
            pairwise.alltoallv(side.t, src, send, dst, recv)
        _args.copy_rows(dst, copy_to)
        return result

    # axis 0 and the counts differ between ranks: the fingerprint leaves them out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]),
                          **_args.declared_field(declared))
    return Plan(NAME, name, fields, _args.on_side(run, side),
                repeatable=x is given and out is not None)


class Counts:
    """Steps 1 and 2 of the module docstring, built once per plan: calling it returns the rows
    each rank sends this one (in rank order; the very same list while they repeat), once every
    rank knows that the call is consistent; else every rank raises. Then `everyone` is (every
    rank's rows are host memory, the rows all ranks send), the same on every rank; and where
    every rank declared, the call's signature is recorded in g.declared with it.

    Small blocks ride in step 1: each pair's numbers are followed by a slot of S bytes, S the
    largest block any rank sent in the last alltoallv on this communicator (rounded up to 8;
    0 when p S > CARRY_MAX or at first), which every rank knows alike, since every rank's
    numbers say its largest block. A rank whose blocks fit (and are host memory: src) sends
    them in its slots; when every rank's largest block fits, the call is over after step 1
    (and step 2 where it is needed): `carried` says so and unpack() copies the blocks out, so a
    repeated small alltoallv costs one MPI_Alltoall, not an all-to-all and an MPI_Alltoallv."""

    def __init__(self, g, x, counts, out, recv_counts, name, host=True, declared=False,
                 sig=None, src=None, send=None):
        p = g.size
        self.g, self.x, self.out, self.recv_counts, self.name = g, x, out, recv_counts, name
        self.sig = sig
        layout = _args.layout(x.dtype, x.shape[1:])
        checking = int(recv_counts is not None or out is not None)
        self.row_bytes = _args.row_elems(x) * x.dtype.itemsize
        # the bytes of this rank's blocks, to carry (None: device memory, never carried)
        self.src = None if src is None or not isinstance(src, np.ndarray) else src.view(np.uint8)
        self.blocks = [c * self.row_bytes for c in counts]
        largest = max(self.blocks, default=0) if self.src is not None else 1 << 62
        numbers = np.empty((p, NUMBERS), np.int64)  # row j: what rank j gets from this rank
        numbers[:, 0] = counts
        # bits: something to check (1), declared (2), host memory (4), the same call again
        # (AGAIN: set in `again`, the numbers sent when this rank repeats); this rank's rows,
        # and its largest block in bytes (more than any slot where its rows cannot ride)
        numbers[:, 1:] = [_args.row_elems(x), x.ndim, layout,
                          checking + 2 * bool(declared) + 4 * bool(host), sum(counts), largest]
        self.numbers = numbers
        self.part = None  # the exchange's buffers, for the current slot size (see _buffers)
        self.slot = None
        self.own, self.every = np.zeros(1, np.int64), np.empty(p, np.int64)
        self.seen, self.got, self.verdict = None, None, FINE
        self.everyone, self.carried = None, False
        # what the bits said, as last judged: some rank checks, all declared, all again
        self.checking = self.all_declared = self.all_again = False
        self.next_slot = 0
        self.verdict_call = None
        if name == "native":
            self.verdict_call = native.bind(g.t, "native_allgather", self.own, self.every,
                                            [1] * p)
        self.unpacking = None

    def _buffers(self, slot):
        """Send buffers (the numbers, and again with the AGAIN bit) and the receive buffer for
        slots of `slot` bytes, this rank's copies into its slots when its blocks fit, and
        MPI's all-to-all bound to each send buffer once: a repeated call parses no
        arguments."""
        g, p = self.g, self.g.size
        width = NUMBERS + slot // 8
        self.mine = np.zeros((p, width), np.int64)
        self.mine[:, :NUMBERS] = self.numbers
        self.again = self.mine.copy()
        self.again[:, 4] |= AGAIN
        self.theirs = np.empty_like(self.mine)  # row i: what rank i sent this rank
        self.heads = self.theirs[:, :NUMBERS]
        self.part = g.host.ws.partition(self.mine.size, p)
        self.fills = [[], []]
        if slot and self.src is not None and max(self.blocks, default=0) <= slot:
            at = np.cumsum([0] + self.blocks).tolist()
            for k, buf in enumerate((self.mine, self.again)):
                slots = buf[:, NUMBERS:].view(np.uint8)
                if self.blocks == [slot] * p:  # one strided copy
                    self.fills[k] = [(slots, self.src[:p * slot].reshape(p, slot))]
                else:
                    self.fills[k] = [(slots[j, :self.blocks[j]], self.src[at[j]:at[j + 1]])
                                     for j in range(p) if self.blocks[j]]
        self.counts_calls = None
        if self.name == "native":
            self.counts_calls = [native.bind(g.t, "native_alltoall", sent.reshape(-1),
                                             self.theirs.reshape(-1))
                                 for sent in (self.mine, self.again)]
        self.slot, self.seen, self.unpacking = slot, None, None

    def __call__(self):
        g = self.g
        slot = g.slots.get(NAME, 0)
        if slot != self.slot:
            self._buffers(slot)
        theirs = self.theirs
        # the same call again: this rank's last alltoallv ran this very exchange and ended
        # fine. When every rank says so (each sees every rank's bit), the call is the last
        # one again on every rank, whose verdicts were all fine: no verdict round
        again = g.last_fine.pop(NAME, None) is self  # (put back only if this call ends fine)
        for into, source in self.fills[again]:
            into[...] = source
        if self.counts_calls is not None:
            self.counts_calls[again]()
        else:
            sent = self.again if again else self.mine
            pairwise.alltoall(g.t, sent.reshape(-1), theirs.reshape(-1), self.part, Tag.COUNTS)
        numbers = self.heads.tobytes()
        if numbers != self.seen:  # (NumPy's reductions only then: each costs a microsecond)
            largest = int(theirs[:, 6].max())  # every rank's largest block: alike everywhere
            self.carried = largest <= slot
            self.next_slot = -(-largest // 8) * 8 if _fits(largest, g.size) else 0
            self.got, self.verdict = _judge(g, self.numbers, theirs, self.x, self.out,
                                            self.recv_counts)
            self.own[0] = self.verdict
            self.seen = numbers
            bits = theirs[:, 4]
            self.everyone = (bool((bits & 4).all()), int(theirs[:, 5].sum()))
            self.checking, self.all_declared = bool((bits & 1).any()), bool((bits & 2).all())
            self.all_again = bool((bits & AGAIN).all())
        g.slots[NAME] = self.next_slot  # (the same on every rank: all saw every largest block)
        if self.checking and not self.all_again:  # some rank checks: share the verdicts
            if self.verdict_call is not None:
                self.verdict_call()
                every = self.every
            else:
                every = bruck.allgather(g.t, self.own, Tag.VERDICT)[:, 0]
            if self.verdict != FINE or np.count_nonzero(every):
                self.seen = None  # (judged again next time, to raise with the right context)
                _refuse(g, self.verdict, every, self.got, self.x, self.out, self.recv_counts)
        if self.sig is not None and self.all_declared:  # agreed: skip it from now on
            g.declared[self.sig] = self.everyone
        g.last_fine[NAME] = self
        return self.got

    def unpack(self, dst, recv):
        """The blocks that came in step 1's slots into dst (flat raw, rank order; recv: its
        Partition in elements): one strided copy when every block fills its slot."""
        if self.unpacking is None or self.unpacking[0] is not dst \
                or self.unpacking[1] is not self.got:
            p, slot, got = self.g.size, self.slot, self.got
            out = dst.view(np.uint8)
            sizes = [c * self.row_bytes for c in got]
            slots = self.theirs[:, NUMBERS:].view(np.uint8)
            if sizes == [slot] * p:
                copies = [(out.reshape(p, slot), slots)]
            else:
                at = np.cumsum([0] + sizes).tolist()
                copies = [(out[at[i]:at[i + 1]], slots[i, :sizes[i]]) for i in range(p)
                          if sizes[i]]
            self.unpacking = (dst, self.got, copies)
        for into, source in self.unpacking[2]:
            into[...] = source


def _fits(largest, p):
    """Do p slots of `largest` bytes (rounded up to 8) stay within CARRY_MAX?"""
    return p * (-(-largest // 8) * 8) <= CARRY_MAX


def _judge(g, mine, theirs, x, out, recv_counts):
    """Step 1's numbers judged: (the rows each rank sends this one, this rank's verdict on
    its own recv_counts= and out=); a dtype or trailing shape mismatch raises here."""
    p, r = g.size, g.rank
    ctx = f"ringcoll rank {r}, {g.progress.call()}: "
    bad = [i for i in range(p) if tuple(theirs[i, 1:4]) != tuple(mine[0, 1:4])]
    if bad:
        raise checks.agreed(CollectiveMismatchError(
            f"{ctx}rank(s) {bad} passed a different dtype or trailing shape than this rank "
            f"({x.dtype}, {x.shape[1:]}); only axis 0 may differ between ranks"))
    got = [int(c) for c in theirs[:, 0]]
    total = sum(got)
    verdict = (WRONG_RECV_COUNTS if recv_counts is not None and recv_counts != got
               else WRONG_OUT if out is not None and out.shape[0] != total else FINE)
    return got, verdict


def _refuse(g, verdict, every, got, x, out, recv_counts):
    """Step 2 found a wrong call: the error this rank raises (its own, or PeerFailedError)."""
    p, r = g.size, g.rank
    ctx = f"ringcoll rank {r}, {g.progress.call()}: "
    total = sum(got)
    if verdict == WRONG_RECV_COUNTS:
        differ = [i for i in range(p) if recv_counts[i] != got[i]]
        raise checks.agreed(CollectiveMismatchError(
            f"{ctx}recv_counts={recv_counts}, but the ranks send this rank {got} rows (rank(s) "
            f"{differ} differ); pass recv_counts={got}, or recv_counts=None to take what the "
            "senders' counts say"))
    if verdict == WRONG_OUT:
        raise checks.agreed(InvalidArgumentError(
            f"{ctx}out has shape {out.shape}, but the ranks send this rank {total} rows in all; "
            f"pass out of shape {(total,) + x.shape[1:]} or out=None"))
    if every.any():
        wrong_counts = [i for i in range(p) if every[i] == WRONG_RECV_COUNTS]
        wrong_out = [i for i in range(p) if every[i] == WRONG_OUT]
        why = "; ".join(
            ([f"rank(s) {wrong_counts} passed recv_counts that differ from what the other "
              "ranks send them"] if wrong_counts else [])
            + ([f"rank(s) {wrong_out} passed out= with the wrong row count"] if wrong_out
               else []))
        raise checks.agreed(PeerFailedError(
            f"{ctx}{why}, so no rank runs this alltoallv; fix the call on those ranks (their "
            "own errors say how)"))
