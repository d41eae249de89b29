"""The Transport interface: the only thing an algorithm knows about the outside world.

An algorithm receives a Transport `t` and calls t.send / t.recv / t.sendrecv / t.isend /
t.irecv / t.wait / t.waitall with 1-D contiguous NumPy arrays, a peer rank and a tag.
Messages between two ranks with the same tag arrive in the order they were sent (MPI's
non-overtaking rule), and a receive must be given a buffer of exactly the size sent.

`t.view(members, tag_offset)` gives a Transport over a subset of ranks (used by the
hierarchical algorithm for its node-local and cross-node groups) that renumbers peers and
shifts tags, so the same algorithm code runs unchanged on a sub-group.

`t.channel()` gives a sibling Transport for the user's point-to-point messages
(Communicator.send/recv/...): the same ranks and message space, its own Progress record (so
a receive on the caller's thread and a non-blocking collective on the background thread never
overwrite each other's), and receives that check the size of what arrives. User tag u travels
as wire tag p2p_tag(u) = u * VIEW_STRIDE + Tag.P2P: no collective, in any view, uses a tag
that is P2P modulo VIEW_STRIDE, so user messages and ringcoll's own can never match.

A channel's receives also take ANY_SOURCE as their peer (MPI_ANY_SOURCE: the user's wildcard
receive, Communicator.recv(out, ANY_SOURCE)): the receive takes the first message with its tag
from any rank, by MPI's matching rules (messages from one sender with one tag in the order they
were sent; a message goes to the earliest-posted receive it matches, wildcard or not), and
`t.source(req)` (or `t.recv_from`'s return) says whose message it took. Collectives always
name their peers; the simulator's recording transport refuses a wildcard, as its replay
matches every message by its named source.
"""

import os
import time
from enum import IntEnum
from functools import partial
from numbers import Integral

import numpy as np

from ..errors import InvalidArgumentError


class Tag(IntEnum):
    """Every tag ringcoll uses, in one place. Views add a multiple of VIEW_STRIDE."""

    RING_REDUCE_SCATTER = 1
    RING_ALLGATHER = 2
    RD_FOLD = 3
    RD_EXCHANGE = 4
    RD_UNFOLD = 5
    RAB_HALVING = 6
    RAB_DOUBLING = 7
    BCAST = 8
    REDUCE = 9
    ALLTOALL = 10
    BARRIER = 11
    META = 12
    BRUCK = 13
    HEADER = 14  # the (collective, count, dtype, op) check with the left neighbour
    FINGERPRINT = 15  # debug mode's exchange of every rank's call before each collective
    P2P = 16  # the user's point-to-point messages: user tag u is wire tag p2p_tag(u)
    GATHER = 17
    COUNTS = 18  # alltoallv's pairwise exchange of the row counts (and dtype, trailing shape)
    VERDICT = 19  # verdicts before data moves: alltoallv's on the counts, scatter's header rows
    SCAN = 20  # scan and exscan's recursive-doubling exchanges
    SCATTER = 21
    NODE = 22  # not a message: the node tier's flag waits, as Progress and errors name them
    VIEW_STRIDE = 32


#: the largest user tag of Communicator.send/recv: its wire tag, 1023 * 32 + 16 = 32752, is
#: below 32767, the smallest tag upper bound (MPI_TAG_UB) the MPI standard allows.
MAX_USER_TAG = 1023


#: the peer of a receive that takes a message from any rank (MPI_ANY_SOURCE); the MPI
#: transport passes its own MPI.ANY_SOURCE in its place. Public as ringcoll.ANY_SOURCE.
ANY_SOURCE = -1


def p2p_tag(tag):
    """The wire tag of user tag `tag` (0..MAX_USER_TAG)."""
    return int(tag) * Tag.VIEW_STRIDE + Tag.P2P


