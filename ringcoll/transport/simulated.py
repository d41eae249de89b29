"""Recording transport: runs a rank's real algorithm code and writes down what it asked for.

`RecordingTransport` is the Transport ringcoll.netsim hands to the algorithm functions. Every
call becomes one entry of `ops`, the rank's operation log, in program order:

    (SEND, peer, tag, nbytes)     an isend (send and sendrecv go through isend/irecv/wait too)
    (RECV, peer, tag, nbytes)     an irecv
    (WAIT, req)                   a wait (or a test) on the request made by ops[req]
    (WAITALL, (req, ...))         a waitall
    (COMPUTE, nbytes)             a reduction of nbytes (CostedCombine, below)

A request is the index of its SEND/RECV entry, so a WAIT names exactly what it waits for.
The network simulator replays these logs in virtual time (ringcoll.netsim.replay).

Two ways to run it:
  payload-free (RecordingTransport): nothing is moved and a wait returns at once, so one
      rank can run its whole algorithm alone, rank after rank, with no threads. That is only
      valid for code whose control flow does not depend on the data it receives - true of
      every all-reduce schedule in ringcoll.algorithms (what it does depends on rank, size,
      counts and segment size only). tests/test_netsim.py checks both modes log the same.
  payload (PayloadRecordingTransport over a ThreadTransport): every call is also made on the
      thread transport, so real data flows with MPI's matching rules and the algorithm's
      results can be checked.
"""

from functools import partial

from ..errors import InvalidArgumentError
from .base import Progress, Transport

SEND, RECV, WAIT, WAITALL, COMPUTE = range(5)


class RecordingTransport(Transport):
    """A Transport that logs every operation and moves nothing (see the module docstring).

    Args:
        rank, size: this rank and the number of ranks.
        node_ids: the node of every rank (what Communicator's topology asks for), or None.
    """

    def __init__(self, rank, size, node_ids=None):
        self.rank, self.size = rank, size
        self.progress = Progress()
        self.ops = []
        self.peers = set()  # every rank this one sends to: tells replay which ports are shared
        self._node_ids = node_ids

    # (the hot path of a 1,024-rank simulation: two million calls each; kept to the minimum)
    def isend(self, buf, peer, tag):
        ops = self.ops
        ops.append((SEND, peer, tag, buf.nbytes))
        self.peers.add(peer)
        return len(ops) - 1

    def irecv(self, buf, peer, tag):
        if peer < 0:
            raise wildcard_refused(self.rank, self.progress.call())
        ops = self.ops
        ops.append((RECV, peer, tag, buf.nbytes))
        return len(ops) - 1

    def wait(self, req):
        self.ops.append((WAIT, req))

    def waitall(self, reqs):
        self.ops.append((WAITALL, tuple(reqs)))

    def test(self, req):
        """Logged as a wait: replay cannot know when a poll would first have succeeded."""
        self.wait(req)
        return True

    def node_ids(self):
        return list(self._node_ids) if self._node_ids is not None else [0] * self.size


def wildcard_refused(rank, call):
    """The error for a receive from ANY_SOURCE on the simulator (recording or replay)."""
    return InvalidArgumentError(
        f"ringcoll rank {rank}, {call}: a receive from any source (ANY_SOURCE) cannot be "
        "simulated: the network simulator records each rank's schedule and replays it "
        "deterministically, matching every message to the receive that names its source, "
        "and which sender a wildcard receive takes depends on timing. Name the source "
        "(recv(out, source=rank)).")


class PayloadRecordingTransport(RecordingTransport):
    """The same log, while every call is also made on `inner` (a ThreadTransport), so real
    data flows with MPI's matching rules and the algorithm's results can be checked."""

    def __init__(self, inner, node_ids=None):
        super().__init__(inner.rank, inner.size, node_ids)
        self.inner = inner
        self.progress = inner.progress
        self._pending = {}  # request index -> the inner transport's request

    def isend(self, buf, peer, tag):
        req = super().isend(buf, peer, tag)
        self._pending[req] = self.inner.isend(buf, peer, tag)
        return req

    def irecv(self, buf, peer, tag):
        req = super().irecv(buf, peer, tag)
        self._pending[req] = self.inner.irecv(buf, peer, tag)
        return req

    def wait(self, req):
        super().wait(req)
        self.inner.wait(self._pending.pop(req))

    def waitall(self, reqs):
        reqs = tuple(reqs)
        super().waitall(reqs)
        self.inner.waitall([self._pending.pop(r) for r in reqs])

    def fail(self, exc, why=None):
        self.inner.fail(exc, why)


class CostedCombine:
    """A combine(a, b, out) that logs a COMPUTE of out.nbytes and reduces nothing (payload-free
    runs: only the cost is written down)."""

    __slots__ = ("ops",)

    def __init__(self, transport):
        self.ops = transport.ops

    def __call__(self, a, b, out):
        self.ops.append((COMPUTE, out.nbytes))

    def bind(self, a, b, out):
        return partial(self, a, b, out)


class PayloadCombine(CostedCombine):
    """CostedCombine that also runs the real reduction `inner` (a ringcoll.ops Combine)."""

    __slots__ = ("inner",)

    def __init__(self, transport, inner):
        super().__init__(transport)
        self.inner = inner

    def __call__(self, a, b, out):
        self.inner(a, b, out)
        self.ops.append((COMPUTE, out.nbytes))
