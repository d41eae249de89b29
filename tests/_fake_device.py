"""A NumPy stand-in for a GPU, for testing the *staging schedule* of transport/device.py on a
CPU. It is not a GPU and says nothing about CUDA; tests/test_gpu.py does that on a real one.

"Device" buffers are ordinary NumPy arrays (by default every buffer counts as one, so every
message of every algorithm is staged). What makes the fake worth having is that copies are
deferred as on a GPU: to_host/to_device only queue work on a copy stream, which runs when an
event recorded after it is waited for, or, at random, when done() is asked. So a send posted
before its D2H copy finished sends stale bytes (the pinned blocks start filled with 0xCD), and a
host block reused before its H2D copy ran hands the next message's bytes to the earlier one:
such schedule bugs give wrong results here, as they would on a GPU.

Copies hold device memory as cudaMemcpyAsync does: by address. A buffer whose last reference
goes before its queued copy runs makes that copy fail (AssertionError), where on a GPU CuPy's
pool could have handed the memory to the next kernel while the copy stream still used it.

Work on the fake's device memory (wrap()'s segments, FakeDevice.array's arrays: DeviceArray)
is deferred too: writes into it and ufuncs that touch it queue on the compute stream and run
when it is synchronised (fence(), sync_stream, an event recorded after them waited for). So a
counter posted before the fence that should precede it lets a peer read bytes not yet written,
and a read still queued when its slot is handed back reads the owner's next chunk. Plain NumPy
buffers (the staging suites') are not deferred: work on them runs at once, and wait(compute,
event) completes the event's stream up to the event at once.

The node tier's device memory (Device.alloc ... fence, which device.py's open_device_shared
uses) is POSIX shared memory here, so that "device memory" really is shared between MPI
processes, and CUDA IPC's rules are enforced rather than assumed:

- alloc makes a segment of its own (/dev/shm/<prefix>_<pid>_<n>); its IPC handle is its name.
- ipc_open attaches by name and refuses a handle made in this process (CUDA refuses those).
  While a peer maps a segment it holds a shared flock on it, so free() sees a peer that has
  not unmapped yet (the owner's exclusive flock fails): an AssertionError, not a silent race.
- A pointer is an address of this process (the mapping's): wrap() finds the mapping it names
  in a table of this process's live mappings, so threads of one process (the thread
  transport's ranks) can use each other's pointers as NCCL does, and a pointer that was
  freed or unmapped is an error, not stale bytes.
- device_id, peer_access (True, False, or the device ids this one may access) and fail_alloc /
  fail_open simulate GPUs without peer access and calls that fail on one rank.
- It counts what happened: allocs, frees, fences, the names it exported, opened and closed.

A mapping whose arrays are still referenced (the tier keeps views of its slots) cannot be
unmapped at once (NumPy holds the buffer): it is unmapped when they go. free() first fills the
allocation with 0xDD (FREED), so a view used after free reads garbage, as on a GPU. Its name is unlinked
at free, so /dev/shm holds nothing once every segment was freed.
"""

import ctypes
import fcntl
import itertools
import os
import random
import threading
import weakref
from collections import deque
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from ringcoll.transport.device import Device

SHM_ROOT = "/dev/shm"


class FakeStream:
    def __init__(self, name):
        self.name, self.queue, self.queued, self.ran = name, deque(), 0, 0

    def push(self, op):
        self.queue.append(op)
        self.queued += 1

    def run_until(self, position):
        while self.ran < position:
            op = self.queue.popleft()
            self.ran += 1
            op()


class FakeEvent:
    __slots__ = ("stream", "position")

    def __init__(self, stream, position):
        self.stream, self.position = stream, position


