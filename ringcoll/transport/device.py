"""Device (GPU) buffers over a host transport: straight through a CUDA-aware MPI, or staged
through pinned host memory.

The Communicator wraps its transport in one of these when a collective's buffers are CuPy
arrays (for_device picks which, once per device); algorithms are unchanged: they still call
isend/irecv/wait on flat views, which are device views now.

CudaAwareTransport: the device arrays go to the inner transport as they are (mpi4py hands a
CUDA-aware MPI the device pointer through __cuda_array_interface__). Every call that touches a
device buffer first synchronises the current CuPy stream: mpi4py cannot, and a kernel still
writing a buffer that MPI already reads is the classic source of corrupt results.

StagedTransport: for an MPI library that cannot read device memory (the embedded MPICH wheel,
for one). Every device message is cut into chunks of `chunk_bytes` (the first one followed by
an 8-byte size tag) and each chunk travels through its own pinned host block:

    sender    D2H chunk k (copy stream)  ->  MPI isend of the host block
    receiver  MPI irecv into a host block  ->  H2D chunk k (copy stream)

All of a message's D2H copies are queued at once, and each chunk's MPI send is posted as soon
as its copy has finished, so the D2H copy of chunk k+1 runs while chunk k is in MPI; on the
receiving side every chunk's irecv is posted at once, and each chunk's H2D copy is queued the
moment it has arrived, so it runs while chunk k+1 is still in MPI. Every wait() (and test())
drives all staged messages in flight, not only the one waited for, so a send whose copies
finish while this rank waits for something else still goes out (no deadlock in a ring).

Ordering on the GPU, without blocking the host: D2H copies wait (cudaStreamWaitEvent) for an
event recorded on the compute stream when isend was called, so they read what the kernels
before the call wrote; H2D copies wait for an event recorded when irecv was called (a kernel
still reading the buffer must finish first); the compute stream waits for the last H2D copy
before anything later runs on it. The host waits only where MPI needs the bytes: for a
chunk's D2H copy before its isend.

A mismatch (the ranks disagree on the element count or dtype) cannot go unnoticed, and is
found on the first chunk: that message is 8 bytes longer than its data and ends with the
sender's total size; a longer one fails MPI's truncation check, a shorter one leaves the
zeroed tag, an equal one with another total names it: CollectiveMismatchError, as on the host
path, before anything waits for chunks that will never come.

Cost: pinned host memory for the chunks in flight (cached in a PinnedPool and reused: nothing
is allocated once the pool has covered a shape's peak), a few Python calls and one event per
chunk, and, on every wait, a busy loop over the messages in flight. What bounds its bandwidth
is in docs/gpu.md.

The staging runs against a small Device interface (CupyDevice here; tests/_fake_device.py
implements it with NumPy arrays and deferred copies to test the schedule on a CPU).

Both paths also give the node tier (algorithms/node.py) device memory: shared() maps every
rank's allocation into the others through CUDA IPC (open_device_shared, at the end of this
file: written once against the Device interface and the host transport's shared() and
flags(), so tests/_fake_device.py runs it on a CPU with POSIX shared memory), and flags()
keeps the tier's counters in host memory.
"""

import os
import sys
from collections import deque
from functools import partial

import numpy as np

from ..errors import CollectiveMismatchError, InvalidArgumentError
from .base import NoSharedMemory, Shared, Transport, describe_tag

TAG = 8  # bytes after the first chunk's data: _MAGIC ^ the message's total size
_MAGIC = 0x52494E47434F4C4C  # "RINGCOLL"


def chunk_bounds(nbytes, chunk):
    """[(start, stop)] byte ranges of a staged message: ceil(nbytes / chunk) chunks, at least
    one (an empty message still sends its size tag). Depends only on the message's size, so
    sender and receiver cut it alike."""
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def _nothing():
    pass


def _tag(nbytes):
    return np.frombuffer((_MAGIC ^ nbytes).to_bytes(8, "little"), dtype=np.uint8)


class Device:
    """What the staging needs from an accelerator. Streams and events are opaque handles.

    owns(buf): is buf device memory (to be staged)?
    compute(): the stream the caller's kernels run on (CuPy's current stream).
    d2h, h2d: the copy streams (attributes).
    record(stream) -> event; wait(stream, event): stream waits for event, the host does not;
    done(event): has it happened (never blocks); synchronize(event): the host waits for it;
    sync_stream(stream): the host waits until stream has run everything queued on it.
    pinned(nbytes): a page-locked host np.uint8 array; empty(nbytes): a device byte buffer.
    to_host(src, offset, block, nbytes, stream): queue a copy of bytes [offset, offset+nbytes)
        of device buffer src into pinned block (a PinnedBlock) on stream;
    to_device(block, dst, offset, nbytes, stream): the reverse.

    The node tier's device memory (open_device_shared: CUDA IPC between processes, direct
    pointers within one) needs eight more, all plain calls with no collective part:
    alloc(nbytes) -> (owner, ptr): a device allocation of its own (cudaMalloc, never a pool
        block: an IPC handle names a whole allocation, so a pool block would need its offset
        too); owner keeps it alive, ptr is its address. free(owner): give it back.
    ipc_handle(ptr) -> bytes: the IPC handle of the allocation at ptr, for another process.
    ipc_open(handle) -> ptr: map a peer process's allocation here (never this process's own:
        CUDA refuses that); ipc_close(ptr): unmap it, before its owner frees it.
    wrap(ptr, nbytes, owner) -> a 1-D uint8 device array over nbytes at ptr (owner: what keeps
        the memory alive, or None where something else does).
    device_id() -> int: this device's ordinal; can_access_peer(other) -> bool: may kernels on
        this device read memory on device `other` (True for the same device)?
    fence(): the host waits until the work queued on the current stream has run, so what it
        wrote is there for a peer that reads it next.
    """


