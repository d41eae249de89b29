"""MPI transport: mpi4py's buffer API (upper-case methods) on a duplicated communicator.

Every message is sent as raw bytes ([buf, MPI.BYTE]) so any dtype travels, including those MPI
has no datatype for (float16, bfloat16). The communicator is the user's duplicated once, so
ringcoll traffic has its own context and can never match a message of the user's.
This is the only module of ringcoll's lower layers that imports mpi4py.

Failure handling. MPI cannot interrupt a rank blocked in a receive, so:
- every blocking receive checks the size of what arrived (MPI itself rejects a longer message
  than the buffer, ERR_TRUNCATE; a shorter one is caught from the status);
- a collective that fails part-way calls fail(): it prints the error and aborts the job
  (MPI_Abort, exit code ringcoll.errors.ABORT_CODE), because its peers may wait forever;
- a watchdog thread aborts the job when one collective has made no progress for `timeout`
  seconds, naming the collective, its sequence number, the step and the peer waited for.
  It costs nothing on the hot path: the communicator and the transport only write a few
  attributes of a Progress record, which the watchdog reads every timeout / 20 s (at most 1 s).
"""

import os
import sys
import threading
import time
import traceback
from functools import partial

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ..errors import ABORT_CODE, CollectiveMismatchError, InvalidArgumentError
from .base import (ANY_SOURCE, NoSharedMemory, Progress, Shared, Transport, Window,
                   size_mismatch)

BYTE = MPI.BYTE


