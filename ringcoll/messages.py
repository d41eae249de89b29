"""Point-to-point messages of a communicator (Communicator.send / recv / isend / irecv /
sendrecv): their argument checks, and each call watched like a collective.

The user's messages travel on the transport's channel (transport/base.py): their wire tags can
never match a collective's, and they have their own progress record, so they run on the
caller's thread even while non-blocking collectives run in the background. They are not
collectives: debug mode does not compare them across ranks.

A receive may take source=ANY_SOURCE (MPI_ANY_SOURCE): the first message with its tag from
any rank, by MPI's matching rules; recv(..., status=) and an irecv's Request say whose it was.
"""

import time
from functools import partial

import numpy as np

from .arrays import check_dtype, flat_view
from .collectives._args import array_input, send_view
from .errors import InvalidArgumentError, InvalidTypeError, where
from .runner import Request
from .transport.base import ANY_SOURCE, MAX_USER_TAG, p2p_tag


class Status:
    """What a receive took (Communicator.recv(..., status=s) fills it in, as MPI_Status):

    source: the rank that sent the message (for a receive from ANY_SOURCE, the sender it
        matched); tag: the message's tag (0..1023); nbytes: its size in bytes.
    """

    __slots__ = ("source", "tag", "nbytes")

    def __init__(self):
        self.source = self.tag = self.nbytes = None

    def __repr__(self):
        return f"Status(source={self.source}, tag={self.tag}, nbytes={self.nbytes})"


class MessageRequest(Request):
    """A non-blocking send or receive (Communicator.isend / irecv): wait() returns the receive
    buffer (None for a send) once the message has arrived (or left); test() polls. A
    receive's `source` is the sender's rank once wait() has returned (or test() said True):
    for irecv(out, ANY_SOURCE), the rank whose message it took; None until then, and for a
    send."""

    def __init__(self, messages, req, call, result, keep=None, source=None):
        super().__init__()
        self._messages, self._req, self._call = messages, req, call
        self._result = result
        self._keep = keep  # a send's buffer (perhaps a contiguous copy) stays alive until done
        self._done = False
        self._source = source  # the source asked for (ANY_SOURCE), then the sender
        self.source = None

    def _finished(self):
        self._done, self._keep = True, None
        if self._source == ANY_SOURCE:
            self._source = self._messages.channel.source(self._req)
        if self._result is not None:
            self.source = self._source

    def wait(self, poll=None):
        """Block until the message has arrived (or left); return the receive buffer (None
        for a send).

        poll: seconds to sleep between checks instead of blocking inside MPI. MPI's blocking
            wait spins on its core; where ranks outnumber cores, that spinning takes the core
            from a rank with work to do, and polling with a short sleep (50 us) gives it back
            (the pipeline example at 4 ranks on 2 cores: twice as fast). Still watched: the
            wait counts as one call, so RINGCOLL_TIMEOUT's watchdog fires if it never ends.
        """
        if not self._done:
            self._messages.point(f"wait for {self._call}", partial(_finish, self._req, poll))
            self._finished()
        return self._result

    def test(self):
        if not self._done and self._messages.point(f"test of {self._call}",
                                                   lambda t: t.test(self._req)):
            self._finished()
        return self._done


def _finish(req, poll, t):
    """t.wait(req), after polling t.test(req) every `poll` seconds if poll is set. Over MPI
    the watchdog ends a poll that never succeeds (the wait is one call, standing still), so a
    watched transport polls on: falling into MPI's blocking wait there could hold MPICH's
    lock while the watchdog's MPI_Abort waits for it, and the job would hang. A transport
    without one gets t.wait after its timeout, which then ends it (thread ranks: a
    CollectiveTimeoutError after twice the timeout in all)."""
    if poll:
        watched = getattr(t, "watched", False)
        give_up = time.monotonic() + (getattr(t, "timeout", None) or 60.0)
        while not t.test(req) and (watched or time.monotonic() < give_up):
            time.sleep(poll)
    t.wait(req)


