"""MPI transport: mpi4py's buffer API (upper-case methods) on a duplicated communicator.

Every message is sent as raw bytes ([buf, MPI.BYTE]) so any dtype travels, including those MPI
has no datatype for (float16, bfloat16). The communicator is the user's duplicated once, so
ringcoll traffic has its own context and can never match a message of the user's.
This is the only module of ringcoll's lower layers that imports mpi4py.
"""

from functools import partial

from mpi4py import MPI

from .base import Transport


class MPITransport(Transport):
    def __init__(self, comm, *, dup=True):
        self.comm = comm.Dup() if dup else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    # point-to-point -------------------------------------------------------------------------
    def isend(self, buf, peer, tag):
        return self.comm.Isend([buf, MPI.BYTE], peer, tag)

    def irecv(self, buf, peer, tag):
        return self.comm.Irecv([buf, MPI.BYTE], peer, tag)

    def send(self, buf, peer, tag):
        self.comm.Send([buf, MPI.BYTE], peer, tag)

    def recv(self, buf, peer, tag):
        self.comm.Recv([buf, MPI.BYTE], peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self.comm.Sendrecv([sendbuf, MPI.BYTE], dest, tag, [recvbuf, MPI.BYTE], source, tag)

    # bound forms: mpi4py's methods themselves with the arguments fixed, so a replayed step
    # is one C call (the [buf, MPI.BYTE] message is still parsed per call: it is cheap).
    def bind_send(self, buf, peer, tag):
        return partial(self.comm.Send, [buf, MPI.BYTE], peer, tag)

    def bind_recv(self, buf, peer, tag):
        return partial(self.comm.Recv, [buf, MPI.BYTE], peer, tag)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        return partial(self.comm.Sendrecv, [sendbuf, MPI.BYTE], dest, tag,
                       [recvbuf, MPI.BYTE], source, tag)

    def bind_native_allreduce(self, sendbuf, recvbuf, op_name):
        return partial(self.comm.Allreduce, _in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name])

    def wait(self, req):
        req.Wait()

    def waitall(self, reqs):
        MPI.Request.Waitall(reqs)

    def test(self, req):
        return req.Test()

    # groups ---------------------------------------------------------------------------------
    def split(self, color, key):
        """A transport over the ranks with the same color (None: this rank takes no part)."""
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MPITransport(sub, dup=False)

    def node_ids(self):
        """For every rank, an id shared by exactly the ranks on the same shared-memory node."""
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            leader = local.bcast(self.rank, root=0)
        finally:
            local.Free()
        return self.comm.allgather(leader)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def close(self):
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    # the MPI library's own collectives, for the 'native' algorithm -------------------------
    def native_allreduce(self, sendbuf, recvbuf, op_name):
        self.bind_native_allreduce(sendbuf, recvbuf, op_name)()

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op_name):
        self.comm.Reduce_scatter(sendbuf, recvbuf, counts, _OPS[op_name])

    def native_allgather(self, sendbuf, recvbuf, counts):
        if all(c == counts[0] for c in counts):  # MPICH's Allgatherv is far slower here
            self.comm.Allgather(sendbuf, recvbuf)
        else:
            self.comm.Allgatherv(sendbuf, [recvbuf, counts])

    def native_bcast(self, buf, root):
        self.comm.Bcast(buf, root)

    def native_reduce(self, sendbuf, recvbuf, root, op_name):
        """recvbuf is None except on root; sendbuf is recvbuf for an in-place reduce."""
        self.comm.Reduce(_in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name], root)

    def native_alltoall(self, sendbuf, recvbuf):
        self.comm.Alltoall(sendbuf, recvbuf)

    def native_barrier(self):
        self.comm.Barrier()


_OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "MIN": MPI.MIN}


def _in_place(sendbuf, recvbuf):
    return MPI.IN_PLACE if sendbuf is recvbuf else sendbuf
