"""Communicator: the user's entry point.

It owns a transport (MPI on a duplicated communicator, or threads), knows rank, size and the
node topology, caches scratch buffers and partitions, validates every argument, picks the
algorithm and runs it. Algorithms never see any of this: they get a transport and flat views.

Host or device: every call's buffers live on one side (_Side), decided once per call from the
input. NumPy arrays use the communicator's own transport and workspace; CuPy arrays use a device
side per GPU, made on first use: the same transport wrapped by transport.device (CUDA-aware, or
staged through pinned host memory), a workspace in device memory, and CUDA reduction kernels.
"""

import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import numpy as np

from . import checks
from .algorithms import ALLREDUCE, ALLREDUCE_NAMES, CostModel
from .algorithms import alltoall as alltoall_alg
from .algorithms import barrier as barrier_alg
from .algorithms import (bruck, hierarchical, native, rabenseifner, recursive_doubling, ring,
                         tree)
from .arrays import Partition, Workspace, array_module, check_dtype, flat_view, is_device, writeable
from .config import MPI_TIMEOUT, Options
from .errors import (CollectiveMismatchError, CommunicatorClosedError, InvalidArgumentError,
                     InvalidTypeError, PeerFailedError, RingcollError, where)
from .ops import check_op_dtype, get_op
from .transport.base import MAX_USER_TAG, p2p_tag
from .transport.trace import Trace, TracingTransport
from .tuning import resolve as resolve_tuning


class Request:
    """A non-blocking collective (iallreduce) or message (isend, irecv) in flight: wait()
    returns its result, test() polls.

    Once a collective has finished, `seconds` is how long it ran on the background thread (not
    counting its wait in the queue): the communication time that overlap can hide.
    """

    def __init__(self, future=None):
        self._future = future
        self.seconds = None

    def wait(self):
        """Block until the collective has finished and return its result (or raise its error)."""
        return self._future.result()

    def test(self):
        """True once the collective has finished; never blocks."""
        return self._future.done()


class _Side:
    """Where one call's buffers live: the transport and workspace that move them, their array
    module, and the reductions checked for them ((dtype, op) -> (ReduceOp, combine)).

    device is None on the host; on a GPU it is the CUDA device id, path says how device buffers
    travel ("cuda-aware" or "staged") and why_path why.
    """

    __slots__ = ("t", "ws", "xp", "reductions", "device", "path", "why_path")

    def __init__(self, t, ws, xp, device=None, path=None, why_path=None):
        self.t, self.ws, self.xp, self.reductions = t, ws, xp, {}
        self.device, self.path, self.why_path = device, path, why_path

    def on_stream(self, fn):
        """fn, run on the CuPy device and stream current now (a queued or non-blocking
        collective runs on the background thread, whose current stream is another)."""
        if self.device is None:
            return fn
        cupy = self.xp
        device, stream = cupy.cuda.Device(self.device), cupy.cuda.get_current_stream()

        def on_stream():
            with device, stream:
                return fn()
        return on_stream


class _MessageRequest(Request):
    """A non-blocking send or receive (Communicator.isend / irecv): wait() returns the receive
    buffer (None for a send) once the message has arrived (or left); test() polls."""

    def __init__(self, comm, req, call, result, keep=None):
        super().__init__()
        self._comm, self._req, self._call = comm, req, call
        self._result = result
        self._keep = keep  # a send's buffer (perhaps a contiguous copy) stays alive until done
        self._done = False

    def wait(self, poll=None):
        """Block until the message has arrived (or left); return the receive buffer (None
        for a send).

        poll: seconds to sleep between checks instead of blocking inside MPI. MPI's blocking
            wait spins on its core; where ranks outnumber cores, that spinning takes the core
            from a rank with work to do, and polling with a short sleep (50 us) gives it back
            (the pipeline example at 4 ranks on 2 cores: twice as fast). Still watched: the
            wait counts as one call, so RINGCOLL_TIMEOUT's watchdog fires if it never ends.
        """
        if not self._done:
            self._comm._point(f"wait for {self._call}", partial(_finish, self._req, poll))
            self._done, self._keep = True, None
        return self._result

    def test(self):
        if not self._done and self._comm._point(f"test of {self._call}",
                                                lambda t: t.test(self._req)):
            self._done, self._keep = True, None
        return self._done