class MPITransport(Transport):
    def __init__(self, comm, *, dup=True, timeout=None):
        ctx = f"ringcoll rank {MPI.COMM_WORLD.Get_rank()}, Communicator(): "  # a world rank
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            got = "MPI.COMM_NULL" if comm == MPI.COMM_NULL else type(comm).__name__
            raise InvalidArgumentError(
                f"{ctx}comm must be an mpi4py communicator this process belongs to, got {got} "
                "(MPI.COMM_NULL is what Split gives a process that passed MPI.UNDEFINED: "
                "such a process has no collectives to run)")
        if comm.Is_inter():
            raise InvalidArgumentError(f"{ctx}inter-communicators are not supported; pass an "
                                       "intra-communicator (Merge() this one)")
        self.comm = comm.Dup() if dup else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # MPI_IN_PLACE for every all-gather where this library measured it no slower (see
        # collectives/allgather.py _mpi_step): the same on every rank of one job
        self.in_place_allgather = self.library().startswith("MPICH")
        self.thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.progress = Progress()
        self.timeout = timeout
        self._status = MPI.Status()
        self._watchdog = _Watchdog(self, timeout) if timeout and self.size > 1 else None
        self._groups = {}  # members -> (communicator, whether it is on one node)

    # point-to-point -------------------------------------------------------------------------
    # Receives (and blocking sends) note their peer and tag in self.progress first, so the
    # watchdog and error messages can say which message never came.
    def isend(self, buf, peer, tag):
        return self.comm.Isend([buf, BYTE], peer, tag)

    def irecv(self, buf, peer, tag):
        progress = self.progress
        progress.step += 1
        progress.at = (peer, tag)
        return self.comm.Irecv([buf, BYTE], peer, tag)

    def send(self, buf, peer, tag):
        progress = self.progress
        progress.step += 1
        progress.at = (peer, tag)
        self.comm.Send([buf, BYTE], peer, tag)

    def recv(self, buf, peer, tag):
        progress, status = self.progress, self._status
        progress.step += 1
        progress.at = (peer, tag)
        self.comm.Recv([buf, BYTE], peer, tag, status)
        if status.Get_count(BYTE) != buf.nbytes:
            raise self._short(status.Get_count(BYTE), buf.nbytes, peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        progress, status = self.progress, self._status
        progress.step += 1
        progress.at = (source, tag)
        self.comm.Sendrecv([sendbuf, BYTE], dest, tag, [recvbuf, BYTE], source, tag, status)
        if status.Get_count(BYTE) != recvbuf.nbytes:
            raise self._short(status.Get_count(BYTE), recvbuf.nbytes, source, tag)

    # bound forms: mpi4py's methods with the arguments fixed, wrapped in a closure that notes
    # progress and checks the received size (0.1-0.15 us a step over the bare call). Each
    # carries its (peer, tag) as step.at: the communicator lists them in progress.current, so
    # the watchdog can tell which step of a schedule is stuck without counting steps here.
    def bind_send(self, buf, peer, tag):
        return self._noted(partial(self.comm.Send, [buf, BYTE], peer, tag), peer, tag)

    def bind_recv(self, buf, peer, tag):
        status = MPI.Status()
        call = partial(self.comm.Recv, [buf, BYTE], peer, tag, status)
        return self._checked(call, buf.nbytes, peer, tag, status)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        if dest == source and sendbuf.nbytes == recvbuf.nbytes:
            # A pairwise exchange of equal sizes (recursive doubling, Rabenseifner): if the
            # partner's message is shorter than ours, ours is longer than its buffer, so MPI
            # fails its receive (ERR_TRUNCATE) and it aborts the job. Skipping the status
            # check here saves 0.1 us of a 3 us small all-reduce.
            return self._noted(partial(self.comm.Sendrecv, [sendbuf, BYTE], dest, tag,
                                       [recvbuf, BYTE], source, tag), source, tag)
        status = MPI.Status()
        call = partial(self.comm.Sendrecv, [sendbuf, BYTE], dest, tag,
                       [recvbuf, BYTE], source, tag, status)
        return self._checked(call, recvbuf.nbytes, source, tag, status)

    def _noted(self, call, peer, tag):
        """call() as a step that first notes (peer, tag) in the progress record."""
        progress, at = self.progress, (peer, tag)

        def step():
            progress.at = at
            call()
        step.at = at
        return step

    def _checked(self, call, nbytes, peer, tag, status):
        """call() noted like _noted's, then the received size checked against nbytes."""
        progress, at, count = self.progress, (peer, tag), status.Get_count  # count(): bytes

        def step():
            progress.at = at
            call()
            if count() != nbytes:
                raise self._short(count(), nbytes, peer, tag)
        step.at = at
        return step

    def _short(self, got, nbytes, peer, tag):
        """The error for a message of `got` bytes (None: more than nbytes) into nbytes."""
        return CollectiveMismatchError(size_mismatch(self.rank, self.progress.call(), peer, tag,
                                                     got, nbytes))

    def bind_native_allreduce(self, sendbuf, recvbuf, op_name):
        return partial(self.comm.Allreduce, _in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name])

    def wait(self, req):
        req.Wait()

    def waitall(self, reqs):
        MPI.Request.Waitall(reqs)

    def test(self, req):
        return req.Test()

    # failure --------------------------------------------------------------------------------
    def fail(self, exc, why=None):
        """Print exc and abort the job: a collective failed part-way, so its peers may wait in
        it forever (one rank alone has no peers: then exc is simply raised)."""
        if self.size == 1:
            raise exc
        why = why or f"the other ranks cannot finish {self.progress.call()} without this one"
        self.abort(f"{self._explain(exc)}ringcoll rank {self.rank}: aborting the job "
                   f"(MPI_Abort, exit code {ABORT_CODE}): {why}.")

    def _explain(self, exc):
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return (f"ringcoll.errors.CollectiveMismatchError: ringcoll rank {self.rank}, "
                    f"{self.progress.call()}: a message from {self.progress.waiting()} was "
                    "longer than this rank expected; the ranks disagree on the element count "
                    "or dtype. Pass the same count and dtype on every rank (RINGCOLL_DEBUG=1 "
                    "names the rank that differs).\n")
        return "".join(traceback.format_exception(exc))

    @property
    def watched(self):
        return self._watchdog is not None

    def abort(self, message, linger=0.0):
        """Write message to stderr and end the whole job with ABORT_CODE, `linger` seconds
        later (so other ranks can still print theirs)."""
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
        if linger:
            time.sleep(linger)
        if self._watchdog is not None:
            self._watchdog.stop()
        if MPI.Is_finalized():
            os._exit(ABORT_CODE)
        self.comm.Abort(ABORT_CODE)

    def channel(self):
        """A sibling transport for the user's point-to-point messages (see base.py)."""
        return _Channel(self)

    # groups ---------------------------------------------------------------------------------
    def split(self, color, key):
        """A transport over the ranks with the same color (None: this rank takes no part)."""
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else self._over(sub)

    def _over(self, comm):
        """A transport like this one over comm (a sub-communicator it owns)."""
        return MPITransport(comm, dup=False, timeout=self.timeout)

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

    def shared(self, nbytes, members=None):
        """Collective over members: the node tier's memory (base.Shared) as an MPI-3 shared
        window (MPI_Win_allocate_shared); see _MPIShared. NoSharedMemory if the members are
        not all on one node, or the MPI library has no shared windows."""
        comm, why = self._group(members)
        if why is not None:
            raise NoSharedMemory(why)
        try:
            return _MPIShared(comm, nbytes)
        except (NotImplementedError, MPI.Exception) as exc:
            raise NoSharedMemory(f"MPI_Win_allocate_shared failed: {exc}") from None

    def _group(self, members):
        """(communicator over members, None or why they cannot share memory), made once per
        group: MPI_Comm_create_group (collective over the members only) and one
        MPI_Comm_split_type(COMM_TYPE_SHARED), which tells whether the group is one node."""
        key = None if members is None or list(members) == list(range(self.size)) \
            else tuple(members)
        found = self._groups.get(key)
        if found is None:
            comm = self.comm if key is None else self.comm.Create_group(
                self.comm.Get_group().Incl(list(key)))
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
            local = node.Get_size()
            node.Free()
            why = None if local == comm.Get_size() else (
                f"only {local} of these {comm.Get_size()} ranks share this rank's node")
            found = self._groups[key] = (comm, why)
        return found

    def window(self, initial):
        """Collective: a Window (base.py) over MPI_Win_allocate; see _MPIWindow."""
        return _MPIWindow(self.comm, initial)

    def library(self):
        """The MPI library's version, its first line ("MPICH Version: 5.0.2", "Open MPI
        v5.0.11, package: ..."): which of ringcoll's built-in tuning tables fits it."""
        return " ".join(MPI.Get_library_version().splitlines()[0].split())

    def cuda_support(self):
        """(aware, why): can this MPI library read and write CUDA device memory?

        Asks MPIX_Query_cuda_support() (MPICH >= 4, Open MPI, MVAPICH: an extension, so it is
        looked up in the library mpi4py is linked to, through ctypes); a library without it
        counts as not CUDA-aware. MPICH refuses the call before MPI_Init: ringcoll asks only
        once a Communicator exists. The embedded mpich wheel answers 0.
        """
        import ctypes

        try:
            query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            return False, "no MPIX_Query_cuda_support() in this MPI library: not CUDA-aware"
        query.restype, query.argtypes = ctypes.c_int, []
        value = query()
        return bool(value), f"MPIX_Query_cuda_support() returned {value}"

    def close(self):
        if self._watchdog is not None:
            self._watchdog.stop()
        for comm, _ in self._groups.values():
            if comm != self.comm:
                comm.Free()
        self._groups.clear()
        if self.comm != MPI.COMM_NULL:
            _discard_unreceived(self.comm)
            self.comm.Free()

    # the MPI library's own collectives, for the 'native' algorithm -------------------------
    def native_allreduce(self, sendbuf, recvbuf, op_name):
        self.bind_native_allreduce(sendbuf, recvbuf, op_name)()

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op_name):
        self.bind_native_reduce_scatter(sendbuf, recvbuf, counts, op_name)()

    def bind_native_reduce_scatter(self, sendbuf, recvbuf, counts, op_name):
        if all(c == counts[0] for c in counts):  # the block form: no counts to read
            return partial(self.comm.Reduce_scatter_block, sendbuf, recvbuf, _OPS[op_name])
        return partial(self.comm.Reduce_scatter, sendbuf, recvbuf, list(counts), _OPS[op_name])

    # The data-movement collectives go as bytes, like the point-to-point calls: mpi4py finds
    # an MPI datatype from a buffer's format and has none for str, bytes, void, structured,
    # datetime64 or bfloat16 buffers, while a copy needs no datatype. counts are in elements.
    def native_allgather(self, sendbuf, recvbuf, counts):
        self.bind_native_allgather(sendbuf, recvbuf, counts)()

    def bind_native_allgather(self, sendbuf, recvbuf, counts):
        """A sendbuf of None means in place: this rank's block is already in recvbuf."""
        send = MPI.IN_PLACE if sendbuf is None else [sendbuf, BYTE]
        if all(c == counts[0] for c in counts):  # MPICH's Allgatherv is far slower here
            return partial(self.comm.Allgather, send, [recvbuf, BYTE])
        nbytes = [c * recvbuf.itemsize for c in counts]
        return partial(self.comm.Allgatherv, send, [recvbuf, nbytes, BYTE])

    def native_gather(self, sendbuf, recvbuf, root):
        """MPI_Gather of equal blocks as bytes; recvbuf matters on root only (None elsewhere),
        where a sendbuf of None means in place (root's block is in recvbuf already)."""
        self.bind_native_gather(sendbuf, recvbuf, root)()

    def bind_native_gather(self, sendbuf, recvbuf, root):
        return partial(self.comm.Gather, MPI.IN_PLACE if sendbuf is None else [sendbuf, BYTE],
                       None if recvbuf is None else [recvbuf, BYTE], root)

    def bind_native_scatter(self, sendbuf, recvbuf, root):
        """MPI_Scatter of equal blocks as bytes; sendbuf matters on root only, where a
        recvbuf of None means in place (root's block stays in sendbuf)."""
        if recvbuf is None:
            return partial(self.comm.Scatter, [sendbuf, BYTE], MPI.IN_PLACE, root)
        return partial(self.comm.Scatter, None if sendbuf is None else [sendbuf, BYTE],
                       [recvbuf, BYTE], root)

    def native_gatherv(self, sendbuf, recvbuf, counts, root):
        """MPI_Gather, or MPI_Gatherv where counts (elements, rank by rank) differ, as bytes;
        recvbuf matters on root only (None elsewhere), where a sendbuf of None means in place."""
        self.bind_native_gatherv(sendbuf, recvbuf, counts, root)()

    def bind_native_gatherv(self, sendbuf, recvbuf, counts, root):
        if all(c == counts[0] for c in counts):
            return self.bind_native_gather(sendbuf, recvbuf, root)
        return partial(self.comm.Gatherv, MPI.IN_PLACE if sendbuf is None else [sendbuf, BYTE],
                       None if recvbuf is None else _bytes_spec(recvbuf, counts), root)

    def native_scatterv(self, sendbuf, recvbuf, counts, root):
        """MPI_Scatter, or MPI_Scatterv where counts (elements, rank by rank) differ, as
        bytes; sendbuf matters on root only, where a recvbuf of None means in place."""
        self.bind_native_scatterv(sendbuf, recvbuf, counts, root)()

    def bind_native_scatterv(self, sendbuf, recvbuf, counts, root):
        if all(c == counts[0] for c in counts):
            return self.bind_native_scatter(sendbuf, recvbuf, root)
        send = None if sendbuf is None else _bytes_spec(sendbuf, counts)
        return partial(self.comm.Scatterv, send,
                       MPI.IN_PLACE if recvbuf is None else [recvbuf, BYTE], root)

    def native_bcast(self, buf, root):
        self.bind_native_bcast(buf, root)()

    def bind_native_bcast(self, buf, root):
        return partial(self.comm.Bcast, [buf, BYTE], root)

    def native_reduce(self, sendbuf, recvbuf, root, op_name):
        """recvbuf is None except on root; sendbuf is recvbuf for an in-place reduce."""
        self.bind_native_reduce(sendbuf, recvbuf, root, op_name)()

    def bind_native_reduce(self, sendbuf, recvbuf, root, op_name):
        return partial(self.comm.Reduce, _in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name],
                       root)

    def native_alltoall(self, sendbuf, recvbuf):
        self.bind_native_alltoall(sendbuf, recvbuf)()

    def bind_native_alltoall(self, sendbuf, recvbuf):
        return partial(self.comm.Alltoall, [sendbuf, BYTE], [recvbuf, BYTE])

    def native_alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        """MPI_Alltoallv; counts in elements of the buffers' dtype, blocks back to back. The
        bytes travel as MPI.BYTE, as the point-to-point calls do, so any dtype travels."""
        self.bind_native_alltoallv(sendbuf, sendcounts, recvbuf, recvcounts)()

    def bind_native_alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        return partial(self.comm.Alltoallv, _bytes_spec(sendbuf, sendcounts),
                       _bytes_spec(recvbuf, recvcounts))

    def native_barrier(self):
        self.comm.Barrier()

    def bind_native_barrier(self):
        return self.comm.Barrier

    def native_scan(self, sendbuf, recvbuf, op_name):
        self.bind_native_scan(sendbuf, recvbuf, op_name)()

    def bind_native_scan(self, sendbuf, recvbuf, op_name):
        return partial(self.comm.Scan, _in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name])

    def native_exscan(self, sendbuf, recvbuf, op_name):
        """recvbuf: rank 0's is left undefined by MPI (pass scratch there)."""
        self.bind_native_exscan(sendbuf, recvbuf, op_name)()

    def bind_native_exscan(self, sendbuf, recvbuf, op_name):
        return partial(self.comm.Exscan, _in_place(sendbuf, recvbuf), recvbuf, _OPS[op_name])