class CupyDevice(Device):
    """The Device interface on one CUDA device through CuPy. Its copy streams are its own
    (non-blocking), so copies overlap the caller's kernels."""

    def __init__(self, device_id):
        import cupy
        import cupyx

        self.cupy, self.id = cupy, int(device_id)
        self._pinned = cupyx.empty_pinned
        runtime = cupy.cuda.runtime
        self._memcpy = runtime.memcpyAsync
        self._d2h_kind, self._h2d_kind = runtime.memcpyDeviceToHost, runtime.memcpyHostToDevice
        with cupy.cuda.Device(self.id):
            self.d2h = cupy.cuda.Stream(non_blocking=True)
            self.h2d = cupy.cuda.Stream(non_blocking=True)

    def owns(self, buf):
        return isinstance(buf, self.cupy.ndarray)

    def compute(self):
        return self.cupy.cuda.get_current_stream()

    def record(self, stream):
        event = self.cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream, event):
        stream.wait_event(event)

    def done(self, event):
        return event.done

    def synchronize(self, event):
        event.synchronize()

    def sync_stream(self, stream):
        stream.synchronize()

    def pinned(self, nbytes):
        return self._pinned((nbytes,), np.uint8)

    def empty(self, nbytes):
        return self.cupy.empty(nbytes, dtype=self.cupy.uint8)

    def to_host(self, src, offset, block, nbytes, stream):
        self._memcpy(block.ptr, src.data.ptr + offset, nbytes, self._d2h_kind, stream.ptr)

    def to_device(self, block, dst, offset, nbytes, stream):
        self._memcpy(dst.data.ptr + offset, block.ptr, nbytes, self._h2d_kind, stream.ptr)

    # -- the node tier's device memory (see Device) -----------------------------------------
    def alloc(self, nbytes):
        with self.cupy.cuda.Device(self.id):
            memory = self.cupy.cuda.Memory(nbytes)  # cudaMalloc: not the pool (see Device)
        return memory, memory.ptr

    def free(self, owner):
        """Nothing to do here: CuPy frees a Memory with its last reference, and the own
        segment's array holds one (wrap's owner), so the memory outlives every view of it."""

    def ipc_handle(self, ptr):
        with self.cupy.cuda.Device(self.id):
            return self.cupy.cuda.runtime.ipcGetMemHandle(ptr)

    def ipc_open(self, handle):
        runtime = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(self.id):  # mapped into this device's context
            # lazy peer access: a peer's allocation on another GPU becomes readable here
            return runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)

    def ipc_close(self, ptr):
        with self.cupy.cuda.Device(self.id):
            self.cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    def wrap(self, ptr, nbytes, owner):
        cuda = self.cupy.cuda
        with cuda.Device(self.id):
            memory = cuda.UnownedMemory(ptr, nbytes, owner)  # its device: looked up from ptr
            return self.cupy.ndarray((nbytes,), self.cupy.uint8, cuda.MemoryPointer(memory, 0))

    def device_id(self):
        return self.id

    def can_access_peer(self, other):
        other = int(other)
        return other == self.id or bool(
            self.cupy.cuda.runtime.deviceCanAccessPeer(self.id, other))

    def fence(self):
        self.cupy.cuda.get_current_stream().synchronize()


class PinnedBlock:
    """A pinned host buffer of the pool: `array` (np.uint8), its address, and `ready`, the
    event after which it may be reused (None: now)."""

    __slots__ = ("array", "ptr", "ready")

    def __init__(self, array):
        self.array, self.ptr, self.ready = array, array.ctypes.data, None


