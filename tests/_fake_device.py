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
"""

import random
from collections import deque

import numpy as np

from ringcoll.transport.device import Device


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

    def __init__(self, seed=0, owns=None, eager=False):
        self._owns = owns or (lambda buf: True)
        self.rng = random.Random(seed)
        self.eager = eager
        self.d2h, self.h2d, self.compute_stream = (FakeStream("d2h"), FakeStream("h2d"),
                                                   FakeStream("compute"))
        self.copies = self.syncs = self.pinned_bytes = 0

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


def _bytes(buf):
    """The bytes of a contiguous 1-D buffer, as a view (copies read and write through it when
    they run, not when they are queued: as on a GPU)."""
    assert buf.ndim == 1 and buf.flags.c_contiguous, "staged buffers are flat and contiguous"
    return buf.view(np.uint8)