def _finish(req, poll, t):
    """t.wait(req), after polling t.test(req) every `poll` seconds if poll is set. Over MPI
    the watchdog ends a poll that never succeeds (the wait is one call, standing still); a
    transport without one gets t.wait after its timeout, which then ends it (thread ranks:
    a CollectiveTimeoutError after twice the timeout in all)."""
    if poll:
        give_up = time.monotonic() + (getattr(t, "timeout", None) or 60.0)
        while not t.test(req) and time.monotonic() < give_up:
            time.sleep(poll)
    t.wait(req)


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

    Example::

        comm = ringcoll.Communicator()
        x = np.full(4, comm.rank, dtype=np.float32)
        comm.allreduce(x)   # every rank: [0+1+...+(p-1)] * 4
    """

    def __init__(self, comm=None, *, local_size=None, algorithm=None, segment_bytes=None,
                 debug=None, timeout=None, cost_model=None, tuning=None, transport=None,
                 cuda_aware=None, staging_bytes=None):
        self.options = Options.from_env(algorithm=algorithm, local_size=local_size,
                                        segment_bytes=segment_bytes, debug=debug, tuning=tuning,
                                        timeout=timeout, cuda_aware=cuda_aware,
                                        staging_bytes=staging_bytes)
        if self.options.algorithm not in ALLREDUCE_NAMES:
            raise InvalidArgumentError(
                f"unknown all-reduce algorithm {self.options.algorithm!r} (from algorithm= or "
                f"RINGCOLL_ALGO); choose one of {ALLREDUCE_NAMES}")
        # The shipped table was measured over MPI (native_allreduce marks that transport);
        # threads in one process time nothing like it, so they get it only when asked to.
        # Read before MPI is touched: a bad file fails fast, with nothing to clean up.
        self.tuning = resolve_tuning(self.options.tuning, builtin=transport is None
                                     or hasattr(transport, "native_allreduce"))
        if transport is None:
            from .transport.mpi import MPITransport  # only the MPI path needs mpi4py

            if comm is None:
                from mpi4py import MPI

                comm = MPI.COMM_WORLD
            seconds = self.options.timeout
            transport = MPITransport(comm, timeout=MPI_TIMEOUT if seconds is None else seconds)
        elif comm is not None:
            raise InvalidArgumentError("pass either an MPI communicator or a transport, not both")
        self._t = transport
        self._progress = transport.progress  # the running collective, for errors and watchdog
        self._closed = False
        self.rank, self.size = transport.rank, transport.size
        self.nodes = self._find_nodes()
        fitted = self.tuning.cost_model(self.size) if self.tuning is not None else None
        self.cost_model = cost_model or fitted or CostModel()
        self._ws = Workspace(self.options.segment_bytes)
        self._host = _Side(transport, self._ws, np)  # NumPy arrays
        self._devices = {}  # CUDA device id -> its _Side, made on first use
        self._auto = {}  # (nbytes, inplace) (or ("inner", nbytes)) -> the algorithm auto runs
        self._executor = None  # the thread that runs non-blocking collectives, once needed
        self._tail = None  # the last non-blocking collective submitted, while it may be pending
        self._plan = None  # the last allreduce with out=, to replay if called again the same
        self._printed = set()  # debug mode: the calls whose algorithm rank 0 has printed
        self._p2p = None  # the transport's point-to-point channel, once a message is sent

    # -- topology ------------------------------------------------------------------------
    def _find_nodes(self):
        k = self.options.local_size
        ids = ([r // k for r in range(self.size)] if k is not None else self._t.node_ids())
        nodes = {}
        for r, node in enumerate(ids):
            nodes.setdefault(node, []).append(r)
        return list(nodes.values())

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

    # -- running a collective: inline, or behind outstanding non-blocking ones --------------
    def _run(self, fn, collective, algorithm, fields=None, schedule=()):
        """Run fn() as one collective (see _execute), after any pending non-blocking ones."""
        job = partial(self._execute, fn, collective, algorithm, fields, schedule)
        if self._tail is not None:
            if not self._tail.done():
                self._tail = self._executor.submit(job)  # keep call order: run after them
                return self._tail.result()
            self._tail = None  # nothing pending: the replay fast path may run again
        return job()

    def _execute(self, fn, collective, algorithm, fields, schedule=()):
        """fn() between progress.begin and .end (the watchdog and error messages read them).

        In debug mode all ranks first compare their calls (checks.exchange_fingerprints);
        `fields` describes this rank's call; `schedule` lists the (peer, tag) of its bound
        steps (see Progress). An error every rank raises alike (a failed
        check) simply propagates. Any other error means this rank stopped part-way while its
        peers may wait for it forever: the transport's fail() handles it (MPI: abort the job).
        """
        progress = self._progress
        progress.begin(collective, algorithm, schedule)
        try:
            if self.options.debug:
                self._agree(collective, algorithm, fields)
            result = fn()
        except BaseException as exc:
            if not getattr(exc, "ringcoll_agreed", False):
                self._t.fail(exc)
            raise
        finally:
            progress.end()
        return result

    def _agree(self, collective, algorithm, fields):
        record = checks.fingerprint(self._progress.seq, collective,
                                    {"algorithm": algorithm, **(fields or {})})
        checks.compare(self._t, checks.exchange_fingerprints(self._t, record))
        if self.rank == 0 and algorithm is not None:  # each distinct call once, not per call
            key = (collective, algorithm, repr(fields))
            if key not in self._printed:
                self._printed.add(key)
                call = ", ".join(f"{k}={v}" for k, v in (fields or {}).items())
                print(f"ringcoll: {collective} #{self._progress.seq} ({call}) on {self.size} "
                      f"ranks -> {algorithm}", file=sys.stderr, flush=True)

    def _invalid(self, exc, collective):
        """This rank's arguments are invalid (exc is about to be raised). In debug mode the
        other ranks are told first, so they raise PeerFailedError instead of waiting."""
        if self.options.debug and not self._closed:
            self._run(lambda: None, collective, None, {"error": f"{type(exc).__name__}: {exc}"})

    def _check_open(self, collective):
        if self._closed:
            raise CommunicatorClosedError(
                f"{where(self.rank, collective)}this Communicator was closed; create a new "
                "one (ringcoll.Communicator(comm)) or call collectives before close()")

    def _submit(self, fn):
        if self._executor is None:
            if not getattr(self._t, "thread_multiple", True):
                raise RingcollError(
                    f"{where(self.rank, 'iallreduce')}non-blocking collectives run on a "
                    "background thread and need MPI_THREAD_MULTIPLE; initialise MPI with it "
                    "(mpi4py's default) or use the blocking allreduce")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ringcoll-progress")
        request = Request()

        def timed():
            start = time.perf_counter()
            try:
                return fn()
            finally:
                request.seconds = time.perf_counter() - start

        self._tail = request._future = self._executor.submit(timed)
        return request

    # -- argument checks ---------------------------------------------------------------------
    def _input(self, x, ctx):
        """(x as an array, its side), dtype checked: a CuPy array stays one."""
        if type(x) is not np.ndarray and is_device(x):
            check_dtype(x.dtype, ctx)
            return x, self._device_side(x, ctx)
        x = np.asarray(x)
        check_dtype(x.dtype, ctx)
        return x, self._host

    def _reduction(self, x, op, ctx):
        """(x as an array, the ReduceOp, its combine function, x's side), checked once per
        side, dtype and op name: on the hot path this is a type check and a dict lookup."""
        if type(x) is np.ndarray:
            side = self._host
        elif is_device(x):
            side = self._device_side(x, ctx)
        else:
            x, side = np.asarray(x), self._host
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

    def _device_side(self, x, ctx):
        """The _Side of CuPy array x's GPU: made on first use (its transport path decided and,
        in debug mode, printed); x must be on the current CuPy device."""
        cupy = array_module(x)
        device, current = x.device.id, cupy.cuda.runtime.getDevice()
        if device != current:
            raise InvalidArgumentError(
                f"{ctx}x is on GPU {device} but the current CuPy device is GPU {current}; call "
                f"the collective inside `with cupy.cuda.Device({device}):` (or make it current "
                f"with cupy.cuda.Device({device}).use())")
        side = self._devices.get(device)
        if side is None:
            from .transport.device import CupyDevice, for_device

            dev = CupyDevice(device)
            t, path, why = for_device(self._t, dev, self.options.cuda_aware,
                                      self.options.staging_bytes)
            side = self._devices[device] = _Side(
                t, Workspace(self.options.segment_bytes, empty=dev.empty), cupy, device,
                path, why)
            if self.options.debug:
                how = ("cuda-aware: device buffers go straight to MPI" if path == "cuda-aware"
                       else "staged via pinned host buffers, chunk "
                            f"{self.options.staging_bytes} B, double-buffered")
                print(f"ringcoll rank {self.rank}: CuPy arrays on GPU {device} -> {how} "
                      f"({why})", file=sys.stderr, flush=True)
        return side

    def _same_memory(self, out, side, ctx):
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

    def _output(self, out, shape, dtype, ctx, rows=False, side=None):
        """Validate a user's out= (or allocate one of shape and dtype, on x's side).

        rows=True: the collective writes axis-0 blocks through _rows_target, so any layout
        of out works; otherwise out must be contiguous (it is reduced into in memory order).
        """
        side = side or self._host
        if out is None:
            return side.xp.empty(shape, dtype)
        self._same_memory(out, side, ctx)
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

    @staticmethod
    def _rows_target(out):
        """(flat buffer to write the C-ordered result into, out or None to copy it into)."""
        if out.flags.c_contiguous:
            return out.reshape(-1), None
        # an F-ordered or strided out: one copy
        staging = array_module(out).empty(out.shape, out.dtype)
        return staging.reshape(-1), out

    def _elementwise(self, x, out, ctx, side=None):
        """(out, src, dst, copy_out) for an elementwise collective.

        src and dst are flat and in x's memory order (C, or F for an F-contiguous x; a strided
        x is copied to C once): every rank sends and reduces in the order of its x, which is
        why x must have the same layout on every rank, while out may have any contiguous
        layout. dst is out itself when out is laid out like x (src is dst when out is x);
        otherwise it is a staging buffer and copy_out() copies the result into out.
        """
        side = side or self._host
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
        self._output(out, x.shape, x.dtype, ctx, side=side)
        if xp.may_share_memory(x, out) and xp.shares_memory(x, out):
            raise InvalidArgumentError(f"{ctx}out overlaps x without being x; use out=x for "
                                       "in place or a separate buffer")
        if out.flags.c_contiguous == x.flags.c_contiguous:
            return out, src, flat_view(out), None
        staging = xp.empty(x.shape, x.dtype, order="C" if x.flags.c_contiguous else "F")
        return out, src, flat_view(staging), partial(xp.copyto, out, staging)

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
        plan = self._plan
        if (plan is not None and plan.x is x and plan.out is out and plan.op is op
                and plan.algorithm is algorithm and plan.dtype is x.dtype and self._tail is None):
            if plan.fields is not None:  # debug mode: the ranks still compare every call
                return self._execute(partial(_run_steps, plan.steps, out), *plan.current[:2],
                                     plan.fields, plan.current[2])
            progress = self._progress  # the same call as last time: replay its checked steps
            progress.seq += 1  # progress.begin, inlined: this is the small-message hot path
            progress.current, progress.at = plan.current, None
            try:
                for step in plan.steps:
                    step()
            except BaseException as exc:
                self._t.fail(exc)  # MPI: print it and abort the job; threads: stop the others
                raise
            progress.current = None  # progress.end(), inlined; fail() needs it still set
            return out
        steps, name, fields, schedule, result, side = self._checked_allreduce(
            x, op, algorithm, out, "allreduce")
        if out is not None and (isinstance(x, np.ndarray) or side.device is not None):
            self._plan = _Plan(x, out, op, algorithm, ("allreduce", name, schedule), steps,
                               fields)
        run = partial(_run_steps, steps, result)
        if side.device is not None:  # (a NumPy call skips even the method call)
            run = side.on_stream(run)
        return self._run(run, "allreduce", name, fields, schedule)

    def iallreduce(self, x, op="sum", algorithm=None, out=None):
        """Non-blocking allreduce: returns a Request; req.wait() gives the result.

        The collective runs on the communicator's background thread, so it progresses while
        the caller computes. Collectives called while it is pending (blocking or not) queue
        behind it on that thread, so everything runs in call order; once nothing is pending,
        blocking calls run on the caller's thread again. Do not touch x or out until wait()
        returns. CuPy arrays: the collective's copies and kernels go on the CuPy stream that is
        current at this call (and its device), as if called here.
        """
        steps, name, fields, schedule, result, side = self._checked_allreduce(
            x, op, algorithm, out, "iallreduce")
        return self._submit(partial(self._execute,
                                    side.on_stream(partial(_run_steps, steps, result)),
                                    "allreduce", name, fields, schedule))

    def _checked_allreduce(self, x, op, algorithm, out, caller):
        """(steps, algorithm, debug fields, schedule, result, side) of a checked allreduce
        call; schedule lists the bound steps' (peer, tag) for Progress. A bad argument is
        raised after debug mode has told the other ranks (_invalid)."""
        try:
            steps, name, fields, result, side = self._prepare_allreduce(
                x, op, algorithm, out, where(self.rank, caller))
        except InvalidArgumentError as exc:
            self._invalid(exc, "allreduce")
            raise
        return steps, name, fields, [getattr(s, "at", None) for s in steps], result, side

    def _prepare_allreduce(self, x, op, algorithm, out, ctx):
        """(steps, algorithm, debug fields, result, side) of a checked allreduce call."""
        self._check_open("allreduce")
        x, op, combine, side = self._reduction(x, op, ctx)
        out, src, dst, copy_out = self._elementwise(x, out, ctx, side)
        name = self._pick(algorithm, dst.nbytes, ctx, inplace=src is dst)
        if name == "native":
            native.check(side.t, dst.dtype, ctx)
        fields = (self._fields(op, x, in_place=src is dst, **_memory(side))
                  if self.options.debug else None)
        steps = self._allreduce_steps(name, op, combine, src, dst, side)
        if copy_out is not None:
            steps.append(copy_out)
        return steps, name, fields, out, side

    @staticmethod
    def _fields(op=None, x=None, **more):
        """This rank's call as debug mode's fingerprint records it."""
        fields = {}
        if op is not None:
            fields["op"] = op.name
        if x is not None:
            fields["dtype"], fields["shape"] = x.dtype.name, list(x.shape)
            if x.ndim > 1:  # the order x is sent and reduced in (see _elementwise)
                fields["layout"] = "F" if x.flags.f_contiguous and not x.flags.c_contiguous else "C"
        fields.update(more)
        return fields

    def _allreduce_steps(self, name, op, combine, src, dst, side):
        """The checked call as a list of zero-argument steps: what allreduce runs, and what it
        keeps to replay when called again with the same arrays (recursive doubling,
        Rabenseifner and Bruck are fully unrolled; the others are one step). The ring's last
        reduction step also divides for 'avg' (one pass over n/p, not a later one over n)."""
        t, ws = side.t, side.ws
        fused = name == "ring" and op.name == "avg" and op.fuses_finish(dst.dtype, self.size)
        steps = []
        if name in ("ring", "hierarchical"):  # segments can hide a count mismatch: check it
            steps.append(partial(checks.neighbour_check, t, "allreduce", dst.size, dst.dtype,
                                 op.name))
        if name == "native":
            steps.append(native.bind_allreduce(t, src, dst, op.mpi_name))
        else:
            if op.prescales(dst.dtype, self.size):  # avg of float16/bfloat16: src / p into dst
                steps.append(partial(op.start, src, dst, self.size, combine))
                src = dst
            if name in _SCHEDULES:
                steps += _SCHEDULES[name](t, src, dst, combine, ws)
            elif name == "hierarchical":
                inner = ALLREDUCE[self._pick_inner(dst.nbytes)]
                steps.append(partial(hierarchical.allreduce, t, src, dst, combine, ws,
                                     self.nodes, inner))
            elif fused:
                steps.append(partial(ring.allreduce, t, src, dst, combine, ws,
                                     combine.final(self.size)))
            else:
                steps.append(partial(ALLREDUCE[name], t, src, dst, combine, ws))
        if op.name == "avg" and self.size > 1 and dst.size and not fused:
            steps.append(partial(op.finish, dst, self.size, combine))
        return steps

    def _pick(self, algorithm, nbytes, ctx, inplace=False):
        name = algorithm or self.options.algorithm
        if name not in ALLREDUCE_NAMES:
            raise InvalidArgumentError(
                f"{ctx}unknown algorithm {name!r}; choose one of {ALLREDUCE_NAMES}")
        if name == "auto":
            name = self.auto_algorithm(nbytes, inplace)
        return name

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
        key = (nbytes, inplace)
        name = self._auto.get(key)
        if name is None:
            measured = (self.tuning.choose(nbytes, self.size, self.nodes, inplace)
                        if self.tuning is not None else None)
            name = self._auto[key] = measured or self.cost_model.choose_allreduce(
                nbytes, self.size, self.nodes)
        return name

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
        side = self._device_side(x, where(self.rank, "device_path"))
        return side.path, side.why_path

    def _pick_inner(self, nbytes):
        """The cross-node algorithm of hierarchical, for a shard of nbytes / local size."""
        key = ("inner", nbytes)
        name = self._auto.get(key)
        if name is None:
            name = self._auto[key] = self.cost_model.cross_node(nbytes, self.nodes)[0]
        return name

    # -- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, x, op="sum", out=None, algorithm=None):
        """Reduce x over all ranks and give rank r the r-th block of the result.

        x is split along axis 0 like np.array_split(x, size): the first x.shape[0] % size
        blocks get one more row.

        Args:
            x (np.ndarray): at least 1-D; same shape and dtype on every rank.
            op: as for allreduce.
            out (np.ndarray): where to write this rank's block.
            algorithm (str): "ring" (also "auto") or "native".

        Returns:
            np.ndarray: this rank's block, shape (rows_r,) + x.shape[1:].

        Example::

            # 2 ranks, x = np.arange(4) + rank: rank 0 gets [1, 3], rank 1 gets [5, 7]
        """
        return self._collective("reduce_scatter", self._prepare_reduce_scatter, x, op, out,
                                algorithm)

    def _collective(self, collective, prepare, *args):
        """Check the arguments (prepare returns run, algorithm, debug fields), then run."""
        self._check_open(collective)
        try:
            run, name, fields = prepare(where(self.rank, collective), *args)
        except InvalidArgumentError as exc:
            self._invalid(exc, collective)
            raise
        return self._run(run, collective, name, fields)

    def _prepare_reduce_scatter(self, ctx, x, op, out, algorithm):
        x, op, combine, side = self._reduction(x, op, ctx)
        t, ws = side.t, side.ws
        x = _as_rows(x)
        name = self._pick_simple(algorithm, "ring", ctx)
        part = ws.row_partition(x.shape[0], self.size, _row_elems(x))
        base, extra = divmod(x.shape[0], self.size)
        rows = base + (1 if self.rank < extra else 0)
        out = self._output(out, (rows,) + x.shape[1:], x.dtype, ctx, rows=True, side=side)
        src, (dst, copy_to) = x.reshape(-1), self._rows_target(out)
        if name == "native":
            native.check(t, x.dtype, ctx)
        # avg: the division in the last ring step
        fused = op.name == "avg" and name != "native" and op.fuses_finish(x.dtype, self.size)

        def run():
            if name == "native":
                t.native_reduce_scatter(src, dst, part.counts, op.mpi_name)
            else:
                checks.neighbour_check(t, "reduce_scatter", src.size, src.dtype, op.name)
                # The last step reduces straight into dst; work carries the partial sums of
                # the other blocks, of which there are none at p = 2 (unless avg prescales).
                prescales = op.prescales(src.dtype, self.size)
                work = ws.scratch("rs.work", src.size if self.size > 2 or prescales else 0,
                                  src.dtype)
                mine = op.start(src, work, self.size, combine)  # work itself if avg prescales
                ring.reduce_scatter(t, mine, work, part, combine, ws, result=dst,
                                    final=combine.final(self.size) if fused else None)
            if not fused:
                op.finish(dst, self.size, combine)
            if copy_to is not None:
                copy_to[...] = dst.reshape(copy_to.shape)
            return out

        fields = self._fields(op, x, **_memory(side)) if self.options.debug else None
        return run if side.device is None else side.on_stream(run), name, fields

    # -- all-gather --------------------------------------------------------------------------
    def allgather(self, x, out=None, algorithm=None):
        """Concatenate every rank's x along axis 0, on every rank.

        Ranks may pass different lengths on axis 0; the other dimensions and the dtype must
        agree (checked: a mismatch raises CollectiveMismatchError on every rank).

        Returns:
            np.ndarray: shape (sum of rows,) + x.shape[1:]; rank 0's rows first.

        Example::

            # 3 ranks, x = np.array([rank]): every rank gets [0, 1, 2]
        """
        return self._collective("allgather", self._prepare_allgather, x, out, algorithm)

    def _prepare_allgather(self, ctx, x, out, algorithm):
        x, side = self._rows_input(x, ctx)
        name = self._pick_simple(algorithm, "ring", ctx)
        if name == "native":
            native.check(side.t, None, ctx)
        if out is not None:  # all but its row count can be checked now; that comes later
            rows = out.shape[0] if getattr(out, "ndim", 0) else -1
            self._output(out, (rows,) + x.shape[1:], x.dtype, ctx, rows=True, side=side)
        src = x.reshape(-1)

        def run():
            rows = self._exchange_rows(x, out, name)  # host numbers, over the host transport
            part = Partition([r * _row_elems(x) for r in rows])
            result = self._output(out, (sum(rows),) + x.shape[1:], x.dtype, ctx, rows=True,
                                  side=side)
            dst, copy_to = self._rows_target(result)
            if name == "native":
                side.t.native_allgather(src, dst, part.counts)
            else:
                dst[part.slices[self.rank]] = src
                ring.allgather(side.t, dst, part, side.ws)
            if copy_to is not None:
                copy_to[...] = dst.reshape(copy_to.shape)
            return result

        # axis 0 may differ between ranks: the fingerprint leaves it out
        fields = (self._fields(dtype=x.dtype.name, row_shape=list(x.shape[1:]), **_memory(side))
                  if self.options.debug else None)
        return run if side.device is None else side.on_stream(run), name, fields

    def _exchange_rows(self, x, out, name):
        """Every rank's row count, once all ranks know that dtypes, trailing shapes and the
        row counts of the out= arrays agree (else every rank raises, so none is left waiting).

        The 5 numbers per rank travel by ringcoll's ring all-gather, or by MPI's own for
        algorithm='native' (so the native baseline pays no ringcoll step).
        """
        layout = zlib.crc32(f"{x.dtype.str} {x.shape[1:]}".encode())  # same in every process
        out_rows = -1 if out is None else out.shape[0]
        mine = np.array([x.shape[0], _row_elems(x), x.ndim, layout, out_rows], dtype=np.int64)
        meta = np.empty((self.size, mine.size), dtype=np.int64)
        meta[self.rank] = mine
        flat = meta.reshape(-1)
        part = self._ws.partition(flat.size, self.size)
        if name == "native":
            self._t.native_allgather(mine, flat, part.counts)
        else:
            ring.allgather(self._t, flat, part, self._ws)
        ctx = f"ringcoll rank {self.rank}, {self._progress.call()}: "
        bad = [r for r in range(self.size) if tuple(meta[r, 1:4]) != tuple(mine[1:4])]
        if bad:
            raise checks.agreed(CollectiveMismatchError(
                f"{ctx}rank(s) {bad} passed a different dtype or trailing shape than this rank "
                f"({x.dtype}, {x.shape[1:]}); only axis 0 may differ between ranks"))
        total = int(meta[:, 0].sum())
        wrong = [r for r in range(self.size) if meta[r, 4] not in (-1, total)]
        if self.rank in wrong:
            raise checks.agreed(InvalidArgumentError(
                f"{ctx}out has shape {out.shape}, but the ranks pass {total} rows in all; pass "
                f"out of shape {(total,) + x.shape[1:]} or out=None"))
        if wrong:
            raise checks.agreed(PeerFailedError(
                f"{ctx}rank(s) {wrong} passed out= with the wrong row count (the result has "
                f"{total} rows), so no rank runs this allgather"))
        return [int(v) for v in meta[:, 0]]

    # -- broadcast, reduce, all-to-all, barrier ---------------------------------------------
    def broadcast(self, x, root=0, algorithm=None):
        """Copy root's x into x on every rank, in place; returns x.

        Example::

            x = np.arange(3) if comm.rank == 0 else np.empty(3, dtype=int)
            comm.broadcast(x, root=0)   # every rank: [0, 1, 2]
        """
        return self._collective("broadcast", self._prepare_broadcast, x, root, algorithm)

    def _prepare_broadcast(self, ctx, x, root, algorithm):
        if isinstance(x, np.ndarray):
            side = self._host
        elif is_device(x):
            side = self._device_side(x, ctx)
        else:
            raise InvalidTypeError(f"{ctx}broadcast works in place and needs a NumPy (or CuPy) "
                                   f"array, got {type(x).__name__}")
        check_dtype(x.dtype, ctx)
        self._check_root(root, ctx)
        name = self._pick_simple(algorithm, "tree", ctx)
        buf = flat_view(x)
        if buf is None:
            raise InvalidArgumentError(f"{ctx}x is not contiguous; broadcast into "
                                       "np.ascontiguousarray(x) and copy back")
        if self.rank != root and not writeable(x):
            raise InvalidArgumentError(f"{ctx}x is read-only; broadcast needs to write into it")
        if name == "native":
            native.check(side.t, None, ctx)

        def run():
            if name == "native":
                side.t.native_bcast(buf, root)
            else:
                tree.broadcast(side.t, buf, root, side.ws)
            return x

        fields = (self._fields(x=x, root=int(root), **_memory(side)) if self.options.debug
                  else None)
        return run if side.device is None else side.on_stream(run), name, fields

    def reduce(self, x, op="sum", root=0, out=None, algorithm=None):
        """Reduce x over all ranks onto root: returns the result on root, None elsewhere.

        Example::

            # 4 ranks, x = np.array([rank]): rank 0 gets [6], the others None
        """
        return self._collective("reduce", self._prepare_reduce, x, op, root, out, algorithm)

    def _prepare_reduce(self, ctx, x, op, root, out, algorithm):
        x, op, combine, side = self._reduction(x, op, ctx)
        t, ws = side.t, side.ws
        self._check_root(root, ctx)
        name = self._pick_simple(algorithm, "tree", ctx)
        is_root = self.rank == root
        copy_out = None
        if is_root:
            out, src, dst, copy_out = self._elementwise(x, out, ctx, side)
        else:
            src = flat_view(x)
            if src is None:
                src = side.xp.ascontiguousarray(x).reshape(-1)
            dst = None
        if name == "native":
            native.check(t, x.dtype, ctx)

        def run():
            if name == "native":
                t.native_reduce(src, dst, root, op.mpi_name)
            else:
                acc = dst if is_root else ws.scratch("reduce.acc", src.size, src.dtype)
                mine = op.start(src, acc, self.size, combine)  # acc itself if avg prescales
                tree.reduce(t, mine, acc, root, combine, ws)
            if not is_root:
                return None
            op.finish(dst, self.size, combine)
            if copy_out is not None:
                copy_out()
            return out

        fields = (self._fields(op, x, root=int(root), **_memory(side)) if self.options.debug
                  else None)
        return run if side.device is None else side.on_stream(run), name, fields

    def alltoall(self, x, out=None, algorithm=None):
        """Send block j of x (axis 0 split into size equal blocks) to rank j.

        Returns:
            np.ndarray: same shape as x; block i came from rank i.

        Example::

            # 2 ranks, x = np.array([10 * rank, 10 * rank + 1])
            # rank 0 gets [0, 10], rank 1 gets [1, 11]
        """
        return self._collective("alltoall", self._prepare_alltoall, x, out, algorithm)

    def _prepare_alltoall(self, ctx, x, out, algorithm):
        x, side = self._rows_input(x, ctx)
        if x.shape[0] % self.size:
            raise InvalidArgumentError(
                f"{ctx}x.shape[0] = {x.shape[0]} must be a multiple of the communicator size "
                f"{self.size} (one equal block per rank)")
        name = self._pick_simple(algorithm, "pairwise", ctx)
        out = self._output(out, x.shape, x.dtype, ctx, rows=True, side=side)
        src, (dst, copy_to) = x.reshape(-1), self._rows_target(out)
        part = side.ws.row_partition(x.shape[0], self.size, _row_elems(x))
        if name == "native":
            native.check(side.t, None, ctx)

        def run():
            if name == "native":
                side.t.native_alltoall(src, dst)
            else:
                alltoall_alg.alltoall(side.t, src, dst, part)
            if copy_to is not None:
                copy_to[...] = dst.reshape(copy_to.shape)
            return out

        fields = self._fields(x=x, **_memory(side)) if self.options.debug else None
        return run if side.device is None else side.on_stream(run), name, fields

    def barrier(self, algorithm=None):
        """Return only once every rank has called barrier()."""
        self._collective("barrier", self._prepare_barrier, algorithm)

    def _prepare_barrier(self, ctx, algorithm):
        name = self._pick_simple(algorithm, "dissemination", ctx)
        if name == "native":
            native.check(self._t, None, ctx)

        def run():
            if name == "native":
                self._t.native_barrier()
            else:
                barrier_alg.barrier(self._t, self._ws)

        return run, name, {} if self.options.debug else None

    def _pick_simple(self, algorithm, own, ctx):
        """Collectives with one ringcoll algorithm, `own`: 'auto' (or None) means that one."""
        if algorithm in (None, "auto", own):
            return own
        if algorithm == "native":
            return "native"
        raise InvalidArgumentError(
            f"{ctx}unknown algorithm {algorithm!r}; use 'auto', {own!r} or 'native'")

    def _rows_input(self, x, ctx):
        x, side = self._input(x, ctx)
        return _as_rows(x), side

    def _check_root(self, root, ctx):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise InvalidArgumentError(f"{ctx}root={root!r} is not a rank of this communicator "
                                       f"(0..{self.size - 1})")

    # -- point-to-point ------------------------------------------------------------------------
    # The user's messages travel on the transport's channel (transport/base.py): their wire
    # tags can never match a collective's, and they have their own progress record, so they
    # run on the caller's thread even while non-blocking collectives run in the background.
    # They are not collectives: debug mode does not compare them across ranks.
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
        buf, dest, wire = self._message("send", x, dest, "dest", tag, outgoing=True)
        if dest == self.rank:
            raise InvalidArgumentError(
                f"{where(self.rank, 'send')}a blocking send to this rank itself can wait "
                "forever for a receive it has not posted yet; use isend (then recv and wait) "
                "or sendrecv")
        self._point(f"send to {dest}", lambda t: t.send(buf, dest, wire))

    def recv(self, out, source, tag=0):
        """Receive a message from rank source into out (in place); returns out.

        Args:
            out (np.ndarray): writeable, C- or F-contiguous, exactly the size in bytes of
                what source sends (checked: a mismatch raises CollectiveMismatchError naming
                both ranks; over MPI the job is then aborted, as the sender may wait for
                this rank).
            source (int): the sending rank (no wildcards).
            tag (int): 0..1023, as passed to the send.
        """
        buf, source, wire = self._message("recv", out, source, "source", tag)
        self._point(f"recv from {source}", lambda t: t.recv(buf, source, wire))
        return out

    def isend(self, x, dest, tag=0):
        """Start sending x to rank dest; returns a Request (wait() returns None).

        Do not modify x until wait() returns. Sending to this rank itself is allowed: post
        the matching irecv (or recv) on this rank, then wait.
        """
        buf, dest, wire = self._message("isend", x, dest, "dest", tag, outgoing=True)
        req = self._point(f"isend to {dest}", lambda t: t.isend(buf, dest, wire))
        return _MessageRequest(self, req, f"isend to {dest}", None, keep=buf)

    def irecv(self, out, source, tag=0):
        """Start receiving a message from rank source into out; returns a Request whose
        wait() returns out once the message has arrived (its size checked as in recv).
        Do not read or write out before then."""
        buf, source, wire = self._message("irecv", out, source, "source", tag)
        req = self._point(f"irecv from {source}", lambda t: t.irecv(buf, source, wire))
        return _MessageRequest(self, req, f"irecv from {source}", out)

    def sendrecv(self, x, dest, out, source=None, tag=0):
        """Send x to dest and receive from source (default: dest) into out, at once: no
        deadlock whatever the other ranks do first (a ring shift, a pairwise exchange, a
        pipeline stage passing activations on and gradients back). Returns out.

        Example::

            # a ring shift: every rank gets its left neighbour's rank
            left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
            got = comm.sendrecv(np.array([comm.rank]), right, np.empty(1, int), left)
        """
        send, dest, wire = self._message("sendrecv", x, dest, "dest", tag, outgoing=True)
        recv, source, _ = self._message("sendrecv", out, dest if source is None else source,
                                        "source", tag)
        self._point(f"sendrecv to {dest} from {source}",
                    lambda t: t.sendrecv(send, dest, recv, source, wire))
        return out

    def _message(self, call, x, peer, role, tag, outgoing=False):
        """(x as a flat buffer, peer, wire tag) of a point-to-point call, all checked.

        outgoing: x is sent (any layout: a non-contiguous x is copied); otherwise x is
        received into (a writeable contiguous NumPy array, refused otherwise)."""
        self._check_open(call)
        ctx = where(self.rank, call)
        if outgoing:
            x, side = self._input(x, ctx)
            if side is not self._host:
                raise InvalidTypeError(
                    f"{ctx}point-to-point messages take NumPy arrays, not CuPy ones (yet); "
                    "send cupy.asnumpy(x) and copy the received array to the GPU")
            buf = flat_view(x)
            if buf is None:
                buf = np.ascontiguousarray(x).reshape(-1)
        else:
            if not isinstance(x, np.ndarray):
                raise InvalidTypeError(f"{ctx}out must be a NumPy array to receive into, got "
                                       f"{type(x).__name__}")
            check_dtype(x.dtype, ctx)
            if not x.flags.writeable:
                raise InvalidArgumentError(f"{ctx}out is read-only; pass a writeable array")
            buf = flat_view(x)
            if buf is None:
                raise InvalidArgumentError(
                    f"{ctx}out is not contiguous; receive into a C- or F-contiguous array "
                    "(np.empty(shape, dtype)) and copy it where you need it")
        if (isinstance(peer, bool) or not isinstance(peer, (int, np.integer))
                or not 0 <= peer < self.size):
            raise InvalidArgumentError(f"{ctx}{role}={peer!r} is not a rank of this "
                                       f"communicator (0..{self.size - 1})")
        if (isinstance(tag, bool) or not isinstance(tag, (int, np.integer))
                or not 0 <= tag <= MAX_USER_TAG):
            raise InvalidArgumentError(f"{ctx}tag={tag!r} must be an integer in "
                                       f"0..{MAX_USER_TAG}")
        return buf, int(peer), p2p_tag(tag)

    def _point(self, call, fn):
        """fn(channel) as one point-to-point call, watched like a collective (the watchdog,
        error messages); an error part-way goes to the channel's fail() as a collective's
        does (MPI: the job is aborted, since the peer may wait for this rank forever)."""
        t = self._p2p
        if t is None:
            t = self._p2p = self._t.channel()
        progress = t.progress
        progress.begin(call, None)
        try:
            return fn(t)
        except BaseException as exc:
            t.fail(exc)
            raise
        finally:
            progress.end()

    # -- groups and lifetime -------------------------------------------------------------------
    def split(self, color, key=0):
        """A Communicator over the ranks that passed the same color, ordered by (key, rank).

        Collective over this communicator. color=None: this rank joins no group, gets None.
        """
        self._check_open("split")
        self.wait_all()
        sub = self._run(partial(self._t.split, color, key), "split", None)
        if sub is None:
            return None
        o = self.options
        return Communicator(transport=sub, local_size=o.local_size, algorithm=o.algorithm,
                            segment_bytes=o.segment_bytes, debug=o.debug, timeout=o.timeout,
                            cost_model=self.cost_model,
                            tuning=self.tuning if self.tuning is not None else False,
                            cuda_aware=o.cuda_aware, staging_bytes=o.staging_bytes)

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
        self._check_open("trace")
        if trace is not None and payloads and not trace.payloads:
            raise InvalidArgumentError(f"{where(self.rank, 'trace')}payloads=True with a trace "
                                       "made without them; pass Trace(payloads=True) instead")
        self.wait_all()  # a pending collective runs on the transport it was built on
        trace = Trace(payloads=payloads) if trace is None else trace
        inner = self._t
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
        """Run on `transport` from now on. The replay plan and the cached schedules hold steps
        and views bound to the old one, so they go: the next call builds them afresh. So do
        the device sides, whose transports wrap the old one."""
        self._t = self._host.t = transport
        self._devices.clear()
        self._plan = None
        self._ws.drop_plans()

    def wait_all(self):
        """Wait for every outstanding non-blocking collective."""
        if self._tail is not None:
            self._tail.result()

    def close(self):
        """Finish outstanding work and free the duplicated communicator (collective: every
        rank calls it). Later collectives raise CommunicatorClosedError; closing twice is
        harmless."""
        if self._closed:
            return
        self.wait_all()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._plan = None  # its steps are bound to the communicator freed below
        self._devices.clear()  # their transports wrap self._t: nothing else of theirs to free
        self._closed = True
        if self._p2p is not None and self._p2p is not self._t:
            self._p2p.close()
        self._t.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Close; but if an exception escapes the with-block on one rank, the others may wait
        for this rank forever: over MPI the error is printed and the job aborted (as
        `python -m mpi4py` does), unless every rank raised it alike (a failed ringcoll check).
        """
        if (exc is not None and self.size > 1 and not self._closed
                and not getattr(exc, "ringcoll_agreed", False)):
            self._closed = True  # no collective can run on it any more: nothing to wait for
            self._plan = None
            if self._executor is not None:
                self._executor.shutdown(wait=False)
            # MPI: print it and abort the job; threads: the other ranks stop, exc propagates
            self._t.fail(exc, "an exception escaped `with Communicator()` on this rank, and "
                         "the other ranks would wait for it in their next collective")
        self.close()


