"""wrap(mpi_comm): mpi4py's upper-case collectives, run by ringcoll.

    from mpi4py import MPI
    import ringcoll
    comm = ringcoll.wrap(MPI.COMM_WORLD)       # the one line that changes
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
    comm.Get_rank(), comm.Split(...)           # everything else is the mpi4py communicator

Each method is a thin adapter that turns mpi4py's arguments (buffer specs, MPI.IN_PLACE,
MPI.Op) into a call of the Communicator's public methods; there is no second implementation
here.

Every buffer collective of mpi4py's Comm and its non-blocking I-form (returning a Request
with Wait/Test/wait/test) runs here: Barrier, Bcast, Gather(v), Scatter(v), Allgather(v),
Alltoall(v), Reduce, Allreduce, Reduce_scatter(_block), Scan, Exscan. Data movement with a
derived datatype runs here too, its data packed (MPI_Pack) where the datatype is, since MPI
lets the ranks' datatypes differ as long as their type signatures match. What ringcoll cannot
do passes through to the mpi4py communicator, on every rank alike: reductions of a derived
datatype or a pair type, user-defined ops and the predefined ops other than SUM, PROD, MAX
and MIN (see _PassThrough); Alltoallw and anything else not defined here is simply the
wrapped communicator's (__getattr__).

Buffers are taken as mpi4py takes them: anything with the buffer protocol (NumPy arrays,
array.array, bytearray, memoryview; read-only ones where only read), DLPack objects on the CPU,
and CuPy arrays (which stay on their GPU), alone or in a spec: [buf, datatype],
[buf, count, datatype], [buf, (count, displ), datatype], and for the v-variants
[buf, counts, displs, datatype] and its shorter forms (the datatype may be left out; it is
then the buffer's own). The caller's memory is always viewed, never copied, so results land
where mpi4py would put them (v-variant blocks at displacements that are not back to back
go through one staging buffer). Data movement sends the bytes as they are, so any datatype
works; reductions need a numeric one.
"""

import ctypes
import functools
import operator
import sys

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from .arrays import Partition, array_module, is_device, writeable
from .communicator import Communicator
from .errors import InvalidArgumentError, InvalidTypeError


def wrap(mpi_comm=None, **options):
    """An mpi4py-compatible communicator whose collectives are ringcoll's."""
    return MPICompat(MPI.COMM_WORLD if mpi_comm is None else mpi_comm, **options)


def _spec(spec):
    """(buffer, count or None, displacement, MPI datatype or None) of an mpi4py buffer spec:
    buf, [buf, datatype], [buf, count], [buf, (count, displ)], [buf, count, datatype],
    [buf, (count, displ), datatype] or [buf, count, displ, datatype], as mpi4py reads them."""
    if not isinstance(spec, (list, tuple)):
        return spec, None, 0, None
    count = displ = datatype = None
    if len(spec) == 2:
        buf, count = spec
        if _is_datatype(count):
            count, datatype = None, count
    elif len(spec) == 3:
        buf, count, datatype = spec
    elif len(spec) == 4:
        buf, count, displ, datatype = spec
    else:
        raise InvalidArgumentError(f"ringcoll.wrap: a buffer spec has 1 to 4 items, not "
                                   f"{len(spec)}; pass buf or [buf, count, datatype]")
    if isinstance(count, (list, tuple)):
        count, displ = count
    return buf, count, displ or 0, datatype


def _vector_fields(spec):
    """(buffer, counts, displs, datatype) of a v-variant spec, as mpi4py reads them: buf,
    [buf, datatype], [buf, counts], [buf, (counts, displs)], [buf, counts, datatype],
    [buf, (counts, displs), datatype] or [buf, counts, displs, datatype]."""
    buf, counts, displs, datatype = spec, None, None, None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            buf, counts = spec
            if _is_datatype(counts):
                counts, datatype = None, counts
            elif isinstance(counts, tuple):  # (counts, displs), as mpi4py reads a 2-tuple
                counts, displs = counts
        elif len(spec) == 3:
            buf, counts, datatype = spec
            if isinstance(counts, tuple):
                counts, displs = counts
        elif len(spec) == 4:  # a tuple here is the counts themselves
            buf, counts, displs, datatype = spec
        else:
            raise InvalidArgumentError(f"ringcoll.wrap: a buffer spec has 1 to 4 items, not "
                                       f"{len(spec)}; pass [buf, counts, displs, datatype]")
    return buf, counts, displs, _datatype(datatype)


def _back_to_back(counts):
    """The displacements of blocks that lie one after the other from the start."""
    return Partition(counts).starts[:-1]


def _counts_displs(counts, displs, size, p, name):
    """counts and displs of a v-spec as lists (size: the buffer's elements): no counts splits
    the buffer like np.array_split, an integer count is every block's, an integer
    displacement is a stride; checked to fit."""
    if counts is None:
        counts = Partition.even(size, p).counts
    elif isinstance(counts, (int, np.integer)):
        counts = [int(counts)] * p
    else:
        counts = [int(c) for c in counts]
    if displs is None:
        displs = _back_to_back(counts)
    elif isinstance(displs, (int, np.integer)):
        displs = [int(displs) * i for i in range(p)]
    else:
        displs = [int(d) for d in displs]
    if len(counts) != p or len(displs) != p:
        raise InvalidArgumentError(f"ringcoll.wrap: {name} has {len(counts)} counts and "
                                   f"{len(displs)} displacements; pass one of each per rank "
                                   f"({p})")
    for c, d in zip(counts, displs):
        if c < 0 or d < 0 or d + c > size:
            raise InvalidArgumentError(f"ringcoll.wrap: {name} has {size} elements; "
                                       f"count {c} at displacement {d} does not fit")
    return counts, displs


