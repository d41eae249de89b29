"""The "ringcoll" torch.distributed backend: a ProcessGroup over a ringcoll Communicator.

torch hands a Python ProcessGroup subclass every collective of its group: dist.all_reduce and
friends, DDP's bucket all-reduces, FSDP's all-gathers and reduce-scatters, the functional
collectives. Each method here turns the call into ringcoll ones:

- tensors become NumPy views of their memory (``t.numpy()``; bfloat16 through ml_dtypes, bool
  as uint8; data movement sends the bytes of any dtype), so a contiguous tensor is never copied.
  A non-contiguous one is staged once (``t.contiguous()``) and its result copied back;
- the collective is queued on the Communicator's background thread (its i-form), so it runs
  while the caller computes, every collective of the group in call order;
- the returned Work (a torch Work subclass) holds a torch Future that the background thread
  completes, with the output tensors or with ringcoll's error: ``wait()`` raises that error,
  and ``get_future()`` is what DDP's comm hooks chain on. (torch's own wrapping of a future,
  _create_work_from_future, is no use here: its wait() returns True for a failed future, and
  its future's wait() returns the exception instead of raising it.)

Point-to-point sends and receives are posted at once (MPI requests) and a second thread waits
for them in order, completing their futures; a receive names its source (ringcoll has no
wildcard receive).

Reductions: SUM, AVG (floats), PRODUCT, MIN, MAX, and BAND/BOR/BXOR of integers; bool tensors
reduce as NCCL's do (SUM and MAX are a logical or, PRODUCT and MIN a logical and);
PREMUL_SUM(f) multiplies the input by f, then sums. CUDA tensors are refused with a message:
this backend runs CPU tensors (see docs/torch.md).
"""

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..arrays import BFLOAT16
from ..communicator import Communicator
from ..errors import CollectiveTimeoutError, InvalidArgumentError, InvalidTypeError, where

RED = dist.ReduceOp.RedOpType
_OPS = {RED.SUM: "sum", RED.AVG: "avg", RED.PRODUCT: "prod", RED.MIN: "min", RED.MAX: "max",
        RED.BAND: "band", RED.BOR: "bor", RED.BXOR: "bxor", RED.PREMUL_SUM: "sum"}
#: bool tensors reduce as uint8 0/1 with these ops instead (NCCL's rule); AVG has none
_BOOL_OPS = {"sum": "max", "prod": "min", "max": "max", "min": "min", "band": "band",
             "bor": "bor", "bxor": "bxor"}


def create(opts, backend_options=None):
    """The creator torch calls for dist.init_process_group("ringcoll") and dist.new_group(...,
    backend="ringcoll") (only on the group's members): a ProcessGroup over a Communicator of
    the group's MPI ranks. torch's ranks must be MPI's: rank r of torch's world is MPI rank r."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    rank, size = opts.group_rank, opts.group_size
    if ranks == list(range(world.size)) or not opts.global_ranks_in_group:  # the whole world
        if size != world.size or rank != world.rank:
            fix = (f"launch with mpiexec -n {size}, or drop world_size= (and WORLD_SIZE)"
                   if size != world.size else "drop rank= (and the RANK variable)")
            raise InvalidArgumentError(
                f"ringcoll rank {world.rank}, init_process_group: torch was given rank {rank} "
                f"of world_size {size}, but MPI runs this process as rank {world.rank} of "
                f"{world.size}; ringcoll's ranks are MPI's: {fix}")
        mpi = world
    else:
        if ranks.index(world.rank) != rank:
            raise InvalidArgumentError(
                f"ringcoll rank {world.rank}, new_group: torch places this rank at {rank} in "
                f"group {ranks}, MPI at {ranks.index(world.rank)}")
        # Create_group is collective over the members only, as torch calls this on them only
        mpi = world.Create_group(world.Get_group().Incl(ranks))
    seconds = None if opts.timeout == default_pg_timeout else opts.timeout.total_seconds()
    try:
        comm = Communicator(mpi, timeout=seconds, poll=_poll())  # duplicates mpi
    finally:
        if mpi is not world:
            mpi.Free()
    return ProcessGroup(comm, ranks)


def _poll():
    """Seconds between the background thread's tests of a message (RINGCOLL_TORCH_POLL,
    default 50e-6; 0 blocks inside MPI instead): it waits beside autograd's computation, and
    MPI's blocking wait would spin on the core that computation needs."""
    value = os.environ.get("RINGCOLL_TORCH_POLL", "50e-6")
    try:
        return float(value)
    except ValueError:
        raise InvalidArgumentError(f"RINGCOLL_TORCH_POLL={value!r}: give seconds, such as "
                                   "50e-6, or 0 to block inside MPI") from None


