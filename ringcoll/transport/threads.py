"""Thread transport: every rank is a thread of one process.

It follows MPI's matching rules (a message goes to the first posted receive with the same
source and tag, in order; otherwise it waits in an unexpected queue) and is eager: isend copies
the payload, so a send never blocks. A receive from ANY_SOURCE (a channel's: the user's
wildcard) matches the same way with any source: both queues are kept per destination in one
order (receives as posted, unexpected messages as sent), so a message goes to the
earliest-posted receive it matches, wildcard or specific, and a wildcard takes the
earliest-sent unexpected message with its tag; messages from one sender with one tag never
overtake each other. Receives check the size and fail loudly on a mismatch.
A rank that fails marks its world failed, and every rank waiting on it raises PeerFailedError
at once instead of hanging; a wait longer than `timeout` raises CollectiveTimeoutError.

    results = run(4, lambda t: algorithm(t, ...))   # one result per rank
"""

import threading
import time
from collections import deque

import numpy as np

from ..arrays import array_module, is_device
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerFailedError
from .base import (ANY_SOURCE, Progress, Shared, Tag, Transport, Window, describe_tag,
                   size_mismatch)

DEFAULT_TIMEOUT = 60.0


class _Request:
    # src: the source the receive asked for (perhaps ANY_SOURCE); source: the sender whose
    # message it took, once matched
    __slots__ = ("done", "error", "buf", "src", "tag", "source")

    def __init__(self, buf=None, src=None, tag=None):
        self.done = buf is None
        self.error = None
        self.buf, self.src, self.tag, self.source = buf, src, tag, src


class ThreadWorld:
    """Mailboxes shared by the `size` threads of one group."""

    def __init__(self, size, timeout=DEFAULT_TIMEOUT, parent=None):
        self.size = size
        self.timeout = timeout
        self.parent = parent
        self.cond = parent.cond if parent is not None else threading.Condition()
        self.unexpected = [deque() for _ in range(size)]  # per destination: (src, tag, bytes)
        self.posted = [[] for _ in range(size)]  # per destination: receive requests in order
        self.splits = {}
        self.windows = {}  # seq -> {rank: (part, lock)}: the ranks' Window memory
        self.shared = {}  # (members, seq) -> {rank: segment}: the node tier's memory
        self._failure = None

    def failure(self):
        world = self
        while world is not None:
            if world._failure is not None:
                return world._failure
            world = world.parent
        return None

    def fail(self, rank, exc):
        with self.cond:
            if self._failure is None:
                self._failure = (rank, exc)
            self.cond.notify_all()

    def transports(self):
        return [ThreadTransport(self, r) for r in range(self.size)]