class PinnedPool:
    """Pinned host blocks, cached by size class and reused once their last copy has finished.

    A full chunk (chunk bytes + size tag) has its own class; smaller and larger requests round
    up to a power of two. take() prefers a free block whose event has passed and allocates only
    when none has, so the pool grows to the peak of blocks in flight and then stops
    (`allocated` counts its bytes).
    """

    def __init__(self, device, chunk):
        self.device, self.full = device, chunk + TAG
        self.allocated = 0
        self._free = {}

    def _size_class(self, nbytes):
        if self.full // 2 < nbytes <= self.full:
            return self.full
        return max(256, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes):
        size = self._size_class(nbytes)
        free = self._free.get(size)
        if free:
            for i, block in enumerate(free):
                if block.ready is None or self.device.done(block.ready):
                    del free[i]
                    block.ready = None
                    return block
        self.allocated += size
        return PinnedBlock(self.device.pinned(size))

    def give(self, block, ready=None):
        block.ready = ready
        self._free.setdefault(block.array.nbytes, []).append(block)


class _Send:
    """A staged isend: its chunks' host blocks, their MPI requests as they get posted, and the
    device buffer, held until every chunk is posted: the D2H copies read it by address, and a
    buffer whose last reference went before they ran would be back in CuPy's pool, free for
    the next kernel (as mpi4py's requests hold theirs, the caller may drop it after isend)."""

    __slots__ = ("buf", "blocks", "mpi", "unposted", "tested", "done")

    def __init__(self, buf):
        self.buf = buf
        self.blocks, self.mpi, self.unposted, self.tested, self.done = [], [], 0, 0, False

    def advance(self, t):
        mpi, test = self.mpi, t.inner.test
        while self.tested < len(mpi) and test(mpi[self.tested]):
            t.pool.give(self.blocks[self.tested])  # MPI is done with it; no copy pending
            self.tested += 1
        self.done = not self.unposted and self.tested == len(mpi)
        return self.done


class _Recv:
    """A staged irecv: every chunk's irecv is posted; H2D copies follow as chunks arrive."""

    __slots__ = ("dst", "nbytes", "peer", "tag", "bounds", "blocks", "mpi", "next", "after",
                 "copying", "done")

    def __init__(self, dst, peer, tag, after):
        self.dst, self.nbytes, self.peer, self.tag, self.after = dst, dst.nbytes, peer, tag, after
        self.bounds, self.blocks, self.mpi = [], [], []
        self.next, self.copying, self.done = 0, False, False

    def advance(self, t):
        dev, test, last = t.device, t.inner.test, len(self.mpi) - 1
        while self.next <= last and test(self.mpi[self.next]):
            i = self.next
            lo, hi = self.bounds[i]
            block = self.blocks[i]
            if i == 0:
                got = bytes(block.array[hi - lo:hi - lo + TAG])
                if got != _tag(self.nbytes).tobytes():
                    raise t.mismatch(self, got)
            if hi > lo:
                if not self.copying:  # the first copy into dst waits for the kernels before irecv
                    dev.wait(dev.h2d, self.after)
                    self.copying = True
                dev.to_device(block, self.dst, lo, hi - lo, dev.h2d)
            self.next += 1
        if self.next <= last:
            return False
        ready = None
        if self.copying:
            ready = dev.record(dev.h2d)
            dev.wait(dev.compute(), ready)  # later kernels see the data; the host goes on
        for block in self.blocks:
            t.pool.give(block, ready)
        self.done = True
        return True


class _Wrapper(Transport):
    """What both device paths share: they wrap the host transport `inner` for one device, keep
    its rank, size and progress record, and hand failure, topology and closing to it."""

    def __init__(self, inner, device):
        self.inner, self.device = inner, device
        self.rank, self.size, self.progress = inner.rank, inner.size, inner.progress
        self.thread_multiple = getattr(inner, "thread_multiple", True)

    def fail(self, exc, why=None):
        self.inner.fail(exc, why)

    def node_ids(self):
        return self.inner.node_ids()

    def shared(self, nbytes, members=None):
        """Collective over members: the node tier's memory (base.Shared) in device memory,
        each rank's segment mapped into every other rank (see open_device_shared)."""
        if getattr(self.device, "alloc", None) is None or not hasattr(self.inner, "shared"):
            why = ("has no IPC calls (alloc, ipc_handle, ...)" if not hasattr(self.device, "alloc")
                   else f"runs over {type(self.inner).__name__}, which has no shared memory")
            raise NoSharedMemory(f"the device {type(self.device).__name__} {why}")
        return open_device_shared(self.inner, self.device, nbytes, members)

    def flags(self, words, members=None):
        """The node tier's counters stay in host memory: the host polls them."""
        return self.inner.flags(words, members)

    def close(self):
        self.inner.close()


