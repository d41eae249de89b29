"""Options, and the one place ringcoll reads its environment variables.

| variable              | meaning                                                            |
|-----------------------|--------------------------------------------------------------------|
| RINGCOLL_ALGO         | force an all-reduce algorithm (ring, recursive_doubling, ...)      |
| RINGCOLL_LOCAL_SIZE   | group consecutive ranks into nodes of this many (hierarchical)     |
| RINGCOLL_TIMEOUT      | seconds a collective may make no progress before the job is aborted|
|                       | (MPI: default 600; threads: default 60; 0 = no limit)              |
| RINGCOLL_SEGMENT_BYTES| pipeline segment size of the ring algorithms                       |
| RINGCOLL_DEBUG        | 1 = all ranks compare each call before running it (fingerprints),  |
|                       | and rank 0 prints each collective's algorithm                      |
| RINGCOLL_TUNING       | tuning file auto looks up first (made by python -m ringcoll.tune); |
|                       | "none": cost model only; unset: the built-in table (MPI only)      |
| RINGCOLL_CUDA_AWARE   | CuPy buffers: 1 = hand them to MPI directly (CUDA-aware MPI),      |
|                       | 0 = stage them through pinned host memory; unset: ask the MPI      |
|                       | library (MPIX_Query_cuda_support)                                  |
| RINGCOLL_STAGING_BYTES| chunk size of that staging (default 1 MiB)                         |
| RINGCOLL_NODE_CHUNK   | slot (chunk) size of the node tier, bytes (default 1 MiB on the    |
|                       | host, 16 MiB on a GPU)                                             |
| RINGCOLL_NODE_TIER    | 0 = never use the node tier (shared memory): messages only         |

Explicit constructor arguments always win over the environment.
"""

import os
from dataclasses import dataclass, replace

from .errors import InvalidArgumentError

#: RINGCOLL_TIMEOUT's default over MPI: generous (torch's NCCL watchdog waits 10 minutes too),
#: since a legitimate collective can wait long for a rank that is still computing.
MPI_TIMEOUT = 600.0
DEFAULT_SEGMENT_BYTES = 4 << 20  # measured: smaller segments only add per-message cost on 2 cores
#: chunk of the pinned-host staging of CuPy buffers (transport/device.py): small enough that the
#: copy of one chunk overlaps the MPI transfer of the next, large enough that the per-chunk cost
#: (a few Python calls, one MPI message, one copy launch) stays small. Not yet tuned on a GPU.
DEFAULT_STAGING_BYTES = 1 << 20


@dataclass(frozen=True)
class Options:
    algorithm: str = "auto"
    local_size: int | None = None
    timeout: float | None = None
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    debug: bool = False
    tuning: object = None  # a path, a ringcoll.Tuning, False/"none", or None: built-in
    cuda_aware: bool | None = None  # None: ask the MPI library (MPIX_Query_cuda_support)
    staging_bytes: int = DEFAULT_STAGING_BYTES
    node_chunk: int | None = None  # None: algorithms/node.py's HOST_CHUNK / DEVICE_CHUNK
    node_tier: bool = True  # False: no shared memory, every collective by messages

    @classmethod
    def from_env(cls, environ=None, **overrides):
        """Options from RINGCOLL_* variables, then the non-None overrides on top."""
        env = os.environ if environ is None else environ
        opts = cls(
            algorithm=env.get("RINGCOLL_ALGO", "auto") or "auto",
            local_size=_int(env, "RINGCOLL_LOCAL_SIZE"),
            timeout=_float(env, "RINGCOLL_TIMEOUT"),
            segment_bytes=_int(env, "RINGCOLL_SEGMENT_BYTES") or DEFAULT_SEGMENT_BYTES,
            debug=env.get("RINGCOLL_DEBUG", "0") not in ("", "0", "false", "False"),
            tuning=env.get("RINGCOLL_TUNING") or None,
            cuda_aware=_flag(env, "RINGCOLL_CUDA_AWARE"),
            staging_bytes=_int(env, "RINGCOLL_STAGING_BYTES") or DEFAULT_STAGING_BYTES,
            node_chunk=_int(env, "RINGCOLL_NODE_CHUNK"),
            node_tier=_flag(env, "RINGCOLL_NODE_TIER") is not False,
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        opts = replace(opts, **given)
        if opts.local_size is not None and opts.local_size < 1:
            raise InvalidArgumentError(f"local_size must be >= 1, got {opts.local_size}")
        if opts.segment_bytes < 1:
            raise InvalidArgumentError(f"segment_bytes must be >= 1, got {opts.segment_bytes}")
        if opts.staging_bytes < 1:
            raise InvalidArgumentError(f"staging_bytes must be >= 1, got {opts.staging_bytes}")
        if opts.node_chunk is not None and opts.node_chunk < 64:
            raise InvalidArgumentError(f"node_chunk (RINGCOLL_NODE_CHUNK) must be >= 64 bytes, "
                                       f"got {opts.node_chunk}")
        return opts


def _flag(env, name):
    """A 0/1 switch: None when unset or empty (then ringcoll decides)."""
    value = env.get(name, "").strip()
    if not value:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(f"{name}={value!r}: use 1 (force it on), 0 (force it off) or leave "
                               "it unset (ringcoll decides)")


def _int(env, name):
    value = env.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None


def _float(env, name):
    value = env.get(name, "")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not a number of seconds") from None
    if seconds < 0:
        raise InvalidArgumentError(f"{name}={value!r}: use a number of seconds >= 0 (0 = no limit)")
    return seconds
