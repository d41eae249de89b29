"""Host and device sides: where one call's buffers live, and what moves and reduces them there.

Every call's buffers live on one side, decided once per call from its input. NumPy arrays use
the communicator's own transport and workspace (the host side); CuPy arrays use a device side
per GPU, made on first use: the same transport wrapped by transport.device (CUDA-aware, or
staged through pinned host memory), a workspace in device memory, and CUDA reduction kernels.
"""

import sys

import numpy as np

from .arrays import Workspace, array_module
from .errors import InvalidArgumentError


class Side:
    """One side: the transport and workspace that move its buffers, their array module, and
    the reductions checked for them ((dtype, op) -> (ReduceOp, combine)).

    device is None on the host; on a GPU it is the CUDA device id, path says how device buffers
    travel ("cuda-aware" or "staged") and why_path why.
    """

    __slots__ = ("t", "ws", "xp", "reductions", "device", "path", "why_path")

    def __init__(self, t, ws, xp, device=None, path=None, why_path=None):
        self.t, self.ws, self.xp, self.reductions = t, ws, xp, {}
        self.device, self.path, self.why_path = device, path, why_path

    def on_stream(self, fn):
        """fn, run on the CuPy device and stream current now (a queued or non-blocking
        collective runs on the background thread, whose current stream is another)."""
        if self.device is None:
            return fn
        cupy = self.xp
        device, stream = cupy.cuda.Device(self.device), cupy.cuda.get_current_stream()

        def on_stream():
            with device, stream:
                return fn()
        return on_stream

    def memory(self):
        """Debug mode's fingerprint field for device buffers (none for host ones, whose
        fingerprints stay as they were): ranks that disagree on where or how are named."""
        return {} if self.device is None else {"memory": f"gpu, {self.path}"}


class Sides:
    """A communicator's host side and its device sides (one per GPU, made on first use)."""

    def __init__(self, transport, options, rank):
        self.options, self.rank = options, rank
        self.host = Side(transport, Workspace(options.segment_bytes, node_chunk=options.node_chunk,
                                              node_tier=options.node_tier), np)  # NumPy arrays
        self.devices = {}  # CUDA device id -> its Side

    def device(self, x, ctx):
        """The Side of CuPy array x's GPU: made on first use (its transport path decided and,
        in debug mode, printed); x must be on the current CuPy device."""
        cupy = array_module(x)
        device, current = x.device.id, cupy.cuda.runtime.getDevice()
        if device != current:
            raise InvalidArgumentError(
                f"{ctx}x is on GPU {device} but the current CuPy device is GPU {current}; call "
                f"the collective inside `with cupy.cuda.Device({device}):` (or make it current "
                f"with cupy.cuda.Device({device}).use())")
        side = self.devices.get(device)
        if side is None:
            from .transport.device import CupyDevice, for_device  # only the GPU path needs it

            o = self.options
            dev = CupyDevice(device)
            t, path, why = for_device(self.host.t, dev, o.cuda_aware, o.staging_bytes)
            side = self.devices[device] = Side(
                t, Workspace(o.segment_bytes, empty=dev.empty, node_chunk=o.node_chunk,
                             node_tier=o.node_tier, device=True), cupy, device, path, why)
            if o.debug:
                how = ("cuda-aware: device buffers go straight to MPI" if path == "cuda-aware"
                       else "staged via pinned host buffers, chunk "
                            f"{o.staging_bytes} B, double-buffered")
                print(f"ringcoll rank {self.rank}: CuPy arrays on GPU {device} -> {how} "
                      f"({why})", file=sys.stderr, flush=True)
        return side

    def close(self):
        """Collective: free the node tiers' shared memory of every side."""
        for side in (self.host, *self.devices.values()):
            side.ws.close_resident()

    def swap(self, transport):
        """Run on `transport` from now on. The cached schedules hold views bound to the old
        one, so they go; so do the device sides, whose transports wrap the old one."""
        self.host.t = transport
        self.devices.clear()
        self.host.ws.drop_plans()