def _vector(spec, p, name):
    """(the whole buffer as a 1-D view, counts, displacements) of a v-variant spec, in
    elements of the datatype (_vector_fields, _counts_displs)."""
    buf, counts, displs, datatype = _vector_fields(spec)
    flat = _elements(buf if datatype is None else [buf, datatype], name)
    counts, displs = _counts_displs(counts, displs, flat.size, p, name)
    return flat, counts, displs


def _byte_vector(spec, p, name):
    """_vector, in bytes: data movement needs no element type."""
    flat, counts, displs = _vector(spec, p, name)
    size = flat.dtype.itemsize
    return _bytes(flat), [c * size for c in counts], [d * size for d in displs]


def _contiguous(counts, displs):
    """True if the blocks lie one after the other from the start, as the core writes them."""
    return displs == _back_to_back(counts)


def _packed(flat, counts, displs):
    """The blocks of a v-spec one after the other: a view when they already are, else a
    copy."""
    if _contiguous(counts, displs):
        return flat[:sum(counts)]
    return array_module(flat).concatenate([flat[d:d + c] for c, d in zip(counts, displs)])


def _unpacked(flat, counts, displs):
    """(where the core writes the blocks one after the other, and a function that puts them
    at their displacements, or None if they are written in place)."""
    if _contiguous(counts, displs):
        return flat[:sum(counts)], None
    staging = array_module(flat).empty(sum(counts), flat.dtype)

    def place():
        start = 0
        for c, d in zip(counts, displs):
            flat[d:d + c] = staging[start:start + c]
            start += c
    return staging, place


def _is_datatype(item):
    """mpi4py takes an MPI.Datatype or its typecode string ('i', 'd', ...) as a datatype."""
    return isinstance(item, (MPI.Datatype, str))


def _datatype(item):
    """An MPI.Datatype (a typecode string looked up as mpi4py does), or None."""
    if isinstance(item, str):
        try:
            return MPI._typedict[item]
        except KeyError:
            raise InvalidTypeError(f"ringcoll.wrap: {item!r} is no typecode mpi4py knows "
                                   "(MPI._typedict); pass an MPI.Datatype") from None
    return item


class _PassThrough(Exception):
    """What ringcoll cannot do itself (a reduction of a derived datatype or pair type, a
    user-defined op, an op without a ringcoll kernel): found while reading the arguments,
    before anything is sent, so the call goes to the wrapped mpi4py communicator instead, on
    every rank alike (a reduction's datatype and op are the same on every rank, as MPI
    requires). Data movement never passes through: a derived datatype there is packed
    (MPICompat._moved), as another rank may describe the same bytes with a basic one."""


def _passes_through(name):
    """A method that, where ringcoll cannot do the call, gives it to the wrapped mpi4py
    communicator's method `name` instead; and whose bad arguments, found here before the
    Communicator sees them, are refused as the Communicator refuses its own (in debug mode
    the other ranks hear of it and raise too, instead of waiting).

    A blocking method also remembers its last call (see _Remembered): the very same arguments
    again run the Communicator call they were read into, with no reading at all, so the core
    sees the very same arrays and repeats its plan too."""
    blocking = not name.startswith("I")

    def decorate(method):
        @functools.wraps(method)
        def adapter(self, *args, **kwargs):
            if blocking:
                last = self._remembered.get(name)
                if last is not None and last.matches(args, kwargs):
                    last.run()
                    return None
                self._reading = None
            try:
                result = method(self, *args, **kwargs)
            except _PassThrough:
                return getattr(self.mpi_comm, name)(*args, **kwargs)
            except (ValueError, TypeError, BufferError) as exc:  # InvalidArgumentError too
                self.ringcoll.refuse(name, exc)
                return None
            if blocking:
                read, self._reading = self._reading, None
                remembered = _Remembered.of(args, kwargs, read)
                if remembered is None:
                    self._remembered.pop(name, None)
                else:
                    self._remembered[name] = remembered
            return result
        return adapter
    return decorate


