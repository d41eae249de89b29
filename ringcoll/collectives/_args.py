"""Argument helpers every collective shares: inputs and their side, dtype and op checks,
out= validation and allocation, memory layouts, roots and algorithm names.

Each takes the Group and the error prefix `ctx` ("ringcoll rank R, allreduce: ") and raises
InvalidArgumentError / InvalidTypeError naming what is wrong and what to pass instead.
"""

import zlib
from functools import partial

import numpy as np

from ..arrays import (HALF_TYPES, array_module, check_dtype, check_movable, flat_view, is_device,
                      writeable)
from ..errors import InvalidArgumentError, InvalidTypeError
from ..ops import check_op_dtype, get_op


def array_input(g, x, ctx, movable=False):
    """(x as an array, its side), dtype checked: a CuPy array stays one.

    movable=True is for a collective that only moves data (broadcast, gather, allgather,
    alltoall): any fixed-size dtype passes (arrays.check_movable), since its bytes travel
    as they are. Otherwise the dtype must be one ringcoll reduces (arrays.check_dtype).
    """
    check = check_movable if movable else check_dtype
    if type(x) is not np.ndarray and is_device(x):
        check(x.dtype, ctx)
        return x, g.sides.device(x, ctx)
    x = np.asarray(x)
    check(x.dtype, ctx)
    return x, g.host


def rows_input(g, x, ctx, movable=False):
    """array_input, with x as C-contiguous rows of axis 0 (see as_rows)."""
    x, side = array_input(g, x, ctx, movable)
    return as_rows(x), side


def reduction(g, x, op, ctx):
    """(x as an array, the ReduceOp, its combine function, x's side), checked once per
    side, dtype and op name: on the hot path this is a type check and a dict lookup."""
    if type(x) is np.ndarray:
        side = g.host
    elif is_device(x):
        side = g.sides.device(x, ctx)
    else:
        x, side = np.asarray(x), g.host
    key = (x.dtype, op) if isinstance(op, str) else None  # MPI.Op objects are unhashable
    found = side.reductions.get(key) if key is not None else None
    if found is None:
        check_dtype(x.dtype, ctx)
        reduce_op = get_op(op, ctx)
        check_op_dtype(reduce_op, x.dtype, ctx)
        found = (reduce_op, reduce_op.bind(x.dtype, side.xp))
        if key is not None:
            side.reductions[key] = found
    return (x, *found, side)


def same_memory(out, side, ctx):
    """InvalidTypeError unless out lives where x does (host, or x's GPU)."""
    if side.device is None:
        if is_device(out):
            raise InvalidTypeError(
                f"{ctx}out is a CuPy array (GPU {out.device.id}) but x is a NumPy array; "
                "pass both on the GPU or both on the host (out=np.empty_like(x))")
        if not isinstance(out, np.ndarray):
            raise InvalidTypeError(f"{ctx}out must be a NumPy array, got "
                                   f"{type(out).__name__}")
        return
    if not is_device(out):
        raise InvalidTypeError(
            f"{ctx}out is a {type(out).__module__}.{type(out).__name__} in host memory but "
            f"x is a CuPy array on GPU {side.device}; results stay on x's device: pass "
            "out=cupy.empty_like(x)")
    if out.device.id != side.device:
        raise InvalidTypeError(
            f"{ctx}out is on GPU {out.device.id} but x on GPU {side.device}; pass out on "
            "x's device (out=cupy.empty_like(x))")


def output(out, shape, dtype, ctx, side, rows=False):
    """Validate a user's out= (or allocate one of shape and dtype, on x's side).

    rows=True: the collective writes axis-0 blocks through rows_target, so any layout
    of out works; otherwise out must be contiguous (it is reduced into in memory order).
    """
    if out is None:
        return side.xp.empty(shape, dtype)
    same_memory(out, side, ctx)
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise InvalidArgumentError(
            f"{ctx}out has shape {out.shape} and dtype {out.dtype}; it must be shape "
            f"{tuple(shape)} and dtype {np.dtype(dtype)}")
    if not writeable(out):
        raise InvalidArgumentError(f"{ctx}out is read-only; pass a writeable array")
    if not (rows or out.flags.c_contiguous or out.flags.f_contiguous):
        raise InvalidArgumentError(
            f"{ctx}out is not contiguous; pass a C- or F-contiguous array "
            "(np.empty(shape, dtype)) and copy the result where you need it")
    return out


