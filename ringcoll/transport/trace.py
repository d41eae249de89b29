"""Traces: every point-to-point message a collective sends, recorded as it goes.

`TracingTransport(inner, trace)` is a Transport that forwards every call to `inner` and writes
into `trace` (a Trace) one Message per message this rank sends and one Receive per message it
receives. The Communicator puts one in front of its transport for the length of
`with comm.trace() as t:` and takes it away after, so a communicator that is not tracing runs
exactly the code it always runs: tracing costs nothing when it is off.

    with comm.trace() as t:
        comm.allreduce(x, algorithm="ring")
    t.bytes_sent(comm.rank), t.by_step(), print(t.summary())

What is recorded, exactly (a Message, at the sender, when the send is posted):
    src, dst     ranks of the traced transport (the communicator's ranks; a sub-group View of
                 hierarchical's shows its parent's ranks, the real ones)
    tag          describe_tag(tag): "ring_allgather", "rd_exchange (sub-group 2)", ...
    nbytes       the size of the message
    collective, algorithm, seq
                 the sender's Progress record at the time: "allreduce", "ring", and the
                 communicator's collective sequence number (1 for its first collective)
    step         this message's index among the sender's messages with the same tag in this
                 collective, from 0. Where a step is one message per rank (recursive doubling,
                 Rabenseifner, Bruck, barrier, all-to-all whose s is step + 1, and the ring
                 while a block fits one pipeline segment) it is the docstring's step, each phase
                 (tag) counted on its own; elsewhere every piece counts one (ring segments, a
                 tree's children), and the all-gather's row-count exchange and its data share
                 the ring_allgather tag, so the data's steps follow the exchange's p-1
    index        its index among all the sender's messages in this collective, from 0
    order        its position among the messages from src to dst with this tag since tracing
                 began: MPI matches messages to receives in that order, and so does the trace
    t_start      time.perf_counter() on the sender when the send was posted (before the
                 transport's isend/send/sendrecv was called)
    t_end        time.perf_counter() on the receiver when it saw the matching receive complete
                 (its recv or sendrecv returned, or the wait/waitall/test that completed it):
                 an upper bound on arrival; None until the receive completes, and over MPI
                 until Trace.gather brings the receiver's record (perf_counter is one clock
                 for all processes of one Linux machine, not across machines)
    event        this rank's count of sends posted and receives completed in this collective
                 before this one: the order in which the rank did its sends and receives
A Receive (at the receiver, when the receive is posted) has src, dst, tag, nbytes,
collective, algorithm, seq, order, t_post, t_end and event (counted when it completed). A
receive from ANY_SOURCE (a user's wildcard) has src ANY_SOURCE (-1) and order -1 until it
completes; then src is the sender and order the count of this rank's receives from that
sender with that tag recorded so far (exact unless wildcard and named receives from one
sender are in flight together).

Payloads (`comm.trace(payloads=True)`, `ringcoll.simulate(p, fn, payloads=True)`, or a
`Trace(payloads=True)`): every Message also keeps what it carried, and both kinds of record
keep where the data was, so a reader can tell which part of which buffer moved:
    payload      a copy of the sent elements (a 1-D array of the sent dtype), taken when the
                 send was posted
    address      the data pointer of the sent (or, for a Receive, the receiving) array.
                 `msg.offset_in(a)` turns it into an element offset within the contiguous array
                 `a` when the message's bytes lie inside `a` (the user's x or out, say), and
                 gives None when they do not: then the algorithm sent from, or received into,
                 one of the communicator's scratch buffers (or some other array).
A watch hook (`Trace(watch=fn)`, `simulate(..., watch=fn)`) sees every rank's state at every
message: fn(rank, buf, sending) is called on rank's thread with the array about to be sent
(sending=True) or received into (False), before the transport is called (so before any
received data lands), and whatever it returns is kept on the record as `seen`.
`ringcoll explain` uses it to copy every rank's buffers step by step. Payloads and `seen`
cost a copy per message: leave them off when timing.

One Trace may be shared by every thread rank (ringcoll.simulate does that): it is thread-safe.
Over MPI each process records only its own rank's sends and receives; Trace.gather(comm)
collects every rank's records on every rank. MPI's own collectives (algorithm="native") are
opaque: their messages are not seen.
"""

import pickle
import threading
import time
from dataclasses import astuple, dataclass

import numpy as np

from .base import ANY_SOURCE, Transport, describe_tag