def describe_tag(tag):
    """A tag as an error message should show it: 'ring_allgather (sub-group 2)'."""
    group, base = divmod(int(tag), Tag.VIEW_STRIDE)
    if base == Tag.P2P:
        return f"point-to-point tag {group}"
    try:
        name = Tag(base).name.lower()
    except ValueError:
        name = f"tag {base}"
    return f"{name} (sub-group {group})" if group else name


def size_mismatch(rank, call, peer, tag, got, expected):
    """The CollectiveMismatchError text of a message whose size is not the receive buffer's.

    got: the bytes that arrived, or None when only "more than expected" is known (MPI's
    truncation error). A point-to-point message names both ranks and the fix for a send/recv
    pair; a collective's says that the ranks disagree on the count or dtype.
    """
    sent = f"more than {expected}" if got is None else f"{got}"
    if int(tag) % Tag.VIEW_STRIDE == Tag.P2P:
        who = "a rank" if peer == ANY_SOURCE else f"rank {peer}"  # (a wildcard's, unknown)
        return (f"ringcoll rank {rank}, {call}: {who} sent {sent} bytes "
                f"({describe_tag(tag)}) to rank {rank}, whose receive buffer holds {expected} "
                f"bytes. Give the receive a buffer of exactly the size and dtype {who} "
                f"sends (or make {who} send {expected} bytes).")
    return (f"ringcoll rank {rank}, {call}: received {sent} bytes from rank {peer} "
            f"({describe_tag(tag)}) where {expected} were expected; the ranks disagree on "
            "the element count or dtype. Pass the same count and dtype on every rank "
            "(RINGCOLL_DEBUG=1 names the rank that differs).")


class Progress:
    """What one rank is doing right now, for error messages and the MPI watchdog.

    The Communicator sets `current` = (collective, algorithm, schedule) around each call and
    counts the calls in `seq`; the transport notes in `at` the (peer, tag) of every receive it
    starts or blocking send it makes. Unbound calls count themselves in `step`; a bound step
    (bind_*) is found in `schedule`, the list of the bound steps' (peer, tag) in order.
    Plain attribute writes: cheap enough for the hot path.
    """

    __slots__ = ("seq", "current", "step", "at")  # the watchdog watches (seq, step) move

    def __init__(self):
        self.seq = 0  # collectives started on this communicator, this one included
        self.current = None  # (collective, algorithm) while one runs, else None
        self.step = 0
        self.at = None

    def begin(self, collective, algorithm, schedule=()):
        self.seq += 1
        self.current = (collective, algorithm, schedule)
        self.step, self.at = 0, None

    def end(self):
        self.current = None

    def call(self):
        """'allreduce #7 (ring)': the collective as error messages name it."""
        if self.current is None:
            return f"after collective #{self.seq}"
        collective, algorithm, _ = self.current
        return f"{collective} #{self.seq}" + (f" ({algorithm})" if algorithm else "")

    def waiting(self):
        """'step 3: rank 1 (ring_allgather)': the message this rank last waited for."""
        if self.at is None:
            return "before its first message"
        peer, tag = self.at
        if peer == ANY_SOURCE:
            return f"step {self.step}: any rank ({describe_tag(tag)})"
        schedule = self.current[2] if self.current is not None else ()
        step = next((i + 1 for i, at in enumerate(schedule) if at is self.at), self.step)
        return f"step {step}: rank {peer} ({describe_tag(tag)})"