# -- tensors <-> NumPy views ----------------------------------------------------------------
def _cpu(t, ctx):
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{ctx}expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise InvalidTypeError(
            f"{ctx}a tensor on {t.device}: the ringcoll backend runs CPU tensors; move it with "
            ".cpu() (and the result back), or run CUDA tensors on a group of a CUDA backend "
            "(dist.new_group(backend='nccl'))")
    if t.layout != torch.strided:
        raise InvalidTypeError(f"{ctx}a {t.layout} tensor: ringcoll sends dense (strided) "
                               "tensors only; call .to_dense() first")


def _array(t, ctx):
    """A NumPy view of contiguous CPU tensor t for a reduction (same shape)."""
    t = t.detach()
    if t.dtype == torch.bfloat16 and BFLOAT16 is not None:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    try:
        return t.numpy()
    except TypeError:
        raise InvalidTypeError(f"{ctx}ringcoll cannot reduce {t.dtype} tensors (no NumPy type); "
                               "convert to float32 or another NumPy dtype first") from None


def _bytes(t):
    """The bytes of contiguous CPU tensor t, as a 1-D uint8 NumPy view (any dtype)."""
    if t.numel() == 0:  # (an empty tensor may have stride 0, which view() refuses)
        return np.empty(0, np.uint8)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _Staging:
    """Contiguous stand-ins for non-contiguous tensors, copied back once the collective has
    run (on the background thread, before the Work completes)."""

    def __init__(self):
        self.later = []  # what finish() runs, in order: copies into the caller's tensors

    def contiguous(self, t, ctx, output=True):
        _cpu(t, ctx)
        if t.is_contiguous():
            return t
        c = t.contiguous()
        if output:
            self.later.append(lambda: t.copy_(c))
        return c

    def unpack(self, buf, outs, counts):
        """Once the collective has run, copy buf's consecutive byte blocks into outs."""
        def copy():
            start = 0
            for o, n in zip(outs, counts):
                if n:  # (an empty block: nothing to copy, and no byte view of it to take)
                    o.copy_(torch.from_numpy(buf[start:start + n]).view(o.dtype)
                            .reshape(o.shape))
                start += n
        self.later.append(copy)

    def finish(self):
        for copy in self.later:
            copy()


def _op_name(op, dtype, ctx):
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    name = _OPS.get(kind)
    if name is None:
        raise InvalidArgumentError(f"{ctx}reduce op {kind} is not supported; use SUM, AVG, "
                                   "PRODUCT, MIN, MAX, BAND, BOR, BXOR or PREMUL_SUM")
    if dtype == torch.bool:
        if name == "avg":
            raise InvalidTypeError(f"{ctx}AVG of bool tensors has no meaning; convert to float")
        return _BOOL_OPS[name]
    return name


def _premul(op, t, keep=False):
    """PREMUL_SUM(f) sums the inputs times f: t scaled in place, or a scaled copy if t must
    keep its values (an input that is not also the output); any other op: t itself."""
    if isinstance(op, dist.ReduceOp) and op.op == RED.PREMUL_SUM:
        return t * op.factor if keep else t.mul_(op.factor)
    return t


