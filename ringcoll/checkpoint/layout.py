"""Where each piece of a global tensor lives: shard specs, regions, chunks and dtypes.

A tensor is *global* (the whole W of a layer) and every rank holds a *region* of it: the
block global[start[0]:start[0]+shape[0], start[1]:...]. A replicated parameter's region is
the whole tensor; a column-parallel weight's is a block of columns. Regions are (start, shape)
pairs of tuples; everything here is plain index arithmetic on them, no I/O.
"""

from collections import namedtuple

import numpy as np

from ..arrays import BFLOAT16
from ..errors import CheckpointError

#: a local array's place in its global tensor: global shape, and the index of its first
#: element (the array is global[start[0]:start[0]+local.shape[0], ...]).
Shard = namedtuple("Shard", "shape start")

#: the most bytes of one piece on disk: bigger regions are cut along axis 0 into chunks of
#: at most this many bytes, so a reader that needs a few rows reads (and checksums) only
#: the chunks holding them.
CHUNK_BYTES = 8 << 20


def shard(global_shape, index):
    """Shard from the global shape and the slices that cut this rank's block out of it:
    shard((64, 256), (slice(None), slice(0, 128))) is the first 128 columns."""
    global_shape = tuple(int(n) for n in global_shape)
    if not isinstance(index, tuple):
        index = (index,)
    index = index + (slice(None),) * (len(global_shape) - len(index))
    start = []
    for axis, (s, n) in enumerate(zip(index, global_shape)):
        first, _, step = s.indices(n)
        if step != 1:
            raise ValueError(f"shard: axis {axis} takes a step {step}; a shard is a block "
                             "(step 1)")
        start.append(first)
    return Shard(global_shape, tuple(start))


def volume(shape):
    return int(np.prod(shape, dtype=np.int64))


def intersect(a, b):
    """The overlap of regions a and b, as a region, or None if they do not overlap."""
    (a_start, a_shape), (b_start, b_shape) = a, b
    start = tuple(max(x, y) for x, y in zip(a_start, b_start))
    stop = tuple(min(x + n, y + m) for x, n, y, m in zip(a_start, a_shape, b_start, b_shape))
    if any(e <= s for s, e in zip(start, stop)):
        return None
    return start, tuple(e - s for s, e in zip(start, stop))


def local_index(region, within):
    """The slices that cut `region` out of an array holding `within` (both global regions)."""
    return tuple(slice(s - w, s - w + n) for s, n, w in zip(region[0], region[1], within[0]))


def chunks(region, itemsize, limit=None):
    """region cut along axis 0 into consecutive regions of at most `limit` bytes each
    (default CHUNK_BYTES; at least one row each; a 0-d or empty region is one chunk)."""
    limit = CHUNK_BYTES if limit is None else limit
    start, shape = region
    if not shape or volume(shape) == 0:
        return [region]
    row = volume(shape[1:]) * itemsize
    rows = max(1, limit // max(row, 1))
    return [((start[0] + i,) + start[1:], (min(rows, shape[0] - i),) + shape[1:])
            for i in range(0, shape[0], rows)]


def overlapping(regions):
    """A pair of distinct regions that overlap, or None (every piece of a tensor on disk
    covers its own elements: the saved pieces must not overlap)."""
    ordered = sorted(set(regions))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if intersect(a, b) is not None and volume(intersect(a, b)[1]):
                return a, b
    return None


# -- dtypes on disk: by name, numeric only, so nothing in a checkpoint is code ------------------
_BY_NAME = {np.dtype(t).name: np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)}
if BFLOAT16 is not None:
    _BY_NAME[BFLOAT16.name] = BFLOAT16


def dtype_name(dtype):
    """The name a dtype is saved under; only plain numeric dtypes (and bool) are saved."""
    dtype = np.dtype(dtype)
    if _BY_NAME.get(dtype.name) != dtype or not dtype.isnative:
        raise ValueError(f"dtype {dtype} cannot be saved; checkpoints hold numeric arrays "
                         "(bool, int, uint, float16/32/64, bfloat16, complex) in native order")
    return dtype.name


def dtype_of(name, path, where):
    """The dtype a checkpoint names, or CheckpointError (corrupt) for anything else."""
    dtype = _BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointError(f"{where}{path} names the dtype {name!r}, which no ringcoll "
                              "checkpoint holds", path=path, problem="corrupt")
    return dtype