class Transport:
    """Abstract point-to-point transport; see the module docstring for the contract."""

    rank: int
    size: int
    progress: Progress
    #: True where a watchdog ends a wait that makes no progress (MPI with RINGCOLL_TIMEOUT):
    #: a polling wait then polls until it succeeds or the watchdog aborts the job
    watched = False

    def send(self, buf, peer, tag):
        self.wait(self.isend(buf, peer, tag))

    def recv(self, buf, peer, tag):
        self.wait(self.irecv(buf, peer, tag))

    def recv_from(self, buf, peer, tag):
        """recv, returning the rank whose message it took: peer, or with peer ANY_SOURCE
        (a channel's receives only) the sender of the first message with this tag."""
        req = self.irecv(buf, peer, tag)
        self.wait(req)
        return self.source(req)

    def source(self, req):
        """The rank whose message the completed receive request req took (for a receive
        from ANY_SOURCE: the sender it matched)."""
        raise NotImplementedError(f"{type(self).__name__} does not report a receive's source")

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        """Send to dest and receive from source at once (no deadlock in a ring)."""
        rreq = self.irecv(recvbuf, source, tag)
        sreq = self.isend(sendbuf, dest, tag)
        self.waitall([rreq, sreq])

    # bound forms: the same calls with their arguments fixed, as zero-argument callables, for
    # schedules that are built once and replayed (a transport may make them cheaper to call).
    def bind_send(self, buf, peer, tag):
        return partial(self.send, buf, peer, tag)

    def bind_recv(self, buf, peer, tag):
        return partial(self.recv, buf, peer, tag)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        return partial(self.sendrecv, sendbuf, dest, recvbuf, source, tag)

    def isend(self, buf, peer, tag):
        raise NotImplementedError

    def irecv(self, buf, peer, tag):
        raise NotImplementedError

    def wait(self, req):
        raise NotImplementedError

    def waitall(self, reqs):
        for req in reqs:
            self.wait(req)

    def test(self, req):
        """True if the request has completed (and then it is finished)."""
        raise NotImplementedError

    def view(self, members, tag_offset):
        """A Transport over `members` (parent ranks, in group order); see View."""
        return View(self, members, tag_offset)

    # the node tier's memory (see Shared): transports whose ranks can share memory define
    # shared(nbytes, members=None), collective over `members` (this transport's ranks, in
    # group order; None: all), returning a Shared, or raising NoSharedMemory with the reason.
    # flags(words, members=None) is the Flags of the same group, in host memory.
    def flags(self, words, members=None):
        """Collective: a Flags of `words` counters per rank (see Flags), in host memory."""
        return Flags(self.shared(_padded(words * 8), members), words, self.progress,
                     self.stalled, members, getattr(self, "pause", None))

    def stalled(self, peer, waited):
        """Called now and then while a Flags wait has waited `waited` seconds for `peer` (a
        rank of this transport): raise if the wait can never end. The default does nothing:
        over MPI the watchdog ends a wait that makes no progress (as for a receive)."""

    def channel(self):
        """A sibling Transport for the user's point-to-point messages (see the module
        docstring). This default shares this transport's Progress record."""
        return self

    def fail(self, exc, why=None):
        """A collective failed part-way through, so other ranks may wait in it forever.

        In-process transports mark their world failed (every rank then stops with
        PeerFailedError) and re-raise; the MPI transport prints exc (and why, if given) and
        aborts the job.
        """
        raise exc


class View(Transport):
    """A sub-group of a transport: rank i of the view is parent rank members[i].

    Tags are shifted by tag_offset * Tag.VIEW_STRIDE so traffic of different views sharing
    a pair of processes can never be confused with each other or with the parent's.
    """

    def __init__(self, parent, members, tag_offset):
        members = list(members)
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not a member of the view {members}")
        self.parent = parent
        self.progress = parent.progress  # peers are recorded as parent ranks: the real ones
        self.members = members
        self.rank = members.index(parent.rank)
        self.size = len(members)
        self.shift = int(tag_offset) * Tag.VIEW_STRIDE

    def isend(self, buf, peer, tag):
        return self.parent.isend(buf, self.members[peer], tag + self.shift)

    def irecv(self, buf, peer, tag):
        return self.parent.irecv(buf, self.members[peer] if peer >= 0 else peer,
                                 tag + self.shift)

    def send(self, buf, peer, tag):
        self.parent.send(buf, self.members[peer], tag + self.shift)

    def recv(self, buf, peer, tag):
        self.parent.recv(buf, self.members[peer] if peer >= 0 else peer, tag + self.shift)

    def source(self, req):
        return self.members.index(self.parent.source(req))

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self.parent.sendrecv(
            sendbuf, self.members[dest], recvbuf, self.members[source], tag + self.shift
        )

    def bind_send(self, buf, peer, tag):
        return self.parent.bind_send(buf, self.members[peer], tag + self.shift)

    def bind_recv(self, buf, peer, tag):
        return self.parent.bind_recv(buf, self.members[peer], tag + self.shift)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        return self.parent.bind_sendrecv(
            sendbuf, self.members[dest], recvbuf, self.members[source], tag + self.shift
        )

    def wait(self, req):
        self.parent.wait(req)

    def waitall(self, reqs):
        self.parent.waitall(reqs)

    def test(self, req):
        return self.parent.test(req)

    def fail(self, exc, why=None):
        self.parent.fail(exc, why)

    def shared(self, nbytes, members=None):
        if not hasattr(self.parent, "shared"):
            raise NoSharedMemory(f"{type(self.parent).__name__} has no shared memory")
        return self.parent.shared(nbytes, self._members(members))

    def flags(self, words, members=None):
        if not hasattr(self.parent, "shared"):
            raise NoSharedMemory(f"{type(self.parent).__name__} has no shared memory")
        return self.parent.flags(words, self._members(members))

    def _members(self, members):
        """A group of this view's ranks as the parent's ranks."""
        return self.members if members is None else [self.members[m] for m in members]