def _collective(name):
    """A ProcessGroup method that runs ringcoll's collective `name`: an error at the call (a
    bad tensor, a tensor torch cannot view) is raised through comm.refuse, so in debug mode
    (RINGCOLL_DEBUG=1) the other ranks raise PeerFailedError instead of waiting for this one."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args):
            try:
                return method(self, *args)
            except Exception as exc:  # noqa: BLE001 - raised again, after the others are told
                self.comm.refuse(name, exc)
        return call
    return wrap


# -- the group ----------------------------------------------------------------------------
class ProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives are ringcoll's.

    Made by torch through ``create`` (dist.init_process_group("ringcoll"), dist.new_group);
    ``pg.comm`` is the ringcoll Communicator underneath, usable directly on NumPy arrays (its
    collectives queue in order with the group's).
    """

    def __init__(self, comm, ranks):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.ranks = ranks  # global (MPI) ranks of the members, in group order
        self._waiter = None  # the thread that completes point-to-point Works, once needed
        self._lock = threading.Lock()
        self._group_name = self._group_desc = ""

    def getBackendName(self):
        return "ringcoll"

    # torch names its groups (DeviceMesh and the functional collectives find them by name);
    # a Python group keeps its own, as it has no C++ backend to keep them in
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def __repr__(self):
        return f"ringcoll.torch.ProcessGroup(rank {self.comm.rank} of {self.comm.size})"

    def _ctx(self, call):
        return where(self.comm.rank, call)

    def _start(self, opts, collective, *args, **kwargs):
        """comm.<collective>(...) for a call torch waits for at once (opts.asyncOp False:
        dist.all_reduce(t) and the others without async_op=True), run here and now (behind any
        pending non-blocking ones: the Communicator keeps call order), so a small blocking call
        pays no hand-off to the background thread; else comm.i<collective>(...) on it (DDP's
        buckets, async_op=True, and calls from C++)."""
        if opts is not None and not opts.asyncOp:
            return _Done(getattr(self.comm, collective)(*args, **kwargs))
        return getattr(self.comm, "i" + collective)(*args, **kwargs)

    def _work(self, requests, result, staging=None):
        """A Work completed by the background thread once the last of requests (queued in
        order: it finishes last) has: staged outputs copied back, then the future set."""
        work = Work(result, self._ctx)

        def done(_):
            try:
                for r in requests:
                    r.wait()  # all finished: returns at once, or raises the collective's error
                if staging is not None:
                    staging.finish()
            except BaseException as exc:  # noqa: B036 - every failure must reach the future
                work._finish(exc)
                return
            work._finish()

        if requests:
            requests[-1].add_done_callback(done)
        else:
            done(None)
        return work

    # -- reductions -----------------------------------------------------------------------
    @_collective("allreduce")
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        ctx, staging, reqs = self._ctx("allreduce"), _Staging(), []
        for t in tensors:
            name = _op_name(opts.reduceOp, t.dtype, ctx)
            x = _array(_premul(opts.reduceOp, staging.contiguous(t, ctx)), ctx)
            reqs.append(self._start(opts, "allreduce", x, name, out=x))
        return self._work(reqs, tensors, staging)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    @_collective("reduce")
    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        ctx, staging, reqs = self._ctx("reduce"), _Staging(), []
        root = self.comm.rank == opts.rootRank
        for t in tensors:  # the result lands in root's tensor; the others keep their values
            name = _op_name(opts.reduceOp, t.dtype, ctx)
            c = _premul(opts.reduceOp, staging.contiguous(t, ctx, output=root), keep=not root)
            x = _array(c, ctx)
            reqs.append(self._start(opts, "reduce", x, name, opts.rootRank,
                                    out=x if root else None))
        return self._work(reqs, tensors, staging)

    def _reduce_scatter_into(self, out, flat, opts, ctx, staging, counts=None, keep=True):
        """reduce_scatter of contiguous flat into out; keep: flat is the caller's input."""
        c = staging.contiguous(out, ctx)
        name = _op_name(opts.reduceOp, flat.dtype, ctx)
        flat = _premul(opts.reduceOp, flat, keep)
        return self._start(opts, "reduce_scatter", _array(flat, ctx).reshape(-1), name,
                           out=_array(c, ctx).reshape(-1), counts=counts)

    @_collective("reduce_scatter")
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        ctx, staging, reqs = self._ctx("reduce_scatter"), _Staging(), []
        for out, ins in zip(output_tensors, input_tensors):
            for i in ins:
                _cpu(i, ctx)
            flat = torch.cat([i.reshape(-1) for i in ins]) if ins else out.new_empty(0)
            reqs.append(self._reduce_scatter_into(out, flat, opts, ctx, staging,
                                                  counts=[i.numel() for i in ins], keep=False))
        return self._work(reqs, output_tensors, staging)

    @_collective("reduce_scatter")
    def _reduce_scatter_tensors(self, outputs, inputs, opts, call):
        """reduce_scatter_tensor and its coalesced form: input i's blocks, reduced, into
        output i."""
        opts = opts or dist.ReduceScatterOptions()
        ctx, staging, reqs = self._ctx(call), _Staging(), []
        for out, inp in zip(outputs, inputs):
            flat = staging.contiguous(inp, ctx, output=False)
            reqs.append(self._reduce_scatter_into(out, flat, opts, ctx, staging))
        return self._work(reqs, outputs, staging)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._reduce_scatter_tensors([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors(outputs, inputs, opts,
                                            "reduce_scatter_tensor_coalesced")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    # -- data movement: bytes of any dtype ------------------------------------------------
    @_collective("broadcast")
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        ctx, staging, reqs = self._ctx("broadcast"), _Staging(), []
        for t in tensors:
            x = _bytes(staging.contiguous(t, ctx))
            reqs.append(self._start(opts, "broadcast", x, opts.rootRank))
        return self._work(reqs, tensors, staging)

    def _gather_into(self, outs, inp, ctx, staging, opts, root=None):
        """All-gather (root None) or gather of inp's bytes into the list outs, rank order."""
        src = _bytes(staging.contiguous(inp, ctx, output=False))
        for o in outs:
            _cpu(o, ctx)
        counts = [o.nbytes for o in outs]
        buf = np.empty(sum(counts), np.uint8)
        staging.unpack(buf, outs, counts)
        if root is None:
            return self._start(opts, "allgather", src, out=buf, counts=counts)
        on_root = self.comm.rank == root
        return self._start(opts, "gather", src, root, out=buf if on_root else None,
                           counts=counts if on_root else None)

    @_collective("allgather")
    def allgather(self, output_tensors, input_tensors, opts=None):
        ctx, staging, reqs = self._ctx("allgather"), _Staging(), []
        for outs, inp in zip(output_tensors, input_tensors):
            reqs.append(self._gather_into(outs, inp, ctx, staging, opts))
        return self._work(reqs, output_tensors, staging)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    @_collective("allgather")
    def _allgather_tensors(self, outputs, inputs, opts, call):
        """all_gather_into_tensor and its coalesced form: every rank's input i, in rank
        order, straight into output i."""
        ctx, staging, reqs = self._ctx(call), _Staging(), []
        for out, inp in zip(outputs, inputs):
            src = _bytes(staging.contiguous(inp, ctx, output=False))
            dst = _bytes(staging.contiguous(out, ctx))
            reqs.append(self._start(opts, "allgather", src, out=dst))
        return self._work(reqs, outputs, staging)

    def _allgather_base(self, output, input, opts=None):
        return self._allgather_tensors([output], [input], opts, "all_gather_into_tensor")

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._allgather_tensors(outputs, inputs, opts,
                                       "allgather_into_tensor_coalesced")

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    @_collective("gather")
    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        ctx, staging = self._ctx("gather"), _Staging()
        root = opts.rootRank
        outs = output_tensors[0] if self.comm.rank == root else []
        if self.comm.rank == root and len(outs) != self.comm.size:
            raise InvalidArgumentError(f"{ctx}root needs {self.comm.size} output tensors, got "
                                       f"{len(outs)}")
        req = self._gather_into(outs, input_tensors[0], ctx, staging, opts, root=root)
        return self._work([req], output_tensors, staging)

    @_collective("scatter")
    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        ctx, staging = self._ctx("scatter"), _Staging()
        root, out = opts.rootRank, output_tensors[0]
        x = counts = None
        if self.comm.rank == root:
            ins = input_tensors[0]
            if len(ins) != self.comm.size:
                raise InvalidArgumentError(f"{ctx}root needs {self.comm.size} input tensors, "
                                           f"got {len(ins)}")
            for i in ins:
                _cpu(i, ctx)
            x = np.concatenate([_bytes(i.contiguous()) for i in ins])
            counts = [i.nbytes for i in ins]
        dst = _bytes(staging.contiguous(out, ctx))
        req = self._start(opts, "scatter", x, root, counts=counts, out=dst)
        return self._work([req], output_tensors, staging)

    @_collective("alltoallv")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        ctx, staging = self._ctx("alltoall"), _Staging()
        for t in [*output_tensors, *input_tensors]:
            _cpu(t, ctx)
        x = np.concatenate([_bytes(i.contiguous()) for i in input_tensors]) if input_tensors \
            else np.empty(0, np.uint8)
        counts = [i.nbytes for i in input_tensors]
        recv = [o.nbytes for o in output_tensors]
        buf = np.empty(sum(recv), np.uint8)
        staging.unpack(buf, output_tensors, recv)
        req = self._start(opts, "alltoallv", x, counts, out=buf, recv_counts=recv)
        return self._work([req], output_tensors, staging)

    @_collective("alltoallv")
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        ctx, staging = self._ctx("all_to_all_single"), _Staging()
        p = self.comm.size
        src = staging.contiguous(input, ctx, output=False)
        dst = staging.contiguous(output, ctx)
        rows_in, rows_out = _split_rows(src, input_split_sizes, p, ctx, "input"), \
            _split_rows(dst, output_split_sizes, p, ctx, "output")
        x, y = _rows(src), _rows(dst)
        req = self._start(opts, "alltoallv", x, rows_in, out=y, recv_counts=rows_out)
        return self._work([req], [output], staging)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        return self._work([self._start(opts, "barrier")], [])

    # -- point-to-point -------------------------------------------------------------------
    def _p2p(self, request, result, staging=None):
        """A Work that a second thread completes once request has (sends and receives are
        MPI requests, posted already: waiting for them in order blocks nothing)."""
        work = Work(result, self._ctx)

        def finish():
            try:
                request.wait()
                if staging is not None:
                    staging.finish()
            except BaseException as exc:  # noqa: B036
                work._finish(exc)
                return
            work._finish()

        with self._lock:
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(1, thread_name_prefix="ringcoll-torch-p2p")
            self._waiter.submit(finish)
        return work

    def send(self, tensors, dstRank, tag=0):
        ctx = self._ctx("send")
        (t,) = tensors
        c = _Staging().contiguous(t, ctx, output=False)
        return self._p2p(self.comm.isend(_bytes(c), dstRank, tag), tensors)

    def recv(self, tensors, srcRank, tag=0):
        ctx, staging = self._ctx("recv"), _Staging()
        (t,) = tensors
        c = staging.contiguous(t, ctx)
        return self._p2p(self.comm.irecv(_bytes(c), srcRank, tag), tensors, staging)

    def recv_anysource(self, tensors, tag=0):
        raise InvalidArgumentError(
            f"{self._ctx('recv')}a receive from any source: ringcoll's receives name their "
            "source (no MPI_ANY_SOURCE); pass src= to dist.recv / dist.irecv")

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self):
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None
        self.comm.close()

    def abort(self):
        self.shutdown()


class _Done:
    """A collective that has run already: a Request as ringcoll's i-forms return."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result

    def add_done_callback(self, fn):
        fn(self)


class Work(dist._Work):
    """A collective (or send/receive) of the ringcoll group in flight.

    wait() blocks until it has finished and raises ringcoll's error if it failed (a timeout
    given to wait raises CollectiveTimeoutError if it has not finished by then; the collective
    itself goes on, under RINGCOLL_TIMEOUT's watchdog). get_future() is completed at the same
    moment, with the output tensors (result()) or the error.
    """

    def __init__(self, result, ctx):
        super().__init__()
        self._result, self._ctx = result, ctx
        self._future = torch.futures.Future()
        self._done = threading.Event()
        self._error = None

    def _finish(self, error=None):
        """The background thread's last act: complete the future, then release wait()."""
        self._error = error
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)
        self._done.set()

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):  # torch: 0 means no limit
            raise CollectiveTimeoutError(
                f"{self._ctx('wait')}not finished after wait(timeout={seconds:g} s); it goes "
                "on in the background (RINGCOLL_TIMEOUT's watchdog ends it if it is stuck)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def synchronize(self):
        """Nothing to do: CPU tensors, and wait() is what blocks."""


def _split_rows(t, sizes, p, ctx, which):
    """all_to_all_single's split sizes (rows of dim 0 per rank), or an even split."""
    rows = t.shape[0] if t.dim() else 1
    if sizes:
        sizes = list(sizes)
        if len(sizes) != p or sum(sizes) != rows:
            raise InvalidArgumentError(f"{ctx}{which}_split_sizes {sizes} must have {p} "
                                       f"entries adding up to the {rows} rows of dim 0")
        return sizes
    if rows % p:
        raise InvalidArgumentError(f"{ctx}the {which} tensor's {rows} rows of dim 0 do not "
                                   f"split evenly over {p} ranks; pass {which}_split_sizes")
    return [rows // p] * p


def _rows(t):
    """t's bytes as a 2-D uint8 view: one row per slice of dim 0."""
    rows = t.shape[0] if t.dim() else 1
    return _bytes(t).reshape(rows, int(np.prod(t.shape[1:])) * t.element_size())
