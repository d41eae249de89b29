"""wrap(mpi_comm): mpi4py's upper-case collectives, run by ringcoll.

    from mpi4py import MPI
    import ringcoll
    comm = ringcoll.wrap(MPI.COMM_WORLD)       # the one line that changes
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
    comm.Get_rank(), comm.Split(...)           # everything else is the mpi4py communicator

Each method is a thin adapter that turns mpi4py's arguments (buffer specs, MPI.IN_PLACE,
MPI.Op) into a call of the Communicator's public methods; there is no second implementation
here.

Buffers are taken as mpi4py takes them: anything with the buffer protocol (NumPy arrays,
array.array, bytearray, memoryview; read-only ones where only read), DLPack objects on the CPU,
and CuPy arrays (which stay on their GPU), alone or in a spec: [buf, datatype],
[buf, count, datatype], [buf, (count, displ), datatype] (the datatype may be left out; it is
then the buffer's own). The caller's memory is always viewed, never copied, so results land
where mpi4py would put them. Data movement (Bcast, Gather, Allgather, Alltoall) sends the
bytes as they are, so any datatype works; reductions need a numeric one.
"""

import ctypes
import functools
import sys

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from .arrays import is_device
from .communicator import Communicator
from .errors import InvalidArgumentError, InvalidTypeError


def wrap(mpi_comm=None, **options):
    """An mpi4py-compatible communicator whose collectives are ringcoll's."""
    return MPICompat(MPI.COMM_WORLD if mpi_comm is None else mpi_comm, **options)


def _spec(spec):
    """(buffer, count or None, displacement, MPI datatype or None) of an mpi4py buffer spec."""
    if not isinstance(spec, (list, tuple)):
        return spec, None, 0, None
    if not spec:
        raise InvalidArgumentError("ringcoll.wrap: an empty buffer spec; pass buf or "
                                   "[buf, count, datatype]")
    buf, *rest = spec
    datatype = rest.pop() if rest and isinstance(rest[-1], MPI.Datatype) else None
    count, displ = None, 0
    if len(rest) == 1:
        count = rest[0]
        if isinstance(count, (list, tuple)):
            count, displ = count
    elif rest:
        raise InvalidArgumentError(f"ringcoll.wrap: buffer spec {spec!r} has counts and "
                                   "displacements; those are for the v-variants")
    return buf, count, displ, datatype


class _PassThrough(Exception):
    """What ringcoll cannot do itself (a derived datatype, a user-defined or MAXLOC/MINLOC
    op): found while reading the arguments, before anything is sent, so the call goes to
    the wrapped mpi4py communicator instead, on every rank alike (the same datatypes and ops
    on every rank, as MPI requires)."""


