"""All-gather: every rank's x concatenated along axis 0, on every rank.

Ranks may pass different lengths on axis 0: the row counts (and a check that dtypes,
trailing shapes, out= and any counts= agree) travel first in a small all-gather of META
numbers per rank (Rows), then the data; a repeated call's small rows ride with them (no second
step). With declared=True (every rank passes it, with the same counts=, as MPI_Allgatherv's
recvcounts are given on every rank), the exchange runs once per distinct call: once all ranks
have agreed on those counts, dtype and row shape, the same call again sends only the data, as
MPI_Allgatherv does (see Rows). The ringcoll algorithm is the ring's all-gather half
(algorithms/ring.py: p-1 steps, (p-1)a + (p-1)/p n b for n the gathered bytes); "node" the
node tier's (algorithms/node.py: each rank copies the blocks it lacks from the others' shared
memory; the default for CuPy arrays on one node); "native" is MPI_Allgatherv.

auto, where the communicator's tuning table lists the all-gather (bench/collectives_sweep.py
measured it), picks ring or native once the counts are in, from the gathered bytes, which
every rank then knows alike (its own x's bytes may differ between ranks); the counts then
travel by MPI's own all-gather where the transport has it.
"""

import numpy as np

from .. import checks
from ..algorithms import COLLECTIVE_ALGORITHMS, native, node, ring
from ..arrays import Partition
from ..errors import CollectiveMismatchError, InvalidArgumentError, PeerFailedError
from ..runner import Plan
from . import _args

NAME = "allgather"
ALGORITHMS = COLLECTIVE_ALGORITHMS[NAME]
#: positions of the plan's arguments that are arrays (see runner.Repeat)
BUFFERS = (0, 1)


def plan(g, ctx, x, out, algorithm, counts=None, declared=False):
    given = x
    x, side = _args.rows_input(g, x, ctx, movable=True)
    counts = expected_counts(g, counts, ctx, declared)
    name = _args.pick_simple(algorithm, ALGORITHMS, ctx, g, side)
    # (an out= that x lives in, as wrap()'s Allgather(IN_PLACE) and FSDP's
    # all_gather_into_tensor pass, goes to MPI's call as MPI_IN_PLACE: see _mpi_step)
    measured = (algorithm in (None, "auto") and name == ALGORITHMS[0] and g.tuning is not None
                and g.tuning.choose_collective(NAME, 0, g.size, g.nodes) is not None)
    if name == "native":
        native.check(side.t, None, ctx)
    if out is not None:  # all but its row count can be checked now; that comes later
        rows_out = out.shape[0] if getattr(out, "ndim", 0) else -1
        _args.output(out, (rows_out,) + x.shape[1:], x.dtype, ctx, side, rows=True)
    src = _args.raw(x.reshape(-1))  # raw: a struct's padding travels too
    native_counts = name == "native" or (measured and hasattr(g.t, "native_allgather"))
    # this rank's rows already in its block of out (wrap()'s Allgather(IN_PLACE), FSDP's
    # all_gather_into_tensor): when every rank's are, MPI's call goes in place on all
    exchange = Rows(g, x, out, "native" if native_counts else "ring", expect=counts, src=src,
                    host=side.device is None, declared=declared,
                    in_place=_own_block(src, out, counts, g.rank, _args.row_elems(x)))
    target = Target(out, x, ctx, side)
    row_bytes = _args.row_elems(x) * x.dtype.itemsize
    chosen = [None, name]  # auto's pick for the last counts seen (a repeat keeps the list)
    problem = declared_problem(ctx, x, out, counts, g.rank)
    bound = [None, None, None, None]  # MPI's all-gather bound to (counts, dst, all in place)
    # once the call is agreed and runs MPI's call: that call bound, and the result (out).
    # Then a repeat is one dict lookup and MPI's call, while the agreement holds (every
    # rank's g.declared forgets it alike: see Rows)
    hot = [None, None]
    sig, agreed = exchange.signature, g.declared.get

    def run():
        if hot[0] is not None and agreed(sig) is not None:
            hot[0]()
            return hot[1]
        # (exchange.agreed() inlined: every rank on the host, every rank in place)
        agreed_before = None if sig is None else agreed(sig)
        if agreed_before is not None:  # counts declared by every rank, agreed before
            if problem is not None:
                raise InvalidArgumentError(problem)  # (the others are sending: abort)
            got, carried, in_place = counts, False, agreed_before[1]
        else:
            got, carried = exchange()  # host numbers, over the host transport
            in_place = exchange.everyone[2]
        part, result, dst, copy_to = target(got)
        if measured and got is not chosen[0]:
            chosen[:] = got, _args.pick_simple(None, ALGORITHMS, ctx, g, side,
                                                (NAME, sum(got) * row_bytes, None))
        if carried:  # every rank's rows came with the counts
            exchange.unpack(dst)
        elif chosen[1] == "native":
            if bound[0] is not got or bound[1] is not dst or bound[3] is not in_place:
                bound[:] = got, dst, _mpi_step(side, src, dst, part, g.rank, in_place), in_place
            bound[2]()
            if got is counts and copy_to is None:  # (declared: got is counts when agreed)
                hot[:] = bound[2], result
        else:
            dst[part.slices[g.rank]] = src
            (node if chosen[1] == "node" else ring).allgather(side.t, dst, part, side.ws)
        if copy_to is not None:
            _args.copy_rows(dst, copy_to)
        return result

    # axis 0 may differ between ranks: the fingerprint leaves it out
    fields = _args.fields(g, side, dtype=_args.dtype_key(x.dtype), row_shape=list(x.shape[1:]),
                          **_args.declared_field(declared))
    return Plan(NAME, "auto" if measured else name, fields, _args.on_side(run, side),
                repeatable=x is given and out is not None)