class _Plan:
    """An allreduce call's arguments and its checked steps. It holds x and out, so their ids
    cannot be reused while it lives: `plan.x is x` proves the very same arrays come back."""

    __slots__ = ("x", "out", "op", "algorithm", "dtype", "current", "steps", "fields")

    def __init__(self, x, out, op, algorithm, current, steps, fields):
        self.x, self.out, self.op, self.algorithm = x, out, op, algorithm
        self.dtype, self.current, self.steps = x.dtype, current, steps  # current: Progress
        self.fields = fields  # debug mode's description of the call, else None


def _run_steps(steps, result):
    for step in steps:
        step()
    return result


#: all-reduce algorithms built as a list of steps that a repeated call replays
_SCHEDULES = {"recursive_doubling": recursive_doubling.schedule,
              "rabenseifner": rabenseifner.schedule, "bruck": bruck.schedule}


def _as_rows(x):
    """x as C-contiguous rows of axis 0 (a 0-d x becomes one row): blocks are whole rows."""
    return array_module(x).ascontiguousarray(x.reshape(1) if x.ndim == 0 else x)


def _memory(side):
    """Debug mode's fingerprint field for device buffers (none for host ones, whose
    fingerprints stay as they were): ranks that disagree on where or how are named."""
    return {} if side.device is None else {"memory": f"gpu, {side.path}"}