class FakeDevice(Device):
    """Device interface on NumPy arrays, copies deferred (see the module docstring).

    owns: predicate for "device" buffers (default: every buffer); seed: the random choices of
    done(); eager=True runs every copy at once (to compare schedules with and without delay).
    Counts what happened: copies, syncs (sync_stream calls), pinned_bytes.
    """

    def __init__(self, seed=0, owns=None, eager=False, device_id=0, peer_access=True,
                 fail_alloc=False, fail_open=False, prefix="rcfake"):
        self._owns = owns or (lambda buf: True)
        self.rng = random.Random(seed)
        self.eager = eager
        self.d2h, self.h2d, self.compute_stream = (FakeStream("d2h"), FakeStream("h2d"),
                                                   FakeStream("compute"))
        self.copies = self.syncs = self.pinned_bytes = self.kernels = 0
        # the node tier's memory (see the module docstring)
        self.id, self.peer_access = int(device_id), peer_access
        self.fail_alloc, self.fail_open, self.prefix = fail_alloc, fail_open, prefix
        self.allocs = self.frees = self.fences = 0
        self.exported, self.opened, self.closed = [], [], []  # segment names, in order
        self._mine = {}  # ptr -> _Segment this device allocated and has not freed
        self._maps = {}  # ptr -> _Segment of a peer this device mapped and has not closed
        self._barrier = threading.Lock()

    def owns(self, buf):
        return self._owns(buf)

    def compute(self):
        return self.compute_stream

    def record(self, stream):
        return FakeEvent(stream, stream.queued)

    def wait(self, stream, event):
        if stream is self.compute_stream or self.eager:
            self._finish(event)
        elif event.stream is not stream:
            stream.push(lambda: self._finish(event))

    def done(self, event):
        if event.stream.ran >= event.position:
            return True
        if self.rng.random() < 0.5:  # the copy engine happened to get there
            self._finish(event)
            return True
        return False

    def synchronize(self, event):
        self._finish(event)

    def sync_stream(self, stream):
        self.syncs += 1
        stream.run_until(stream.queued)

    @staticmethod
    def _finish(event):
        event.stream.run_until(event.position)

    def pinned(self, nbytes):
        self.pinned_bytes += nbytes
        return np.full(nbytes, 0xCD, dtype=np.uint8)  # stale bytes are recognisable

    def empty(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def to_host(self, src, offset, block, nbytes, stream):
        memory = _Weak(src, offset, nbytes, "to_host (D2H) copy's source")
        self._push(stream, lambda: block.array.__setitem__(slice(0, nbytes), memory.bytes()))

    def to_device(self, block, dst, offset, nbytes, stream):
        memory = _Weak(dst, offset, nbytes, "to_device (H2D) copy's target")
        self._push(stream, lambda: memory.bytes().__setitem__(slice(None),
                                                              block.array[:nbytes]))

    def _push(self, stream, copy):
        self.copies += 1
        stream.push(copy)
        if self.eager:
            stream.run_until(stream.queued)

    # -- the node tier's device memory ------------------------------------------------------
    def alloc(self, nbytes):
        if self.fail_alloc:
            raise MemoryError(f"fake cudaMalloc of {nbytes} bytes failed (fail_alloc=True)")
        _sweep()
        name = f"{self.prefix}_{os.getpid()}_{next(_NUMBERS)}"
        seg = _Segment(SharedMemory(name=name, create=True, size=max(nbytes, 1)), name)
        _CREATED.add(name)
        self._mine[seg.ptr] = seg
        self.allocs += 1
        return seg, seg.ptr

    def free(self, owner):
        seg = self._mine.pop(owner.ptr, None)
        assert seg is owner, f"free of {owner.name}, which this device does not hold (twice?)"
        try:  # a peer still mapping it holds a shared lock: then this fails
            fcntl.flock(seg.shm._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AssertionError(f"pid {os.getpid()} freed {seg.name} while a peer process "
                                 "still maps it (ipc_close must come first)") from None
        fcntl.flock(seg.shm._fd, fcntl.LOCK_UN)
        seg.array[:] = FREED  # a view kept past free reads this, as on a GPU it reads garbage
        seg.unmap()
        seg.shm.unlink()
        _CREATED.discard(seg.name)
        self.frees += 1

    def ipc_handle(self, ptr):
        seg = self._mine.get(ptr)
        if seg is None:
            raise ValueError(f"ipc_handle({ptr:#x}): not the start of an allocation of this "
                             "device (cudaErrorInvalidValue)")
        self.exported.append(seg.name)
        return seg.name.encode()

    def ipc_open(self, handle):
        name = bytes(handle).decode()
        if name in _CREATED:
            raise RuntimeError(f"ipc_open({name}): a process cannot open its own IPC handle "
                               "(cudaErrorInvalidContext on a GPU)")
        if self.fail_open:
            raise RuntimeError(f"fake cudaIpcOpenMemHandle({name}) failed (fail_open=True)")
        seg = _Segment(_attach(name), name)
        fcntl.flock(seg.shm._fd, fcntl.LOCK_SH)  # released by ipc_close (see free)
        self._maps[seg.ptr] = seg
        self.opened.append(name)
        return seg.ptr

    def ipc_close(self, ptr):
        seg = self._maps.pop(ptr, None)
        if seg is None:
            raise ValueError(f"ipc_close({ptr:#x}): no mapping opened there")
        fcntl.flock(seg.shm._fd, fcntl.LOCK_UN)
        seg.unmap()
        self.closed.append(seg.name)

    def wrap(self, ptr, nbytes, owner):
        seg = _SPACE.get(ptr)
        if seg is None:
            raise ValueError(f"wrap({ptr:#x}): no live fake device memory at this address "
                             "(freed, unmapped, or never allocated)")
        assert nbytes <= seg.array.size, f"wrap of {nbytes} bytes over {seg.array.size}"
        return self._lazy(seg.array[:nbytes])

    def array(self, host):
        """A copy of NumPy array `host` in this device's memory, as the caller's CuPy array
        would be: work on it queues on the compute stream (see DeviceArray)."""
        return self._lazy(np.array(host, copy=True))

    def _lazy(self, a):
        view = a.view(DeviceArray)
        view.device = self
        return view

    def kernel(self, op):
        """Queue op on the compute stream: it runs when the stream is synchronised (fence,
        sync_stream, an event on it waited for), as a CuPy kernel would."""
        self.kernels += 1
        self.compute_stream.push(op)
        if self.eager:
            self.compute_stream.run_until(self.compute_stream.queued)

    def flush(self):
        """Run everything queued on the compute stream (the host waits for the stream)."""
        self.compute_stream.run_until(self.compute_stream.queued)

    def device_id(self):
        return self.id

    def can_access_peer(self, other):
        if other == self.id or self.peer_access is True:
            return True
        return bool(self.peer_access) and other in self.peer_access

    def fence(self):
        self.fences += 1
        self.flush()  # the current stream synchronised: what its kernels wrote is there
        with self._barrier:  # (an atomic instruction: a memory barrier for the host's writes)
            pass

    def live(self):
        """(allocations, mappings) this device holds now: both empty once all are closed."""
        return sorted(s.name for s in self._mine.values()), \
            sorted(s.name for s in self._maps.values())


FREED = 0xDD  # the bytes of a freed allocation


class DeviceArray(np.ndarray):
    """An array in fake device memory (wrap(), FakeDevice.array): NumPy's memory, a GPU's
    order. Writes into it and ufuncs that touch it (as input or out) are queued on its
    device's compute stream (FakeDevice.kernel) and read their inputs when they run, not when
    they are called; they run when the stream is synchronised (fence(), sync_stream, an event
    recorded after them that a copy or the host waits for). So a counter posted before the
    fence that should precede it lets a peer read bytes not yet written, and a peer's slot
    read after its owner was told the reader is done reads the owner's next chunk: such
    ordering bugs give wrong results here, as on a GPU. NumPy functions on it
    (np.array_equal, ...), a ufunc with no out, and its methods read at once after the
    stream ran (the host waits, as CuPy's .get() does); so do copy, tobytes, astype,
    tolist and item. Slices and views stay DeviceArrays of the same device. Read through
    the buffer protocol (bytes(x), MPI) or assigned into a NumPy array, it is read at once,
    without waiting: synchronise first (a CUDA-aware MPI needs that too), and where a GPU
    would queue the copy, make the caller's array a DeviceArray (FakeDevice.array)."""

    device = None

    def __array_finalize__(self, obj):
        self.device = getattr(obj, "device", None)

    def __setitem__(self, key, value):
        dev = self.device
        if dev is None:
            return np.ndarray.__setitem__(self, key, value)
        target = self.view(np.ndarray)
        dev.kernel(lambda: target.__setitem__(key, _plain(value)))

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        dev = next(x.device for x in inputs + (out or ()) if isinstance(x, DeviceArray))
        args = [_plain(x) for x in inputs]
        if out is None or dev is None:
            if dev is not None:
                dev.flush()
            if out is not None:
                kwargs["out"] = tuple(_plain(o) for o in out)
            result = getattr(ufunc, method)(*args, **kwargs)
            return result if out is None else (out[0] if len(out) == 1 else out)
        kwargs["out"] = tuple(_plain(o) for o in out)
        dev.kernel(lambda: getattr(ufunc, method)(*args, **kwargs))
        return out[0] if len(out) == 1 else out

    def __array_function__(self, func, types_, args, kwargs):
        for dev in {x.device for x in _arrays(args, kwargs)} - {None}:
            dev.flush()
        return func(*_unwrap(args), **_unwrap(kwargs))

    def _read(name):  # noqa: N805 - a method maker: methods that read on the host
        def method(self, *args, **kwargs):
            if self.device is not None:
                self.device.flush()
            return getattr(self.view(np.ndarray), name)(*args, **kwargs)
        method.__name__ = name
        return method

    copy, tobytes, astype = _read("copy"), _read("tobytes"), _read("astype")
    tolist, item = _read("tolist"), _read("item")
    del _read


def _plain(x):
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


def _arrays(args, kwargs):
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, DeviceArray):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _unwrap(x):
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return _plain(x)


class _Weak:
    """nbytes of a flat device buffer from byte offset, held as a GPU copy holds them: by
    address, not by reference. cudaMemcpyAsync keeps nothing alive, so a buffer whose last
    reference goes before its queued copy runs is back in CuPy's pool, which may hand it to
    the next kernel on the compute stream while the copy stream still reads or writes it.
    Here the copy then fails (AssertionError) instead of reading what a later kernel wrote.
    What is watched is the array that owns the memory (the end of buf's .base chain), as
    CuPy's views keep their allocation alive; the copy reads and writes through the address
    when it runs, not when it is queued."""

    __slots__ = ("owner", "address", "nbytes", "what")

    def __init__(self, buf, offset, nbytes, what):
        assert buf.ndim == 1 and buf.flags.c_contiguous, "staged buffers are flat and contiguous"
        root = buf
        while isinstance(root.base, np.ndarray):
            root = root.base
        self.owner = weakref.ref(root)
        self.address, self.nbytes, self.what = buf.ctypes.data + offset, nbytes, what
        assert 0 <= offset and offset + nbytes <= buf.nbytes

    def bytes(self):
        if self.owner() is None:
            raise AssertionError(
                f"a {self.what} ran after the buffer's last reference was dropped: on a GPU "
                "its memory may already belong to a later kernel (keep the buffer referenced "
                "until its copy has run)")
        if not self.nbytes:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.address))