class Window:
    """One-sided memory: every rank exposes a 1-D array that any rank reads and adds into
    without the owner taking part (MPI's passive-target RMA). Made collectively by
    `t.window(initial)`; `initial` is this rank's part (its size may differ per rank).

    Every call completes before it returns, at the origin and at the target, so what it wrote
    is visible to every later call of any rank. Calls on one target element are atomic with
    respect to each other (MPI's accumulate atomicity): concurrent adds never lose an update,
    and a fetch sees an element before or after an add, never half of one. Nothing else is
    ordered: a fetch of a range may see one rank's add in some elements and not yet in others.

    `local` is this rank's part as an array: read it only when no rank can be adding (after a
    barrier that follows the last add), and never write it while the window is open.
    """

    rank: int
    size: int
    counts: tuple  # every rank's part, in elements
    dtype: object
    local: object

    def check(self, call, values, target, offset):
        """Raise InvalidArgumentError unless values (a 1-D array of the window's dtype) fits
        target's part at offset: MPI would corrupt memory or abort, not raise."""
        ctx = f"ringcoll rank {self.rank}, Window.{call}: "
        if not isinstance(target, Integral) or not 0 <= target < self.size:
            raise InvalidArgumentError(f"{ctx}target must be a rank 0..{self.size - 1}, got "
                                       f"{target!r}")
        if getattr(values, "dtype", None) != self.dtype or values.ndim != 1 \
                or not values.flags.c_contiguous:
            raise InvalidArgumentError(
                f"{ctx}pass a 1-D contiguous {self.dtype} array (the window's dtype), got "
                f"{getattr(values, 'dtype', type(values).__name__)} of shape "
                f"{getattr(values, 'shape', None)}")
        if not isinstance(offset, Integral) or offset < 0 or \
                offset + values.size > self.counts[target]:
            raise InvalidArgumentError(
                f"{ctx}elements [{offset}, {offset}+{values.size}) are outside rank {target}'s "
                f"part of {self.counts[target]} elements")

    def add(self, values, target, offset):
        """target's part[offset:offset + values.size] += values (atomic per element)."""
        raise NotImplementedError

    def fetch(self, out, target, offset):
        """out[...] = target's part[offset:offset + out.size] (atomic per element)."""
        raise NotImplementedError

    def fetch_add(self, value, target, offset):
        """The old value of target's part[offset], to which value is added, as one atomic
        step (MPI_Fetch_and_op): a counter every rank can bump and read."""
        raise NotImplementedError

    def close(self):
        """Collective: every rank calls it once its last call returned."""
        raise NotImplementedError


#: dtypes a Window holds: those every MPI library can add atomically (predefined datatypes)
WINDOW_DTYPES = ("int32", "int64", "uint32", "uint64", "float32", "float64")