@dataclass(slots=True)
class Message:
    """One point-to-point message; see the module docstring for what each field means."""

    src: int
    dst: int
    tag: str
    nbytes: int
    collective: str | None
    algorithm: str | None
    seq: int
    step: int
    index: int
    order: int
    t_start: float
    t_end: float | None = None
    event: int = -1
    payload: np.ndarray | None = None
    address: int | None = None
    seen: object = None

    def offset_in(self, array):
        """The element offset of this message's data within `array` (contiguous), or None if
        it was not sent from array's memory (or payloads were off)."""
        return _offset(self.address, self.nbytes, array)


@dataclass(slots=True)
class Receive:
    """One receive, as the receiving rank saw it (matches the Message with the same src, dst,
    tag and order)."""

    src: int
    dst: int
    tag: str
    nbytes: int
    collective: str | None
    algorithm: str | None
    seq: int
    order: int
    t_post: float
    t_end: float | None = None
    event: int = -1
    address: int | None = None
    seen: object = None

    def offset_in(self, array):
        """The element offset within `array` (contiguous) where this message was received, or
        None if it was received elsewhere (or payloads were off)."""
        return _offset(self.address, self.nbytes, array)


def _offset(address, nbytes, array):
    if address is None:
        return None
    delta = address - array.__array_interface__["data"][0]
    if delta < 0 or delta + nbytes > array.nbytes or delta % array.itemsize:
        return None
    return delta // array.itemsize


class Trace:
    """The messages (Message) and receives (Receive) recorded while tracing.

    `messages` is in the order the sends were recorded; `receives` likewise. payloads=True
    keeps each message's data and addresses; watch=fn(rank, buf, sending) is called before
    each message a rank sends or receives (see the module docstring).
    """

    def __init__(self, messages=(), receives=(), *, payloads=False, watch=None):
        self.messages = list(messages)
        self.receives = list(receives)
        self.payloads = payloads
        self.watch = watch
        self._lock = threading.Lock()
        self._unmatched = {}  # (src, dst, tag, order) -> Message whose receive has not completed
        self._early = {}  # the same key -> t_end of a receive that completed first (self-sends)

    # -- recording (TracingTransport calls these, from any rank's thread) --------------------
    def _add_message(self, msg):
        key = (msg.src, msg.dst, msg.tag, msg.order)
        with self._lock:
            self.messages.append(msg)
            done = self._early.pop(key, None)
            if done is None:
                self._unmatched[key] = msg
            else:
                msg.t_end = done

    def _add_receive(self, rec):
        with self._lock:
            self.receives.append(rec)

    def _complete(self, rec):
        now = time.perf_counter()
        key = (rec.src, rec.dst, rec.tag, rec.order)
        with self._lock:
            rec.t_end = now
            msg = self._unmatched.pop(key, None)
            if msg is None:  # over MPI: the sender's record is in the sender's process
                self._early[key] = now
            else:
                msg.t_end = now

    # -- queries ------------------------------------------------------------------------------
    def __len__(self):
        return len(self.messages)

    def __iter__(self):
        return iter(self.messages)

    def __repr__(self):
        return f"<ringcoll.Trace: {len(self.messages)} messages, {len(self.receives)} receives>"

    def bytes_sent(self, rank):
        """Bytes of every message rank sent (as recorded by rank itself)."""
        return sum(m.nbytes for m in self.messages if m.src == rank)

    def bytes_received(self, rank):
        """Bytes of every receive rank posted (as recorded by rank itself)."""
        return sum(r.nbytes for r in self.receives if r.dst == rank)

    def ranks(self):
        """Every rank that appears as a sender or receiver, sorted."""
        return sorted({m.src for m in self.messages} | {m.dst for m in self.messages}
                      | {r.src for r in self.receives} | {r.dst for r in self.receives})

    def collectives(self):
        """[(seq, collective, algorithm)] of the traced collectives that moved a message."""
        return sorted({(m.seq, m.collective, m.algorithm)
                       for m in (*self.messages, *self.receives)}, key=lambda c: c[0])

    def select(self, **criteria):
        """A new Trace with the records whose fields match: each criterion is a value, or a
        predicate called with the field's value. Receives are kept only if every criterion
        names a field a Receive has (src, dst, tag, nbytes, collective, algorithm, seq, order).

            t.select(collective="allreduce", tag=lambda tag: not tag.startswith("header"))
        """
        def match(rec):
            for name, want in criteria.items():
                if not hasattr(rec, name):
                    return False
                have = getattr(rec, name)
                if not (want(have) if callable(want) else have == want):
                    return False
            return True

        with self._lock:
            return Trace([m for m in self.messages if match(m)],
                         [r for r in self.receives if match(r)])

    def by_step(self):
        """{(seq, tag, step): [Message]}: the messages of each step of each collective, the
        steps in the order they began (lowest sender index first), the messages by sender."""
        groups = {}
        with self._lock:
            for m in self.messages:
                groups.setdefault((m.seq, m.tag, m.step), []).append(m)

        def began(item):
            (seq, _, _), msgs = item
            return seq, min(m.index for m in msgs), min(m.t_start for m in msgs)

        return {key: sorted(msgs, key=lambda m: (m.src, m.index))
                for key, msgs in sorted(groups.items(), key=began)}

    def summary(self):
        """A table of messages and bytes sent and received per rank."""
        lines = ["rank  sent: msgs     bytes   received: msgs     bytes"]
        for r in self.ranks():
            sent = [m for m in self.messages if m.src == r]
            got = [x for x in self.receives if x.dst == r]
            lines.append(f"{r:4}  {len(sent):10} {sum(m.nbytes for m in sent):9}"
                         f"  {len(got):14} {sum(x.nbytes for x in got):9}")
        return "\n".join(lines)

    # -- over MPI: every rank's records on every rank ---------------------------------------
    def gather(self, comm):
        """A Trace of every rank's records, on every rank (collective over comm).

        For per-rank traces (each process, or each thread rank, traced its own communicator):
        Over MPI a rank records only its own sends and receives; this all-gathers them (with
        ringcoll's own allgather on comm: call it after the with-block, so it is not traced
        itself) and fills each Message's t_end from its receiver's record.
        """
        with self._lock:
            mine = pickle.dumps(([astuple(m) for m in self.messages],
                                 [astuple(r) for r in self.receives]))
        sizes = comm.allgather(np.array([len(mine)], dtype=np.int64))
        blob = comm.allgather(np.frombuffer(mine, dtype=np.uint8))
        messages, receives, start = [], [], 0
        for size in sizes.tolist():
            sent, got = pickle.loads(blob[start:start + size].tobytes())
            messages += [Message(*m) for m in sent]
            receives += [Receive(*r) for r in got]
            start += size
        done = {(r.src, r.dst, r.tag, r.order): r.t_end for r in receives}
        for m in messages:
            if m.t_end is None:
                m.t_end = done.get((m.src, m.dst, m.tag, m.order))
        return Trace(messages, receives)