# -- this process's fake device address space ---------------------------------------------------
_SPACE = {}  # address -> _Segment: every live allocation or mapping of this process
_CREATED = set()  # names of the segments this process created and has not freed
_NUMBERS = itertools.count()  # (next() on a count is atomic: thread ranks get distinct names)
_LINGERING = []  # SharedMemory objects whose arrays are still referenced: unmapped later


class _Segment:
    """One mapping of a shared-memory segment in this process: its SharedMemory, its name,
    the uint8 array over it and that array's address (the fake device pointer)."""

    def __init__(self, shm, name):
        self.shm, self.name = shm, name
        self.array = np.frombuffer(shm.buf, np.uint8)
        self.ptr = self.array.ctypes.data
        _SPACE[self.ptr] = self

    def unmap(self):
        """Forget the address at once (wrap refuses it from now on); unmap when NumPy lets."""
        del _SPACE[self.ptr]
        self.array = None
        _release(self.shm)


def _release(shm):
    try:
        shm.close()
    except BufferError:  # views of it still live: try again at a later alloc
        _LINGERING.append(shm)


def _sweep():
    """Unmap the lingering mappings whose views are gone."""
    pending = _LINGERING[:]
    _LINGERING.clear()
    for shm in pending:
        _release(shm)


def _attach(name):
    """Attach to segment `name` without handing it to this process's resource tracker, which
    would unlink it (and warn) when this process exits, although its owner frees it."""
    try:
        return SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # (3.12 and older track it)
        return shm


def leftovers(prefix):
    """Names in /dev/shm that start with prefix: what a test run left behind."""
    try:
        return sorted(n for n in os.listdir(SHM_ROOT) if n.startswith(prefix))
    except FileNotFoundError:
        return []