def _mpi_step(side, src, dst, part, rank, in_place=False):
    """MPI's all-gather of src into dst (flat, every rank's rows at part) as one zero-argument
    call. MPI forbids a send buffer that overlaps the receive buffer and wants MPI_IN_PLACE
    on every rank or on none. in_place: the ranks agreed that every rank's rows sit in its
    block of dst (Rows' in-place bits): then every rank passes MPI_IN_PLACE, with no copy
    (a rank whose rows moved since, under declared counts, copies them in first). Else which
    of two ways is faster depends on the MPI library, the same on every rank (the
    transport's in_place_allgather):

    - MPICH: every rank passes MPI_IN_PLACE, having copied its rows into its block of dst
      unless they are that block already (an in-place call, as wrap()'s Allgather(IN_PLACE)
      and FSDP's all_gather_into_tensor make: no copy at all). At -n 2 that costs an
      out-of-place call nothing (8 B: 2.13 against 2.07 us; 8 KiB: 5.77 against 5.75) and
      makes the in-place call 1.6x faster than a copy as the send buffer (8 KiB: 4.0 against
      6.5 us; MPI's own: 3.2).
    - Open MPI (and any other): src as the send buffer, or a copy of it where it overlaps
      dst. Open MPI 5.0.11's in-place all-gather right after the copy takes twice as long as
      the copy and the all-gather apart (128 KiB at -n 2: 22.8 against 3.1 + 8.0 us), and
      a copy of the own rows into a spare before the out-of-place call made wrap()'s
      Allgather(IN_PLACE) of 256 KiB 5x slower than MPI's in place (in_place above)."""
    mine = dst[part.slices[rank]]
    if in_place or getattr(side.t, "in_place_allgather", False):
        call = native.bind(side.t, "native_allgather", None, dst, part.counts)
        if _args.same_bytes(src, mine):
            return call
        return _args.copy_first(mine, src, call)
    if not side.xp.may_share_memory(src, dst):
        return native.bind(side.t, "native_allgather", src, dst, part.counts)
    spare = src.copy()
    return _args.copy_first(spare, src, native.bind(side.t, "native_allgather", spare, dst,
                                                    part.counts))


def _own_block(src, out, counts, rank, row_elems):
    """Are src's bytes (this rank's raw rows) exactly its block of out under counts (MPI's
    IN_PLACE)? False without counts (the block's place is known only after the exchange) or
    with an out that is not C-contiguous (the result is staged elsewhere)."""
    if out is None or counts is None or not out.flags.c_contiguous:
        return False
    start = sum(counts[:rank]) * row_elems
    flat = _args.raw(out.reshape(-1))
    return _args.same_bytes(src, flat[start:start + counts[rank] * row_elems])


def expected_counts(g, counts, ctx, declared=False):
    """counts= (the rows a rank expects from every rank) as a list, checked locally; None
    stays None (refused with declared=True, which promises counts)."""
    if counts is None:
        if declared:
            raise InvalidArgumentError(f"{ctx}declared=True needs counts= (every rank's rows, "
                                       "the same list on every rank); pass counts or leave "
                                       "declared out")
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