class _PendingRecv:
    """What irecv returns while tracing: the transport's request and the Receive it fills."""

    __slots__ = ("req", "rec", "tag")

    def __init__(self, req, rec, tag):
        self.req, self.rec, self.tag = req, rec, tag


class TracingTransport(Transport):
    """Forwards every call to `inner`, recording each message into `trace` (a Trace)."""

    def __init__(self, inner, trace):
        self.inner = inner
        self.trace = trace
        self.rank, self.size = inner.rank, inner.size
        self.progress = inner.progress  # the same record: the communicator writes it
        self._seq = None  # the collective the counters below belong to
        self._index = 0
        self._event = 0  # sends posted and receives completed in this collective
        self._steps = {}  # tag -> messages sent with it in this collective
        self._sends = {}  # (dst, tag) -> messages sent there since tracing began
        self._recvs = {}  # (src, tag) -> receives posted from there since tracing began
        self._names = {}  # tag -> describe_tag(tag)

    def __getattr__(self, name):
        # everything not traced is the inner transport's: native_*, thread_multiple, comm ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- recording ------------------------------------------------------------------------------
    def _name(self, tag):
        name = self._names.get(tag)
        if name is None:
            name = self._names[tag] = describe_tag(tag)
        return name

    def _tick(self):
        """This rank's next event number in the current collective (counters restart with
        each collective)."""
        if self.progress.seq != self._seq:
            self._seq, self._index, self._event, self._steps = self.progress.seq, 0, 0, {}
        event, self._event = self._event, self._event + 1
        return event

    def _sent(self, buf, peer, tag):
        trace, progress = self.trace, self.progress
        seen = trace.watch(self.rank, buf, True) if trace.watch is not None else None
        event = self._tick()
        step = self._steps.get(tag, 0)
        self._steps[tag] = step + 1
        index, self._index = self._index, self._index + 1
        order = self._sends.get((peer, tag), 0)
        self._sends[(peer, tag)] = order + 1
        current = progress.current
        collective, algorithm = current[:2] if current is not None else (None, None)
        msg = Message(self.rank, peer, self._name(tag), buf.nbytes, collective, algorithm,
                      progress.seq, step, index, order, time.perf_counter(), event=event,
                      seen=seen)
        if trace.payloads:
            msg.payload = buf.copy()
            msg.address = buf.__array_interface__["data"][0]
        trace._add_message(msg)

    def _posted(self, buf, peer, tag):
        trace, progress = self.trace, self.progress
        seen = trace.watch(self.rank, buf, False) if trace.watch is not None else None
        current = progress.current
        if peer == ANY_SOURCE:
            order = -1  # the sender is known once it completes (_done)
        else:
            order = self._recvs.get((peer, tag), 0)
            self._recvs[(peer, tag)] = order + 1
        collective, algorithm = current[:2] if current is not None else (None, None)
        rec = Receive(peer, self.rank, self._name(tag), buf.nbytes, collective, algorithm,
                      progress.seq, order, time.perf_counter(), seen=seen)
        if trace.payloads:
            rec.address = buf.__array_interface__["data"][0]
        trace._add_receive(rec)
        return rec

    def _done(self, rec, source=None, tag=None):
        """rec completed; a wildcard's (src ANY_SOURCE) sender was `source`, with `tag`."""
        if rec.src == ANY_SOURCE and source is not None:
            rec.src = source
            rec.order = self._recvs.get((source, tag), 0)
            self._recvs[(source, tag)] = rec.order + 1
        rec.event = self._tick()
        self.trace._complete(rec)

    def _pending_done(self, pending):
        rec = pending.rec
        if rec.src == ANY_SOURCE:
            self._done(rec, self.inner.source(pending.req), pending.tag)
        else:
            self._done(rec)

    # -- point-to-point ---------------------------------------------------------------------------
    def isend(self, buf, peer, tag):
        self._sent(buf, peer, tag)
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag):
        rec = self._posted(buf, peer, tag)
        return _PendingRecv(self.inner.irecv(buf, peer, tag), rec, tag)

    def send(self, buf, peer, tag):
        self._sent(buf, peer, tag)
        self.inner.send(buf, peer, tag)

    def recv(self, buf, peer, tag):
        rec = self._posted(buf, peer, tag)
        self.inner.recv(buf, peer, tag)
        self._done(rec)

    def recv_from(self, buf, peer, tag):
        rec = self._posted(buf, peer, tag)
        source = self.inner.recv_from(buf, peer, tag)
        self._done(rec, source, tag)
        return source

    def source(self, req):
        return self.inner.source(req.req if type(req) is _PendingRecv else req)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._sent(sendbuf, dest, tag)
        rec = self._posted(recvbuf, source, tag)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)
        self._done(rec)

    def wait(self, req):
        if type(req) is _PendingRecv:
            self.inner.wait(req.req)
            self._pending_done(req)
        else:
            self.inner.wait(req)

    def waitall(self, reqs):
        self.inner.waitall([r.req if type(r) is _PendingRecv else r for r in reqs])
        for r in reqs:
            if type(r) is _PendingRecv:
                self._pending_done(r)

    def test(self, req):
        if type(req) is not _PendingRecv:
            return self.inner.test(req)
        done = self.inner.test(req.req)
        if done:
            self._pending_done(req)
        return done

    # bound forms: the inner transport's bound step, with the recording around it. The step's
    # `at` (its (peer, tag), which the communicator lists for the watchdog) is kept.
    def bind_send(self, buf, peer, tag):
        call, sent = self.inner.bind_send(buf, peer, tag), self._sent

        def step():
            sent(buf, peer, tag)
            call()
        return _same_at(step, call)

    def bind_recv(self, buf, peer, tag):
        call, posted, done = self.inner.bind_recv(buf, peer, tag), self._posted, self._done

        def step():
            rec = posted(buf, peer, tag)
            call()
            done(rec)
        return _same_at(step, call)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        call = self.inner.bind_sendrecv(sendbuf, dest, recvbuf, source, tag)
        sent, posted, done = self._sent, self._posted, self._done

        def step():
            sent(sendbuf, dest, tag)
            rec = posted(recvbuf, source, tag)
            call()
            done(rec)
        return _same_at(step, call)

    # -- the rest: the inner transport's -----------------------------------------------------------
    def fail(self, exc, why=None):
        return self.inner.fail(exc, why)

    def split(self, color, key):
        """The inner transport's split: a sub-communicator made while tracing is not traced
        (it outlives the with-block; trace it with its own comm.trace())."""
        return self.inner.split(color, key)

    def node_ids(self):
        return self.inner.node_ids()

    def close(self):
        self.inner.close()


def _same_at(step, call):
    at = getattr(call, "at", None)
    if at is not None:
        step.at = at
    return step