class StagedTransport(_Wrapper):
    """Device buffers through pinned host memory over `inner` (see the module docstring);
    host buffers go to inner unchanged."""

    def __init__(self, inner, device, chunk_bytes):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        super().__init__(inner, device)
        self.chunk = int(chunk_bytes)
        self.pool = PinnedPool(device, self.chunk)
        # between polls of a busy wait: nothing for MPI (its own Wait spins too); the thread
        # transport yields the GIL, or its ranks would wait for each other's time slices
        self._pause = getattr(inner, "pause", None) or _nothing
        self._outbox = deque()  # queued D2H chunks: (event, block, nbytes, peer, tag, send)
        self._active = []  # staged requests not finished yet

    def __repr__(self):
        return f"<StagedTransport chunk={self.chunk} over {self.inner!r}>"

    # -- messages ---------------------------------------------------------------------------
    def isend(self, buf, peer, tag):
        dev = self.device
        if not dev.owns(buf):
            return self.inner.isend(buf, peer, tag)
        d2h, nbytes = dev.d2h, buf.nbytes
        dev.wait(d2h, dev.record(dev.compute()))  # copy what the kernels before this call wrote
        req = _Send(buf)
        bounds = chunk_bounds(nbytes, self.chunk)
        for i, (lo, hi) in enumerate(bounds):
            size = hi - lo + (TAG if i == 0 else 0)
            block = self.pool.take(size)
            event = None
            if hi > lo:
                dev.to_host(buf, lo, block, hi - lo, d2h)
                event = dev.record(d2h)
            if i == 0:
                block.array[hi - lo:size] = _tag(nbytes)
            req.blocks.append(block)
            self._outbox.append((event, block, size, peer, tag, req))
        req.unposted = len(bounds)
        self._active.append(req)
        self._pump()
        return req

    def irecv(self, buf, peer, tag):
        dev = self.device
        if not dev.owns(buf):
            return self.inner.irecv(buf, peer, tag)
        if peer < 0:
            # every chunk is its own message: from ANY_SOURCE, two senders' chunks could mix
            raise InvalidArgumentError(
                f"ringcoll rank {self.rank}, {self.progress.call()}: a staged receive of device "
                "memory cannot take a message from any source (its chunks are separate "
                "messages, which two senders' would interleave); name the source")
        req = _Recv(buf, peer, tag, dev.record(dev.compute()))
        bounds = chunk_bounds(buf.nbytes, self.chunk)
        for i, (lo, hi) in enumerate(bounds):
            size = hi - lo + (TAG if i == 0 else 0)
            block = self.pool.take(size)
            if i == 0:
                block.array[hi - lo:size] = 0  # a shorter message than this leaves it zero
            req.bounds.append((lo, hi))
            req.blocks.append(block)
            req.mpi.append(self.inner.irecv(block.array[:size], peer, tag))
        self._active.append(req)
        return req

    def _pump(self):
        """Move every staged message as far as it can go without blocking: post the sends
        whose D2H copies have finished (in queue order: one copy stream, so in order of
        completion), test MPI, queue the H2D copies of chunks that arrived."""
        out, dev, isend = self._outbox, self.device, self.inner.isend
        while out:
            event, block, size, peer, tag, req = out[0]
            if event is not None and not dev.done(event):
                break
            out.popleft()
            req.mpi.append(isend(block.array[:size], peer, tag))
            req.unposted -= 1
            if not req.unposted:  # every D2H copy has run: the host blocks hold the bytes
                req.buf = None
        if self._active:
            self._active = [req for req in self._active if not req.advance(self)]

    def _idle(self):
        return not self._active and not self._outbox

    def wait(self, req):
        if isinstance(req, (_Send, _Recv)):
            self._pump()
            while not req.done:
                self._pause()
                self._pump()
        elif self._idle():
            self.inner.wait(req)
        else:
            while not self.inner.test(req):
                self._pause()
                self._pump()

    def waitall(self, reqs):
        for req in reqs:
            self.wait(req)

    def test(self, req):
        self._pump()
        if isinstance(req, (_Send, _Recv)):
            return req.done
        return self.inner.test(req)

    def source(self, req):
        """A staged receive names its source (irecv refuses ANY_SOURCE); a host one, inner's."""
        return req.peer if isinstance(req, _Recv) else self.inner.source(req)

    def send(self, buf, peer, tag):
        if self._idle() and not self.device.owns(buf):
            return self.inner.send(buf, peer, tag)
        self.wait(self.isend(buf, peer, tag))

    def recv(self, buf, peer, tag):
        if self._idle() and not self.device.owns(buf):
            return self.inner.recv(buf, peer, tag)
        self.wait(self.irecv(buf, peer, tag))

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        owns = self.device.owns
        if self._idle() and not owns(sendbuf) and not owns(recvbuf):
            return self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)
        rreq = self.irecv(recvbuf, source, tag)
        sreq = self.isend(sendbuf, dest, tag)
        self.wait(rreq)
        self.wait(sreq)

    def mismatch(self, req, got):
        theirs = int.from_bytes(got, "little") ^ _MAGIC
        said = (f"rank {req.peer} sent {theirs} bytes" if 0 <= theirs < 1 << 48
                else f"rank {req.peer} sent a different number of bytes")
        return CollectiveMismatchError(
            f"ringcoll rank {self.rank}, {self.progress.call()}: {said} "
            f"({describe_tag(req.tag)}) where this rank expected {req.nbytes}; the ranks "
            "disagree on the element count or dtype (or on whether the buffers are on the GPU, "
            "or on RINGCOLL_CUDA_AWARE). Pass the same count and dtype on every rank "
            "(RINGCOLL_DEBUG=1 names the rank that differs).")

    def split(self, color, key):
        sub = self.inner.split(color, key)
        return None if sub is None else type(self)(sub, self.device, self.chunk)


