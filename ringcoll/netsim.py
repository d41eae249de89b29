"""Network simulator: run the real algorithm code against a model of a cluster, in virtual time.

    from ringcoll.netsim import Cluster, Simulator, formula
    cluster = Cluster(nodes=128, devices_per_node=8)      # 1,024 ranks, one NIC per node
    sim = Simulator()
    sim.allreduce(cluster, "ring", 256 << 20).seconds     # predicted completion time
    sim.allreduce(cluster, "hierarchical", 256 << 20).seconds
    formula(cluster, "ring", 256 << 20)                   # the closed form, for comparison

How it works, in two passes (docs/simulator.md has the full story and the validation):

1. Record. Each rank's algorithm function - the very function in ringcoll.algorithms that
   the Communicator calls - runs on a RecordingTransport (ringcoll.transport.simulated), which
   writes every isend / irecv / wait / waitall and every reduction (with its byte count) into
   that rank's log. Payload-free (the default), a wait returns at once and nothing moves, so
   the ranks run one after another with no threads; the algorithms' control flow depends only
   on rank, size, counts and segment size, never on the data, so each log is exactly what the
   rank would do in a real run. Arrays are zero-stride views (any length, one element of
   memory); above `max_elems` elements the count is scaled down to a multiple of every
   partition the algorithm makes, and replay multiplies each byte count back up. With
   payload=True the ranks are threads over the thread transport instead, real data flows
   (MPI matching rules) and the reduced arrays come back to be checked; the logs are the same.
   Where rank r's log is rank 0's with every peer q renamed (q + r) % p (the ring with
   equal blocks, and Bruck: rotation_symmetric), only rank 0 and the check ranks 1, p // 2
   and p - 1 run; the other logs are derived from rank 0's (record_rotated), so 1,024 ranks
   cost what 4 do.

2. Replay. A discrete-event engine walks the logs in virtual time. Each rank has a clock. A
   message sent at t occupies its ports from start = max(t, when both ports are free) for
   bytes / bandwidth, and arrives at start + bytes / bandwidth + alpha; a wait completes at
   max(clock, arrival) (a send request at the end of its injection); a reduction adds
   gamma * bytes to the clock. Messages match receives by (source, tag) in posting order,
   exactly as MPI (and the thread transport) do; sizes must agree. Ties break by rank, so the
   result is deterministic.

The cluster: `nodes` x `devices_per_node` ranks, rank r on node r // devices_per_node. Inside
a node every device has its own egress and ingress port (an NVSwitch-like full crossbar,
intra_bandwidth each way). Between nodes a message goes through its source node's NIC egress
and its destination node's NIC ingress (inter_bandwidth each way), and every device of a node
shares its node's `nics_per_node` NICs (device i uses NIC i * nics_per_node // devices).
Shared ports serialize messages first-come first-served in virtual time (see
docs/simulator.md for why that, not fair sharing).
"""

import gc
import heapq
import math
import time
from collections import OrderedDict, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .algorithms import ALLREDUCE, CostModel
from .arrays import Workspace
from .config import DEFAULT_SEGMENT_BYTES
from .errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidArgumentError
from .ops import get_op
from .transport.simulated import (COMPUTE, RECV, SEND, WAIT, CostedCombine, PayloadCombine,
                                  PayloadRecordingTransport, RecordingTransport,
                                  wildcard_refused)

#: simulate with no pipeline segmentation: every block is one message (what the closed forms
#: in the algorithms' docstrings describe)
NO_SEGMENTS = 1 << 62


