"""Gradient compression for DistributedOptimizer: fewer bytes on the wire per all-reduce.

A Compressor turns one gradient bucket (a flat float array) into the averaged bucket over all
ranks, sending less than the bucket itself:

    start(comm, buf, state) -> handle   begin the exchange (non-blocking where it can)
    finish(handle)                      wait for it and write the average into buf
    wire_bytes(buf)   -> int            bytes this rank sends per bucket (compare buf.nbytes)

`state` is a dict the bucket owns (a payload buffer, top-k's residual), so one compressor
object serves any number of buckets and optimizers; `state_keys` names the entries that carry
over between steps (top-k's residual), which checkpoints save.

Built in:
- `Compression.none`: the bucket itself, all-reduced in place (`op="avg"`).
- `Compression.fp16` / `Compression.bf16`: each rank divides its bucket by p *before* casting
  (so the sum of p casts cannot overflow where the average itself fits), all-reduces the half
  precision payload with op="sum" (ringcoll accumulates it in float32 inside each step), and
  casts the result back. Half the bytes of float32.
- `TopK(density)`: each rank sends only the k = density * n largest entries (by magnitude) of
  its gradient plus its residual, as (index, value) pairs by all-gather, and keeps what it did
  not send as the residual for the next step (error feedback: nothing is dropped, only
  delayed). Every rank adds the p sparse contributions and divides by p. Per rank on the wire:
  k * (4 + itemsize) bytes instead of n * itemsize. The all-gather is blocking (finish() runs
  it), so top-k does not overlap with the backward pass.

Every compressor runs in the array module of the bucket (NumPy on the host, CuPy on the GPU:
the cast and the top-k selection happen on the device, and only the payload travels). bf16 is
host-only (CuPy has no bfloat16 dtype): DistributedOptimizer refuses it for GPU parameters.

Write your own by subclassing Compressor; see FP16 for the pattern.
"""

import numpy as np

from .arrays import BFLOAT16, array_module
from .errors import InvalidArgumentError


class Compressor:
    """Base class: no compression. start() all-reduces buf in place in the background."""

    name = "none"
    #: the keys of a bucket's state that carry over from step to step (saved in checkpoints:
    #: top-k's residual); the others are scratch, rebuilt on the next start()
    state_keys = ()
    #: True where the compressor has no GPU form (bf16): refused for CuPy buckets
    host_only = False

    def start(self, comm, buf, state):
        return comm.iallreduce(buf, op="avg", out=buf)

    def finish(self, handle):
        handle.wait()

    def wire_bytes(self, buf):
        return buf.nbytes


class Cast(Compressor):
    """Pre-divide by p, cast to a 16-bit float, sum, cast back (see the module docstring)."""

    def __init__(self, dtype, name, host_only=False):
        self.dtype, self.name, self.host_only = np.dtype(dtype), name, host_only

    def start(self, comm, buf, state):
        xp = array_module(buf)
        payload = state.get("payload")
        if payload is None:
            payload = state["payload"] = xp.empty(buf.size, self.dtype)
        xp.multiply(buf, 1.0 / comm.size, out=payload, casting="unsafe")
        return buf, payload, comm.iallreduce(payload, op="sum", out=payload)

    def finish(self, handle):
        buf, payload, request = handle
        request.wait()
        buf[...] = payload

    def wire_bytes(self, buf):
        return buf.size * self.dtype.itemsize


class TopK(Compressor):
    """Top-k sparsification with error feedback (see the module docstring).

    Args:
        density: the fraction of each bucket's entries sent per step, 0 < density <= 1.
    """

    def __init__(self, density=0.01):
        if not 0 < density <= 1:
            raise InvalidArgumentError(f"TopK: density must be in (0, 1], got {density}")
        self.density = density
        self.name = f"topk({density:g})"
        self.state_keys = ("residual",)

    def k(self, n):
        return max(1, int(round(self.density * n))) if n else 0

    def start(self, comm, buf, state):
        xp = array_module(buf)
        residual = state.get("residual")  # what this rank has not sent yet
        if residual is None:
            residual = state["residual"] = xp.zeros_like(buf)
        residual += buf  # the gradient plus everything not sent before
        k = self.k(buf.size)
        index = xp.argpartition(xp.abs(residual), buf.size - k)[buf.size - k:] if k else \
            xp.empty(0, np.int64)
        index = index.astype(np.int32)
        values = residual[index]
        residual[index] = 0  # sent: the rest waits for a later step
        return comm, buf, index, values

    def finish(self, handle):
        comm, buf, index, values = handle
        indices = comm.allgather(index)  # every rank sends the same k: no count exchange needed
        gathered = comm.allgather(values)
        buf[...] = 0
        array_module(buf).add.at(buf, indices, gathered)  # one index from two ranks adds up
        buf /= comm.size

    def wire_bytes(self, buf):
        return self.k(buf.size) * (4 + buf.itemsize)


class Compression:
    """The built-in compressors, by name: Compression.none, .fp16, .bf16, .topk(density)."""

    none = Compressor()
    fp16 = Cast(np.float16, "fp16")
    bf16 = Cast(BFLOAT16, "bf16", host_only=True) if BFLOAT16 is not None else None

    @staticmethod
    def topk(density=0.01):
        return TopK(density)