def rows_target(out):
    """(flat buffer to write the C-ordered result into, out or None to copy it into)."""
    if out.flags.c_contiguous:
        return out.reshape(-1), None
    # an F-ordered or strided out: one copy
    staging = array_module(out).empty(out.shape, out.dtype)
    return staging.reshape(-1), out


def copy_rows(dst, copy_to):
    """Finish a rows_target: copy the C-ordered result dst into out where it was staged
    (as raw elements, so a structured dtype's padding bytes are copied too)."""
    if copy_to is not None:
        raw(copy_to)[...] = raw(dst).reshape(copy_to.shape)


def copy_first(into, src, call):
    """call() as a zero-argument step that copies src into `into` first: for an MPI call that
    must not see src where it lies (inside the receive buffer, or not in its own block)."""
    def step():
        into[...] = src
        call()
    return step


def same_bytes(a, b):
    """Are arrays a and b (NumPy or CuPy) the very same contiguous bytes?"""
    if a.nbytes != b.nbytes or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return False
    face = "__cuda_array_interface__" if hasattr(a, "__cuda_array_interface__") else \
        "__array_interface__"
    other = getattr(b, face, None)
    return other is not None and getattr(a, face)["data"][0] == other["data"][0]


def raw(buf):
    """buf as a data-movement algorithm should copy it: a structured dtype viewed as plain
    void of its itemsize ('V16'), other dtypes as they are (no copy either way).

    NumPy copies a structured array field by field and skips its padding (dst[s] = src
    leaves dst's padding bytes as they were, garbage in np.empty's memory), so a rank's own
    block would differ in its padding from the blocks that came as bytes over the transport.
    A plain void element is copied as its bytes: every byte arrives as it was sent.
    """
    dtype = buf.dtype
    return buf if dtype.fields is None else buf.view(np.dtype((np.void, dtype.itemsize)))


def elementwise(x, out, ctx, side):
    """(out, src, dst, copy_out) for an elementwise collective.

    src and dst are flat and in x's memory order (C, or F for an F-contiguous x; a strided
    x is copied to C once): every rank sends and reduces in the order of its x, which is
    why x must have the same layout on every rank, while out may have any contiguous
    layout. dst is out itself when out is laid out like x (src is dst when out is x);
    otherwise it is a staging buffer and copy_out() copies the result into out.
    """
    xp = side.xp
    src = flat_view(x)
    if out is x:
        if src is None:
            raise InvalidArgumentError(f"{ctx}in-place (out=x) needs a contiguous x; pass "
                                       "np.ascontiguousarray(x) and use the returned array")
        if not writeable(x):
            raise InvalidArgumentError(f"{ctx}x is read-only and cannot be reduced in place")
        return out, src, src, None
    if src is None:
        x = xp.ascontiguousarray(x)  # one copy, for a non-contiguous x
        src = x.reshape(-1)
    if out is None:
        out = xp.empty_like(x)  # laid out like x, so both flatten in the same order
        return out, src, flat_view(out), None
    output(out, x.shape, x.dtype, ctx, side)
    if xp.may_share_memory(x, out) and xp.shares_memory(x, out):
        raise InvalidArgumentError(f"{ctx}out overlaps x without being x; use out=x for "
                                   "in place or a separate buffer")
    if out.flags.c_contiguous == x.flags.c_contiguous:
        return out, src, flat_view(out), None
    staging = xp.empty(x.shape, x.dtype, order="C" if x.flags.c_contiguous else "F")
    return out, src, flat_view(staging), partial(xp.copyto, out, staging)


def send_view(x, side):
    """x as a flat buffer to send from, in its memory order (a non-contiguous x copied)."""
    src = flat_view(x)
    return src if src is not None else side.xp.ascontiguousarray(x).reshape(-1)