@dataclass(frozen=True)
class Cluster:
    """nodes x devices_per_node ranks; seconds, bytes and bytes/s throughout.

    The defaults are illustrative, not measured: an NVLink-class node (300 GB/s each way per
    device, 2 us) and an InfiniBand-class network (one 25 GB/s NIC per node each way, 5 us),
    with reductions at 1 TB/s (gamma = 1 ps/byte) as on a GPU.
    """

    nodes: int = 1
    devices_per_node: int = 8
    intra_alpha: float = 2e-6
    intra_bandwidth: float = 300e9
    inter_alpha: float = 5e-6
    inter_bandwidth: float = 25e9
    nics_per_node: int = 1
    gamma: float = 1e-12

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise InvalidArgumentError(f"need nodes >= 1 and devices_per_node >= 1, got "
                                       f"{self.nodes} x {self.devices_per_node}")
        if not 1 <= self.nics_per_node <= self.devices_per_node:
            raise InvalidArgumentError(f"nics_per_node must be 1..devices_per_node, got "
                                       f"{self.nics_per_node}")
        if min(self.intra_bandwidth, self.inter_bandwidth) <= 0:
            raise InvalidArgumentError("bandwidths must be > 0 (bytes per second)")

    @classmethod
    def flat(cls, p, alpha, bandwidth, gamma=0.0):
        """p ranks on one full-bisection switch: every pair alpha apart, every rank its own
        bandwidth each way. The setting the alpha-beta-gamma closed forms assume."""
        return cls(nodes=1, devices_per_node=p, intra_alpha=alpha, intra_bandwidth=bandwidth,
                   gamma=gamma)

    @property
    def size(self):
        return self.nodes * self.devices_per_node

    def node_lists(self):
        """Each node's ranks, in order: what hierarchical takes as `nodes`."""
        k = self.devices_per_node
        return [list(range(i * k, (i + 1) * k)) for i in range(self.nodes)]

    def node_ids(self):
        return [r // self.devices_per_node for r in range(self.size)]

    def nic_ids(self):
        """The NIC (numbered across the cluster) each rank's inter-node messages use."""
        k, m = self.devices_per_node, self.nics_per_node
        return [(r // k) * m + (r % k) * m // k for r in range(self.size)]

    def cost_model(self):
        """The CostModel with this cluster's link parameters (beta = 1 / bandwidth)."""
        return CostModel(alpha=self.intra_alpha, beta=1 / self.intra_bandwidth,
                         gamma=self.gamma, inter_alpha=self.inter_alpha,
                         inter_beta=1 / self.inter_bandwidth)


@dataclass
class Prediction:
    """What a simulated collective did. `seconds` is the prediction: the last rank's finish."""

    seconds: float
    finish: list  # each rank's virtual clock when its log ran out
    messages: int
    bytes_intra: float  # nominal bytes through intra-node ports, all messages together
    bytes_inter: float  # nominal bytes through NICs
    ordered: bool  # some port was shared, so sends on it were booked in virtual-time order
    record_seconds: float = 0.0  # wall time of the record pass (0 when the logs were cached)
    replay_seconds: float = 0.0  # wall time of the replay
    count: int = 0  # elements each rank's arrays really had
    scale: float = 1.0  # nominal bytes per recorded byte
    ranks_recorded: int = 0  # ranks whose algorithm code ran; the others' logs were derived
    results: list | None = field(default=None, repr=False)  # payload=True: every rank's dst


@contextmanager
def _no_gc():
    """Millions of small tuples and no reference cycles: the cyclic collector would only walk
    them again and again (a third of a 1,024-rank record pass went there)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# -- pass 1: record -------------------------------------------------------------------------
def _zeros(count, dtype):
    """A writable array of `count` elements backed by one element: what payload-free runs
    hand the algorithms. Slicing, partitions and byte counts behave as for a real buffer."""
    return as_strided(np.zeros(1, dtype), (count,), (0,))


class NominalWorkspace(Workspace):
    """The Workspace simulated ranks get: scratch buffers that take no memory (payload-free),
    partitions shared by every rank, and a pipeline segment of `seg_elems` elements (the
    segment in nominal bytes over the nominal bytes one element stands for).

    `shared` is a dict of partitions shared by every rank's workspace (they are pure
    functions of (n, parts), and building p of them at every rank would cost O(p^2))."""

    def __init__(self, seg_elems, shared, payload=False):
        super().__init__(None)
        self.seg_elems = seg_elems
        self.shared = shared
        self.payload = payload

    def scratch(self, name, count, dtype):
        if self.payload:
            return super().scratch(name, count, dtype)
        return _zeros(count, dtype)

    def partition(self, n, parts):
        key = ("even", n, parts)
        part = self.shared.get(key)
        if part is None:
            part = self.shared[key] = super().partition(n, parts)
        return part

    def segment_elems(self, dtype):
        return self.seg_elems


def record(p, fn, payload=False, node_ids=None, timeout=60.0):
    """Run fn(transport) on p ranks over RecordingTransports; return (transports, results).

    Payload-free: rank 0's whole run, then rank 1's, ... (no threads). Payload: one thread per
    rank over the thread transport, so data really moves; fn's return values are the results.
    """
    if not payload:
        transports, results = [], []
        with _no_gc():
            for r in range(p):
                t = RecordingTransport(r, p, node_ids=node_ids)
                results.append(fn(t))
                transports.append(t)
        return transports, results
    from .transport import threads

    transports = [None] * p

    def body(inner):
        t = transports[inner.rank] = PayloadRecordingTransport(inner, node_ids=node_ids)
        return fn(t)

    results = threads.run(p, body, timeout=timeout)
    return transports, results


# -- recording once for a rotation-symmetric schedule ---------------------------------------
def rotation_symmetric(algorithm, count, p):
    """Whether rank r's payload-free log is rank 0's with every peer q renamed (q + r) % p,
    as a fact read off the algorithm's code (docs/simulator.md, "Recording one rank"):

    - ring (ring.py): a rank uses its own number only as (r + 1) % p and (r - 1) % p, its
      neighbours, and as (r - step - k) % p, the block it handles at a step. With
      count % p == 0 every block has the same size, so every rank makes the same calls with
      the same byte counts and the same request numbers; only the neighbours' names differ.
    - bruck (bruck.py): peers (r - 2^k) % p and (r + 2^k) % p; the slots it sends, receives
      and reduces have sizes that depend on p and count only.

    Recursive doubling and Rabenseifner pair ranks by XOR and fold the ranks above the
    power-of-two core, hierarchical gives leaders other work: they record every rank."""
    if algorithm == "ring":
        return count % p == 0
    return algorithm == "bruck"


def _check_ranks(p):
    """The ranks record_rotated records besides rank 0 to compare with the derived logs: the
    neighbours of rank 0 and the middle of the ring."""
    return sorted(r for r in {1, p // 2, p - 1} if 0 < r < p)


def record_rotated(p, fn, node_ids=None):
    """Every rank's log from rank 0's, for a schedule that rotation_symmetric vouches for.

    Runs fn on rank 0 and on the _check_ranks, then derives each other rank r's log by
    renaming rank 0's peers q to (q + r) % p. The recorded check ranks must equal what the
    derivation gives them, entry for entry, or this returns None and the caller records
    every rank: a cheap guard against an algorithm changed since rotation_symmetric was
    written. Returns (logs, peers, ranks recorded) otherwise."""
    recorded = {}
    with _no_gc():
        for r in [0, *_check_ranks(p)]:
            t = RecordingTransport(r, p, node_ids=node_ids)
            fn(t)
            recorded[r] = t
    rotation = _Rotation(recorded[0].ops, recorded[0].peers, p)
    for r, t in recorded.items():
        if t.ops != rotation.log(r) or t.peers != rotation.peers(r):
            return None
    logs = [recorded[r].ops if r in recorded else rotation.log(r) for r in range(p)]
    peers = [recorded[r].peers if r in recorded else rotation.peers(r) for r in range(p)]
    return logs, peers, len(recorded)


class _Rotation:
    """Rank 0's log, ready to be renamed for any rank r of p.

    Only SEND and RECV entries name a peer; waits and reductions are the same at every rank,
    so every derived log shares those tuples with rank 0's. A log is stored as indices into
    its distinct entries, and rank r's is built by looking each index up in a copy of that
    table with the peers renamed: one C-level pass per rank, no Python per entry."""

    def __init__(self, ops, peers, p):
        self.p = p
        index = {}
        self.ids = [index.setdefault(op, len(index)) for op in ops]
        self.table = list(index)
        self.named = [j for j, op in enumerate(self.table) if op[0] in (SEND, RECV)]
        self.peers0 = peers

    def log(self, r):
        table = self.table.copy()
        for j in self.named:
            kind, q, tag, nbytes = table[j]
            table[j] = (kind, (q + r) % self.p, tag, nbytes)
        return list(map(table.__getitem__, self.ids))

    def peers(self, r):
        return {(q + r) % self.p for q in self.peers0}


# -- pass 2: replay -------------------------------------------------------------------------
def _port_numbers(cluster):
    """(port of each rank's intra-node egress, intra ingress, NIC egress, NIC ingress, total):
    the four as lists indexed by rank, every port a small int."""
    p, nic = cluster.size, cluster.nic_ids()
    nics = cluster.nodes * cluster.nics_per_node
    return (list(range(p)), [p + r for r in range(p)], [2 * p + j for j in nic],
            [2 * p + nics + j for j in nic], 2 * p + 2 * nics)


def _shared_ports(cluster, peers):
    """The ports that carry messages from two or more ranks: only bookings on those depend on
    the order in which ranks are replayed."""
    node = cluster.node_ids()
    eg, ing, nic_out, nic_in, _ = _port_numbers(cluster)
    sender, shared = {}, set()
    for s, dests in enumerate(peers):
        for d in dests:
            for port in ((eg[s], ing[d]) if node[s] == node[d] else (nic_out[s], nic_in[d])):
                if sender.setdefault(port, s) != s:
                    shared.add(port)
    return shared


def replay(cluster, logs, peers=None, scale=1.0, ordered=None, timeline=None):
    """Virtual-time replay of per-rank operation logs on `cluster`; returns a Prediction.

    logs[r] is rank r's op list (RecordingTransport.ops); peers[r] the ranks it sends to
    (they tell which ports are shared; None: treat every port as shared). Byte counts in the
    logs are multiplied by `scale`. A list passed as `timeline` gets one
    (src, dst, tag, nbytes, start, end, arrival) per message, in the order they were booked.

    Engine: a rank runs its log until it must wait for a message not yet sent. First-come
    first-served on a port needs the messages that share it booked in virtual-time order
    (equal times: lower rank first), so runnable ranks sit in a heap keyed by (a lower bound
    of their clock, rank), and a rank about to send through a shared port while its
    (clock, rank) is past the heap's smallest key yields first.
    Everything else (receives, waits, reductions, sends on a port only this rank uses) cannot
    be affected by the order, so ranks run ahead through it. Without shared ports the heap is
    skipped altogether. ordered=True treats every port as shared (the same answer, slower: a
    test checks it); ordered=False treats none as shared, which is exact only when none is.
    """
    p = cluster.size
    if len(logs) != p:
        raise InvalidArgumentError(f"{len(logs)} logs for a cluster of {p} ranks")
    if ordered is True or (ordered is None and peers is None):
        shared = None  # every port
    elif ordered is False:
        shared = set()
    else:
        shared = _shared_ports(cluster, peers)
    with _no_gc():
        return _replay(cluster, logs, scale, shared, timeline)


def _replay(cluster, logs, scale, shared, timeline):
    p = cluster.size
    node = cluster.node_ids()
    eg, ing, nic_out, nic_in, nports = _port_numbers(cluster)
    free = [0.0] * nports
    a_l, a_g = cluster.intra_alpha, cluster.inter_alpha
    s_l, s_g = scale / cluster.intra_bandwidth, scale / cluster.inter_bandwidth
    g = cluster.gamma * scale
    last = (math.inf, p)  # a heap key that sorts after every real one
    ordered = shared is None or bool(shared)
    routes = [{} for _ in range(p)]  # per rank: peer -> (egress, ingress, s/byte, alpha, ...)

    def route(s, d):
        if node[s] == node[d]:
            pe, pi, spb, lat, inter = eg[s], ing[d], s_l, a_l, False
        else:
            pe, pi, spb, lat, inter = nic_out[s], nic_in[d], s_g, a_g, True
        must_wait = shared is None or pe in shared or pi in shared
        r = routes[s][d] = (pe, pi, spb, lat, must_wait, inter)
        return r

    clock = [0.0] * p
    pc = [0] * p
    done = [[None] * len(log) for log in logs]  # request index -> completion time
    blocked = [-1] * p  # the request a rank waits for, or -1
    # MPI's matching queues, per (src, dst, tag): the messages sent and not yet received
    # (arrival, nbytes), and the receives posted and not yet matched (request index, nbytes);
    # at most one of the two holds anything
    channels = defaultdict(lambda: (deque(), deque()))
    messages, intra, inter = 0, 0.0, 0.0
    heap = [(0.0, r) for r in range(p)]  # keys: lower bounds of each runnable rank's clock
    ready = list(range(p - 1, -1, -1))  # (no shared port: any order will do)
    heappush, heappop = heapq.heappush, heapq.heappop

    while True:
        if ordered:
            if not heap:
                break
            _, r = heappop(heap)
            top = heap[0] if heap else last  # (clock, rank) of the next rank in line
        else:
            if not ready:
                break
            r = ready.pop()
            top = last
        c, i, log, rdone, rroutes = clock[r], pc[r], logs[r], done[r], routes[r]
        n = len(log)
        while i < n:
            op = log[i]
            kind = op[0]
            if kind == SEND:
                _, d, tag, nb = op
                rt = rroutes.get(d) or route(r, d)
                if rt[4] and (c, r) > top:  # a shared port: book in (time, rank) order only
                    heappush(heap, (c, r))
                    break
                pe, pi, spb, lat, _, crosses = rt
                if crosses:
                    inter += nb
                else:
                    intra += nb
                start = c
                if free[pe] > start:
                    start = free[pe]
                if free[pi] > start:
                    start = free[pi]
                end = start + nb * spb
                free[pe] = free[pi] = end
                rdone[i] = end
                arrival = end + lat
                messages += 1
                if timeline is not None:
                    timeline.append((r, d, tag, nb * scale, start, end, arrival))
                sent, waiting = channels[r, d, tag]
                if waiting:
                    j, rnb = waiting.popleft()
                    if rnb != nb:
                        raise _size_mismatch(r, d, tag, nb, rnb)
                    done[d][j] = arrival
                    if blocked[d] == j:
                        blocked[d] = -1
                        if ordered:
                            wake = (clock[d] if clock[d] > arrival else arrival, d)
                            heappush(heap, wake)
                            if wake < top:
                                top = wake
                        else:
                            ready.append(d)
                else:
                    sent.append((arrival, nb))
                i += 1
            elif kind == RECV:
                _, s, tag, nb = op
                if s < 0:  # a log written by hand: RecordingTransport refuses it already
                    raise wildcard_refused(r, f"replay of op {i}")
                sent, waiting = channels[s, r, tag]
                if sent:
                    arrival, snb = sent.popleft()
                    if snb != nb:
                        raise _size_mismatch(s, r, tag, snb, nb)
                    rdone[i] = arrival
                else:
                    waiting.append((i, nb))
                i += 1
            elif kind == COMPUTE:
                c += op[1] * g
                i += 1
            else:  # WAIT or WAITALL
                if kind == WAIT:
                    t = rdone[op[1]]
                    if t is None:
                        blocked[r] = op[1]
                        break
                else:
                    t = 0.0
                    for j in op[1]:
                        tj = rdone[j]
                        if tj is None:
                            blocked[r] = j
                            break
                        if tj > t:
                            t = tj
                    if blocked[r] >= 0:
                        break
                i += 1
                if t > c:
                    c = t
        clock[r], pc[r] = c, i

    stuck = [r for r in range(p) if pc[r] < len(logs[r])]
    if stuck:
        raise _deadlock(logs, pc, stuck)
    return Prediction(seconds=max(clock, default=0.0), finish=clock, messages=messages,
                      bytes_intra=intra * scale, bytes_inter=inter * scale, ordered=ordered,
                      scale=scale)


def _size_mismatch(src, dst, tag, sent, posted):
    return CollectiveMismatchError(
        f"simulated rank {dst} posted a {posted}-byte receive for a {sent}-byte message from "
        f"rank {src} (tag {tag}): the ranks disagree on the count or dtype")


def _deadlock(logs, pc, stuck):
    lines = []
    for r in stuck[:8]:
        op = logs[r][pc[r]]
        reqs = op[1] if isinstance(op[1], tuple) else (op[1],)
        waits = [logs[r][j] for j in reqs if logs[r][j][0] == RECV]
        what = ", ".join(f"rank {w[1]} (tag {w[2]})" for w in waits) or "a send"
        lines.append(f"rank {r} waits for {what}")
    more = f" and {len(stuck) - 8} more" if len(stuck) > 8 else ""
    return CollectiveTimeoutError("simulated ranks would wait forever: " + "; ".join(lines)
                                  + more)


# -- the front end --------------------------------------------------------------------------
def _core(p):
    return 1 << (p.bit_length() - 1)


class Simulator:
    """Predicts collectives on Clusters by running the real algorithms (see the module doc).

    Args:
        segment_bytes: the ring algorithms' pipeline segment (default: the Communicator's);
            NO_SEGMENTS sends every block as one message, as the closed forms assume.
        max_elems: payload-free arrays longer than this are scaled down (see _shape).
        symmetry: record one rank and derive the others by renaming peers where
            rotation_symmetric says the logs are equal up to that (record_rotated); False
            runs the algorithm on every rank (the same logs, slower: a test compares them).

    Recorded logs are cached per (algorithm, ranks, node size, count, dtype, segment, inner):
    they do not depend on the link parameters, so sweeping a cluster's bandwidths or
    comparing message sizes that scale to the same count replays without recording again.
    The cache keeps the most recent logs up to `cache_ops` operations in all (a 1,024-rank
    ring is 7.3 million: about 700 MB recorded rank by rank, 64 MB derived by rotation,
    whose logs share their entries).
    """

    def __init__(self, segment_bytes=DEFAULT_SEGMENT_BYTES, max_elems=1 << 16,
                 cache_ops=10_000_000, symmetry=True):
        self.segment_bytes = segment_bytes
        self.max_elems = max_elems
        self.cache_ops = cache_ops
        self.symmetry = symmetry
        self._logs = OrderedDict()  # key -> (logs, peers, ranks recorded, number of ops)

    def _shape(self, algorithm, n, cluster, inner):
        """(count, scale): run on `count` elements, each standing for `scale` nominal ones.

        Up to max_elems: the nominal count itself (exact). Above: a multiple of p, of the
        power-of-two core p' and (hierarchical) of k * the cross-node core, so that every
        block any of the algorithms cuts is the same fraction of the buffer as at the nominal
        size (there the real code's blocks differ by at most one element: < 1e-6 here)."""
        if n <= self.max_elems:
            return n, 1.0
        p, k, nodes = cluster.size, cluster.devices_per_node, cluster.nodes
        grain = 1  # recursive doubling and Bruck never cut the buffer: any count will do
        if algorithm in ("ring", "rabenseifner", "hierarchical"):
            grain = math.lcm(p, _core(p))
        if algorithm == "hierarchical":
            grain = math.lcm(grain, k * _core(nodes))
        count = max(grain, self.max_elems // grain * grain)
        return count, n / count

    def allreduce(self, cluster, algorithm, nbytes, *, dtype=np.float32, payload=False,
                  inner="ring", ordered=None):
        """Predict an all-reduce of nbytes per rank with `algorithm` (a name of
        ringcoll.algorithms.ALLREDUCE) on `cluster`; returns a Prediction.

        payload=True moves real data (each rank's input: (index % 7) + rank) over threads and
        returns every rank's output in .results; keep p small (threads). hierarchical gets
        the cluster's nodes and runs `inner` across them ("auto": the cross-node algorithm
        the Communicator would pick with cost_model=cluster.cost_model()).
        """
        if algorithm not in ALLREDUCE:
            raise InvalidArgumentError(f"unknown all-reduce algorithm {algorithm!r}; choose "
                                       f"one of {tuple(ALLREDUCE)}")
        dtype = np.dtype(dtype)
        if nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{nbytes} bytes is not a whole number of {dtype}")
        n = nbytes // dtype.itemsize
        p = cluster.size
        inner = _inner(cluster, nbytes, inner)
        count, scale = (n, 1.0) if payload else self._shape(algorithm, n, cluster, inner)
        seg = self._segment(algorithm, count, dtype.itemsize * scale, cluster)
        key = (algorithm, p, cluster.devices_per_node, count, dtype.str, seg,
               inner if algorithm == "hierarchical" else None)
        t0 = time.perf_counter()
        cached = None if payload else self._logs.get(key)
        results, recorded = None, cached is None
        if recorded:
            run = self._runner(cluster, algorithm, count, dtype, seg, inner, payload)
            logs = None
            if self.symmetry and not payload and rotation_symmetric(algorithm, count, p):
                logs = record_rotated(p, run, node_ids=cluster.node_ids())
            if logs is None:
                transports, results = record(p, run, payload=payload,
                                             node_ids=cluster.node_ids())
                logs = [t.ops for t in transports], [t.peers for t in transports], p
            cached = (*logs, sum(map(len, logs[0])))
            if not payload:
                self._remember(key, cached)
        else:
            self._logs.move_to_end(key)
        t1 = time.perf_counter()
        pred = replay(cluster, cached[0], cached[1], scale=scale, ordered=ordered)
        pred.record_seconds = t1 - t0 if recorded else 0.0
        pred.replay_seconds = time.perf_counter() - t1
        pred.ranks_recorded = cached[2]
        pred.count, pred.results = count, (results if payload else None)
        return pred

    def _remember(self, key, entry):
        self._logs[key] = entry
        total = sum(e[3] for e in self._logs.values())
        while total > self.cache_ops and len(self._logs) > 1:
            total -= self._logs.popitem(last=False)[1][3]

    def _segment(self, algorithm, count, elem_bytes, cluster):
        """The ring pipeline segment in elements, clamped to the largest block a ring step of
        this algorithm sends: a longer segment cuts nothing more, so equal clamped values
        give equal logs (and share a cache entry). 0 for the algorithms that never segment."""
        parts = {"ring": cluster.size, "hierarchical": cluster.devices_per_node}.get(algorithm)
        if parts is None:
            return 0
        seg = max(1, int(self.segment_bytes // elem_bytes))
        return min(seg, max(1, -(-count // parts)))

    def _runner(self, cluster, algorithm, count, dtype, seg, inner, payload):
        fn = ALLREDUCE[algorithm]
        extra = {}
        if algorithm == "hierarchical":
            extra = {"nodes": cluster.node_lists(), "inner": ALLREDUCE[inner]}
        shared = {}
        real = get_op("sum").bind(dtype) if payload else None

        def run(t):
            ws = NominalWorkspace(max(seg, 1), shared, payload)
            if payload:
                src = (np.arange(count) % 7 + t.rank).astype(dtype)
                dst = np.empty(count, dtype)
            else:
                src, dst = _zeros(count, dtype), _zeros(count, dtype)
            combine = PayloadCombine(t, real) if payload else CostedCombine(t)
            fn(t, src, dst, combine, ws, **extra)
            return dst if payload else None

        return run


def predict_allreduce(cluster, algorithm, nbytes, **options):
    """Simulator(...).allreduce(cluster, algorithm, nbytes) with a fresh simulator; options
    segment_bytes and max_elems go to the Simulator, the rest to allreduce."""
    sim_opts = {k: options.pop(k) for k in ("segment_bytes", "max_elems") if k in options}
    return Simulator(**sim_opts).allreduce(cluster, algorithm, nbytes, **options)


def expected_sum(count, p, dtype=np.float32):
    """What payload=True runs must produce on every rank: sum over r of (i % 7) + r."""
    return (p * (np.arange(count) % 7) + p * (p - 1) // 2).astype(dtype)


# -- closed forms ---------------------------------------------------------------------------
def _inner(cluster, nbytes, inner):
    if inner == "auto":
        return cluster.cost_model().cross_node(nbytes, cluster.node_lists())[0]
    if inner not in ALLREDUCE or inner == "hierarchical":
        raise InvalidArgumentError(f"hierarchical's inner algorithm must be 'auto' or one of "
                                   f"{tuple(a for a in ALLREDUCE if a != 'hierarchical')}, "
                                   f"got {inner!r}")
    return inner


def formula(cluster, algorithm, nbytes, inner="ring"):
    """The alpha-beta-gamma closed form (ringcoll.algorithms.CostModel) with this cluster's
    parameters. It has no notion of shared links: a flat algorithm on several nodes pays the
    inter-node alpha and beta on every step, hierarchical pays them only for its cross-node
    all-reduce of nbytes / devices_per_node, as if every rank had a NIC of its own."""
    model, p = cluster.cost_model(), cluster.size
    nodes = cluster.node_lists() if cluster.nodes > 1 else None
    if algorithm == "hierarchical":
        inner = _inner(cluster, nbytes, inner)
        k, m = cluster.devices_per_node, cluster.nodes
        local = model.allreduce("ring", nbytes, k)
        spread = [[i] for i in range(m)]
        return local + _flat_formula(model, inner, nbytes / k, m, spread if m > 1 else None)
    return _flat_formula(model, algorithm, nbytes, p, nodes)


def _flat_formula(model, name, nbytes, p, nodes):
    if name == "bruck":  # (CostModel rules bruck out above its MAX_BYTES; the formula holds)
        if p == 1:
            return 0.0
        multi = nodes is not None and len(nodes) > 1
        a = model.inter_alpha if multi and model.inter_alpha is not None else model.alpha
        b = model.inter_beta if multi and model.inter_beta is not None else model.beta
        return math.ceil(math.log2(p)) * a + (p - 1) * nbytes * (b + model.gamma)
    return model.allreduce(name, nbytes, p, nodes)


__all__ = ["NO_SEGMENTS", "Cluster", "NominalWorkspace", "Prediction", "Simulator",
           "expected_sum", "formula", "predict_allreduce", "record", "replay"]