class _StagedNative(StagedTransport):
    """StagedTransport over MPI: 'native' stages whole buffers through one pinned block each
    (MPI's collective needs the whole buffer at once), synchronously."""

    def _native(self, call, bufs, outputs):
        """call(*host twins of bufs): device buffers copied to pinned blocks first (one object
        twice, e.g. in place, gets one twin), the outputs copied back after."""
        dev, twins, blocks = self.device, {}, []
        args = []
        for buf in bufs:
            if buf is None or not dev.owns(buf):
                args.append(buf)
                continue
            if id(buf) not in twins:
                block = self.pool.take(buf.nbytes)
                blocks.append(block)
                if buf.nbytes:
                    if len(blocks) == 1:
                        dev.wait(dev.d2h, dev.record(dev.compute()))
                    dev.to_host(buf, 0, block, buf.nbytes, dev.d2h)
                twins[id(buf)] = (block, block.array[:buf.nbytes].view(buf.dtype))
            args.append(twins[id(buf)][1])
        if blocks:
            dev.synchronize(dev.record(dev.d2h))
        call(*args)
        ready = None
        copied = [buf for buf in outputs if buf is not None and id(buf) in twins and buf.nbytes]
        if copied:
            dev.wait(dev.h2d, dev.record(dev.compute()))
            for buf in copied:
                dev.to_device(twins[id(buf)][0], buf, 0, buf.nbytes, dev.h2d)
            ready = dev.record(dev.h2d)
            dev.wait(dev.compute(), ready)
        for block in blocks:
            self.pool.give(block, ready)

    def native_allreduce(self, sendbuf, recvbuf, op_name):
        self._native(partial(self.inner.native_allreduce, op_name=op_name), (sendbuf, recvbuf),
                     (recvbuf,))

    def bind_native_allreduce(self, sendbuf, recvbuf, op_name):
        return partial(self.native_allreduce, sendbuf, recvbuf, op_name)

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op_name):
        self._native(lambda s, r: self.inner.native_reduce_scatter(s, r, counts, op_name),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_allgather(self, sendbuf, recvbuf, counts):
        self._native(lambda s, r: self.inner.native_allgather(s, r, counts),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_gatherv(self, sendbuf, recvbuf, counts, root):
        self._native(lambda s, r: self.inner.native_gatherv(s, r, counts, root),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_scatterv(self, sendbuf, recvbuf, counts, root):
        self._native(lambda s, r: self.inner.native_scatterv(s, r, counts, root),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_bcast(self, buf, root):
        self._native(lambda b: self.inner.native_bcast(b, root), (buf,), (buf,))

    def native_reduce(self, sendbuf, recvbuf, root, op_name):
        self._native(lambda s, r: self.inner.native_reduce(s, r, root, op_name),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_alltoall(self, sendbuf, recvbuf):
        self._native(self.inner.native_alltoall, (sendbuf, recvbuf), (recvbuf,))

    def native_alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        self._native(lambda s, r: self.inner.native_alltoallv(s, sendcounts, r, recvcounts),
                     (sendbuf, recvbuf), (recvbuf,))

    def native_barrier(self):
        self.inner.native_barrier()

    def allgather_object(self, obj):
        return self.inner.allgather_object(obj)


class CudaAwareTransport(_Wrapper):
    """Device buffers straight to `inner` (a CUDA-aware MPI, or the thread transport), each
    call that touches one preceded by a synchronisation of the current CuPy stream."""

    def __repr__(self):
        return f"<CudaAwareTransport over {self.inner!r}>"

    def _sync(self, *bufs):
        dev = self.device
        for buf in bufs:
            if buf is not None and dev.owns(buf):
                dev.sync_stream(dev.compute())
                return

    def _synced(self, step, *bufs):
        """step as a bound step that first synchronises the stream, if bufs are on the device
        (keeping step.at, the (peer, tag) the progress record lists)."""
        owns = self.device.owns
        if not any(buf is not None and owns(buf) for buf in bufs):
            return step
        dev = self.device

        def synced():
            dev.sync_stream(dev.compute())
            step()
        synced.at = getattr(step, "at", None)
        return synced

    def isend(self, buf, peer, tag):
        self._sync(buf)
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag):
        self._sync(buf)  # a kernel may still read what MPI is about to overwrite
        return self.inner.irecv(buf, peer, tag)

    def source(self, req):
        return self.inner.source(req)

    def send(self, buf, peer, tag):
        self._sync(buf)
        self.inner.send(buf, peer, tag)

    def recv(self, buf, peer, tag):
        self._sync(buf)
        self.inner.recv(buf, peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._sync(sendbuf, recvbuf)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def bind_send(self, buf, peer, tag):
        return self._synced(self.inner.bind_send(buf, peer, tag), buf)

    def bind_recv(self, buf, peer, tag):
        return self._synced(self.inner.bind_recv(buf, peer, tag), buf)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        return self._synced(self.inner.bind_sendrecv(sendbuf, dest, recvbuf, source, tag),
                            sendbuf, recvbuf)

    def wait(self, req):
        self.inner.wait(req)

    def waitall(self, reqs):
        self.inner.waitall(reqs)

    def test(self, req):
        return self.inner.test(req)

    def split(self, color, key):
        sub = self.inner.split(color, key)
        return None if sub is None else type(self)(sub, self.device)


class _CudaAwareNative(CudaAwareTransport):
    """CudaAwareTransport over MPI: 'native' hands the device buffers to MPI's collective."""

    def _call(self, name, *args):
        self._sync(*(a for a in args if hasattr(a, "nbytes")))
        return getattr(self.inner, name)(*args)

    def native_allreduce(self, sendbuf, recvbuf, op_name):
        self._call("native_allreduce", sendbuf, recvbuf, op_name)

    def bind_native_allreduce(self, sendbuf, recvbuf, op_name):
        return self._synced(self.inner.bind_native_allreduce(sendbuf, recvbuf, op_name),
                            sendbuf, recvbuf)

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op_name):
        self._call("native_reduce_scatter", sendbuf, recvbuf, counts, op_name)

    def native_allgather(self, sendbuf, recvbuf, counts):
        self._call("native_allgather", sendbuf, recvbuf, counts)

    def native_gatherv(self, sendbuf, recvbuf, counts, root):
        self._call("native_gatherv", sendbuf, recvbuf, counts, root)

    def native_scatterv(self, sendbuf, recvbuf, counts, root):
        self._call("native_scatterv", sendbuf, recvbuf, counts, root)

    def native_bcast(self, buf, root):
        self._call("native_bcast", buf, root)

    def native_reduce(self, sendbuf, recvbuf, root, op_name):
        self._call("native_reduce", sendbuf, recvbuf, root, op_name)

    def native_alltoall(self, sendbuf, recvbuf):
        self._call("native_alltoall", sendbuf, recvbuf)

    def native_alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        self._call("native_alltoallv", sendbuf, sendcounts, recvbuf, recvcounts)

    def native_barrier(self):
        self.inner.native_barrier()

    def allgather_object(self, obj):
        return self.inner.allgather_object(obj)


def staged(inner, device, chunk_bytes):
    """A StagedTransport over inner, with 'native' where inner has MPI's collectives."""
    cls = _StagedNative if hasattr(inner, "native_allreduce") else StagedTransport
    return cls(inner, device, chunk_bytes)


def cuda_aware(inner, device):
    """A CudaAwareTransport over inner, with 'native' where inner has MPI's collectives."""
    cls = _CudaAwareNative if hasattr(inner, "native_allreduce") else CudaAwareTransport
    return cls(inner, device)


def for_device(inner, device, aware=None, chunk_bytes=1 << 20):
    """(transport, path, why): the transport for device buffers over inner.

    aware: True/False forces the path (RINGCOLL_CUDA_AWARE / Communicator(cuda_aware=));
    None asks inner.cuda_support() (MPI: MPIX_Query_cuda_support), and stages when in doubt.
    path is "cuda-aware" or "staged"; why says what decided it, for debug output.
    """
    if aware is None:
        query = getattr(inner, "cuda_support", None)
        aware, why = query() if query is not None else (False, "the transport cannot say")
    else:
        why = f"forced by RINGCOLL_CUDA_AWARE={int(aware)} or cuda_aware={aware}"
    if aware:
        return cuda_aware(inner, device), "cuda-aware", why
    return staged(inner, device, chunk_bytes), "staged", why


# -- the node tier's device memory ---------------------------------------------------------------
# Each rank's record in the set-up's host Shared: uint64 fields, its IPC handle's bytes, and the
# text of what failed on it (if something did), which every rank then puts in its error.
_RECORD, _HANDLE_AT, _MESSAGE_AT = 1024, 64, 320
_DEVICE, _PID, _PTR, _HANDLE_LEN, _MESSAGE_LEN = range(5)
# the set-up's Flags words: the stage a rank has reached, and the stage it failed in (0: none)
_STAGE, _FAILED = 0, 1
PUBLISHED, CHECKED, OPENED, UNMAPPED = 1, 2, 3, 4


def open_device_shared(inner, device, nbytes, members=None):
    """Collective over members: a Shared whose segments are device memory, every rank's
    allocation mapped into every other rank of the group.

    Written once against the Device interface and the host transport `inner` (its shared()
    and flags(), never MPI itself). Each rank allocates nbytes, writes its record (IPC handle,
    device, pid, address) into a small host Shared, and the ranks meet through host Flags at
    three stages, each followed by a look at every rank's verdict:

        PUBLISHED  records written                  (a failed allocation ends it here)
        CHECKED    peer access checked for every peer on another device
        OPENED     every peer's handle opened       (never this rank's own: CUDA refuses)

    If any rank failed at a stage, every rank sees it at the same meeting, undoes what it did
    (after OPENED it first unmaps, then meets once more, so that no owner frees memory a peer
    still maps) and raises NoSharedMemory naming the ranks and why: the tier then runs the
    ring on every rank alike. A transport whose ranks share one address space (the thread
    transport's `same_process`) has no handles to exchange: the ranks use each other's
    pointers directly, as NCCL does within a process; the stages and checks are the same.
    """
    meta = inner.shared(_RECORD, members)
    try:
        flags = inner.flags(2, members)
    except BaseException:
        meta.close()
        raise
    ranks = list(range(inner.size) if members is None else members)
    return _Setup(meta, flags, device, nbytes, ranks, _same_process(inner)).run()


def _same_process(t):
    """Do all ranks of transport t live in this process? The transport says so (thread
    transport: same_process = True); a view asks the transport it is a view of."""
    while t is not None:
        if hasattr(t, "same_process"):
            return bool(t.same_process)
        t = getattr(t, "parent", None)
    return False


class _Refused(Exception):
    def __init__(self, stage, why):
        super().__init__(why)
        self.stage = stage


class _Setup:
    """One open_device_shared call on one rank: its steps, and the undoing of them."""

    def __init__(self, meta, flags, device, nbytes, ranks, direct):
        self.meta, self.flags, self.dev, self.nbytes = meta, flags, device, nbytes
        self.rank, self.size, self.ranks, self.direct = meta.rank, meta.size, ranks, direct
        self.me = ranks[self.rank]  # as the caller's transport numbers it: for messages
        self.fields = [seg[:_HANDLE_AT].view(np.uint64) for seg in meta.segments]
        self.owner = self.ptr = None
        self.opened = {}  # peer -> the address its handle was opened at
        self.segments = [None] * self.size

    def run(self):
        try:
            self._stage(PUBLISHED, self._publish)
            self._stage(CHECKED, self._check)
            self._stage(OPENED, self._open)
        except _Refused as refused:
            self._undo(refused.stage)
            raise NoSharedMemory(str(refused)) from None
        self.meta.close()
        return DeviceShared(self.rank, self.segments, self.dev, self.owner, self.opened,
                            self.flags, self.ranks)

    def _stage(self, stage, work):
        """work(); then meet every rank at `stage` and raise _Refused, on every rank alike,
        if any of them failed in it. An error of work() is this rank's verdict, never a
        reason to leave the meeting: the peers would wait for it forever."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - becomes every rank's NoSharedMemory
            self._fail(stage, f"{type(exc).__name__}: {exc}")
        meta, flags = self.meta, self.flags
        meta.fence()
        flags.post(_STAGE, stage)
        flags.wait_all(_STAGE, stage)
        meta.fence()
        # failed at this stage: `== stage`, not `!= 0`, since a faster rank may have failed
        # at the next one already (its verdict is written before its next meeting, and a
        # rank stops at the first stage someone failed in: there is no older verdict to see)
        failed = [q for q in range(self.size) if flags.value(q, _FAILED) == stage]
        if failed:
            why = "; ".join(f"rank {self.ranks[q]}: {self._message(q)}" for q in failed)
            raise _Refused(stage, (
                f"ringcoll rank {self.me}: no shared device memory for ranks {self.ranks} "
                f"(CUDA IPC): {why}. The node tier runs the ring instead."))

    def _fail(self, stage, text):
        """This rank's verdict: failed at `stage`, because of `text` (kept in its record)."""
        if self.flags.value(self.rank, _FAILED):
            return  # the first reason is the one to tell (and the stage: see _stage)
        room = _RECORD - _MESSAGE_AT
        data = text.encode("utf-8", "replace")[:room]
        mine = self.meta.segments[self.rank]
        mine[_MESSAGE_AT:_MESSAGE_AT + len(data)] = np.frombuffer(data, np.uint8)
        self.fields[self.rank][_MESSAGE_LEN] = len(data)
        self.flags.post(_FAILED, stage)

    def _message(self, q):
        n = int(self.fields[q][_MESSAGE_LEN])
        return bytes(self.meta.segments[q][_MESSAGE_AT:_MESSAGE_AT + n]).decode("utf-8", "replace")

    # -- the steps --------------------------------------------------------------------------
    def _publish(self):
        dev, mine = self.dev, self.fields[self.rank]
        mine[_PID] = os.getpid()
        mine[_DEVICE] = dev.device_id()
        self.owner, self.ptr = dev.alloc(max(self.nbytes, 1))  # (an empty one has no handle)
        mine[_PTR] = self.ptr
        handle = b"" if self.direct else bytes(dev.ipc_handle(self.ptr))
        if len(handle) > _MESSAGE_AT - _HANDLE_AT:
            raise ValueError(f"an IPC handle of {len(handle)} bytes does not fit the "
                             f"{_MESSAGE_AT - _HANDLE_AT} bytes its record has for it")
        segment = self.meta.segments[self.rank]
        segment[_HANDLE_AT:_HANDLE_AT + len(handle)] = np.frombuffer(handle, np.uint8)
        mine[_HANDLE_LEN] = len(handle)

    def _check(self):
        mine = self.fields[self.rank]
        device, pid = int(mine[_DEVICE]), int(mine[_PID])
        for q in range(self.size):
            if q == self.rank:
                continue
            theirs = self.fields[q]
            if not self.direct and int(theirs[_PID]) == pid:
                self._fail(CHECKED, (
                    f"ranks {self.me} and {self.ranks[q]} are one process (pid {pid}), which "
                    "cannot open its own IPC handle, but the transport does not say "
                    "same_process = True; give it that attribute"))
                return
            other = int(theirs[_DEVICE])
            if other != device and not self.dev.can_access_peer(other):
                self._fail(CHECKED, (
                    f"GPU {device} (rank {self.me}) has no peer access to GPU {other} "
                    f"(rank {self.ranks[q]}): cudaDeviceCanAccessPeer({device}, {other}) is 0. "
                    "Put the ranks of a node-tier group on GPUs with peer access (NVLink or "
                    "one PCIe switch; see nvidia-smi topo -m), or on one GPU"))
                return

    def _open(self):
        dev, nbytes = self.dev, self.nbytes
        for q in range(self.size):
            if q == self.rank:
                continue
            if self.direct:
                ptr = int(self.fields[q][_PTR])
            else:
                n = int(self.fields[q][_HANDLE_LEN])
                handle = bytes(self.meta.segments[q][_HANDLE_AT:_HANDLE_AT + n])
                ptr = self.opened[q] = dev.ipc_open(handle)  # noted first: undo closes it
            self.segments[q] = dev.wrap(ptr, nbytes, None)
        self.segments[self.rank] = dev.wrap(self.ptr, nbytes, self.owner)

    def _undo(self, stage):
        """Free what this rank made, in the order that keeps every peer safe, and the
        set-up's host memory: collective, after a _Refused every rank saw alike."""
        self.segments = None
        trouble = _close_all(self.dev, self.opened)
        if stage >= OPENED:  # peers may map my memory until they unmapped it
            self.flags.post(_STAGE, UNMAPPED)
            self.flags.wait_all(_STAGE, UNMAPPED)
        if self.owner is not None:
            self.dev.free(self.owner)
        self.owner = None
        self.meta.close()
        self.flags.close()
        if trouble:
            print(f"ringcoll rank {self.me}: while giving up on CUDA IPC: {trouble}",
                  file=sys.stderr, flush=True)


def _close_all(dev, opened):
    """ipc_close every mapping in opened (emptied); the errors, as text (every mapping is
    tried: one that fails must not keep the others open)."""
    errors = []
    for q, ptr in sorted(opened.items()):
        try:
            dev.ipc_close(ptr)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(f"closing the mapping of group rank {q}: {type(exc).__name__}: {exc}")
    opened.clear()
    return "; ".join(errors)


class DeviceShared(Shared):
    """The node tier's memory in device memory (made by open_device_shared).

    segments[q]: group rank q's allocation as a uint8 device array (this rank's own, or a
    peer's mapped through CUDA IPC, or its pointer within one process). fence() synchronises
    the current stream: a kernel still writing a segment has finished once it returns, so a
    peer that sees the flag posted next reads finished bytes. The Flags it keeps (host memory)
    are for close(), whose meeting lets no owner free memory a peer still maps.
    """

    def __init__(self, rank, segments, device, owner, opened, flags, ranks):
        self.rank, self.size, self.segments = rank, len(segments), segments
        self._dev, self._owner, self._opened, self._flags = device, owner, opened, flags
        self._ranks = ranks
        self.fence = device.fence  # bound once: the tier fences a few times a chunk

    def fence(self):  # (replaced per instance by the device's fence itself)
        self._dev.fence()

    def close(self):
        """Collective: unmap the peers' memory, meet, then free this rank's own."""
        if self.segments is None:
            return
        self.segments = None
        self._dev.fence()  # my last kernels on a peer's memory have run before I unmap it
        trouble = _close_all(self._dev, self._opened)
        self._flags.post(_STAGE, UNMAPPED)
        self._flags.wait_all(_STAGE, UNMAPPED)
        self._dev.free(self._owner)
        self._owner = None
        self._flags.close()
        if trouble:
            raise RuntimeError(f"ringcoll rank {self._ranks[self.rank]}, closing the node "
                               f"tier's device memory: {trouble}")