def _row_elems(x):
    return int(np.prod(x.shape[1:], dtype=np.int64)) if x.ndim > 1 else 1


def run_threads(size, fn, timeout=None, **options):
    """Run fn(comm) on `size` in-process ranks (threads); return the results in rank order.

    The thread transport follows MPI's matching rules, so this runs every algorithm exactly as
    under mpiexec, in one process: handy for tests, experiments and teaching.

    Example::

        ringcoll.run_threads(4, lambda comm: comm.allreduce(np.array([comm.rank])))
        # -> [array([6]), array([6]), array([6]), array([6])]
    """
    from .transport import threads

    seconds = Options.from_env(timeout=timeout).timeout
    wait = threads.DEFAULT_TIMEOUT if seconds is None else (seconds or None)  # 0: no limit

    def body(t):
        comm = Communicator(transport=t, **options)
        try:
            return fn(comm)
        finally:
            comm.wait_all()

    return threads.run(size, body, timeout=wait)


def simulate(size, fn, timeout=None, payloads=False, watch=None, **options):
    """Run fn(comm) on `size` thread ranks with tracing on: (results in rank order, Trace).

    The Trace holds every rank's messages and receives (see Communicator.trace).
    payloads=True keeps a copy of each message's data (`msg.payload`) and where it was sent
    from (`msg.offset_in(array)`); watch=fn(rank, buf, sending) is called before each message
    a rank sends or receives, and what it returns is kept as the record's `seen` (see
    ringcoll.transport.trace: `ringcoll explain` snapshots every rank's buffers with it).

    Example::

        results, trace = ringcoll.simulate(
            4, lambda comm: comm.allreduce(np.arange(8.0), algorithm="ring"), payloads=True)
        trace.bytes_sent(0)   # 144: 3 blocks of 2 float64 in each half, and the 48-byte header
        first = trace.select(src=0, tag="ring_reduce_scatter").messages[0]
        first.payload   # array([6., 7.]): block 3, the first rank 0 sends on the ring
    """
    trace = Trace(payloads=payloads, watch=watch)

    def body(comm):
        with comm.trace(trace):
            return fn(comm)

    return run_threads(size, body, timeout=timeout, **options), trace