class _Remembered:
    """A blocking call's mpi4py arguments and the Communicator call they were read into.

    Kept only when replaying that call is all the method does: nothing to finish afterwards
    (no derived datatype to unpack, no staged v-blocks to place) and every array the core got
    views a NumPy array or a buffer object (bytearray, mmap, array.array, ...) the caller
    passed, so no packed or staged copy would be sent stale.
    The arguments match the very same objects (a spec list: the same items), every array of
    them still writeable and of the same dtype. run is the Communicator's again(): the
    core's own plan run with no second matching."""

    __slots__ = ("args", "keys", "kwargs", "layouts", "arrays", "run", "given", "lists")

    @classmethod
    def of(cls, args, kwargs, read):
        if read is None:
            return None
        again, core_args, core_kwargs, finish, copy = read
        if finish is not None:
            return None
        given = [a for a in list(args) + list(kwargs.values()) for a in _items(a)]
        arrays = [a for a in given if isinstance(a, np.ndarray)]
        owners = [_owner(b) for b in arrays]
        for a in list(core_args) + list(core_kwargs.values()) + ([copy[1]] if copy else []):
            if not isinstance(a, np.ndarray) or copy is not None and _owner(a) is copy[0]:
                continue  # (the copy is made anew from copy[1], checked here)
            owner = _owner(a)
            if not any(owner is b for b in owners) and not (
                    isinstance(owner.base, memoryview)
                    and any(owner.base.obj is b for b in given)):
                return None  # a copy (packed, staged): it would not see new values
            if not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__"):
                return None  # a device array: read again each call (cheap next to the GPU)
        if not all(a.flags.writeable for a in arrays):
            return None
        r = cls()
        # The common call (ndarrays given positionally, everything else a scalar: op, root,
        # a datatype) is matched by one C comparison of the tuples and of the keyword dicts,
        # then each array by identity. That comparison alone would take a new size-1 array
        # or bytearray equal in value to the kept one for the same: hence the identities.
        # The core no longer matches its arguments (see Communicator.again): an array the
        # caller retypes in place (x.dtype = ...) is read anew here, hence the dtypes. (A
        # reshape in place keeps the memory and the element count, which is all an MPI call
        # reads.)
        if all(_scalar(v) for v in kwargs.values()) and all(
                isinstance(a, np.ndarray) or _scalar(a) for a in args):
            r.args, r.kwargs = tuple(args), dict(kwargs)
            r.arrays = tuple((i, a, a.dtype) for i, a in enumerate(args)
                             if isinstance(a, np.ndarray))
            r.keys = r.layouts = None
        else:  # spec lists, buffer objects, arrays by keyword: _matches_any
            r.args = tuple(tuple(a) if isinstance(a, (list, tuple)) else a
                           for a in args + tuple(kwargs.values()))
            # the very objects given, and each spec list with its items then: a loop that
            # passes the same list again (the OSU demos' msg) is matched by identities alone
            r.given = args + tuple(kwargs.values())
            r.lists = tuple((a, kept) for a, kept in zip(r.given, r.args) if type(a) is list)
            r.keys = tuple(kwargs)
            r.layouts = tuple((a, a.dtype) for a in arrays)
            r.kwargs = r.arrays = None
        if copy is None:
            r.run = again
        else:
            into, source = copy

            def refresh_then_call():
                into[...] = source
                again()
            r.run = refresh_then_call
        return r

    def matches(self, args, kwargs):
        if self.arrays is None:
            return self._matches_any(args, kwargs)
        try:
            if args != self.args or kwargs != self.kwargs:
                return False
        except (ValueError, TypeError):  # an array compared elementwise with a kept value
            return False
        for i, kept, dtype in self.arrays:
            if args[i] is not kept or kept.dtype is not dtype or not kept.flags.writeable:
                return False
        return True

    def _matches_any(self, args, kwargs):
        """matches() for spec lists, buffer objects and arrays given by keyword."""
        mine = self.args  # the positional arguments, then the keyword ones' values
        if kwargs:
            if tuple(kwargs) != self.keys:
                return False
            args += tuple(kwargs.values())
        elif self.keys:
            return False
        if len(args) != len(mine):
            return False
        if all(map(operator.is_, self.given, args)):  # the same objects: lists unchanged?
            for given, kept in self.lists:
                if len(given) != len(kept) or not all(map(operator.is_, kept, given)):
                    return False
        elif not all(map(operator.is_, mine, args)):
            for kept, given in zip(mine, args):  # a spec list made anew: its items
                if kept is not given and (
                        type(kept) is not tuple or not isinstance(given, (list, tuple))
                        or len(given) != len(kept) or not all(map(operator.is_, kept, given))):
                    return False
        for a, dtype in self.layouts:
            if a.dtype is not dtype or not a.flags.writeable:
                return False
        return True


def _scalar(value):
    """Whether value is an argument compared by value, never a buffer: an int (root, count),
    an MPI handle (op, datatype), MPI.IN_PLACE or None."""
    return value is None or value is MPI.IN_PLACE or type(value) in (int, bool) or isinstance(
        value, (MPI.Op, MPI.Datatype))


def _items(arg):
    """arg, or the items of a buffer spec (a list or tuple)."""
    return arg if isinstance(arg, (list, tuple)) else (arg,)


def _owner(a):
    """The array whose memory a NumPy view ends in."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _check_op(op):
    """Raise _PassThrough for an MPI.Op ringcoll does not implement: user-defined ones, and
    every predefined one but SUM, PROD, MAX and MIN (MAXLOC/MINLOC, the logical and bitwise
    ops, REPLACE, NO_OP). Ops are the same on every rank (MPI requires it), so every rank
    passes alike."""
    if isinstance(op, MPI.Op) and not (op.is_predefined and op in _OWN_OPS):
        raise _PassThrough(op)
    return op


_OWN_OPS = (MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN)


def _numpy_dtype(datatype, arr):
    """The NumPy dtype of an MPI datatype (None: the buffer's own)."""
    if datatype is None:
        return arr.dtype
    if not datatype.is_predefined:
        raise _PassThrough(datatype)  # derived: packed for data movement, else mpi4py's
    dtype = np.dtype(dtlib.to_numpy_dtype(datatype))
    if dtype.kind == "U":  # MPI.WCHAR: one wchar_t
        dtype = np.dtype(f"<U{max(1, datatype.Get_size() // 4)}")
    if dtype.itemsize != datatype.Get_size() or datatype.Get_extent()[1] != dtype.itemsize:
        raise _PassThrough(datatype)  # a pair type with a gap (MPI.SHORT_INT...): mpi4py's
    return dtype


def _array(buf, name):
    """buf as a NumPy (or CuPy) array viewing the caller's memory, never a copy."""
    if isinstance(buf, np.ndarray) or is_device(buf):
        return buf
    if buf is None:  # mpi4py takes None as an empty buffer where a count of 0 is meant
        return np.empty(0, np.uint8)
    try:
        return np.asarray(memoryview(buf))
    except TypeError:
        pass
    if hasattr(buf, "__cuda_array_interface__"):
        return _from_cai(buf, name)
    if hasattr(buf, "__dlpack__"):
        return _from_dlpack(buf, name)
    raise InvalidTypeError(f"ringcoll.wrap: {name} must be a buffer (a NumPy array, "
                           f"array.array, bytearray, memoryview, ...), not "
                           f"{type(buf).__name__}")


def _pack_blocks(raw, datatype, counts, displs, comm, name):
    """Blocks of a derived datatype (counts[i] elements at displacement displs[i] extents)
    as bytes, back to back, and a function that writes such bytes back into the blocks.

    MPI_Pack lays the datatype's type map out contiguously: on one machine (homogeneous
    MPI) these are the very bytes the same values have in basic datatypes, which is what the
    other ranks send or expect, since MPI requires only the type signatures to match. So a
    derived datatype on some ranks and a basic one on the others run on ringcoll alike.
    raw: the caller's whole buffer as bytes."""
    size, extent = datatype.Get_size(), datatype.Get_extent()[1]
    if extent <= 0:
        raise _PassThrough(datatype)
    packed = np.empty(sum(counts) * size, np.uint8)
    spans, at = [], 0
    for c, d in zip(counts, displs):
        start, stop = d * extent, (d + c) * extent
        if stop > raw.size:
            raise InvalidArgumentError(f"ringcoll.wrap: {name} has {raw.size} bytes; {c} "
                                       f"elements of {datatype} at displacement {d} do not fit")
        if c:
            datatype.Pack(raw[start:stop], packed[at:at + c * size], 0, comm)
            spans.append((start, stop, at, c * size))
        at += c * size

    def unpack():
        for start, stop, at, n in spans:
            datatype.Unpack(packed[at:at + n], 0, raw[start:stop], comm)
    return packed, [c * size for c in counts], unpack


def _then(*steps):
    """One finishing step for a call: each of steps that is not None, in order."""
    steps = [f for f in steps if f is not None]
    if len(steps) < 2:
        return steps[0] if steps else None
    return lambda: [f() for f in steps] and None


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor)))]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                          ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DL_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}  # DLDataTypeCode -> NumPy kind