class _MPIWindow(Window):
    """A Window in MPI memory: MPI_Win_allocate on every rank (MPI's own memory, which on one
    node is shared memory the origin's MPI writes directly, so a sleeping or computing owner
    never delays a call) and one passive-target access epoch to every rank for the window's
    whole life (MPI_Win_lock_all at creation, unlock at close). Each call is then one RMA
    operation and MPI_Win_flush(target), which completes it at the target.

    add is MPI_Accumulate(MPI_SUM); fetch is MPI_Get_accumulate(MPI_NO_OP), not MPI_Get: a
    plain Get concurrent with an Accumulate on the same element is a conflicting access
    (undefined), while accumulate-family calls on one element are atomic with each other.
    fetch_add is MPI_Fetch_and_op(MPI_SUM).
    """

    def __init__(self, comm, initial):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.dtype = initial.dtype
        self.counts = tuple(comm.allgather(int(initial.size)))
        item = self.dtype.itemsize
        self.win = MPI.Win.Allocate(max(initial.size, 1) * item, item, comm=comm)
        self.local = np.frombuffer(self.win.tomemory(), self.dtype)[:initial.size]
        self.local[...] = initial  # before the epoch opens and the barrier: then it is public
        self.win.Lock_all(MPI.MODE_NOCHECK)  # nobody takes an exclusive lock: no checks
        self.win.Sync()
        comm.Barrier()
        self._type = from_numpy_dtype(self.dtype)
        self._one = np.empty(1, self.dtype)

    def add(self, values, target, offset):
        self.check("add", values, target, offset)
        self.win.Accumulate(values, target, (offset, values.size, self._type), MPI.SUM)
        self.win.Flush(target)

    def fetch(self, out, target, offset):
        self.check("fetch", out, target, offset)
        self.win.Get_accumulate(out, out, target, (offset, out.size, self._type), MPI.NO_OP)
        self.win.Flush(target)

    def fetch_add(self, value, target, offset):
        self.check("fetch_add", self._one, target, offset)
        self.win.Fetch_and_op(np.array([value], self.dtype), self._one, target, offset, MPI.SUM)
        self.win.Flush(target)
        return self._one[0].item()

    def close(self):
        if self.win == MPI.WIN_NULL:
            return
        self.win.Unlock_all()
        self.comm.Barrier()  # no rank frees while another's last call may still target it
        self.local = None
        self.win.Free()