class ThreadTransport(Transport):
    #: every rank is a thread of this process: the node tier's device memory (device.py's
    #: open_device_shared) then passes pointers, as NCCL does within a process, instead of
    #: CUDA IPC handles, which a process cannot open for its own memory
    same_process = True

    def __init__(self, world, rank):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.progress = Progress()
        self._nsplits = 0
        self._nwindows = 0
        self._nshared = {}  # members -> Shared regions made with them so far

    @property
    def timeout(self):
        return self.world.timeout

    def isend(self, buf, peer, tag):
        data = buf.view(np.uint8)
        world = self.world
        with world.cond:
            posted = world.posted[peer]
            for i, req in enumerate(posted):  # the earliest-posted receive that matches
                if req.tag == tag and (req.src == self.rank or req.src == ANY_SOURCE):
                    del posted[i]
                    _deliver(req, data, self.rank, peer, tag)
                    world.cond.notify_all()
                    break
            else:
                copy = data.copy()
                _settle(copy)
                world.unexpected[peer].append((self.rank, tag, copy))
        return _Request()

    def irecv(self, buf, peer, tag):
        req = _Request(buf, peer, tag)
        world = self.world
        with world.cond:
            queue = world.unexpected[self.rank]
            for i, (src, mtag, data) in enumerate(queue):  # the earliest sent that matches
                if mtag == tag and (src == peer or peer == ANY_SOURCE):
                    del queue[i]
                    _deliver(req, data, src, self.rank, tag)
                    break
            else:
                world.posted[self.rank].append(req)
        return req

    def wait(self, req):
        if not req.done:
            world = self.world
            with world.cond:
                ok = world.cond.wait_for(lambda: req.done or world.failure(), world.timeout)
                if not req.done:
                    self._raise_stuck(req, ok)
        if req.error is not None:
            raise self._mismatch(req)

    def source(self, req):
        return req.source

    def test(self, req):
        if req.done and req.error is not None:
            raise self._mismatch(req)
        if not req.done and self.world.failure() is not None:
            self._raise_stuck(req, False)  # a poll loop must not outlive a failed world
        return req.done

    def _mismatch(self, req):
        got, expected = req.error
        if req.tag % Tag.VIEW_STRIDE == Tag.P2P:  # a user's message: name the pair and the fix
            return CollectiveMismatchError(size_mismatch(self.rank, self.progress.call(),
                                                         req.source, req.tag, got, expected))
        return CollectiveMismatchError(
            f"ringcoll rank {self.rank}, {self.progress.call()}: received {got} bytes from rank "
            f"{req.source} ({describe_tag(req.tag)}) into a {expected}-byte buffer; the ranks "
            "disagree on the element count, dtype or collective. Pass the same count and dtype "
            "on every rank (RINGCOLL_DEBUG=1 names the rank that differs).")

    def channel(self):
        """A sibling transport for point-to-point messages: same world, own Progress."""
        return ThreadTransport(self.world, self.rank)

    def fail(self, exc, why=None):
        self.world.fail(self.rank, exc)  # the others stop at once, as MPI_Abort would make them
        raise exc

    def _raise_stuck(self, req, ok):
        failure = self.world.failure()
        if failure is not None:
            rank, exc = failure
            raise PeerFailedError(
                f"ringcoll rank {self.rank}, {self.progress.call()}: gave up waiting for "
                f"{_whom(req.src)} "
                f"({describe_tag(req.tag)}) because rank {rank} failed: "
                f"{type(exc).__name__}: {exc}"
            )
        raise CollectiveTimeoutError(
            f"ringcoll rank {self.rank}, {self.progress.call()}: no message from {_whom(req.src)} "
            f"({describe_tag(req.tag)}) within {self.world.timeout} s; a rank skipped a "
            "collective or called a different one. Raise RINGCOLL_TIMEOUT if the job is just slow."
        )

    def _meet(self, tables, seq, value, call, members=None):
        """Every rank's value in tables[seq] ({rank: value}) once all have put theirs; world.cond
        must be held. Raises naming the missing ranks if some never come (timeout or failure).
        members: the ranks that meet (default all of the world)."""
        world = self.world
        members = range(world.size) if members is None else members
        table = tables.setdefault(seq, {})
        table[self.rank] = value
        world.cond.notify_all()
        world.cond.wait_for(lambda: len(table) == len(members) or world.failure(),
                            world.timeout)
        if len(table) < len(members):
            missing = sorted(set(members) - set(table))
            failure = world.failure()
            cls = PeerFailedError if failure else CollectiveTimeoutError
            raise cls(f"ringcoll rank {self.rank}, {call}: rank(s) {missing} did not call "
                      f"{call}() within {world.timeout} s"
                      + (f" (rank {failure[0]} failed: {type(failure[1]).__name__}: "
                         f"{failure[1]})" if failure else ""))
        return table

    def split(self, color, key):
        """Collective over this world: a transport on a new world per color (None: no part)."""
        world, seq = self.world, self._nsplits
        self._nsplits += 1
        with world.cond:
            table = self._meet(world.splits, seq, (color, key), "split")
            if color is None:
                return None
            members = sorted((r for r, (c, _) in table.items() if c == color),
                             key=lambda r: (table[r][1], r))
            sub = world.splits.setdefault((seq, color),
                                          ThreadWorld(len(members), world.timeout, world))
        return ThreadTransport(sub, members.index(self.rank))

    def window(self, initial):
        """Collective: a Window (base.py) whose parts are plain arrays shared by the threads;
        see ThreadWindow."""
        world, seq = self.world, self._nwindows
        self._nwindows += 1
        part = np.array(initial, copy=True)
        with world.cond:
            table = self._meet(world.windows, seq, (part, threading.Lock()), "window")
        return ThreadWindow(self.rank, [table[r] for r in range(world.size)])

    def shared(self, nbytes, members=None):
        """Collective over members: the node tier's memory (base.Shared). The threads share
        one address space, so every segment is a plain array every rank holds."""
        members = tuple(range(self.size) if members is None else members)
        seq = self._nshared.get(members, 0)
        self._nshared[members] = seq + 1
        segment = np.zeros(nbytes, dtype=np.uint8)
        with self.world.cond:
            table = self._meet(self.world.shared, (members, seq), segment, "shared", members)
        return ThreadShared(members.index(self.rank), [table[r] for r in members])

    def stalled(self, peer, waited):
        """A node-tier wait for `peer` ends as a receive would: the world failed, or timeout."""
        failure = self.world.failure()
        if failure is not None:
            rank, exc = failure
            raise PeerFailedError(
                f"ringcoll rank {self.rank}, {self.progress.call()}: gave up waiting for rank "
                f"{peer} (node tier) because rank {rank} failed: {type(exc).__name__}: {exc}")
        if waited > self.world.timeout:
            raise CollectiveTimeoutError(
                f"ringcoll rank {self.rank}, {self.progress.call()}: rank {peer} did not reach "
                f"this collective's next step (node tier) within {self.world.timeout} s; a rank "
                "skipped a collective or called a different one. Raise RINGCOLL_TIMEOUT if the "
                "job is just slow.")

    def node_ids(self):
        return [0] * self.size

    @staticmethod
    def pause():
        """Let the other thread ranks run: a busy wait over this transport (the staging's)
        calls it between polls, or it would hold the GIL for whole switch intervals."""
        time.sleep(0)

    def cuda_support(self):
        """Threads pass arrays by reference: a CuPy array is copied on the device (with CuPy's
        own copies, on the current stream), so no staging is needed."""
        return True, "the thread transport copies device arrays itself"

    def close(self):
        pass