class Messages:
    """The point-to-point calls of the communicator whose Group is g (docs: Communicator)."""

    def __init__(self, g):
        self.g = g
        self.channel = None  # the transport's point-to-point channel, once a message is sent

    def send(self, x, dest, tag):
        buf, dest, wire = self.checked("send", x, dest, "dest", tag, outgoing=True)
        if dest == self.g.rank:
            raise InvalidArgumentError(
                f"{where(self.g.rank, 'send')}a blocking send to this rank itself can wait "
                "forever for a receive it has not posted yet; use isend (then recv and wait) "
                "or sendrecv")
        self.point(f"send to {dest}", lambda t: t.send(buf, dest, wire))

    def recv(self, out, source, tag, status=None):
        buf, source, wire = self.checked("recv", out, source, "source", tag, wildcard=True)
        if status is not None and not isinstance(status, Status):
            raise InvalidTypeError(f"{where(self.g.rank, 'recv')}status must be a "
                                   f"ringcoll.Status (or None), got {type(status).__name__}")
        if source == ANY_SOURCE:
            source = self.point("recv from any rank",
                                lambda t: t.recv_from(buf, ANY_SOURCE, wire))
        else:
            self.point(f"recv from {source}", lambda t: t.recv(buf, source, wire))
        if status is not None:
            status.source, status.tag, status.nbytes = source, int(tag), buf.nbytes
        return out

    def isend(self, x, dest, tag):
        buf, dest, wire = self.checked("isend", x, dest, "dest", tag, outgoing=True)
        req = self.point(f"isend to {dest}", lambda t: t.isend(buf, dest, wire))
        return MessageRequest(self, req, f"isend to {dest}", None, keep=buf)

    def irecv(self, out, source, tag):
        buf, source, wire = self.checked("irecv", out, source, "source", tag, wildcard=True)
        whom = "any rank" if source == ANY_SOURCE else source
        req = self.point(f"irecv from {whom}", lambda t: t.irecv(buf, source, wire))
        return MessageRequest(self, req, f"irecv from {whom}", out, source=source)

    def sendrecv(self, x, dest, out, source, tag):
        send, dest, wire = self.checked("sendrecv", x, dest, "dest", tag, outgoing=True)
        recv, source, _ = self.checked("sendrecv", out, dest if source is None else source,
                                       "source", tag)
        self.point(f"sendrecv to {dest} from {source}",
                   lambda t: t.sendrecv(send, dest, recv, source, wire))
        return out

    def checked(self, call, x, peer, role, tag, outgoing=False, wildcard=False):
        """(x as a flat buffer, peer, wire tag) of a point-to-point call, all checked.

        outgoing: x is sent (any layout: a non-contiguous x is copied); otherwise x is
        received into (a writeable contiguous NumPy array, refused otherwise). wildcard:
        peer may be ANY_SOURCE (recv and irecv)."""
        g = self.g
        g.check_open(call)
        ctx = where(g.rank, call)
        if outgoing:
            x, side = array_input(g, x, ctx)
            if side is not g.host:
                raise InvalidTypeError(
                    f"{ctx}point-to-point messages take NumPy arrays, not CuPy ones (yet); "
                    "send cupy.asnumpy(x) and copy the received array to the GPU")
            buf = send_view(x, side)
        else:
            if not isinstance(x, np.ndarray):
                raise InvalidTypeError(f"{ctx}out must be a NumPy array to receive into, got "
                                       f"{type(x).__name__}")
            check_dtype(x.dtype, ctx)
            if not x.flags.writeable:
                raise InvalidArgumentError(f"{ctx}out is read-only; pass a writeable array")
            buf = flat_view(x)
            if buf is None:
                raise InvalidArgumentError(
                    f"{ctx}out is not contiguous; receive into a C- or F-contiguous array "
                    "(np.empty(shape, dtype)) and copy it where you need it")
        if (isinstance(peer, bool) or not isinstance(peer, (int, np.integer))
                or not (0 <= peer < g.size or (wildcard and peer == ANY_SOURCE))):
            if wildcard:
                raise InvalidArgumentError(
                    f"{ctx}{role}={peer!r} is not a rank of this communicator "
                    f"(0..{g.size - 1}) nor ringcoll.ANY_SOURCE ({ANY_SOURCE}); pass the "
                    "sending rank, or ringcoll.ANY_SOURCE to take a message from any rank "
                    "(not mpi4py's MPI.ANY_SOURCE, whose value differs between MPI libraries)")
            raise InvalidArgumentError(
                f"{ctx}{role}={peer!r} is not a rank of this communicator (0..{g.size - 1})"
                + ("; sendrecv names its source (use irecv(out, ringcoll.ANY_SOURCE) and "
                   "isend for a wildcard)" if call == "sendrecv" and role == "source"
                   and peer == ANY_SOURCE else ""))
        if (isinstance(tag, bool) or not isinstance(tag, (int, np.integer))
                or not 0 <= tag <= MAX_USER_TAG):
            raise InvalidArgumentError(f"{ctx}tag={tag!r} must be an integer in "
                                       f"0..{MAX_USER_TAG}")
        return buf, int(peer), p2p_tag(tag)

    def point(self, call, fn):
        """fn(channel) as one point-to-point call, watched like a collective (the watchdog,
        error messages); an error part-way goes to the channel's fail() as a collective's
        does (MPI: the job is aborted, since the peer may wait for this rank forever)."""
        t = self.channel
        if t is None:
            t = self.channel = self.g.t.channel()
        progress = t.progress
        progress.begin(call, None)
        try:
            return fn(t)
        except BaseException as exc:
            t.fail(exc)
            raise
        finally:
            progress.end()

    def close(self):
        if self.channel is not None and self.channel is not self.g.t:
            self.channel.close()
