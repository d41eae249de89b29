"""Communicator: the user's entry point, and a facade.

Construction and topology live here, and one short public method per collective whose body
is "check the arguments, build the plan, run it": the collective's module
(ringcoll/collectives/) checks and plans, the runner (runner.py) runs, the algorithms
(ringcoll/algorithms/) move the bytes over a transport (ringcoll/transport/). Host and
device sides (sides.py), point-to-point messages (messages.py) and the shared state of a
communicator (group.py) each have their own module. The docstrings here are the user's
reference; docs/architecture.md shows a call's path from here to the wire.
"""

from contextlib import contextmanager

import numpy as np

from . import collectives
from .checks import agreed
from .algorithms import ALLREDUCE_NAMES, CostModel
from .algorithms import node as _node
from .config import MPI_TIMEOUT, Options
from .errors import InvalidArgumentError, InvalidTypeError, where
from .arrays import is_device
from .group import Group
from .messages import Messages, Status
from .runner import Plan, Request, Runner
from .transport.base import ANY_SOURCE, WINDOW_DTYPES
from .transport.trace import Trace, TracingTransport
from .tuning import resolve as resolve_tuning

__all__ = ["ANY_SOURCE", "Communicator", "Request", "Status"]


def _find_nodes(options, transport):
    """The ranks of each node: consecutive groups of local_size if set, else as MPI says."""
    k = options.local_size
    ids = [r // k for r in range(transport.size)] if k is not None else transport.node_ids()
    nodes = {}
    for r, node in enumerate(ids):
        nodes.setdefault(node, []).append(r)
    return list(nodes.values())


class Communicator:
    """A group of ranks that run ringcoll collectives together.

    Args:
        comm: an mpi4py communicator (default MPI.COMM_WORLD). It is duplicated, so ringcoll
            messages can never match the user's own.
        local_size: group consecutive ranks into nodes of this many (the last may be smaller)
            instead of asking MPI which ranks share memory; RINGCOLL_LOCAL_SIZE does the same.
        algorithm: default all-reduce algorithm, "auto" unless RINGCOLL_ALGO says otherwise.
        segment_bytes: pipeline segment size of the ring algorithms (RINGCOLL_SEGMENT_BYTES).
        debug: before every collective, check that all ranks make the same call (same
            collective, op, dtype, shape, root, algorithm, in place or not) and raise
            CollectiveMismatchError on every rank naming who differs; rank 0 also prints
            each collective's algorithm (RINGCOLL_DEBUG=1). Costs one small all-gather a call.
        timeout: seconds one collective may make no progress before ringcoll aborts the job
            with an error naming the collective and the rank it waits for (RINGCOLL_TIMEOUT;
            default 600 over MPI; 0 = no limit).
        cost_model: the CostModel that `auto` uses where no tuning table covers this
            communicator's size and node shape (default: the table file's fitted one).
        tuning: the tuning table `auto` looks up first: a path to a file written by
            `python -m ringcoll.tune`, a ringcoll.Tuning, or False for none
            (RINGCOLL_TUNING; default: the table shipped with ringcoll, on MPI only).
        transport: run over this ringcoll Transport instead of MPI (tests, simulation).
        cuda_aware: for CuPy arrays, True hands device buffers to MPI directly, False stages
            them through pinned host memory; None (default) asks the MPI library
            (MPIX_Query_cuda_support) (RINGCOLL_CUDA_AWARE=1/0).
        staging_bytes: chunk size of that staging (RINGCOLL_STAGING_BYTES; default 1 MiB).
        node_chunk: slot size in bytes of the node tier (algorithm "node", shared memory
            between the ranks of one node; RINGCOLL_NODE_CHUNK; default 1 MiB on the host,
            16 MiB on a GPU).
        node_tier: False runs every collective by messages, never through the node tier's
            shared memory (RINGCOLL_NODE_TIER=0); algorithm "node" then runs the ring.
        poll: over MPI, wait for messages by testing them with sleeps of this many seconds in
            between (e.g. 50e-6) instead of blocking inside MPI, which spins on a core; for
            collectives that run beside computation on the same cores (ringcoll.torch sets
            it). None (default): block inside MPI, the lowest latency.

    Example::

        comm = ringcoll.Communicator()
        x = np.full(4, comm.rank, dtype=np.float32)
        comm.allreduce(x)   # every rank: [0+1+...+(p-1)] * 4
    """

    def __init__(self, comm=None, *, local_size=None, algorithm=None, segment_bytes=None,
                 debug=None, timeout=None, cost_model=None, tuning=None, transport=None,
                 cuda_aware=None, staging_bytes=None, poll=None, node_chunk=None,
                 node_tier=None):
        options = Options.from_env(algorithm=algorithm, local_size=local_size,
                                   segment_bytes=segment_bytes, debug=debug, tuning=tuning,
                                   timeout=timeout, cuda_aware=cuda_aware,
                                   staging_bytes=staging_bytes, node_chunk=node_chunk,
                                   node_tier=node_tier)
        if options.algorithm not in ALLREDUCE_NAMES:
            raise InvalidArgumentError(
                f"unknown all-reduce algorithm {options.algorithm!r} (from algorithm= or "
                f"RINGCOLL_ALGO); choose one of {ALLREDUCE_NAMES}")
        # A table given is read before MPI is touched: a bad file fails fast, with nothing to
        # clean up. The shipped ones come after the transport, which names its MPI library.
        table = resolve_tuning(options.tuning, builtin=None)
        if transport is None:
            # only the MPI path needs mpi4py
            from .transport.mpi import MPITransport, PollingMPITransport

            if comm is None:
                from mpi4py import MPI

                comm = MPI.COMM_WORLD
            seconds = MPI_TIMEOUT if options.timeout is None else options.timeout
            transport = (MPITransport(comm, timeout=seconds) if not poll else
                         PollingMPITransport(comm, timeout=seconds, poll=poll))
        elif comm is not None:
            raise InvalidArgumentError("pass either an MPI communicator or a transport, not both")
        self.rank, self.size = transport.rank, transport.size
        if options.tuning is None and hasattr(transport, "native_allreduce"):
            # the shipped tables were measured over MPI, one per MPI library; threads in one
            # process time nothing like them, so they get one only when asked to
            table = resolve_tuning(None, builtin=getattr(transport, "library", str)())
        fitted = table.cost_model(self.size) if table is not None else None
        self._g = Group(transport, options, _find_nodes(options, transport), table,
                        cost_model or fitted or CostModel())
        self._runner = Runner(self._g)
        self._replay = self._runner.replay  # bound once: allreduce's hot path calls it first
        self._messages = Messages(self._g)

    # -- options and topology: one copy of each, in the Group the layers below share --------
    @property
    def options(self):
        """The ringcoll.config.Options in force (arguments over RINGCOLL_* variables)."""
        return self._g.options

    @property
    def nodes(self):
        """The ranks of each node, e.g. [[0, 1], [2, 3]]."""
        return self._g.nodes

    @property
    def tuning(self):
        """The tuning table auto looks up first (a ringcoll.Tuning), or None."""
        return self._g.tuning

    @tuning.setter
    def tuning(self, table):
        self._g.tuning = table

    @property
    def cost_model(self):
        """The CostModel auto falls back on."""
        return self._g.cost_model

    @cost_model.setter
    def cost_model(self, model):
        self._g.cost_model = model

    @property
    def local_rank(self):
        """This rank's index inside its node."""
        return self._node().index(self.rank)

    @property
    def local_size(self):
        """How many ranks share this rank's node."""
        return len(self._node())

    def _node(self):
        return next(m for m in self.nodes if self.rank in m)

    def __repr__(self):
        return (f"<ringcoll.Communicator rank {self.rank} of {self.size}, "
                f"{len(self.nodes)} node(s), algorithm={self.options.algorithm!r}>")

    # -- all-reduce --------------------------------------------------------------------------
    def allreduce(self, x, op="sum", algorithm=None, out=None):
        """Reduce x over all ranks and give every rank the result.

        The result is bitwise identical on every rank, for every algorithm. Integer results
        equal MPI_Allreduce's exactly; float16/bfloat16 sums accumulate in float32 each step.

        Args:
            x (np.ndarray): this rank's contribution, any shape; same shape, dtype and memory
                layout (C or F) on every rank.
            op (str or MPI.Op): "sum", "prod", "max", "min" or "avg" (floats only).
            algorithm (str): "auto", "ring", "recursive_doubling", "rabenseifner",
                "hierarchical" or "native"; default the communicator's.
            out (np.ndarray): where to write the result; out=x reduces in place.

        Returns:
            np.ndarray: the reduced array (out if given).

        Example::

            # rank r passes np.array([r, 1]); on 3 ranks every rank gets [3, 3]
            y = comm.allreduce(np.array([comm.rank, 1]))
        """
        done = self._replay(x, out, op, algorithm)  # the same call as last time: run it again
        if done is not None:
            return done
        return self._runner.run(self._runner.plan(collectives.allreduce, x, op, algorithm, out))

    def iallreduce(self, x, op="sum", algorithm=None, out=None):
        """Non-blocking allreduce: returns a Request; req.wait() gives the result.

        The collective runs on the communicator's background thread, so it progresses while
        the caller computes. Collectives called while it is pending (blocking or not) queue
        behind it on that thread, so everything runs in call order; once nothing is pending,
        blocking calls run on the caller's thread again. Do not touch x or out until wait()
        returns. CuPy arrays: the collective's copies and kernels go on the CuPy stream that is
        current at this call (and its device), as if called here.
        """
        plan = self._runner.plan(collectives.allreduce, x, op, algorithm, out,
                                 call="iallreduce")
        return self._runner.submit(plan)

    def refuse(self, collective, error):
        """Raise error, this rank's reason not to run `collective`, as the collectives do
        with a bad argument: in debug mode the other ranks are told first, so they raise
        PeerFailedError instead of waiting for this rank. For front-ends that check their own
        arguments before calling a collective (ringcoll.wrap); an error a collective raised
        itself has been told already and is simply raised again."""
        if not getattr(error, "ringcoll_told", False) and not getattr(error, "ringcoll_agreed",
                                                                        False):
            self._runner.invalid(error, collective)
        raise error

    def again(self, collective, call):
        """For a front-end that remembers its own arguments (ringcoll.wrap): call(), a call
        of `collective` (its method name) just made, as a zero-argument callable that runs
        it again with no argument matching at all (runner.Again). The front-end must have
        checked that its arguments are the very same arrays, unchanged, and equal values."""
        return self._runner.again(collective, call)

    def auto_algorithm(self, nbytes, inplace=False):
        """The all-reduce algorithm `auto` runs on this communicator for a buffer of nbytes.

        The tuning table's measured winner if it has a table for this size and node shape,
        else the cost model's pick; in-place calls (out=x) have their own column, because
        sending from a buffer that is written right after can be much slower (MPICH's
        single-copy path). Cached per (nbytes, inplace).

        Example::

            comm.auto_algorithm(8)            # 'recursive_doubling' on most machines
            comm.auto_algorithm(64 << 20, inplace=True)
        """
        return collectives.allreduce.auto(self._g, nbytes, inplace)

    def device_path(self, x):
        """(path, why) for CuPy array x's GPU: "cuda-aware" (device buffers go to MPI as they
        are) or "staged" (through pinned host buffers), and what decided it
        (RINGCOLL_CUDA_AWARE, or the MPI library's answer). Local: no communication.

        Example::

            comm.device_path(cupy.zeros(1))  # ('staged', 'MPIX_Query_cuda_support() returned 0')
        """
        if not is_device(x):
            raise InvalidTypeError(f"{where(self.rank, 'device_path')}x must be a CuPy array, "
                                   f"got {type(x).__name__}")
        side = self._g.sides.device(x, where(self.rank, "device_path"))
        return side.path, side.why_path

    # -- the node tier's registered buffers ---------------------------------------------------
    def shared_array(self, shape, dtype=np.float32, xp=np):
        """Collective: a new zeroed array in the node tier's shared memory (a registered
        buffer), which collectives on it read and write where it lies.

        An in-place all-reduce of such an array (algorithm "node", or auto where it picks
        the tier) skips the copy into the tier's slots: every rank reads the others' blocks
        straight from their arrays. Ranks may register different shapes; registrations must
        come in the same order on every rank. Where the tier cannot run (one rank, ranks on
        several nodes, an MPI library without shared windows, GPUs without peer access), and
        beyond 64 live registrations (release() frees one), this returns an ordinary array;
        is_shared() tells which it is.

        Args:
            shape (int or tuple): the array's shape.
            dtype: its dtype (default float32).
            xp: numpy (host memory: an MPI-3 shared window) or cupy (device memory of the
                current GPU, opened by every peer through CUDA IPC).

        Returns:
            an xp.ndarray. Do not use it after release(x) or close(): its memory is gone.

        Example::

            g = comm.shared_array(1 << 20)   # e.g. a gradient bucket
            g[...] = local_gradient
            comm.allreduce(g, out=g)         # no copy in; every rank gets the sum
        """
        ctx = where(self.rank, "shared_array")
        self._g.check_open("shared_array")
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
        dtype = np.dtype(dtype)
        if min(shape, default=1) < 0:
            raise InvalidArgumentError(f"{ctx}shape {shape} has a negative length")
        count = int(np.prod(shape, dtype=np.int64))
        side = self._side_of(xp, ctx)
        self.wait_all()  # making the memory is collective: after the queued collectives
        tier = _node.tier_of(side.t, side.ws) if self.size > 1 else None
        segment = tier.register(max(count * dtype.itemsize, 1)) if tier is not None else None
        if segment is None:
            return xp.zeros(shape, dtype)
        array = segment[:count * dtype.itemsize].view(dtype).reshape(shape)
        array[...] = 0
        return array

    def is_shared(self, x):
        """True if x lies in one of this communicator's registered buffers (shared_array)."""
        side = self._g.sides.device(x, where(self.rank, "is_shared")) if is_device(x) \
            else self._g.host
        tier = _node.existing(side.t, side.ws)
        return tier is not None and tier.locate(x)[0] != 0

    def release(self, x):
        """Collective: free the registered buffer x lies in (from shared_array), on every
        rank at the same point, each passing its own array of the same registration. An
        ordinary array on every rank: nothing happens. x must not be used afterwards."""
        ctx = where(self.rank, "release")
        self._g.check_open("release")
        side = self._g.sides.device(x, ctx) if is_device(x) else self._g.host
        self.wait_all()  # freeing is collective: after the queued collectives
        tier = _node.existing(side.t, side.ws)
        mine = tier.locate(x)[0] - 1 if tier is not None else -1
        every = self.allgather(np.array([mine], dtype=np.int64), algorithm="ring")
        if (every != mine).any():
            raise agreed(InvalidArgumentError(
                f"{ctx}the ranks pass arrays of different registrations (index per rank, -1 = "
                f"not registered: {every.tolist()}); release the same shared_array on every "
                "rank"))
        if mine >= 0:
            tier.release(mine)

    def _side_of(self, xp, ctx):
        if xp is np:
            return self._g.host
        if getattr(xp, "__name__", "") != "cupy":
            raise InvalidTypeError(f"{ctx}xp must be numpy or cupy, got {xp!r}")
        return self._g.sides.device(xp.empty(0), ctx)

    # -- the other collectives -----------------------------------------------------------------
    def reduce_scatter(self, x, op="sum", out=None, algorithm=None, counts=None):
        """Reduce x over all ranks and give rank r the r-th block of the result.

        x is split along axis 0 into size blocks: counts[r] rows for rank r if counts is
        given (MPI_Reduce_scatter's recvcounts), else like np.array_split(x, size): the first
        x.shape[0] % size blocks get one more row.

        Args:
            x (np.ndarray): at least 1-D; same shape and dtype on every rank.
            op: as for allreduce.
            out (np.ndarray): where to write this rank's block.
            algorithm (str): "ring" or "native" (MPI's own); "auto": the faster of the two
                at this size where the tuning table measured it, else "ring".
            counts (sequence of int): rows of each rank's block: size non-negative ints
                summing to x.shape[0], the same on every rank (checked on each rank for
                itself; debug mode compares them across ranks).

        Returns:
            np.ndarray: this rank's block, shape (counts[r],) + x.shape[1:].

        Example::

            # 2 ranks, x = np.arange(4) + rank: rank 0 gets [1, 3], rank 1 gets [5, 7]
            # counts=[3, 1]: rank 0 gets [1, 3, 5], rank 1 gets [7]
        """
        return self._runner.call(collectives.reduce_scatter, x, op, out, algorithm, counts)

    def allgather(self, x, out=None, algorithm=None, counts=None, declared=False):
        """Concatenate every rank's x along axis 0, on every rank.

        Ranks may pass different lengths on axis 0; the other dimensions and the dtype must
        agree (checked: a mismatch raises CollectiveMismatchError on every rank). Any
        fixed-size dtype works (numeric, bool, 'S'/'U' strings, void, structured, datetime64):
        the bytes arrive as they were sent; object dtypes raise InvalidTypeError.

        Args:
            x (np.ndarray): this rank's rows (a 0-d x is one row).
            out (np.ndarray): where to write the result.
            algorithm (str): "ring" or "native" (MPI's own); "auto": the faster of the two
                at this size where the tuning table measured it, else "ring".
            counts (sequence of int): the rows this rank expects from each rank, as
                MPI_Allgatherv's recvcounts; checked against what the ranks pass (a
                difference raises on every rank). Default: whatever they pass.
            declared (bool): True on every rank, with the same counts on every rank, as
                MPI_Allgatherv's contract: the ranks then agree on counts, dtype and row
                shape once per distinct call, and the same call again sends only the data
                (see docs/errors.md for what is then no longer checked).

        Returns:
            np.ndarray: shape (sum of rows,) + x.shape[1:]; rank 0's rows first.

        Example::

            # 3 ranks, x = np.array([rank]): every rank gets [0, 1, 2]
        """
        return self._runner.call(collectives.allgather, x, out, algorithm, counts, declared)

    def broadcast(self, x, root=0, algorithm=None):
        """Copy root's x into x on every rank, in place; returns x.

        x: a contiguous array of the same shape and dtype on every rank. Any fixed-size
        dtype works (numeric, bool, 'S'/'U' strings, void, structured, datetime64): the bytes
        arrive as they were sent; object dtypes raise InvalidTypeError.

        Example::

            x = np.arange(3) if comm.rank == 0 else np.empty(3, dtype=int)
            comm.broadcast(x, root=0)   # every rank: [0, 1, 2]
        """
        return self._runner.call(collectives.broadcast, x, root, algorithm)

    def reduce(self, x, op="sum", root=0, out=None, algorithm=None):
        """Reduce x over all ranks onto root: returns the result on root, None elsewhere.

        Example::

            # 4 ranks, x = np.array([rank]): rank 0 gets [6], the others None
        """
        return self._runner.call(collectives.reduce, x, op, root, out, algorithm)

    def scan(self, x, op="sum", out=None, algorithm=None):
        """Inclusive prefix reduction: rank r gets op(x_0, x_1, ..., x_r).

        The data are combined in rank order, lower ranks first (as MPI_Scan does), so float
        results are deterministic; integer results equal MPI_Scan's exactly. Recursive
        doubling: at step k every rank exchanges its block's partial reduction with rank
        r ^ 2^k (if that rank exists) and folds in what comes from below; ceil(log2 p)
        (a + n b + 2 n g) at most, one message of x's size per step.

        Args:
            x (np.ndarray): this rank's contribution, any shape; same shape, dtype and memory
                layout (C or F) on every rank.
            op (str or MPI.Op): "sum", "prod", "max" or "min" (or MPI.SUM, ...). "avg" is
                refused: each rank's result covers a different number of ranks; scan with
                "sum" and divide by comm.rank + 1.
            out (np.ndarray): where to write the result; out=x scans in place.
            algorithm (str): "recursive_doubling" or "native" (MPI's own); "auto": the
                faster at this size where the tuning table measured it, else recursive doubling.

        Returns:
            np.ndarray: this rank's prefix (out if given). On one rank: a copy of x (x itself
            for out=x).

        Example::

            # 4 ranks, x = np.array([rank + 1]): ranks 0..3 get [1], [3], [6], [10]
            y = comm.scan(np.array([comm.rank + 1]))
        """
        return self._runner.call(collectives.scan, x, op, out, algorithm)

    def exscan(self, x, op="sum", out=None, algorithm=None):
        """Exclusive prefix reduction: rank r > 0 gets op(x_0, ..., x_{r-1}); rank 0 None.

        MPI_Exscan leaves rank 0's receive buffer undefined; here rank 0 gets None and its
        out, if given, is left as it was (it is still checked, as on every rank). Otherwise
        as scan: rank order, lower ranks first; the same recursive doubling and cost, the
        first data from below copied instead of reduced.

        Args:
            x (np.ndarray): this rank's contribution, any shape; same shape, dtype and memory
                layout (C or F) on every rank (rank 0's x is sent, never written).
            op (str or MPI.Op): "sum", "prod", "max" or "min" (or MPI.SUM, ...). "avg" is
                refused: exscan with "sum" and divide by comm.rank (on ranks > 0).
            out (np.ndarray): where to write the result; out=x scans in place (rank 0's x is
                then unchanged).
            algorithm (str): "recursive_doubling" or "native" (MPI's own); "auto": the
                faster at this size where the tuning table measured it, else recursive doubling.

        Returns:
            np.ndarray: this rank's prefix (out if given) on ranks > 0; None on rank 0 (and
            on a single rank).

        Example::

            # 4 ranks, x = np.array([rank + 1]): ranks 0..3 get None, [1], [3], [6]
            y = comm.exscan(np.array([comm.rank + 1]))
        """
        return self._runner.call(collectives.exscan, x, op, out, algorithm)

    def alltoall(self, x, out=None, algorithm=None):
        """Send block j of x (axis 0 split into size equal blocks) to rank j.

        Any fixed-size dtype works (numeric, bool, 'S'/'U' strings, void, structured,
        datetime64): the bytes arrive as they were sent; object dtypes raise InvalidTypeError.

        Returns:
            np.ndarray: same shape as x; block i came from rank i.

        Example::

            # 2 ranks, x = np.array([10 * rank, 10 * rank + 1])
            # rank 0 gets [0, 10], rank 1 gets [1, 11]
        """
        return self._runner.call(collectives.alltoall, x, out, algorithm)

    def alltoallv(self, x, counts, out=None, recv_counts=None, algorithm=None, declared=False):
        """Send counts[j] rows of x to rank j (MPI_Alltoallv): all-to-all with uneven blocks.

        x holds this rank's blocks back to back along axis 0: rows 0 .. counts[0]-1 go to
        rank 0, the next counts[1] to rank 1, and so on. The ranks first exchange how many
        rows each sends each (and check that dtypes and trailing shapes agree), then the data.
        A disagreement between ranks (dtype or trailing shape, recv_counts that differ from
        what the senders send, out= with the wrong row count) raises on every rank before any
        data moves: CollectiveMismatchError or InvalidArgumentError on the rank at fault,
        PeerFailedError on the others.

        Args:
            x (np.ndarray): this rank's rows (a 0-d x is one row); the same dtype and
                trailing shape on every rank.
            counts (sequence of int): rows for each rank: size non-negative ints summing to
                x.shape[0] (zeros allowed: nothing is sent for an empty block).
            out (np.ndarray): where to write the result: shape (sum of received rows,) +
                x.shape[1:] and x's dtype; must not overlap x (there is no in-place form:
                for MPI_IN_PLACE pass a copy of the buffer as x).
            recv_counts (sequence of int): the rows expected from each rank, checked against
                what the senders' counts say (None: take what they send).
            algorithm (str): "pairwise" or "native" (MPI_Alltoallv); "auto": MPI's own calls
                for the count exchange where the transport has them, and for the data where
                every rank's rows are host memory and the tuning table measured
                MPI_Alltoallv faster at the bytes all ranks send (without a table entry: up
                to 64 KiB in all), else pairwise.
            declared (bool): True on every rank, each passing recv_counts= (MPI_Alltoallv's
                contract: every rank knows what it sends and receives): the ranks then agree
                on counts, dtype and row shape once per distinct call, and the same call
                again sends only the data (see docs/errors.md for what is then no longer
                checked).

        Returns:
            np.ndarray: the received blocks in rank order (block i from rank i), shape
            (sum of received rows,) + x.shape[1:].

        Cost: (p-1) a + 56 (p-1) b for the count exchange (7 int64 per pair), ceil(log2 p) a
        more when some rank passes recv_counts= or out= (every rank's verdict, all-gathered),
        then at most (p-1) a for the data, empty blocks skipped, each step taking the longer of
        its send and its receive; a repeated call of small blocks carries them in the count
        exchange instead (module ringcoll.collectives.alltoallv has the details).

        Example::

            # 2 ranks; rank 0: x = [0, 1, 2], counts=[1, 2]; rank 1: x = [10], counts=[1, 0]
            # rank 0 gets [0, 10], rank 1 gets [1, 2]
            y = comm.alltoallv(x, counts)
        """
        return self._runner.call(collectives.alltoallv, x, counts, out, recv_counts, algorithm,
                                 declared)

    def gather(self, x, root=0, out=None, algorithm=None, counts=None, declared=False):
        """Concatenate every rank's x along axis 0 on root; the other ranks get None.

        Ranks may pass different lengths on axis 0; the other dimensions and the dtype must
        agree (checked: a mismatch raises CollectiveMismatchError on every rank). Any
        fixed-size dtype works (numeric, bool, 'S'/'U' strings, void, structured, datetime64):
        the bytes arrive as they were sent; object dtypes raise InvalidTypeError. The data
        travels up a binomial tree (the inverse of broadcast's): ceil(log2 p) steps, and the
        root receives every other rank's rows exactly once.

        Args:
            x (np.ndarray): this rank's rows (a 0-d x is one row).
            root (int): the rank that receives the result.
            out (np.ndarray): where root writes the result (ignored on the other ranks).
            algorithm (str): "tree", or "native" (the data by MPI_Gather(v)); "auto": MPI's
                own calls for the small exchanges before the data where the transport has
                them, and for the data where the tuning table measured MPI_Gather faster at
                this size (without a table: declared equal blocks of up to 64 KiB).
            counts (sequence of int): on root, the rows it expects from each rank, as
                MPI_Gatherv's recvcounts; checked against what the ranks pass (a difference
                raises on every rank). Ignored elsewhere unless declared. Default: whatever
                they pass.
            declared (bool): True on every rank, each passing root's counts: the ranks then
                agree on counts, dtype and row shape once per distinct call, and the same
                call again sends only the data (see docs/errors.md for what is then no
                longer checked).

        Returns:
            np.ndarray on root: shape (sum of rows,) + x.shape[1:], rank 0's rows first;
            None on every other rank.

        Example::

            # 3 ranks, x = np.full(rank + 1, rank): rank 0 gets [0, 1, 1, 2, 2, 2]
            y = comm.gather(np.full(comm.rank + 1, comm.rank), root=0)
        """
        return self._runner.call(collectives.gather, x, root, out, algorithm, counts,
                                 declared)

    def scatter(self, x, root=0, counts=None, out=None, algorithm=None, declared=False):
        """Split root's x along axis 0 into one block per rank; rank r gets block r.

        counts=None splits like np.array_split(x, size) (the first x.shape[0] % size blocks
        get one more row); otherwise counts[r] rows go to rank r, as MPI_Scatterv's
        sendcounts. x and counts matter on root only. Before the data moves, the ranks agree
        on the call (each rank's out= goes to root, root's verdict and block shapes come
        back), so a mismatch (a non-root's out of the wrong row count, dtype or trailing
        shape; a bad counts list on root) raises on every rank alike: InvalidArgumentError or
        CollectiveMismatchError on the rank at fault, PeerFailedError naming it elsewhere.
        The data then travels down a binomial tree (gather's mirror image): ceil(log2 p)
        steps, and the root sends every other rank's rows exactly once.

        Args:
            x (np.ndarray): on root, the rows to hand out (a 0-d x is one row); ignored (may
                be None) on the other ranks.
            root (int): the rank whose x is scattered.
            counts (sequence of int): on root, the rows of each rank's block: size
                non-negative ints adding up to x.shape[0]; None for np.array_split's sizes.
                Ignored on the other ranks.
            out (np.ndarray): where to write this rank's block, on any rank: counts[rank]
                rows of root's dtype and trailing shape. On root, out may be its own block
                viewed in x (x[start:stop]: MPI's IN_PLACE); it must not otherwise overlap x.
                A non-root without out gets a new array (NumPy; dtype and trailing shape
                from root); for a structured dtype, or rows of more than 8 trailing
                dimensions, a non-root must pass out.
            algorithm (str): "tree", or "native" (the data by MPI_Scatter(v)); "auto": MPI's
                own calls for the small exchanges before the data where the transport has
                them, and for the data where the tuning table measured MPI_Scatter faster at
                this size (without a table: declared equal blocks of up to 64 KiB).
            declared (bool): True on every rank, each passing root's counts and (but root)
                out=: the ranks then agree once per distinct call, and the same call again
                sends only the data (see docs/errors.md for what is then no longer checked).

        Returns:
            np.ndarray: this rank's block, shape (counts[rank],) + x.shape[1:] in root's
            dtype (out if given).

        Cost: 2 ceil(log2 p) a for the agreement (a few int64 per rank), plus ceil(log2 p) a
        + (n - root's block) b at the root for n scattered bytes.

        Example::

            # 3 ranks: rank 0 gets [0, 1], rank 1 [2, 3], rank 2 [4]
            y = comm.scatter(np.arange(5) if comm.rank == 0 else None, root=0)
            # explicit counts: rank 0 gets [], rank 1 [0, 1, 2, 3], rank 2 [4]
            y = comm.scatter(np.arange(5) if comm.rank == 0 else None, counts=[0, 4, 1])
        """
        return self._runner.call(collectives.scatter, x, root, counts, out, algorithm,
                                 declared)

    def barrier(self, algorithm=None):
        """Return only once every rank has called barrier()."""
        self._runner.call(collectives.barrier, algorithm)

    # -- non-blocking forms: the same checks at the call, the run on the background thread ---
    # Each returns a Request whose wait() gives what the blocking call returns. As with
    # iallreduce, the arguments are checked at the call (a bad one raises there), the
    # collective runs in call order with every other one on this communicator, and x and out
    # must not be touched until wait() returns.
    def _start(self, collective, call, *args):
        return self._runner.submit(self._runner.plan(collective, *args, call=call))

    def ireduce_scatter(self, x, op="sum", out=None, algorithm=None, counts=None):
        """Non-blocking reduce_scatter: a Request; wait() gives this rank's block."""
        return self._start(collectives.reduce_scatter, "ireduce_scatter", x, op, out, algorithm,
                           counts)

    def ialltoallv(self, x, counts, out=None, recv_counts=None, algorithm=None,
                   declared=False):
        """Non-blocking alltoallv: a Request; wait() gives the received blocks."""
        return self._start(collectives.alltoallv, "ialltoallv", x, counts, out, recv_counts,
                           algorithm, declared)

    def iallgather(self, x, out=None, algorithm=None, counts=None, declared=False):
        """Non-blocking allgather: a Request; wait() gives the concatenated rows."""
        return self._start(collectives.allgather, "iallgather", x, out, algorithm, counts,
                           declared)

    def ibroadcast(self, x, root=0, algorithm=None):
        """Non-blocking broadcast: a Request; wait() gives x, filled with root's data."""
        return self._start(collectives.broadcast, "ibroadcast", x, root, algorithm)

    def ireduce(self, x, op="sum", root=0, out=None, algorithm=None):
        """Non-blocking reduce: a Request; wait() gives the result on root, None elsewhere."""
        return self._start(collectives.reduce, "ireduce", x, op, root, out, algorithm)

    def ialltoall(self, x, out=None, algorithm=None):
        """Non-blocking alltoall: a Request; wait() gives the received blocks."""
        return self._start(collectives.alltoall, "ialltoall", x, out, algorithm)

    def igather(self, x, root=0, out=None, algorithm=None, counts=None, declared=False):
        """Non-blocking gather: a Request; wait() gives the rows on root, None elsewhere."""
        return self._start(collectives.gather, "igather", x, root, out, algorithm, counts,
                           declared)

    def iscatter(self, x, root=0, counts=None, out=None, algorithm=None, declared=False):
        """Non-blocking scatter: a Request; wait() gives this rank's block."""
        return self._start(collectives.scatter, "iscatter", x, root, counts, out, algorithm,
                           declared)

    def iscan(self, x, op="sum", out=None, algorithm=None):
        """Non-blocking scan: a Request; wait() gives this rank's prefix."""
        return self._start(collectives.scan, "iscan", x, op, out, algorithm)

    def iexscan(self, x, op="sum", out=None, algorithm=None):
        """Non-blocking exscan: a Request; wait() gives this rank's prefix (None on rank 0)."""
        return self._start(collectives.exscan, "iexscan", x, op, out, algorithm)

    def ibarrier(self, algorithm=None):
        """Non-blocking barrier: a Request; wait() returns once every rank has called
        barrier() or ibarrier()."""
        return self._start(collectives.barrier, "ibarrier", algorithm)

    # -- point-to-point (messages.py) ----------------------------------------------------------
    def send(self, x, dest, tag=0):
        """Send x to rank dest; returns once x may be reused.

        The bytes of x travel in its memory order, as with MPI buffers: the receiver passes
        an array of the same size and dtype (a different size is an error on the receiver,
        naming both ranks). Like MPI_Send, a large message may wait until dest posts its
        receive, so two ranks that both send first can deadlock: use sendrecv, or isend.

        Args:
            x (np.ndarray): any shape and numeric dtype (a non-contiguous x is copied once).
            dest (int): the receiving rank, 0..size-1, not this rank itself (use isend then
                recv, or sendrecv, to send to yourself).
            tag (int): 0..1023; a receive takes the messages from dest's rank with its tag
                in the order they were sent.

        Example::

            if comm.rank == 0:
                comm.send(np.arange(3.0), dest=1)
            elif comm.rank == 1:
                print(comm.recv(np.empty(3), source=0))   # [0. 1. 2.]
        """
        self._messages.send(x, dest, tag)

    def recv(self, out, source, tag=0, status=None):
        """Receive a message from rank source (or from any rank) into out (in place);
        returns out.

        Matching follows MPI's rules: messages from one sender with one tag arrive in the
        order they were sent (non-overtaking), a message goes to the earliest-posted receive
        it matches, and a receive from ringcoll.ANY_SOURCE takes the first message with its
        tag from whichever rank (tags always match exactly: there is no ANY_TAG).

        Args:
            out (np.ndarray): writeable, C- or F-contiguous, exactly the size in bytes of
                what source sends (checked: a mismatch raises CollectiveMismatchError naming
                both ranks; over MPI the job is then aborted, as the sender may wait for
                this rank).
            source (int): the sending rank 0..size-1, or ringcoll.ANY_SOURCE (MPI_ANY_SOURCE:
                any rank). Anything else raises InvalidArgumentError.
            tag (int): 0..1023, as passed to the send.
            status (ringcoll.Status, optional): filled in with the message's source (the
                sender's rank: what a receive from ANY_SOURCE needs), tag and nbytes.

        Returns:
            out, holding the message (as before wildcards existed: the sender is in status).

        Example::

            if comm.rank == 0:                  # one message from every other rank
                st = ringcoll.Status()
                for _ in range(comm.size - 1):
                    got = comm.recv(np.empty(1, int), ringcoll.ANY_SOURCE, status=st)
                    assert got[0] == st.source  # each sender sent its own rank
            else:
                comm.send(np.array([comm.rank]), dest=0)
        """
        return self._messages.recv(out, source, tag, status)

    def isend(self, x, dest, tag=0):
        """Start sending x to rank dest; returns a Request (wait() returns None).

        Do not modify x until wait() returns. Sending to this rank itself is allowed: post
        the matching irecv (or recv) on this rank, then wait.
        """
        return self._messages.isend(x, dest, tag)

    def irecv(self, out, source, tag=0):
        """Start receiving a message from rank source (or ringcoll.ANY_SOURCE: any rank)
        into out; returns a Request whose wait() returns out once the message has arrived
        (its size checked as in recv), after which `request.source` is the sender's rank.
        Do not read or write out before then. Receives match messages by MPI's rules (see
        recv): one posted earlier matches first, wildcard or not.

        Example::

            req = comm.irecv(np.empty(4), ringcoll.ANY_SOURCE, tag=3)
            data = req.wait()
            print(req.source)   # the rank that sent it
        """
        return self._messages.irecv(out, source, tag)

    def sendrecv(self, x, dest, out, source=None, tag=0):
        """Send x to dest and receive from source (default: dest) into out, at once: no
        deadlock whatever the other ranks do first (a ring shift, a pairwise exchange, a
        pipeline stage passing activations on and gradients back). Returns out.

        Example::

            # a ring shift: every rank gets its left neighbour's rank
            left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
            got = comm.sendrecv(np.array([comm.rank]), right, np.empty(1, int), left)
        """
        return self._messages.sendrecv(x, dest, out, source, tag)

    # -- groups, traces and lifetime -----------------------------------------------------------
    def split(self, color, key=0):
        """A Communicator over the ranks that passed the same color, ordered by (key, rank).

        Collective over this communicator. color=None: this rank joins no group, gets None.
        """
        self._g.check_open("split")
        self.wait_all()
        t = self._g.t
        sub = self._runner.run(Plan("split", None, None, lambda: t.split(color, key)))
        if sub is None:
            return None
        o = self.options
        return Communicator(transport=sub, local_size=o.local_size, algorithm=o.algorithm,
                            segment_bytes=o.segment_bytes, debug=o.debug, timeout=o.timeout,
                            cost_model=self.cost_model,
                            tuning=self.tuning if self.tuning is not None else False,
                            cuda_aware=o.cuda_aware, staging_bytes=o.staging_bytes)

    def window(self, initial):
        """One-sided memory: a ringcoll Window whose part on this rank starts as `initial`.

        Collective over this communicator. `initial` is a 1-D NumPy array of int32, int64,
        uint32, uint64, float32 or float64 (the dtypes MPI adds atomically), the same dtype on
        every rank, any size per rank (0 too). Then any rank may, without the owner's
        participation: win.add(values, target, offset) (target's elements += values),
        win.fetch(out, target, offset) and win.fetch_add(value, target, offset) (an atomic
        counter). Each call is complete when it returns; concurrent calls on one element are
        atomic. Over MPI: MPI_Win_allocate with a passive-target epoch for the window's life
        (ringcoll/transport/mpi.py). win.close() is collective. See ringcoll.AsyncSGD.

        Example::

            win = comm.window(np.zeros(1, np.int64))        # a counter on every rank
            ticket = win.fetch_add(1, 0, 0)                 # rank 0's, bumped by this rank
            comm.barrier(); win.close()
        """
        self._g.check_open("window")
        ctx = where(self.rank, "window")
        if not isinstance(initial, np.ndarray) or initial.ndim != 1 \
                or initial.dtype.name not in WINDOW_DTYPES:
            raise InvalidArgumentError(
                f"{ctx}initial must be a 1-D NumPy array of one of {', '.join(WINDOW_DTYPES)}, "
                f"got {getattr(initial, 'dtype', type(initial).__name__)} of shape "
                f"{getattr(initial, 'shape', None)}")
        make = getattr(self._g.t, "window", None)
        if make is None:
            raise InvalidArgumentError(f"{ctx}this communicator's transport "
                                       f"({type(self._g.t).__name__}) has no one-sided memory; "
                                       "use an MPI or thread communicator")
        # every rank must agree on the dtype first: MPI would scale offsets by each rank's
        # own element size and add mismatched bytes, silently
        codes = self.allgather(np.array([WINDOW_DTYPES.index(initial.dtype.name)]))
        if len(set(codes.tolist())) > 1:
            raise InvalidArgumentError(f"{ctx}every rank must pass the same dtype; the ranks "
                                       f"passed {[WINDOW_DTYPES[c] for c in codes]}")
        return self._runner.run(Plan("window", None, None,
                                     lambda: make(np.ascontiguousarray(initial))))

    @contextmanager
    def trace(self, trace=None, payloads=False):
        """Record every message this rank sends and receives inside the with-block.

        Yields a ringcoll.Trace (or fills `trace`, which several thread ranks may share):
        one Message per message sent (src, dst, tag, nbytes, collective, seq, step, t_start,
        t_end; see ringcoll.transport.trace) and one Receive per message received. Over MPI
        each process records only its own rank's traffic; `t.gather(comm)` after the block
        collects every rank's on every rank. Not itself collective: call it on every rank
        around the same calls. Outside the block nothing is recorded and nothing costs more.

        payloads=True also keeps a copy of what each message carried (`msg.payload`) and
        where it came from (`msg.offset_in(x)`: its element offset in x, or None for a
        scratch buffer); for a shared `trace`, create it as Trace(payloads=True).

        Example::

            with comm.trace(payloads=True) as t:
                comm.allreduce(x, algorithm="ring", out=y)
            t.bytes_sent(comm.rank)   # 2(p-1)/p * x.nbytes plus the ring's 48-byte header
            [(m.dst, m.offset_in(x), m.payload) for m in t]   # None: sent from y or scratch
        """
        self._g.check_open("trace")
        if trace is not None and payloads and not trace.payloads:
            raise InvalidArgumentError(f"{where(self.rank, 'trace')}payloads=True with a trace "
                                       "made without them; pass Trace(payloads=True) instead")
        self.wait_all()  # a pending collective runs on the transport it was built on
        trace = Trace(payloads=payloads) if trace is None else trace
        inner = self._g.t
        self._swap_transport(TracingTransport(inner, trace))
        ok = False
        try:
            yield trace
            ok = True
        finally:
            if ok:
                self.wait_all()  # the traced non-blocking collectives finish traced
            self._swap_transport(inner)

    def _swap_transport(self, transport):
        """Run on `transport` from now on; the replay and every cached schedule, bound to the
        old one, go (the next call builds them afresh)."""
        self._g.sides.swap(transport)
        self._runner.forget()

    def wait_all(self):
        """Wait for every outstanding non-blocking collective."""
        self._runner.wait_all()

    def close(self):
        """Finish outstanding work and free the duplicated communicator (collective: every
        rank calls it). Later collectives raise CommunicatorClosedError; closing twice is
        harmless."""
        if self._g.closed:
            return
        self.wait_all()
        self._runner.shutdown()
        self._g.sides.close()  # the node tiers' shared memory (collective)
        self._g.sides.devices.clear()  # their transports wrap the host's: nothing else to free
        self._g.closed = True
        self._messages.close()
        self._g.t.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Close; but if an exception escapes the with-block on one rank, the others may wait
        for this rank forever: over MPI the error is printed and the job aborted (as
        `python -m mpi4py` does), unless every rank raised it alike (a failed ringcoll check).
        """
        if (exc is not None and self.size > 1 and not self._g.closed
                and not getattr(exc, "ringcoll_agreed", False)):
            self._g.closed = True  # no collective can run on it any more: nothing to wait for
            self._runner.shutdown(wait=False)
            # MPI: print it and abort the job; threads: the other ranks stop, exc propagates
            self._g.t.fail(exc, "an exception escaped `with Communicator()` on this rank, and "
                           "the other ranks would wait for it in their next collective")
        self.close()