def _host_view(address, nbytes, dtype):
    """A NumPy view of nbytes at address (the caller keeps the memory alive for the call)."""
    memory = (ctypes.c_uint8 * nbytes).from_address(address) if nbytes else bytearray()
    return np.frombuffer(memory, dtype=np.uint8).view(dtype)


def _from_cai(buf, name):
    """A __cuda_array_interface__ object that is not a CuPy array. With CuPy imported it
    becomes one (cupy.asarray views it: the GPU path); without, its pointer is read as mpi4py
    hands it to MPI, as host memory (mpi4py's fake GPU test arrays; a real device pointer
    needs CuPy here, or a CUDA-aware MPI through mpi4py itself)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return cupy.asarray(buf)
    iface = buf.__cuda_array_interface__
    (address, readonly), shape = iface["data"], tuple(iface["shape"])
    dtype = np.dtype(iface["typestr"])
    count = int(np.prod(shape, dtype=np.int64))
    strides = iface.get("strides")
    if strides is not None and count > 1:
        contiguous = np.empty(shape, dtype).strides
        if tuple(s for s, n in zip(strides, shape) if n > 1) != tuple(
                s for s, n in zip(contiguous, shape) if n > 1):
            raise BufferError(f"ringcoll.wrap: {name} is not contiguous")
    view = _host_view(address or 0, count * dtype.itemsize, dtype)
    if readonly:
        view.flags.writeable = False
    return view


def _from_dlpack(buf, name):
    """A NumPy view of a CPU DLPack tensor, read as mpi4py reads one: the tensor's fields are
    taken and the producer's deleter called at once, so the view is valid while the caller
    holds buf (for the call), as with mpi4py. (np.from_dlpack would call the deleter when the
    view dies, which producers written for mpi4py do not expect.)"""
    device = buf.__dlpack_device__()
    if int(device[0]) != 1:  # kDLCPU
        raise InvalidTypeError(f"ringcoll.wrap: {name} is a DLPack tensor on device {device}; "
                               "ringcoll takes host tensors and CuPy arrays")
    capsule = buf.__dlpack__()
    managed = ctypes.cast(_capsule_pointer(capsule, b"dltensor"),
                          ctypes.POINTER(_DLManagedTensor))
    t = managed.contents.dl_tensor
    kind, bits, lanes = _DL_KINDS.get(t.dtype.code), t.dtype.bits, t.dtype.lanes
    if kind == "f" and lanes == 2:  # complex as two float lanes (the older DLPack spelling)
        kind, bits, lanes = "c", 2 * bits, 1
    if kind is None or lanes != 1:
        raise InvalidTypeError(f"ringcoll.wrap: {name} has DLPack type code {t.dtype.code} "
                               f"({bits} bits, {lanes} lanes); not supported")
    dtype = np.dtype(f"{kind}{bits // 8}")
    shape = [t.shape[i] for i in range(t.ndim)]
    count = int(np.prod(shape, dtype=np.int64))
    if t.strides and count > 1:
        expect, ok = 1, True
        for i in reversed(range(t.ndim)):  # C order, in elements
            ok = ok and (shape[i] == 1 or t.strides[i] == expect)
            expect *= shape[i]
        if not ok:
            raise BufferError(f"ringcoll.wrap: {name} is a non-contiguous DLPack tensor")
    view = _host_view((t.data or 0) + t.byte_offset, count * dtype.itemsize, dtype)
    if managed.contents.deleter:
        managed.contents.deleter(managed)
    _capsule_rename(capsule, b"used_dltensor")  # consumed: its destructor must not delete
    return view


def _elements(spec, name, blocks=1):
    """The elements a buffer spec names, as a 1-D view of the caller's memory in its dtype.

    blocks: for a buffer of one block per rank (Alltoall both sides, the gathered side of
    Allgather and Gather), a spec's count is per block, as in MPI (recvcount: per process)."""
    buf, count, displ, datatype = _spec(spec)
    datatype = _datatype(datatype)
    if (type(buf) is np.ndarray and buf.ndim == 1 and buf.flags.c_contiguous and count is None
            and not displ and (datatype is None or datatype.is_predefined
                               and np.dtype(dtlib.to_numpy_dtype(datatype)) == buf.dtype)):
        return buf  # the caller's own array: a repeated call replays (the hot path)
    arr = _array(buf, name)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise BufferError(f"ringcoll.wrap: {name} is not contiguous; pass a contiguous buffer "
                          "(np.ascontiguousarray(buf)) as mpi4py requires")
    flat = arr.reshape(-1, order="A")
    dtype = _numpy_dtype(datatype, arr)
    if dtype != flat.dtype:  # MPI reads the bytes as the datatype says
        raw = flat.view(np.uint8)
        if raw.size % dtype.itemsize:
            raise InvalidArgumentError(f"ringcoll.wrap: {name} has {raw.size} bytes, not a "
                                       f"whole number of {dtype} elements")
        flat = raw.view(dtype)
    if count is None:
        return flat[displ:] if displ else flat
    count *= blocks
    if displ < 0 or count < 0 or displ + count > flat.size:
        raise InvalidArgumentError(f"ringcoll.wrap: {name} has {flat.size} elements; "
                                   f"count {count} at displacement {displ} does not fit")
    return flat[displ:displ + count]