def _passes_through(name):
    """A method that, where ringcoll cannot do the call, gives it to the wrapped mpi4py
    communicator's method `name` instead."""
    def decorate(method):
        @functools.wraps(method)
        def adapter(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except _PassThrough:
                return getattr(self.mpi_comm, name)(*args, **kwargs)
        return adapter
    return decorate


def _check_op(op):
    """Raise _PassThrough for an op ringcoll does not implement (user-defined, MAXLOC...)."""
    if isinstance(op, MPI.Op) and (not op.is_predefined or op in (MPI.MAXLOC, MPI.MINLOC,
                                                                    MPI.REPLACE, MPI.NO_OP)):
        raise _PassThrough(op)
    return op


def _numpy_dtype(datatype, arr):
    """The NumPy dtype of an MPI datatype (None: the buffer's own)."""
    if datatype is None:
        return arr.dtype
    if not datatype.is_predefined:
        raise _PassThrough(datatype)  # derived datatypes: mpi4py runs the call
    dtype = np.dtype(dtlib.to_numpy_dtype(datatype))
    if dtype.kind == "U":  # MPI.WCHAR: one wchar_t
        dtype = np.dtype(f"<U{max(1, datatype.Get_size() // 4)}")
    if dtype.itemsize != datatype.Get_size():
        raise InvalidTypeError(f"ringcoll.wrap: no NumPy dtype has the size of "
                               f"{datatype.Get_name()}; call the mpi4py communicator for it")
    return dtype


def _array(buf, name):
    """buf as a NumPy (or CuPy) array viewing the caller's memory, never a copy."""
    if isinstance(buf, np.ndarray) or is_device(buf):
        return buf
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
    if not getattr(x.flags, "writeable", True):
        raise InvalidArgumentError(f"ringcoll.wrap: {name} is read-only; pass a writeable "
                                   "buffer to receive into")
    return x


def _in_place(sendbuf):
    return sendbuf is MPI.IN_PLACE or sendbuf is None


_NOTHING = object()  # matches no argument


class MPICompat:
    """mpi4py's upper-case collective methods over a ringcoll Communicator."""

    def __init__(self, mpi_comm, **options):
        self.mpi_comm = mpi_comm
        self.ringcoll = Communicator(mpi_comm, **options)
        self._last_allreduce = (_NOTHING,) * 4  # (sendbuf, recvbuf, op, send view)

    def __getattr__(self, name):  # everything we do not override is the mpi4py communicator's
        return getattr(self.mpi_comm, name)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        last = self._last_allreduce  # the same buffers and op as last time: no parsing, and
        if last[0] is sendbuf and last[1] is recvbuf and last[2] is op:  # the core replays
            self.ringcoll.allreduce(last[3], op=op, out=recvbuf)
            return
        self._allreduce(sendbuf, recvbuf, op)

    @_passes_through("Allreduce")
    def _allreduce(self, sendbuf, recvbuf, op):
        _check_op(op)
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf")
        send = recv if sendbuf is MPI.IN_PLACE else _elements(sendbuf, "sendbuf")
        self.ringcoll.allreduce(send, op=op, out=recv)
        if recv is recvbuf and (send is sendbuf or sendbuf is MPI.IN_PLACE):
            self._last_allreduce = (sendbuf, recvbuf, op, send)  # plain arrays: remembered

    @_passes_through("Reduce_scatter_block")
    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        _check_op(op)
        p = self.ringcoll.size
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf")
        if sendbuf is MPI.IN_PLACE:  # MPI: recvbuf holds all p blocks; the result is block 0
            send, recv = recv.copy(), recv[:recv.size // p]
        else:
            send = _elements(sendbuf, "sendbuf")
        if send.size != p * recv.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Reduce_scatter_block: sendbuf has {send.size} elements; it "
                f"must have size * len(recvbuf) = {p * recv.size}")
        self.ringcoll.reduce_scatter(send.reshape(p, -1), op=op, out=recv.reshape(1, -1))

    @_passes_through("Allgather")
    def Allgather(self, sendbuf, recvbuf):
        p = self.ringcoll.size
        recv = _bytes(_writeable(_elements(recvbuf, "recvbuf", p), "recvbuf"))
        if _in_place(sendbuf):  # this rank's block is already in place in recvbuf
            send = recv.reshape(p, -1)[self.ringcoll.rank].copy()
        else:
            send = _bytes(_elements(sendbuf, "sendbuf"))
        if recv.size != p * send.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Allgather: recvbuf has {recv.size} bytes; it must have "
                f"size * the bytes of sendbuf = {p * send.size}")
        self.ringcoll.allgather(send.reshape(1, -1), out=recv.reshape(p, -1))

    @_passes_through("Gather")
    def Gather(self, sendbuf, recvbuf, root=0):
        p, rank = self.ringcoll.size, self.ringcoll.rank
        recv = None
        if rank == root:  # recvbuf matters on root only, as in MPI
            recv = _bytes(_writeable(_elements(recvbuf, "recvbuf", p), "recvbuf"))
        if rank == root and _in_place(sendbuf):
            send = recv.reshape(p, -1)[root].copy()
        else:
            send = _bytes(_elements(sendbuf, "sendbuf"))
        if recv is not None and recv.size != p * send.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Gather: recvbuf has {recv.size} bytes; it must have "
                f"size * the bytes of sendbuf = {p * send.size}")
        self.ringcoll.gather(send.reshape(1, -1), root=root,
                             out=None if recv is None else recv.reshape(p, -1))

    @_passes_through("Bcast")
    def Bcast(self, buf, root=0):
        x = _bytes(_elements(buf, "buf"))
        if self.ringcoll.rank != root:
            _writeable(x, "buf")
        self.ringcoll.broadcast(x, root=root)

    @_passes_through("Reduce")
    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        _check_op(op)
        is_root = self.ringcoll.rank == root
        recv = _writeable(_elements(recvbuf, "recvbuf"), "recvbuf") if is_root else None
        send = recv if sendbuf is MPI.IN_PLACE else _elements(sendbuf, "sendbuf")
        self.ringcoll.reduce(send, op=op, root=root, out=recv)

    @_passes_through("Alltoall")
    def Alltoall(self, sendbuf, recvbuf):
        p = self.ringcoll.size
        recv = _bytes(_writeable(_elements(recvbuf, "recvbuf", p), "recvbuf"))
        send = recv.copy() if _in_place(sendbuf) else _bytes(_elements(sendbuf, "sendbuf", p))
        self.ringcoll.alltoall(send.reshape(p, -1), out=recv.reshape(p, -1))

    def Barrier(self):
        self.ringcoll.barrier()

    def Free(self):
        """Close the ringcoll communicator and free the wrapped one, as mpi4py's Free does
        (a wrapped COMM_WORLD or COMM_SELF, which MPI cannot free, stays usable)."""
        self.ringcoll.close()
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi_comm.Free()
