"""A NumPy stand-in for a GPU, for testing the *staging schedule* of transport/device.py on a
CPU. It is not a GPU and says nothing about CUDA; tests/test_gpu.py does that on a real one.

"Device" buffers are ordinary NumPy arrays (by default every buffer counts as one, so every
message of every algorithm is staged). What makes the fake worth having is that copies are
deferred as on a GPU: to_host/to_device only queue work on a copy stream, which runs when an
event recorded after it is waited for, or, at random, when done() is asked. So a send posted
before its D2H copy finished sends stale bytes (the pinned blocks start filled with 0xCD), and a
host block reused before its H2D copy ran hands the next message's bytes to the earlier one:
such schedule bugs give wrong results here, as they would on a GPU.

The compute stream runs everything at once (NumPy kernels are synchronous), so wait(compute,
event) completes the event's stream up to the event, and events recorded on compute have
always happened.

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
unmapped at once (NumPy holds the buffer): it is unmapped when they go. Its name is unlinked
at free, so /dev/shm holds nothing once every segment was freed.
"""

import fcntl
import itertools
import os
import random
import threading
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
        self.copies = self.syncs = self.pinned_bytes = 0
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
        data = _bytes(src)[offset:offset + nbytes]
        self._push(stream, lambda: block.array.__setitem__(slice(0, nbytes), data))

    def to_device(self, block, dst, offset, nbytes, stream):
        target = _bytes(dst)[offset:offset + nbytes]
        self._push(stream, lambda: target.__setitem__(slice(None), block.array[:nbytes]))

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
        return seg.array[:nbytes]

    def device_id(self):
        return self.id

    def can_access_peer(self, other):
        if other == self.id or self.peer_access is True:
            return True
        return bool(self.peer_access) and other in self.peer_access

    def fence(self):
        self.fences += 1
        with self._barrier:  # (an atomic instruction: a memory barrier for the host's writes)
            pass

    def live(self):
        """(allocations, mappings) this device holds now: both empty once all are closed."""
        return sorted(s.name for s in self._mine.values()), \
            sorted(s.name for s in self._maps.values())


def _bytes(buf):
    """The bytes of a contiguous 1-D buffer, as a view (copies read and write through it when
    they run, not when they are queued: as on a GPU)."""
    assert buf.ndim == 1 and buf.flags.c_contiguous, "staged buffers are flat and contiguous"
    return buf.view(np.uint8)


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