def _bytes(x):
    """x's bytes as uint8 (data movement needs no element type)."""
    return x.view(np.uint8)


def _writeable(x, name):
    if not writeable(x):
        raise InvalidArgumentError(f"ringcoll.wrap: {name} is read-only; pass a writeable "
                                   "buffer to receive into")
    return x


def _in_place(sendbuf):
    return sendbuf is MPI.IN_PLACE or sendbuf is None


_NOTHING = object()  # matches no argument


class Request:
    """A non-blocking collective of wrap(): mpi4py's Request methods over ringcoll's.

    Wait() (and wait(), test(), Test()) finish the call as mpi4py's do; once completed it is
    false and equals MPI.REQUEST_NULL, as mpi4py's requests. MPI.Request.Waitall and friends
    take MPI handles only and refuse this object (a TypeError, never a silent no-op): use
    Request.Waitall(requests) from here, or wait on each. A status passed to Wait is left as
    it is (MPI leaves a collective's status fields undefined).
    """

    def __init__(self, inner, finish=None):
        self._inner, self._finish, self._done = inner, finish, False

    def __bool__(self):  # as mpi4py's: a completed request is MPI.REQUEST_NULL, false
        return not self._done

    def __eq__(self, other):
        if isinstance(other, MPI.Request):  # REQUEST_NULL once completed, as in mpi4py
            return self._done and other == MPI.REQUEST_NULL
        return self is other

    __hash__ = object.__hash__

    def Wait(self, status=None):
        if not self._done:
            self._inner.wait()
            if self._finish is not None:
                self._finish()  # e.g. blocks moved to their displacements
            self._done = True
        return True

    def Test(self, status=None):
        if not (self._done or self._inner.test()):
            return False
        return self.Wait()

    def Get_status(self, status=None):
        return self._done or self._inner.test()

    def wait(self, status=None):
        self.Wait()

    def test(self, status=None):
        return self.Test(), None

    def Free(self):
        self.Wait()  # a collective cannot be abandoned half-way; MPI completes it too

    @staticmethod
    def Waitall(requests, statuses=None):
        for request in requests:
            request.Wait()
        return True

    @staticmethod
    def Testall(requests, statuses=None):
        return all([request.Test() for request in requests])  # a list: test every one