class _MPIShared(Shared):
    """The node tier's memory as an MPI-3 shared window: MPI_Win_allocate_shared with
    alloc_shared_noncontig (each rank's segment starts on its own page, so two ranks' hot
    lines never share a cache line), every peer's segment mapped through
    MPI_Win_shared_query, and one passive-target epoch for the window's life (lock_all), in
    which MPI_Win_sync is the memory barrier fence() needs."""

    def __init__(self, comm, nbytes):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, info, comm=comm)
        finally:
            info.Free()
        self.segments = [np.frombuffer(self.win.Shared_query(q)[0], np.uint8)[:nbytes]
                         for q in range(self.size)]
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.fence = self.win.Sync  # bound once: the tier fences a few times a chunk
        comm.Barrier()

    def fence(self):  # (replaced per instance by win.Sync itself)
        self.win.Sync()

    def close(self):
        if self.win == MPI.WIN_NULL:
            return
        self.win.Unlock_all()
        self.comm.Barrier()  # no rank unmaps while another may still read its segment
        self.segments = None
        self.win.Free()


class _Receive:
    """A point-to-point receive in flight: the MPI request and what its status must say.
    peer may be ANY_SOURCE; source is the sender, read from the status once it is done."""

    __slots__ = ("req", "nbytes", "peer", "tag", "at", "done", "source")

    def __init__(self, req, nbytes, peer, tag):
        self.req, self.nbytes, self.peer, self.tag = req, nbytes, peer, tag
        self.at = (peer, tag)  # one object: a poll loop that notes it shows the watchdog no move
        self.done = False  # MPI frees a finished request: its status cannot be read twice
        self.source = peer


