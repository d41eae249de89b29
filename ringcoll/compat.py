"""wrap(mpi_comm): mpi4py's upper-case collectives, run by ringcoll.

    from mpi4py import MPI
    import ringcoll
    comm = ringcoll.wrap(MPI.COMM_WORLD)       # the one line that changes
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
    comm.Get_rank(), comm.Split(...)           # everything else is the mpi4py communicator

Each method is a thin adapter that turns mpi4py's arguments (buffers, [buffer, MPI type] lists,
MPI.IN_PLACE, MPI.Op) into a call of the Communicator's method; there is no second
implementation here. Buffers are NumPy arrays (or anything np.asarray views without copying),
or CuPy arrays (which stay on their GPU).
"""

import numpy as np
from mpi4py import MPI

from .arrays import is_device
from .communicator import Communicator
from .errors import InvalidArgumentError, InvalidTypeError


def wrap(mpi_comm=None, **options):
    """An mpi4py-compatible communicator whose collectives are ringcoll's."""
    return MPICompat(MPI.COMM_WORLD if mpi_comm is None else mpi_comm, **options)


def _buffer(spec, name):
    """The array inside an mpi4py buffer spec: arr, [arr, MPI.TYPE] or [arr, count, MPI.TYPE]."""
    if isinstance(spec, (list, tuple)):
        spec = spec[0]
    if is_device(spec):
        return spec
    arr = np.asarray(spec)
    if arr.dtype == object:
        raise InvalidTypeError(f"ringcoll.wrap: {name} must be a buffer (a NumPy array), "
                               f"not {type(spec)}")
    return arr


def _flat(arr):
    """A 1-D view of a contiguous buffer (mpi4py treats buffers as flat memory).

    A non-contiguous array is refused, as mpi4py refuses it: a flat copy would take the
    result and leave the caller's array unchanged.
    """
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise BufferError("ringcoll.wrap: buffer is not contiguous; pass a contiguous array "
                          "(np.ascontiguousarray(buf)) as mpi4py requires")
    return arr.reshape(-1, order="A")


class MPICompat:
    """mpi4py's upper-case collective methods over a ringcoll Communicator."""

    def __init__(self, mpi_comm, **options):
        self.mpi_comm = mpi_comm
        self.ringcoll = Communicator(mpi_comm, **options)

    def __getattr__(self, name):  # everything we do not override is the mpi4py communicator's
        return getattr(self.mpi_comm, name)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        recv = _flat(_buffer(recvbuf, "recvbuf"))
        send = recv if sendbuf is MPI.IN_PLACE else _flat(_buffer(sendbuf, "sendbuf"))
        self.ringcoll.allreduce(send, op=op, out=recv)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        p = self.ringcoll.size
        recv = _flat(_buffer(recvbuf, "recvbuf"))
        if sendbuf is MPI.IN_PLACE:  # MPI: recvbuf holds all p blocks; the result is block 0
            send, recv = recv.copy(), recv[:recv.size // p]
        else:
            send = _flat(_buffer(sendbuf, "sendbuf"))
        if send.size != p * recv.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Reduce_scatter_block: sendbuf has {send.size} elements; it "
                f"must have size * len(recvbuf) = {p * recv.size}")
        self.ringcoll.reduce_scatter(send.reshape(p, -1), op=op, out=recv.reshape(1, -1))

    def Allgather(self, sendbuf, recvbuf):
        p = self.ringcoll.size
        recv = _flat(_buffer(recvbuf, "recvbuf"))
        if sendbuf is MPI.IN_PLACE:
            send = recv.reshape(p, -1)[self.ringcoll.rank].copy()
        else:
            send = _flat(_buffer(sendbuf, "sendbuf"))
        if recv.size != p * send.size:
            raise InvalidArgumentError(
                f"ringcoll.wrap Allgather: recvbuf has {recv.size} elements; it must have "
                f"size * len(sendbuf) = {p * send.size}")
        self.ringcoll.allgather(send.reshape(1, -1), out=recv.reshape(p, -1))

    def Bcast(self, buf, root=0):
        self.ringcoll.broadcast(_flat(_buffer(buf, "buf")), root=root)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        is_root = self.ringcoll.rank == root
        recv = _flat(_buffer(recvbuf, "recvbuf")) if is_root else None
        send = recv if sendbuf is MPI.IN_PLACE else _flat(_buffer(sendbuf, "sendbuf"))
        self.ringcoll.reduce(send, op=op, root=root, out=recv)

    def Alltoall(self, sendbuf, recvbuf):
        p = self.ringcoll.size
        recv = _flat(_buffer(recvbuf, "recvbuf"))
        send = recv.copy() if sendbuf is MPI.IN_PLACE else _flat(_buffer(sendbuf, "sendbuf"))
        self.ringcoll.alltoall(send.reshape(p, -1), out=recv.reshape(p, -1))

    def Barrier(self):
        self.ringcoll.barrier()

    def Free(self):
        self.ringcoll.close()
