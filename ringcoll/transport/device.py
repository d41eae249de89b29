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
"""

from collections import deque
from functools import partial

import numpy as np

from ..errors import CollectiveMismatchError
from .base import Transport, describe_tag

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
    """A staged isend: its chunks' host blocks, their MPI requests as they get posted."""

    __slots__ = ("blocks", "mpi", "unposted", "tested", "done")

    def __init__(self):
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
        req = _Send()
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