def _mpi_peer(peer):
    """ringcoll's ANY_SOURCE (-1) as MPI's (MPICH's is -2), any other rank as itself."""
    return MPI.ANY_SOURCE if peer == ANY_SOURCE else peer


class _Channel(MPITransport):
    """The user's point-to-point messages, on the parent transport's communicator.

    Its own Progress record (so the watchdog watches a blocked receive on the caller's thread
    while a non-blocking collective runs on the background thread, and neither overwrites the
    other's step) and its own watchdog, started when the first message is sent or received.
    Every receive checks the size of what arrives: a blocking one probes the message first
    (MPI_Mprobe, thread-safe) and refuses it before reading, a non-blocking one reads its
    status at wait (MPI reports a longer message as ERR_TRUNCATE, a shorter one in the count).
    Receives take ANY_SOURCE (passed as MPI.ANY_SOURCE); the status names the sender.
    """

    def __init__(self, parent):  # shares parent.comm: nothing to duplicate, nothing to free
        self.comm = parent.comm
        self.rank, self.size = parent.rank, parent.size
        self.thread_multiple = parent.thread_multiple
        self.progress = Progress()
        self.timeout = parent.timeout
        self._status = MPI.Status()
        self._watchdog = (_Watchdog(self, self.timeout) if self.timeout and self.size > 1
                          else None)

    def recv(self, buf, peer, tag):
        self.recv_from(buf, peer, tag)

    def recv_from(self, buf, peer, tag):
        """The probed receive (see the class docstring); returns the sender's rank."""
        progress, status = self.progress, self._status
        progress.step += 1
        progress.at = (peer, tag)
        message = self.comm.Mprobe(_mpi_peer(peer), tag, status)
        source = status.Get_source()
        if status.Get_count(BYTE) != buf.nbytes:
            raise self._short(status.Get_count(BYTE), buf.nbytes, source, tag)
        message.Recv([buf, BYTE])
        return source

    def irecv(self, buf, peer, tag):
        return _Receive(self.comm.Irecv([buf, BYTE], _mpi_peer(peer), tag), buf.nbytes, peer,
                        tag)

    def source(self, req):
        return req.source

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        receive = self.irecv(recvbuf, source, tag)
        send = self.isend(sendbuf, dest, tag)
        self.wait(receive)
        self.wait(send)

    def wait(self, req):
        if not isinstance(req, _Receive):
            req.Wait()
            return
        self._note(req)
        self._check(req, lambda: req.req.Wait(self._status))

    def test(self, req):
        if not isinstance(req, _Receive):
            return req.Test()
        self._note(req)
        return self._check(req, lambda: req.req.Test(self._status))

    def _note(self, req):
        """One step in the progress record per receive, however often it is tested (a poll
        loop) and then waited for: the watchdog must see a poll that never ends stand still."""
        if self.progress.at is not req.at:
            self.progress.step += 1
            self.progress.at = req.at

    def _check(self, req, call):
        """call() (a Wait, or a Test returning whether it finished), then the size check."""
        if req.done:
            return True
        try:
            done = call()
        except MPI.Exception as exc:
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                raise self._short(None, req.nbytes, self._sender(req), req.tag) from None
            raise
        if done is False:
            return False
        req.done = True
        req.source = self._sender(req)
        if self._status.Get_count(BYTE) != req.nbytes:
            raise self._short(self._status.Get_count(BYTE), req.nbytes, req.source, req.tag)
        return True

    def _sender(self, req):
        """The sender of the message req took: its peer, or for ANY_SOURCE the status's
        source (still ANY_SOURCE if MPI did not fill it in)."""
        if req.peer != ANY_SOURCE:
            return req.peer
        source = self._status.Get_source()
        return source if 0 <= source < self.size else ANY_SOURCE

    def close(self):
        if self._watchdog is not None:
            self._watchdog.stop()