# -- the node tier's memory ---------------------------------------------------------------------
class NoSharedMemory(RuntimeError):
    """A transport cannot give these ranks shared memory (not on one node, no MPI-3 shared
    windows, GPUs without peer access); the message says why. The node tier then falls back
    to messages: it is never raised to the user."""


class Shared:
    """Node-tier memory: one segment per rank of a group whose ranks share a node, every
    segment read and written directly by every rank of the group. Made collectively by
    t.shared(nbytes, members): an MPI-3 shared window on the host, the threads' own arrays
    on the thread transport, CUDA IPC on a GPU.

    segments[q] is rank q's segment (q a rank of the group) as a 1-D uint8 array: NumPy in
    host memory, CuPy in device memory. Nothing orders one rank's writes with another's
    reads but the Flags posted and waited for around them, with fence() on both sides:

        writer: write; fence(); flags.post(...)      reader: flags.wait(...); fence(); read

    fence() completes this rank's writes (a memory barrier on the host; the current stream
    synchronised on a GPU), so a peer that saw the flag reads them whole.
    """

    rank: int
    size: int
    segments: list

    def fence(self):
        raise NotImplementedError

    def close(self):
        """Collective: every rank of the group calls it once no rank can still read."""
        raise NotImplementedError


class Flags:
    """`words` int64 counters per rank of a group, in shared host memory: rank r writes only
    its own (post) and reads everyone's (value, wait). The node tier keeps them increasing
    (sequence numbers), so a counter never has to be reset and a waiter's test is `>=`.

    wait() spins, then calls pause() between polls, and stalled(peer, seconds) every
    STALL_CHECK seconds: the transport's way to end a wait that can never finish (threads: a
    failed or timed-out peer; MPI: the watchdog instead). pause defaults to sched_yield, which
    gives the core away only if another process wants it (ranks may outnumber cores), unlike
    time.sleep(0): a nanosleep, which costs a timer slack of ~50 us every time (measured: 74 us
    a call at p = 2 on 2 cores). Threads pass their own pause, which releases the GIL.
    While it waits, progress.at names the peer (Tag.NODE), for the watchdog's message.
    """

    SPINS = 64
    STALL_CHECK = 0.05

    def __init__(self, shared, words, progress, stalled=None, ranks=None, pause=None):
        self.shared = shared
        self.rank, self.size, self.words = shared.rank, shared.size, words
        self.counters = [seg[:words * 8].view(np.int64) for seg in shared.segments]
        self.counters[self.rank][:] = 0
        self._mine = self.counters[self.rank]
        self.progress, self._stalled = progress, stalled
        self._pause = pause or os.sched_yield
        self._at = [(q if ranks is None else ranks[q], Tag.NODE) for q in range(self.size)]

    def post(self, index, value):
        """This rank's counter `index` := value (after a fence of the data it announces)."""
        self._mine[index] = value

    def value(self, peer, index):
        return int(self.counters[peer][index])

    def wait(self, peer, index, value):
        """Until peer's counter `index` >= value."""
        word = self.counters[peer]
        if word[index] >= value:
            return
        progress = self.progress
        progress.step += 1
        progress.at = self._at[peer]
        for _ in range(self.SPINS):
            if word[index] >= value:
                return
        start = last = time.monotonic()
        pause = self._pause
        while word[index] < value:
            pause()
            now = time.monotonic()
            if now - last >= self.STALL_CHECK:
                last = now
                if self._stalled is not None:
                    self._stalled(self._at[peer][0], now - start)

    def wait_all(self, index, value):
        """Until every other rank's counter `index` >= value."""
        for q in range(self.size):
            if q != self.rank:
                self.wait(q, index, value)

    def close(self):
        self.counters = self._mine = None
        self.shared.close()


def _padded(nbytes):
    """nbytes rounded up to whole 64-byte cache lines: ranks' counters never share a line."""
    return max(64, -(-nbytes // 64) * 64)