class ThreadWindow(Window):
    """A Window over threads: each part is an array with its own lock, taken by every call on
    that part, which makes each call atomic as a whole (stronger than MPI's per-element
    atomicity, which is all a caller may rely on). close() is not collective here: nothing
    is freed that another rank could still be using."""

    def __init__(self, rank, parts):
        self.rank, self.size = rank, len(parts)
        self._parts = parts
        self.local = parts[rank][0]
        self.dtype = self.local.dtype
        self.counts = tuple(int(part.size) for part, _ in parts)
        self._one = np.empty(1, self.dtype)  # the shape check() wants of fetch_add's element

    def add(self, values, target, offset):
        self.check("add", values, target, offset)
        part, lock = self._parts[target]
        with lock:
            part[offset:offset + values.size] += values

    def fetch(self, out, target, offset):
        self.check("fetch", out, target, offset)
        part, lock = self._parts[target]
        with lock:
            out[...] = part[offset:offset + out.size]

    def fetch_add(self, value, target, offset):
        self.check("fetch_add", self._one, target, offset)
        part, lock = self._parts[target]
        with lock:
            old = part[offset].item()
            part[offset] += value
        return old

    def close(self):
        self.local = None


class ThreadShared(Shared):
    """The node tier's memory over threads: one process, so nothing to map and, the GIL
    ordering every write before the flag that follows it, nothing to fence."""

    def __init__(self, rank, segments):
        self.rank, self.size, self.segments = rank, len(segments), segments

    def fence(self):
        pass

    def close(self):
        self.segments = None


def _whom(src):
    return "any rank" if src == ANY_SOURCE else f"rank {src}"


def _deliver(req, data, src, dst, tag):
    req.source = src
    dest = req.buf.view(np.uint8)
    if dest.nbytes != data.nbytes:
        req.error = (data.nbytes, dest.nbytes)  # raised by the receiver's wait (_mismatch)
    else:
        dest[...] = data
        _settle(dest)
    req.done = True


def _settle(buf):
    """A copy of CuPy arrays runs on the copying thread's current stream, which the other
    thread rank does not wait for: finish it before that rank may use the bytes."""
    if type(buf) is not np.ndarray and is_device(buf):
        array_module(buf).cuda.get_current_stream().synchronize()


def run(size, fn, timeout=DEFAULT_TIMEOUT):
    """Run fn(transport) on `size` threads; return the per-rank results in rank order.

    If any rank raises, the others are released with PeerFailedError and the first genuine
    error is re-raised here, prefixed with its rank.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    world = ThreadWorld(size, timeout)
    results, errors = [None] * size, [None] * size

    def body(t):
        try:
            results[t.rank] = fn(t)
        except BaseException as exc:  # noqa: BLE001 - reported below, with its rank
            errors[t.rank] = exc
            if not getattr(exc, "ringcoll_agreed", False):  # else every rank raises it too
                world.fail(t.rank, exc)

    threads = [threading.Thread(target=body, args=(t,), name=f"ringcoll-rank-{t.rank}",
                                daemon=True) for t in world.transports()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first = next((e for e in errors if e is not None and not isinstance(e, PeerFailedError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        first.add_note(f"(raised on rank {errors.index(first)} of {size} thread ranks)")
        raise first
    return results