class PollingMPITransport(MPITransport):
    """MPITransport whose blocking calls wait by polling, with short sleeps, not inside MPI.

    MPI's blocking calls spin on a core until their message has moved. On a background thread
    that shares the cores with computation (a torch backend overlapping DDP's all-reduces with
    backward) the spinning takes a core from the computation for the whole wait; here every
    send and receive is posted non-blocking and tested, a few times at once (a small message
    is done in microseconds), then after sleeps of `poll` seconds (about 50-100 us each on
    Linux), which give the core back. Large messages lose nothing measurable (each test moves
    all that has arrived); a small collective's wait can take up to one sleep longer.
    MPI's own collectives (algorithm 'native') still block inside MPI.
    """

    SPINS = 20  # tests before the first sleep: ~5-10 us, a small message's whole trip

    def __init__(self, comm, *, dup=True, timeout=None, poll=50e-6):
        super().__init__(comm, dup=dup, timeout=timeout)
        self.poll = poll

    def _until_done(self, reqs, statuses=None):
        testall = MPI.Request.Testall
        for _ in range(self.SPINS):
            if testall(reqs, statuses):
                return
        nap = self.poll
        while not testall(reqs, statuses):
            time.sleep(nap)

    def _receive(self, status, recvbuf, source, tag, sendbuf=None, dest=None):
        """Post the receive (and the send) and wait; the receive's status lands in status."""
        reqs = [self.comm.Irecv([recvbuf, BYTE], source, tag)]
        if sendbuf is not None:
            reqs.append(self.comm.Isend([sendbuf, BYTE], dest, tag))
        self._until_done(reqs, [status, MPI.Status()][:len(reqs)])

    def send(self, buf, peer, tag):
        progress = self.progress
        progress.step += 1
        progress.at = (peer, tag)
        self._until_done([self.comm.Isend([buf, BYTE], peer, tag)])

    def recv(self, buf, peer, tag):
        progress, status = self.progress, self._status
        progress.step += 1
        progress.at = (peer, tag)
        self._receive(status, buf, peer, tag)
        if status.Get_count(BYTE) != buf.nbytes:
            raise self._short(status.Get_count(BYTE), buf.nbytes, peer, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        progress, status = self.progress, self._status
        progress.step += 1
        progress.at = (source, tag)
        self._receive(status, recvbuf, source, tag, sendbuf, dest)
        if status.Get_count(BYTE) != recvbuf.nbytes:
            raise self._short(status.Get_count(BYTE), recvbuf.nbytes, source, tag)

    def bind_send(self, buf, peer, tag):
        return self._noted(lambda: self._until_done([self.comm.Isend([buf, BYTE], peer, tag)]),
                           peer, tag)

    def bind_recv(self, buf, peer, tag):
        status = MPI.Status()
        return self._checked(partial(self._receive, status, buf, peer, tag), buf.nbytes, peer,
                             tag, status)

    def bind_sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        status = MPI.Status()
        return self._checked(partial(self._receive, status, recvbuf, source, tag, sendbuf, dest),
                             recvbuf.nbytes, source, tag, status)

    def wait(self, req):
        self._until_done([req])

    def waitall(self, reqs):
        self._until_done(reqs)

    def _over(self, comm):
        return PollingMPITransport(comm, dup=False, timeout=self.timeout, poll=self.poll)


_OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "MIN": MPI.MIN, "BAND": MPI.BAND,
        "BOR": MPI.BOR, "BXOR": MPI.BXOR}