def declared_problem(ctx, x, out, counts, rank):
    """Why this rank's own x or out contradicts its counts= (None if it does not, or if there
    are no counts). Checked only when the call skips its exchange (Rows.agreed): the
    exchange would make every rank raise it alike; without one the others are already
    moving data, so it ends the job with this message."""
    if counts is None:
        return None
    if x.shape[0] != counts[rank]:
        return (f"{ctx}x has {x.shape[0]} rows, but counts[{rank}] = {counts[rank]}; pass "
                "the counts the ranks send (every rank the same list)")
    if out is not None and out.shape[0] != sum(counts):
        return (f"{ctx}out has shape {out.shape}, but counts adds up to {sum(counts)} rows; "
                f"pass out of shape {(sum(counts),) + x.shape[1:]} or out=None")
    return None


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


#: bytes of a rank's rows that may ride in its slot of the count exchange (see Rows)
SLOT_MAX = 8192
#: numbers per rank: rows, row elements, ndim, layout crc, out rows, counts crc, carried,
#: and bits: its rows are host memory (1), it declared its counts (2), its rows are its block
#: of out (4: in place)
META = 8


class Rows:
    """Every rank's row count, once all ranks know that dtypes, trailing shapes, the row
    counts of the out= arrays and any expected counts agree (else every rank raises, so none
    is left waiting): calling it runs the exchange and returns (the counts, whether every
    rank's rows came with them: then unpack() writes them out and no data phase is needed).

    expect: this rank's counts= (what it expects each rank to send), or None. Only a
    fingerprint of it travels, so every rank can tell whether some rank expected otherwise.
    The numbers travel by ringcoll's ring all-gather, or by MPI's own (name 'native': for
    algorithm='native', so the native baseline pays no ringcoll step, and for auto with a
    measured table).

    Small rows ride with the counts: every rank's slot in the exchange is its META numbers and
    S bytes, S being the largest block of the last exchange of this collective on this
    communicator (up to SLOT_MAX; 0 at first). S is the same on every rank without a message,
    since every rank saw that exchange's counts. A rank whose rows fit in S sends them in its
    slot and says so (the "carried" number); when every rank did, the call is over after this
    one exchange, so a repeated small all-gather or gather costs one collective, not two.
    src: this rank's rows as host bytes to carry (None: never carried, e.g. device memory).

    Built once per plan, so a repeated call (runner.Repeat) only exchanges: this rank's
    numbers are computed here, and when every rank's numbers come back as they were last
    time, the counts judged then are returned again (the very same list) unjudged.

    Declared counts: when every rank passed declared=True (with counts=) and the exchange
    found them right, each rank records the call's signature (collective, counts, dtype and
    row shape, whether its rows are host memory, and `key`: gather's root) in g.declared,
    with whether every rank's rows are host memory (then MPI's own calls may move them); with
    in_place given (all-gather), the pair (that, whether every rank's rows were its block of
    out: then MPI's call goes in place on every rank). A later call of that signature skips the exchange (agreed() says so; the caller then uses
    its counts). Every rank decides alike, since each records after the same exchanges and
    evicts the same oldest entry: what a rank that passed other arguments than the others
    would break is documented in docs/errors.md. Debug mode never skips (it checks every
    call).
    """

    def __init__(self, g, x, out, name, collective=NAME, expect=None, src=None, key=(),
                 host=True, declared=False, in_place=None):
        self.g, self.x, self.out, self.name = g, x, out, name
        self.collective, self.expect, self.in_place = collective, expect, in_place
        layout = _args.layout(x.dtype, x.shape[1:])
        out_rows = -1 if out is None else out.shape[0]
        self.numbers = [x.shape[0], _args.row_elems(x), x.ndim, layout, out_rows,
                        -1 if expect is None else _args.counts_crc(expect), 0,
                        bool(host) + 2 * bool(declared) + 4 * bool(in_place)]
        self.signature = None if not declared or g.options.debug else \
            (collective, tuple(expect), layout, bool(host)) + tuple(key)
        # the judged exchange's verdict: all declared, all host memory, all in place?
        self.everyone = None
        self.src = None if src is None or not isinstance(src, np.ndarray) else \
            src.view(np.uint8)
        self.row_bytes = _args.row_elems(x) * x.dtype.itemsize
        self.slot = None  # the buffers of the current slot size (see _buffers)
        self.got = None  # the counts judged last
        self.seen, self.carried = None, False  # the last headers received, and their verdict
        self.unpacking = None  # (got, dst, [(into, from)]): unpack's copies for them

    def _buffers(self, width):
        """Send and receive buffers for slots of `width` bytes, with views of this rank's
        numbers (written once), its payload and every rank's numbers."""
        g, head = self.g, META * 8
        send, recv = np.zeros(width, np.uint8), np.empty((g.size, width), np.uint8)
        mine = send[:head].view(np.int64)
        mine[:] = self.numbers
        src = self.src
        fits = src is not None and src.size <= width - head
        mine[6] = fits  # "carried": this rank's rows are in its slot
        payload = send[head:head + src.size] if fits else None
        flat, part = recv.reshape(-1), g.host.ws.partition(recv.size, g.size)
        # MPI's all-gather bound once per slot size: a repeated call parses no arguments
        call = native.bind(g.t, "native_allgather", send, flat, part.counts) \
            if self.name == "native" else None
        self.heads = recv[:, :head]  # every rank's numbers, viewed once
        self.slot = (width, send, recv, flat, payload, part, call)

    def __call__(self):
        g = self.g
        width = META * 8 + g.slots.get(self.collective, 0)
        if self.slot is None or self.slot[0] != width:
            self._buffers(width)
        _, send, recv, flat, payload, part, call = self.slot
        if payload is not None:
            payload[...] = self.src
        if call is not None:
            call()
        else:
            recv[g.rank] = send
            ring.allgather(g.t, flat, part, g.host.ws)
        headers = self.heads.tobytes()
        if headers != self.seen:  # another call than the last: judge it
            meta = np.frombuffer(headers, np.int64).reshape(g.size, META)
            if self.seen is None or headers_differ(headers, self.seen, g.size):
                self.got = _judge(g, meta, meta[g.rank], self.x, self.out, self.collective,
                                  self.expect)
                sizes = [c * self.row_bytes for c in self.got]
                self.offsets = np.cumsum([0] + sizes).tolist()
                self.next_slot = -(-max(sizes) // 8) * 8 if max(sizes) <= SLOT_MAX else 0
                self.everyone = (bool((meta[:, 7] & 2).all()), bool((meta[:, 7] & 1).all()),
                                 bool((meta[:, 7] & 4).all()))
            self.seen, self.carried = headers, bool(meta[:, 6].all())
        if width - META * 8 != self.next_slot:  # the same on every rank: all saw got
            g.slots[self.collective] = self.next_slot
        if self.signature is not None and self.everyone[0]:
            g.declared[self.signature] = self.everyone[1] if self.in_place is None else \
                self.everyone[1:]
        return self.got, self.carried

    def agreed(self):
        """None unless this call may skip the exchange (every rank declared its counts and an
        earlier exchange of the same signature found them right: see the class doc); then
        whether every rank's rows are host memory, as that exchange found."""
        return None if self.signature is None else self.g.declared.get(self.signature)

    def unpack(self, dst):
        """Copy the rows that came in the slots into dst (flat, the result's bytes in rank
        order): one strided copy when every block has the same size."""
        if self.unpacking is None or self.unpacking[0] is not self.got \
                or self.unpacking[1] is not dst or self.unpacking[3] is not self.slot:
            recv, offsets, head, p = self.slot[2], self.offsets, META * 8, self.g.size
            out = dst.view(np.uint8)
            n = offsets[1]
            if offsets == [n * r for r in range(p + 1)]:
                copies = [(out.reshape(p, n), recv[:, head:head + n])]
            else:
                copies = [(out[offsets[r]:offsets[r + 1]],
                           recv[r, head:head + offsets[r + 1] - offsets[r]]) for r in range(p)]
            self.unpacking = (self.got, dst, copies, self.slot)
        for into, source in self.unpacking[2]:
            into[...] = source


def headers_differ(a, b, p):
    """Do two exchanges' headers differ in more than the "carried" numbers (which change with
    the payload, not the call)? The bits count: they make everyone's verdict."""
    x = np.frombuffer(a, np.int64).reshape(p, META)
    y = np.frombuffer(b, np.int64).reshape(p, META)
    return not (np.array_equal(x[:, :6], y[:, :6]) and np.array_equal(x[:, 7], y[:, 7]))


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
    differ = [r for r in range(g.size) if meta[r, 5] not in (-1, _args.counts_crc(got))]
    if g.rank in differ:
        raise checks.agreed(InvalidArgumentError(
            f"{ctx}counts={expect} but the ranks pass {got} rows; pass the counts they send"))
    if differ:
        raise checks.agreed(PeerFailedError(
            f"{ctx}rank(s) {differ} passed counts= that differ from the rows the ranks pass "
            f"({got}), so no rank runs this {collective}"))
    return got