class MPICompat:
    """mpi4py's upper-case collective methods over a ringcoll Communicator.

    Each method reads mpi4py's arguments into a call of the Communicator's, then runs it
    (the blocking form) or starts its non-blocking twin (the I-form, which returns a
    Request) through _call; both forms share the reading, so they check and behave alike.
    """

    def __init__(self, mpi_comm, **options):
        self.mpi_comm = mpi_comm
        self.ringcoll = Communicator(mpi_comm, **options)
        self._options = options
        self._last_allreduce = (_NOTHING,) * 4  # (sendbuf, recvbuf, op, send view)
        self._remembered = {}  # blocking method name -> its last call (_Remembered)
        self._reading = None  # the Communicator call a method is reading its arguments into

    def __getattr__(self, name):  # everything we do not override is the mpi4py communicator's
        return getattr(self.mpi_comm, name)

    def _call(self, blocking, method, *args, finish=None, copy=None, remember=True,
              **kwargs):
        """Run Communicator.method(*args, **kwargs) (blocking), or start its I-form and
        return a Request. finish runs once the call is done. copy: (a copy the call sends,
        what it copies), MPI_IN_PLACE's own block, which a remembered call copies anew.
        remember=False: reading the arguments took a message (Reduce_scatter's counts), which
        a remembered call would skip while another rank reading anew would not."""
        comm = self.ringcoll
        if not blocking:
            return Request(getattr(comm, "i" + method)(*args, **kwargs), finish)
        core = getattr(comm, method)
        core(*args, **kwargs)
        if remember:  # for _passes_through to remember
            again = comm.again(method, functools.partial(core, *args, **kwargs))
            self._reading = (again, args, kwargs, finish, copy)
        if finish is not None:
            finish()
        return None

    # -- data-movement buffers: bytes, a derived datatype's packed -----------------------------
    def _moved(self, spec, name, blocks=1, write=False):
        """(a data-movement buffer as bytes, how to finish receiving into it or None). A basic
        datatype's bytes are the caller's memory itself; a derived one's are packed
        (_pack_blocks). write: the call receives into it, so the caller's buffer must be
        writeable, and a derived datatype's bytes are unpacked into it by the returned step."""
        try:
            flat = _bytes(_elements(spec, name, blocks))
            return (_writeable(flat, name) if write else flat), None
        except _PassThrough as exc:
            datatype = exc.args[0]
            if not isinstance(datatype, MPI.Datatype):
                raise
        buf, count, displ, _ = _spec(spec)
        raw = self._raw(buf, name, write)
        if count is None:  # as mpi4py: the whole buffer, in extents
            count = (raw.size // max(1, datatype.Get_extent()[1]) - displ) // blocks
        packed, _, unpack = _pack_blocks(raw, datatype, [count * blocks], [displ],
                                         self.mpi_comm, name)
        return packed, unpack if write else None

    def _moved_vector(self, spec, p, name, write=False):
        """_byte_vector, as _moved does it: (bytes, counts, displs, finish or None)."""
        try:
            flat, counts, displs = _byte_vector(spec, p, name)
            return (_writeable(flat, name) if write else flat), counts, displs, None
        except _PassThrough as exc:
            datatype = exc.args[0]
            if not isinstance(datatype, MPI.Datatype):
                raise
        buf, counts, displs, _ = _vector_fields(spec)
        raw = self._raw(buf, name, write)
        whole = raw.size // max(1, datatype.Get_extent()[1])
        counts, displs = _counts_displs(counts, displs, whole, p, name)
        packed, counts, unpack = _pack_blocks(raw, datatype, counts, displs, self.mpi_comm,
                                              name)
        return packed, counts, _back_to_back(counts), unpack if write else None

    @staticmethod
    def _raw(buf, name, write):
        """The caller's whole buffer as bytes (a derived datatype's blocks live in it)."""
        raw = _bytes(_array(buf, name).reshape(-1, order="A"))
        return _writeable(raw, name) if write else raw

    def _receiving(self, spec, p, vector, method, name="recvbuf", write=True):
        """The one-block-per-rank side of a gather, scatter or all-gather: (bytes, counts,
        displs, finish) in bytes, from a v-spec or from p equal blocks."""
        if vector:
            return self._moved_vector(spec, p, name, write)
        flat, unpack = self._moved(spec, name, p, write)
        if flat.size % p:
            raise InvalidArgumentError(f"ringcoll.wrap {method}: {name} has {flat.size} "
                                       f"bytes, not a multiple of the size {p}")
        return flat, [flat.size // p] * p, [r * flat.size // p for r in range(p)], unpack

    # -- reductions -------------------------------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        last = self._last_allreduce  # the same buffers and op as last time: no parsing, and
        if (last[0] is sendbuf and last[1] is recvbuf and last[2] is op  # the core replays
                and recvbuf.flags.writeable):  # (and notices a reshape itself)
            self.ringcoll.allreduce(last[3], op=op, out=recvbuf)
            return
        self._first_allreduce(sendbuf, recvbuf, op)

    @_passes_through("Allreduce")
    def _first_allreduce(self, sendbuf, recvbuf, op):
        self._allreduce(True, sendbuf, recvbuf, op)

    @_passes_through("Iallreduce")
    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._allreduce(False, sendbuf, recvbuf, op)

    def _allreduce(self, blocking, sendbuf, recvbuf, op):
        _check_op(op)
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf")
        send = recv if _in_place(sendbuf) else _elements(sendbuf, "sendbuf")
        if blocking and recv is recvbuf and (send is sendbuf or sendbuf is MPI.IN_PLACE):
            self._last_allreduce = (sendbuf, recvbuf, op, send)  # plain arrays: remembered
        return self._call(blocking, "allreduce", send, op=op, out=recv)

    def _reduce(self, blocking, sendbuf, recvbuf, op, root):
        _check_op(op)
        is_root = self.ringcoll.rank == root
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf") if is_root else None
        send = recv if is_root and _in_place(sendbuf) else _elements(sendbuf, "sendbuf")
        return self._call(blocking, "reduce", send, op=op, root=root, out=recv)

    @_passes_through("Reduce")
    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        return self._reduce(True, sendbuf, recvbuf, op, root)

    @_passes_through("Ireduce")
    def Ireduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        return self._reduce(False, sendbuf, recvbuf, op, root)

    def _reduce_scatter_block(self, blocking, sendbuf, recvbuf, op):
        _check_op(op)
        p = self.ringcoll.size
        in_place = _in_place(sendbuf)
        # a count is per block, as MPI's recvcount; in place recvbuf holds all p blocks
        recv = _writeable(_elements(recvbuf, "recvbuf", p if in_place else 1), "recvbuf")
        copy = None
        if in_place:  # the result is block 0
            whole = recv
            send, recv = whole.copy(), whole[:whole.size // p]
            copy = (send, whole)
        else:
            send = _elements(sendbuf, "sendbuf", p)
        if send.size != p * recv.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Reduce_scatter_block: sendbuf has {send.size} elements; it "
                f"must have size * len(recvbuf) = {p * recv.size}")
        return self._call(blocking, "reduce_scatter", send.reshape(p, -1), op=op,
                          out=recv.reshape(1, -1), copy=copy)

    @_passes_through("Reduce_scatter_block")
    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduce_scatter_block(True, sendbuf, recvbuf, op)

    @_passes_through("Ireduce_scatter_block")
    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduce_scatter_block(False, sendbuf, recvbuf, op)

    def _reduce_scatter(self, blocking, sendbuf, recvbuf, recvcounts, op):
        _check_op(op)
        comm = self.ringcoll
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf")
        in_place = _in_place(sendbuf)
        recvcounts_given = recvcounts is not None
        if recvcounts is None:
            if in_place:
                raise InvalidArgumentError("ringcoll.wrap Reduce_scatter: in place needs "
                                           "recvcounts (recvbuf holds every rank's block)")
            # as mpi4py: every rank's receive count is its recvbuf's size (a blocking
            # all-gather, also for Ireduce_scatter)
            recvcounts = comm.allgather(np.array([recv.size], dtype=np.int64))
        counts = [int(c) for c in recvcounts]
        if len(counts) != comm.size:
            raise InvalidArgumentError(f"ringcoll.wrap Reduce_scatter: {len(counts)} "
                                       f"recvcounts; pass one per rank ({comm.size})")
        total = sum(counts)
        if in_place:  # recvbuf holds all the blocks; the result is its start
            if recv.size != total:
                raise InvalidArgumentError(
                    f"ringcoll.wrap Reduce_scatter: recvbuf has {recv.size} elements; in "
                    f"place it must hold sum(recvcounts) = {total}")
            send, recv = recv.copy(), recv[:counts[comm.rank]]
        else:
            send = _elements(sendbuf, "sendbuf")
            if send.size != total or recv.size != counts[comm.rank]:
                raise InvalidArgumentError(
                    f"ringcoll.wrap Reduce_scatter: sendbuf has {send.size} elements and "
                    f"recvbuf {recv.size}; they must have sum(recvcounts) = {total} and "
                    f"recvcounts[{comm.rank}] = {counts[comm.rank]}")
        return self._call(blocking, "reduce_scatter", send, op=op, out=recv, counts=counts,
                          remember=recvcounts_given)

    @_passes_through("Reduce_scatter")
    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        return self._reduce_scatter(True, sendbuf, recvbuf, recvcounts, op)

    @_passes_through("Ireduce_scatter")
    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        return self._reduce_scatter(False, sendbuf, recvbuf, recvcounts, op)

    def _scan(self, blocking, method, sendbuf, recvbuf, op):
        _check_op(op)
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf")
        send = recv if _in_place(sendbuf) else _elements(sendbuf, "sendbuf")
        return self._call(blocking, method, send, op=op, out=recv)

    @_passes_through("Scan")
    def Scan(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._scan(True, "scan", sendbuf, recvbuf, op)

    @_passes_through("Iscan")
    def Iscan(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._scan(False, "scan", sendbuf, recvbuf, op)

    @_passes_through("Exscan")
    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._scan(True, "exscan", sendbuf, recvbuf, op)

    @_passes_through("Iexscan")
    def Iexscan(self, sendbuf, recvbuf, op=MPI.SUM):
        return self._scan(False, "exscan", sendbuf, recvbuf, op)

    # -- data movement: bytes as they are -----------------------------------------------------
    def _bcast(self, blocking, buf, root):
        x, unpack = self._moved(buf, "buf", write=self.ringcoll.rank != root)  # root only reads
        return self._call(blocking, "broadcast", x, root=root, finish=unpack)

    @_passes_through("Bcast")
    def Bcast(self, buf, root=0):
        return self._bcast(True, buf, root)

    @_passes_through("Ibcast")
    def Ibcast(self, buf, root=0):
        return self._bcast(False, buf, root)

    def _gather(self, blocking, sendbuf, recvbuf, root, vector):
        p, rank = self.ringcoll.size, self.ringcoll.rank
        recv = counts = place = None
        if rank == root:  # recvbuf matters on root only, as in MPI
            flat, counts, displs, unpack = self._receiving(recvbuf, p, vector, "Gather")
            recv, place = _unpacked(flat, counts, displs)
            place = _then(place, unpack)
        copy = None
        if rank == root and _in_place(sendbuf):  # root's block is in place in recvbuf
            own = flat[displs[root]:displs[root] + counts[root]]
            if place is None:  # the core writes flat itself: x is its block there (MPI's
                send = own     # call gets MPI_IN_PLACE, the tree leaves it where it is)
            else:
                send = own.copy()
                copy = (send, own)
        else:
            send = self._moved(sendbuf, "sendbuf")[0]
        if not vector and rank != root:  # MPI_Gather: every block is the size of this one's
            counts = [send.size] * p
        # declared (the count exchange once per distinct call): MPI_Gather's counts are
        # known on every rank; MPI_Gatherv's only on root
        return self._call(blocking, "gather", send, root=root, out=recv, counts=counts,
                          finish=place, copy=copy, declared=not vector)

    @_passes_through("Gather")
    def Gather(self, sendbuf, recvbuf, root=0):
        return self._gather(True, sendbuf, recvbuf, root, False)

    @_passes_through("Igather")
    def Igather(self, sendbuf, recvbuf, root=0):
        return self._gather(False, sendbuf, recvbuf, root, False)

    @_passes_through("Gatherv")
    def Gatherv(self, sendbuf, recvbuf, root=0):
        return self._gather(True, sendbuf, recvbuf, root, True)

    @_passes_through("Igatherv")
    def Igatherv(self, sendbuf, recvbuf, root=0):
        return self._gather(False, sendbuf, recvbuf, root, True)

    def _scatter(self, blocking, sendbuf, recvbuf, root, vector):
        p, rank = self.ringcoll.size, self.ringcoll.rank
        send = counts = unpack = None
        if rank == root:  # sendbuf matters on root only, as in MPI
            flat, counts, displs, _ = self._receiving(sendbuf, p, vector, "Scatter", "sendbuf",
                                                      write=False)
            send = _packed(flat, counts, displs)
        if rank == root and _in_place(recvbuf):  # root's block stays where it is in sendbuf
            start = sum(counts[:root])
            recv = send[start:start + counts[root]]  # (a no-op copy, or into a packed copy)
            if not writeable(recv):  # a bytes sendbuf: nothing to write there
                recv = array_module(send).empty(counts[root], np.uint8)
        else:
            recv, unpack = self._moved(recvbuf, "recvbuf", write=True)
        if not vector and rank != root:  # MPI_Scatter: every block is the size of this one's
            counts = [recv.size] * p
        # declared (the agreement once per distinct call): MPI_Scatter's counts are known on
        # every rank; MPI_Scatterv's only on root
        return self._call(blocking, "scatter", send, root=root, counts=counts, out=recv,
                          finish=unpack, declared=not vector)

    @_passes_through("Scatter")
    def Scatter(self, sendbuf, recvbuf, root=0):
        return self._scatter(True, sendbuf, recvbuf, root, False)

    @_passes_through("Iscatter")
    def Iscatter(self, sendbuf, recvbuf, root=0):
        return self._scatter(False, sendbuf, recvbuf, root, False)

    @_passes_through("Scatterv")
    def Scatterv(self, sendbuf, recvbuf, root=0):
        return self._scatter(True, sendbuf, recvbuf, root, True)

    @_passes_through("Iscatterv")
    def Iscatterv(self, sendbuf, recvbuf, root=0):
        return self._scatter(False, sendbuf, recvbuf, root, True)

    def _allgather(self, blocking, sendbuf, recvbuf, vector):
        p, rank = self.ringcoll.size, self.ringcoll.rank
        flat, counts, displs, unpack = self._receiving(recvbuf, p, vector, "Allgather")
        recv, place = _unpacked(flat, counts, displs)
        copy = None
        if _in_place(sendbuf):  # this rank's block is already in place in recvbuf
            own = flat[displs[rank]:displs[rank] + counts[rank]]
            if place is None:  # the core writes flat itself: x is its block there (the
                send = own     # core passes MPI_IN_PLACE on, or copies where it must)
            else:
                send = own.copy()
                copy = (send, own)
        else:
            send = self._moved(sendbuf, "sendbuf")[0]
        # declared (the count exchange once per distinct call): MPI gives every rank the
        # counts of MPI_Allgather and MPI_Allgatherv alike
        return self._call(blocking, "allgather", send, out=recv, counts=counts,
                          finish=_then(place, unpack), copy=copy, declared=True)

    @_passes_through("Allgather")
    def Allgather(self, sendbuf, recvbuf):
        return self._allgather(True, sendbuf, recvbuf, False)

    @_passes_through("Iallgather")
    def Iallgather(self, sendbuf, recvbuf):
        return self._allgather(False, sendbuf, recvbuf, False)

    @_passes_through("Allgatherv")
    def Allgatherv(self, sendbuf, recvbuf):
        return self._allgather(True, sendbuf, recvbuf, True)

    @_passes_through("Iallgatherv")
    def Iallgatherv(self, sendbuf, recvbuf):
        return self._allgather(False, sendbuf, recvbuf, True)

    def _alltoall(self, blocking, sendbuf, recvbuf):
        p = self.ringcoll.size
        recv, unpack = self._moved(recvbuf, "recvbuf", p, write=True)
        send = recv.copy() if _in_place(sendbuf) else self._moved(sendbuf, "sendbuf", p)[0]
        if send.size % p or recv.size != send.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Alltoall: sendbuf has {send.size} bytes and recvbuf "
                f"{recv.size}; both must hold size ({p}) equal blocks of the same size")
        return self._call(blocking, "alltoall", send.reshape(p, -1), out=recv.reshape(p, -1),
                          finish=unpack)

    @_passes_through("Alltoall")
    def Alltoall(self, sendbuf, recvbuf):
        return self._alltoall(True, sendbuf, recvbuf)

    @_passes_through("Ialltoall")
    def Ialltoall(self, sendbuf, recvbuf):
        return self._alltoall(False, sendbuf, recvbuf)

    def _alltoallv(self, blocking, sendbuf, recvbuf):
        p = self.ringcoll.size
        flat, rcounts, rdispls, unpack = self._moved_vector(recvbuf, p, "recvbuf", write=True)
        if _in_place(sendbuf):  # MPI: the data to send is in recvbuf, laid out as received
            send, scounts = _packed(flat, rcounts, rdispls).copy(), rcounts
        else:
            sflat, scounts, sdispls, _ = self._moved_vector(sendbuf, p, "sendbuf")
            send = _packed(sflat, scounts, sdispls)
        recv, place = _unpacked(flat, rcounts, rdispls)
        # declared (the count exchange once per distinct call): MPI_Alltoallv's send and
        # receive counts are known on every rank
        return self._call(blocking, "alltoallv", send, scounts, out=recv, recv_counts=rcounts,
                          finish=_then(place, unpack), declared=True)

    @_passes_through("Alltoallv")
    def Alltoallv(self, sendbuf, recvbuf):
        return self._alltoallv(True, sendbuf, recvbuf)

    @_passes_through("Ialltoallv")
    def Ialltoallv(self, sendbuf, recvbuf):
        return self._alltoallv(False, sendbuf, recvbuf)

    # -- new communicators are wrapped too: code that splits or dups keeps running ringcoll --
    def _wrapped(self, comm):
        return comm if comm == MPI.COMM_NULL else MPICompat(comm, **self._options)

    def Dup(self, *args, **kwargs):
        return self._wrapped(self.mpi_comm.Dup(*args, **kwargs))

    def Dup_with_info(self, info):
        return self._wrapped(self.mpi_comm.Dup_with_info(info))

    def Clone(self):
        return self._wrapped(self.mpi_comm.Clone())

    def Create_cart(self, *args, **kwargs):  # a Cartcomm: its own methods via __getattr__
        return self._wrapped(self.mpi_comm.Create_cart(*args, **kwargs))

    def Split(self, color=0, key=0):
        return self._wrapped(self.mpi_comm.Split(color, key))

    def Split_type(self, *args, **kwargs):
        return self._wrapped(self.mpi_comm.Split_type(*args, **kwargs))

    def Create(self, group):
        return self._wrapped(self.mpi_comm.Create(group))

    def Create_group(self, group, tag=0):
        return self._wrapped(self.mpi_comm.Create_group(group, tag))

    # -- synchronisation and lifetime -------------------------------------------------------
    def Barrier(self):
        self.ringcoll.barrier()

    def Ibarrier(self):
        return Request(self.ringcoll.ibarrier())

    def Free(self):
        """Close the ringcoll communicator and free the wrapped one, as mpi4py's Free does
        (a wrapped COMM_WORLD or COMM_SELF, which MPI cannot free, stays usable)."""
        self.ringcoll.close()
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi_comm.Free()