def _bytes_spec(buf, counts):
    """[buf, (byte counts, byte displacements), BYTE]: blocks of `counts` elements in a row."""
    sizes = [c * buf.itemsize for c in counts]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return [buf, (sizes, starts), BYTE]


def _in_place(sendbuf, recvbuf):
    return MPI.IN_PLACE if sendbuf is recvbuf else sendbuf


class _Watchdog:
    """Aborts the job when one collective has made no progress for `timeout` seconds.

    It polls the transport's Progress record: the same collective (sequence number) at the
    same step on looks `timeout` apart means the rank is stuck (MPI gives no way to interrupt
    the blocked call, and the other ranks are stuck behind it or already gone). A long
    collective that keeps receiving messages keeps moving its step, so it is never cut off.
    """

    def __init__(self, transport, timeout):
        self.transport, self.timeout = transport, timeout
        self._stop = threading.Event()
        thread = threading.Thread(target=self._watch, daemon=True,
                                  name=f"ringcoll-watchdog-{transport.rank}")
        thread.start()

    def stop(self):
        self._stop.set()

    def _watch(self):
        progress = self.transport.progress
        seen = since = None
        while not self._stop.wait(min(1.0, self.timeout / 20)):
            if progress.current is None:
                seen = None
                continue
            now, where = time.monotonic(), (progress.seq, progress.step, id(progress.at))
            if where != seen:
                seen, since = where, now
            elif now - since >= self.timeout:
                self._fire(now - since)
                return

    def _fire(self, waited):
        t, progress = self.transport, self.transport.progress
        t.abort(
            f"ringcoll.errors.CollectiveTimeoutError: ringcoll rank {t.rank}, "
            f"{progress.call()}: no progress for {waited:.1f} s, waiting at "
            f"{progress.waiting()}. That rank (or one it waits for) skipped this collective, "
            "called a different one, raised or exited: look for its own ringcoll message. "
            f"Aborting the job (MPI_Abort, exit code {ABORT_CODE}); if the job is only slow, "
            "raise RINGCOLL_TIMEOUT (seconds; 0 = no limit).",
            # The other stuck ranks' watchdogs fire about now too: give them a moment to say
            # where *they* wait before MPI_Abort ends every process, since together the
            # messages show the whole deadlock (and who skipped which call).
            linger=min(5.0, self.timeout / 2))


def _discard_unreceived(comm):
    """Receive and drop every message that has arrived on comm and that no receive took (a
    send the program never matched). MPI may give a later communicator the context of one
    freed, and such a message would then match a receive there."""
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], status.Get_source(),
                  status.Get_tag())