def fields(g, side, op=None, x=None, **more):
    """This rank's call as debug mode's fingerprint records it; None outside debug mode."""
    if not g.options.debug:
        return None
    found = {}
    if op is not None:
        found["op"] = op.name
    if x is not None:
        found["dtype"], found["shape"] = dtype_key(x.dtype), list(x.shape)
        if x.ndim > 1:  # the order x is sent and reduced in (see elementwise)
            found["layout"] = "F" if x.flags.f_contiguous and not x.flags.c_contiguous else "C"
    found.update(more)
    if side is not None:
        found.update(side.memory())
    return found


def counts_crc(counts):
    """A fingerprint of a counts list that ranks compare in their exchanges (never -1, which
    their records use for "no counts")."""
    return zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes())


def declared_field(declared):
    """debug mode's field for a declared call (allgather.Rows): present only when it is, so a
    rank that declares where another does not is named."""
    return {"declared": True} if declared else {}


def dtype_key(dtype):
    """dtype as debug mode's fingerprint compares it: its name ('float32', 'str96'), or for a
    structured dtype, whose name ('void128') every struct of that size shares, its fields
    with their padding (dtype.descr), so two different structs never compare equal. A long
    descr becomes its crc, to keep the fingerprint within its fixed size."""
    if dtype.fields is None:
        return dtype.name
    descr = str(dtype.descr)
    return descr if len(descr) <= 64 else f"{dtype.name} crc {zlib.crc32(descr.encode()):08x}"


def layout(dtype, trail):
    """A crc of a dtype and a row shape, the same in every process, for ranks to compare
    before they move rows: dtype.str has the byte order; dtype_key tells apart what shares a
    .str (two structs of one size, '|V12', by their fields and padding; ml_dtypes' float8
    kinds, '<V1', by name)."""
    return zlib.crc32(f"{dtype.str} {dtype_key(dtype)} {tuple(trail)}".encode())


#: the transport method behind each collective's 'native' algorithm
NATIVE_CALLS = {"broadcast": "native_bcast", "reduce": "native_reduce", "scan": "native_scan",
                "exscan": "native_exscan", "allgather": "native_allgather",
                "reduce_scatter": "native_reduce_scatter", "alltoall": "native_alltoall",
                "barrier": "native_barrier", "gather": "native_gatherv",
                "scatter": "native_scatterv", "alltoallv": "native_alltoallv"}


def native_rows(g, collective, algorithm, nbytes, host_all, fallback):
    """Does the data step of gather, scatter or alltoallv go by MPI's own call
    (MPI_Gather(v), MPI_Scatter(v), MPI_Alltoallv) rather than ringcoll's algorithm? nbytes:
    the bytes the tuning table looks up (the whole buffer's); host_all: every rank's rows are
    host memory. 'native' always does; auto only where every rank's rows are host memory
    and the transport has the call, and then as g's tuning table measured this collective at
    nbytes, or, where it has no such entry, as `fallback` says. Every rank answers alike: the
    arguments and the table are the same on every rank."""
    if algorithm == "native":
        return True
    if algorithm not in (None, "auto") or not host_all \
            or not hasattr(g.t, NATIVE_CALLS[collective]):
        return False
    found = None if g.tuning is None else \
        g.tuning.choose_collective(collective, nbytes, g.size, g.nodes)
    return fallback if found is None else found == "native"


#: integer types whose sums Open MPI's op/avx component gets wrong: from 64 elements on they
#: saturate instead of wrapping (int8 100 + 100 gives 127, not -56; uint8 and uint16 in
#: MPI_Reduce_scatter_block too), measured with Open MPI 5.0.11; OMPI_MCA_op=^avx avoids it
AVX_SATURATED = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16))


def native_reduces(t, dtype):
    """May auto hand a reduction of dtype (None: not a reduction) to the MPI library's call
    over transport t? Not for float16 / bfloat16, which MPI has no type for, nor for the
    8/16-bit integers under Open MPI (AVX_SATURATED): a result silently wrong is worse than
    ringcoll's own algorithm. algorithm='native' still asks MPI, as asked."""
    if dtype is None:
        return True
    if dtype in HALF_TYPES:
        return False
    library = getattr(t, "library", None)
    return not (dtype in AVX_SATURATED and library is not None and "Open MPI" in library())


