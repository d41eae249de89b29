"""Array plumbing: NumPy or CuPy, which dtypes ringcoll reduces or moves, flat views, block
partitions.

Algorithms work on 1-D contiguous views; this module turns the user's arrays into those views
without copying when it can, and says exactly what is wrong when it cannot. The array module
(NumPy on the CPU, CuPy on the GPU) is decided from the input once per call, never per step,
and never by importing CuPy for a NumPy input.
"""

import sys

import numpy as np

from .cache import BoundedCache
from .errors import InvalidTypeError

try:  # bfloat16 is not a NumPy type; ml_dtypes provides it where installed.
    from ml_dtypes import bfloat16 as _bfloat16

    BFLOAT16 = np.dtype(_bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BFLOAT16 = None

_KINDS = "iufc"  # signed, unsigned, float, complex
#: dtypes whose reductions accumulate in float32 inside each step.
HALF_TYPES = tuple(t for t in (np.dtype(np.float16), BFLOAT16) if t is not None)


def is_supported_dtype(dtype):
    dtype = np.dtype(dtype)
    return dtype in HALF_TYPES or (dtype.kind in _KINDS and dtype.fields is None)


def check_dtype(dtype, where):
    if not is_supported_dtype(dtype):
        raise InvalidTypeError(
            f"{where}dtype {np.dtype(dtype)} is not supported; use a numeric dtype "
            "(int8..int64, uint8..uint64, float16/32/64, complex64/128, or bfloat16 "
            "from ml_dtypes)"
        )


def check_movable(dtype, where):
    """Refuse a dtype the data-movement collectives cannot send (broadcast, gather, allgather,
    alltoall): they copy bytes and do no arithmetic, so any fixed-size dtype travels, bit for
    bit (bool, bytes, str, void, structured, datetime64, numeric). Refused: object dtypes
    (their bytes are pointers into this process) and dtypes of no bytes at all."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise InvalidTypeError(
            f"{where}dtype {dtype} holds Python object pointers, which cannot be sent; pass a "
            "fixed-size dtype (numeric, bool, 'S'/'U' strings, datetime64 or a structured "
            "dtype without object fields)")
    if dtype.itemsize == 0:
        raise InvalidTypeError(
            f"{where}dtype {dtype} has itemsize 0, so its elements have no bytes to send; "
            "pass a fixed-size dtype of at least one byte")


def is_device(x):
    """True for a CuPy array (GPU memory). Never imports CuPy: if it is not imported yet, x
    cannot be one of its arrays. NumPy arrays answer on the first comparison."""
    if type(x) is np.ndarray:
        return False
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x):
    """numpy for host arrays (and anything np.asarray takes), cupy for a CuPy array."""
    return sys.modules["cupy"] if is_device(x) else np


def is_array(x):
    """A NumPy or CuPy array."""
    return isinstance(x, np.ndarray) or is_device(x)


def to_module(xp, x):
    """x (NumPy or CuPy) as an array of module xp: a copy across host and device (cupy.asarray
    or cupy.asnumpy), else x itself."""
    if is_device(x) == (xp is not np):
        return x
    return xp.asarray(x) if xp is not np else array_module(x).asnumpy(x)


def memory_of(x):
    """Where x lives, for error messages."""
    return "on the GPU (CuPy)" if is_device(x) else "on the host (NumPy)"


def writeable(x):
    """x.flags.writeable; CuPy arrays have no such flag and are always writeable."""
    return getattr(x.flags, "writeable", True)


def flat_view(x):
    """A 1-D view of a C- or F-contiguous array in memory order, or None if impossible."""
    if x.ndim == 1:
        return x if x.flags.c_contiguous else None  # already flat: no new view object
    if x.ndim == 0:
        return x.reshape(-1) if x.flags.c_contiguous else None
    if x.flags.c_contiguous:
        return x.reshape(-1)
    if x.flags.f_contiguous:
        return x.T.reshape(-1)
    return None


class Partition:
    """Contiguous blocks of a flat buffer: block b is buf[starts[b]:starts[b+1]].

    `even(n, parts)` splits like np.array_split (the first n % parts blocks get one more
    element); `rows(...)` splits axis 0 that way and scales by the elements in a row.
    """

    __slots__ = ("starts", "counts", "slices")

    def __init__(self, counts):
        self.counts = [int(c) for c in counts]
        self.starts = [0]
        for c in self.counts:
            self.starts.append(self.starts[-1] + c)
        self.slices = [slice(self.starts[b], self.starts[b + 1]) for b in range(len(self.counts))]

    @classmethod
    def even(cls, n, parts):
        base, extra = divmod(n, parts)
        return cls([base + (1 if b < extra else 0) for b in range(parts)])

    @classmethod
    def rows(cls, nrows, parts, row_elems):
        return cls([c * row_elems for c in cls.even(nrows, parts).counts])

    @property
    def total(self):
        return self.starts[-1]

    def __len__(self):
        return len(self.counts)

    def __eq__(self, other):
        return isinstance(other, Partition) and self.counts == other.counts

    def __repr__(self):
        return f"Partition({self.counts})"


def segments(count, seg_elems):
    """Pipeline segments [0, count) in pieces of at most seg_elems; none for an empty block."""
    return [slice(s, min(s + seg_elems, count)) for s in range(0, count, seg_elems)]


class Workspace:
    """Scratch buffers, block partitions and schedules cached per communicator.

    After the first call of a given size nothing is allocated: scratch(name, count, dtype)
    hands out a view of a byte buffer that only ever grows (one per name, so their number is
    fixed). `empty(nbytes)` allocates those byte buffers: host memory by default, device memory
    for a GPU's workspace. Partitions, segment lists and schedules are cached per size in one
    BoundedCache, so a job that runs many different sizes keeps only the latest few hundred.
    """

    def __init__(self, segment_bytes, empty=None, node_chunk=None, device=False, node_tier=True):
        self.segment_bytes = segment_bytes
        # the node tier: its slot size, whether it may run at all, and its memory's kind
        self.node_chunk, self.node_tier, self.device = node_chunk, node_tier, device
        self._empty = empty or _host_bytes
        self._buffers = {}
        self._plans = BoundedCache()  # partitions, segment lists and schedules, by key
        self._resident = {}  # connection-time state (the node tier's memory), never evicted

    def resident(self, key, build):
        """An object made once and kept for the workspace's life, unlike the cached plans: the
        node tier's shared memory, whose making is collective (close_resident frees it)."""
        found = self._resident.get(key)
        if found is None:
            found = self._resident[key] = build()
        return found

    def resident_get(self, key):
        """The resident object under key, or None if none was made."""
        return self._resident.get(key)

    def close_resident(self):
        """Collective: close every resident object that has a close() (the node tiers)."""
        for obj in self._resident.values():
            if hasattr(obj, "close"):
                obj.close()
        self._resident.clear()

    def scratch(self, name, count, dtype):
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._buffers[name] = self._empty(max(nbytes, 64))
        return buf[:nbytes].view(dtype)

    def cached(self, key, build):
        """A partition or schedule cached under key: build() runs on the first call only."""
        plan = self._plans.get(key)  # dict's own get: the hit path stays one C call
        if plan is None:
            plan = self._plans.put(key, build())
        return plan

    def drop_plans(self):
        """Forget the cached partitions and schedules (some hold views of the transport they
        were built on: the Communicator calls this when it swaps its transport)."""
        self._plans.clear()

    def segments(self, count, seg_elems):
        """segments(count, seg_elems), cached: the ring asks for every block at every step."""
        key = ("segments", count, seg_elems)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = segments(count, seg_elems)
        return found

    def partition(self, n, parts):
        return self.cached(("even", n, parts), lambda: Partition.even(n, parts))

    def row_partition(self, nrows, parts, row_elems):
        return self.cached(("rows", nrows, parts, row_elems),
                           lambda: Partition.rows(nrows, parts, row_elems))

    def segment_elems(self, dtype):
        return max(1, self.segment_bytes // np.dtype(dtype).itemsize)


def _host_bytes(nbytes):
    return np.empty(nbytes, dtype=np.uint8)