def pick_simple(algorithm, names, ctx, g=None, side=None, measured=None):
    """The algorithm of a collective other than the all-reduce: names is its ALGORITHMS.

    auto (or None): device buffers (side.device set) run 'node', the node tier, where names
    has it and every rank shares one node (g.nodes): device to device, not through the host's
    MPI. Otherwise, with measured = (collective, nbytes, dtype), the winner g's tuning table
    measured at nbytes (what every rank agrees on; see ringcoll.tuning), if this transport can
    run it ('native' needs the MPI library's call, and for a reduction a dtype MPI reduces
    correctly: native_reduces); else names[0], ringcoll's own algorithm."""
    if algorithm in (None, "auto"):
        side = side if side is not None else (g.host if g is not None else None)
        if side is not None and side.device is not None and "node" in names \
                and len(g.nodes) == 1 and g.size > 1 and side.ws.node_tier \
                and hasattr(side.t, "shared"):
            return "node"
        if measured is not None and g.tuning is not None:
            collective, nbytes, dtype = measured
            found = g.tuning.choose_collective(collective, nbytes, g.size, g.nodes)
            if found == "native":
                if hasattr(side.t, NATIVE_CALLS[collective]) and native_reduces(side.t, dtype):
                    return found
            elif found in names and found != "node":  # node: chosen above, or not at all
                return found
        return names[0]
    if algorithm in names:
        return algorithm
    allowed = ["'auto'"] + [repr(n) for n in names]
    raise InvalidArgumentError(f"{ctx}unknown algorithm {algorithm!r}; use "
                               f"{', '.join(allowed[:-1])} or {allowed[-1]}")


def check_root(g, root, ctx):
    if not isinstance(root, (int, np.integer)) or not 0 <= root < g.size:
        raise InvalidArgumentError(f"{ctx}root={root!r} is not a rank of this communicator "
                                   f"(0..{g.size - 1})")


def counts(values, size, ctx, total=None, name="counts"):
    """values as a list of size non-negative ints (summing to total, if given): the rows of
    each rank's block in an uneven collective (alltoallv's counts and recv_counts,
    reduce_scatter's counts). Checked here, on this rank alone, before anything is sent."""
    try:
        found = list(values)
    except TypeError:
        raise InvalidArgumentError(f"{ctx}{name} must be a sequence of {size} row counts, one "
                                   f"per rank, got {type(values).__name__}") from None
    if len(found) != size:
        raise InvalidArgumentError(f"{ctx}{name} has {len(found)} entries; pass one row count "
                                   f"per rank ({size})")
    bad = [i for i, c in enumerate(found)
           if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) or c < 0]
    if bad:
        raise InvalidArgumentError(f"{ctx}{name}[{bad[0]}] = {found[bad[0]]!r}; row counts "
                                   "must be non-negative integers")
    found = [int(c) for c in found]
    if total is not None and sum(found) != total:
        raise InvalidArgumentError(f"{ctx}{name} sum to {sum(found)} rows but x has {total} "
                                   f"(x.shape[0]); pass counts that sum to x.shape[0]")
    return found


def counts_field(values):
    """Debug mode's fingerprint field for a list of counts: the list, or its length and CRC
    where the list would crowd the fixed-size record."""
    text = repr(values)
    return values if len(text) <= 64 else f"{len(values)} counts, crc {zlib.crc32(text.encode())}"


def as_rows(x):
    """x as C-contiguous rows of axis 0 (a 0-d x becomes one row): blocks are whole rows."""
    x = x.reshape(1) if x.ndim == 0 else x
    if x.dtype.fields is not None and not x.flags.c_contiguous:  # copied with its padding
        return np.ascontiguousarray(raw(x)).view(x.dtype)  # (CuPy has no structured dtypes)
    return array_module(x).ascontiguousarray(x)


def row_elems(x):
    """Elements in one row of axis 0."""
    return int(np.prod(x.shape[1:], dtype=np.int64)) if x.ndim > 1 else 1


def on_side(run, side):
    """run, on side's device stream if it is a GPU's (a NumPy call skips the wrapper)."""
    return run if side.device is None else side.on_stream(run)
