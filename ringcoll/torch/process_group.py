"""The "ringcoll" torch.distributed backend: a ProcessGroup over a ringcoll Communicator.

torch hands a Python ProcessGroup subclass every collective of its group: dist.all_reduce and
friends, DDP's bucket all-reduces, FSDP's all-gathers and reduce-scatters, the functional
collectives. Each method here turns the call into ringcoll ones:

- tensors become array views of their memory (no copy for a contiguous tensor): NumPy views
  of CPU tensors (``t.numpy()``; bfloat16 through ml_dtypes), CuPy views of CUDA tensors on
  ringcoll's device path, each call queued on the tensor's current stream (CudaMemory); bool
  reduces as uint8, and data movement sends the bytes of any dtype. A non-contiguous tensor
  is staged once (``t.contiguous()``) and its result copied back;
- the collective is queued on the Communicator's background thread (its i-form), so it runs
  while the caller computes, every collective of the group in call order;
- the returned Work (a torch Work subclass) holds a torch Future that the background thread
  completes, with the output tensors or with ringcoll's error: ``wait()`` raises that error,
  and ``get_future()`` is what DDP's comm hooks chain on. (torch's own wrapping of a future,
  _create_work_from_future, is no use here: its wait() returns True for a failed future, and
  its future's wait() returns the exception instead of raising it.)

Point-to-point sends and receives are posted at once (MPI requests) and a second thread waits
for them in order, completing their futures; ``dist.recv`` / ``dist.irecv`` without ``src``
(recv_anysource) is a ringcoll receive from ANY_SOURCE, and its Work's ``_source_rank()`` is
the sender's group rank, as gloo's.

Reductions: SUM, AVG (of integers as NCCL's: the sum divided by the size, truncated), PRODUCT,
MIN, MAX, and BAND/BOR/BXOR of integers; bool tensors reduce as NCCL's do (SUM and MAX are a
logical or, PRODUCT and MIN a logical and); PREMUL_SUM(f) multiplies the input by f, then
sums; all_reduce SUMs sparse COO tensors too, as gloo's. One call's tensors are on one device;
a group takes CPU and CUDA tensors from call to call, as gloo's does, and every rank of one
call must pass the same kind (see docs/torch.md).
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
from ..communicator import ANY_SOURCE, Communicator
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


# -- where a call's tensors live: host or GPU memory ----------------------------------------
class HostMemory:
    """CPU tensors: NumPy views of their memory; a collective runs as called."""

    host = True
    bfloat16 = BFLOAT16 is not None  # reduced as such through ml_dtypes

    def array(self, t):
        """A zero-copy array of contiguous, detached t (not bool; bfloat16 only if
        self.bfloat16)."""
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()

    def stream(self, t):
        return None

    def run(self, stream, comm, name, *args, **kwargs):
        return getattr(comm, name)(*args, **kwargs)

    def settle(self, stream, later):
        for fn in later:
            fn()


class CudaMemory:
    """CUDA tensors: CuPy views of their memory (``cupy.asarray`` through torch's
    ``__cuda_array_interface__``, no copy) on ringcoll's device path (the node tier through
    CUDA IPC on one node, else device buffers to MPI, CUDA-aware or staged; see docs/gpu.md).

    Streams, as NCCL orders its calls: the group's collectives on one GPU run on a stream of
    their own, which first waits (an event, not the host) for what the caller's current stream
    has queued, so a collective reads what the kernels before it wrote, and the caller's
    stream is never held up by a collective (DDP's backward goes on while its buckets are
    reduced). CuPy is handed that stream as an ExternalStream while the call is made, and
    ringcoll's device path records and waits for its events there. A Work completes once its
    results are in device memory: the copies that finish the call (a staged tensor's copy
    back) run on the collective's stream, which the background thread then synchronises, so
    wait() and the future's value are safe on any stream. The call keeps the tensors it made
    until then (torch's allocator must not hand their memory to the caller's stream while the
    collective's stream still uses it). CuPy has no bfloat16: a bfloat16 reduction runs in
    float32 on the device.
    """

    host = False
    bfloat16 = False

    def __init__(self, cupy):
        self.cupy = cupy
        self.streams = {}  # GPU index -> the stream this group's collectives run on there

    def array(self, t):
        if t.numel() == 0:  # (an empty tensor may have no pointer for CuPy to take)
            dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
            with self.cupy.cuda.Device(t.device.index):
                return self.cupy.empty(tuple(t.shape), dtype)
        return self.cupy.asarray(t)

    def stream(self, t):
        stream = self.streams.get(t.device.index)
        if stream is None:
            stream = self.streams[t.device.index] = torch.cuda.Stream(t.device)
        return stream

    def run(self, stream, comm, name, *args, **kwargs):
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # the inputs, made so far
        cuda = self.cupy.cuda
        with cuda.Device(stream.device.index), \
                cuda.ExternalStream(stream.cuda_stream, stream.device.index):
            return getattr(comm, name)(*args, **kwargs)

    def settle(self, stream, later):
        with torch.cuda.stream(stream):
            for fn in later:
                fn()
        stream.synchronize()


def _cuda_memory(ctx):
    try:
        import cupy
    except ImportError:
        raise InvalidTypeError(
            f"{ctx}CUDA tensors run on ringcoll's CuPy path, and CuPy is not installed: pip "
            "install cupy-cuda12x (or cupy-cuda13x, as your CUDA), or move the tensors to "
            "the CPU with .cpu()") from None
    return CudaMemory(cupy)


#: a call's memory, by its tensors' device type (made on the group's first such call)
MEMORIES = {"cpu": lambda ctx: HostMemory(), "cuda": _cuda_memory}


def _check(t, ctx):
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{ctx}expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidTypeError(f"{ctx}a {t.layout} tensor: ringcoll sends dense (strided) "
                               "tensors only (and all_reduce SUMs sparse COO ones); call "
                               ".to_dense() first")


def _byte_tensor(t):
    """The bytes of contiguous tensor t, as a 1-D uint8 tensor (any dtype)."""
    if t.numel() == 0:  # (an empty tensor may have stride 0, which view() refuses)
        return t.new_empty(0, dtype=torch.uint8)
    return t.detach().reshape(-1).view(torch.uint8)


class _Call:
    """One call's tensors as arrays of their memory, and what finishes the call: contiguous
    stand-ins for non-contiguous tensors and float32 ones for bfloat16 on a GPU, copied back
    once the collective has run (on the background thread, before the Work completes)."""

    def __init__(self, memory, stream):
        self.memory, self.stream = memory, stream
        self.later = []  # what finish() runs, in order: copies into the caller's tensors
        self.keep = []  # the tensors viewed, alive until the call has finished

    def contiguous(self, t, output=True):
        if t.is_contiguous():
            return t
        c = t.contiguous()
        if output:
            self.later.insert(0, lambda: t.copy_(c))  # inner copies (array's) go first
        return c

    def array(self, t, ctx, output=True):
        """An array view of contiguous t for a reduction (same shape): bool as uint8 0/1,
        bfloat16 widened to a float32 copy where the memory has no bfloat16."""
        t = t.detach()
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        elif t.dtype == torch.bfloat16 and not self.memory.bfloat16:
            if not self.memory.host:  # the GPU: reduce in float32, round once at the end
                wide = t.float()
                if output:
                    self.later.insert(0, lambda: t.copy_(wide))
                return self._view(wide)
            raise InvalidTypeError(f"{ctx}bfloat16 tensors need the ml_dtypes package on the "
                                   "host: pip install ml_dtypes")
        try:
            return self._view(t)
        except TypeError:
            raise InvalidTypeError(f"{ctx}ringcoll cannot reduce {t.dtype} tensors (no NumPy "
                                   "type); convert to float32 or another NumPy dtype "
                                   "first") from None

    def bytes(self, t):
        """The bytes of contiguous tensor t, as a 1-D uint8 array view (any dtype)."""
        return self._view(_byte_tensor(t))

    def _view(self, t):
        self.keep.append(t)
        return self.memory.array(t)

    def unpack(self, buf, outs, counts):
        """Once the collective has run, copy uint8 tensor buf's consecutive byte blocks into
        outs."""
        def copy():
            start = 0
            for o, n in zip(outs, counts):
                if n:  # (an empty block: nothing to copy, and no byte view of it to take)
                    o.copy_(buf[start:start + n].view(o.dtype).reshape(o.shape))
                start += n
        self.later.append(copy)

    def finish(self):
        self.memory.settle(self.stream, self.later)
        self.keep.clear()


def _kind(op):
    """A ReduceOp's kind (RED.SUM, ...): torch passes a ReduceOp or its kind alone."""
    return op.op if isinstance(op, dist.ReduceOp) else op


def _op_name(op, dtype, ctx):
    kind = _kind(op)
    name = _OPS.get(kind)
    if name is None:
        raise InvalidArgumentError(f"{ctx}reduce op {kind} is not supported; use SUM, AVG, "
                                   "PRODUCT, MIN, MAX, BAND, BOR, BXOR or PREMUL_SUM")
    if dtype == torch.bool:
        if name == "avg":
            raise InvalidTypeError(f"{ctx}AVG of bool tensors has no meaning; convert to float")
        return _BOOL_OPS[name]
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        return "sum"  # divided afterwards: _then_average
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
        self._memories = {}  # device type -> its HostMemory or CudaMemory, made on first use
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

    def _call(self, ctx, *tensors):
        """The _Call of a call on tensors (lists of them flattened; None skipped): each a
        dense tensor, all on one device, whose memory (host or GPU) the call runs in."""
        flat = []
        for t in tensors:
            if isinstance(t, (list, tuple)):
                flat.extend(t)
            elif t is not None:
                flat.append(t)
        for t in flat:
            _check(t, ctx)
        devices = {t.device for t in flat}
        if len(devices) > 1:
            raise InvalidArgumentError(
                f"{ctx}tensors on {', '.join(sorted(map(str, devices)))}: one call's tensors "
                "must be on one device (as gloo's and NCCL's); move them with .to(device)")
        device = devices.pop() if devices else torch.device("cpu")
        memory = self._memories.get(device.type)
        if memory is None:
            make = MEMORIES.get(device.type)
            if make is None:
                raise InvalidTypeError(
                    f"{ctx}a tensor on {device}: the ringcoll backend runs CPU and CUDA "
                    "tensors; move it with .cpu() (and the result back)")
            memory = self._memories[device.type] = make(ctx)
        return _Call(memory, memory.stream(flat[0]) if flat else None)

    def _start(self, opts, call, collective, *args, **kwargs):
        """comm.<collective>(...) in call's memory, for a call torch waits for at once
        (opts.asyncOp False: dist.all_reduce(t) and the others without async_op=True), run
        here and now (behind any pending non-blocking ones: the Communicator keeps call
        order), so a small blocking call pays no hand-off to the background thread; else
        comm.i<collective>(...) on it (DDP's buckets, async_op=True, and calls from C++)."""
        if opts is not None and not opts.asyncOp:
            return _Done(call.memory.run(call.stream, self.comm, collective, *args, **kwargs))
        return call.memory.run(call.stream, self.comm, "i" + collective, *args, **kwargs)

    def _work(self, requests, result, call=None):
        """A Work completed by the background thread once the last of requests (queued in
        order: it finishes last) has: staged outputs copied back, then the future set."""
        work = Work(result, self._ctx)

        def done(_):
            try:
                for r in requests:
                    r.wait()  # all finished: returns at once, or raises the collective's error
                if call is not None:
                    call.finish()
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
        ctx = self._ctx("allreduce")
        if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, opts, ctx)  # (a dense one among: refused)
        call, reqs = self._call(ctx, tensors), []
        for t in tensors:
            name = _op_name(opts.reduceOp, t.dtype, ctx)
            c = call.contiguous(t)
            self._then_average(opts.reduceOp, c, call)
            x = call.array(_premul(opts.reduceOp, c), ctx)
            reqs.append(self._start(opts, call, "allreduce", x, name, out=x))
        return self._work(reqs, tensors, call)

    def _then_average(self, op, c, call):
        """AVG of an integer tensor as NCCL computes it (ncclAvg): the collective sums, in the
        tensor's dtype (wrapping as that sum does), then each element of the result, in c, is
        divided by the group's size, truncated toward zero (C's integer division)."""
        dtype = c.dtype  # (floats first: the op's kind costs a C++ call)
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return
        if _kind(op) == RED.AVG:
            call.later.insert(0, lambda: c.div_(self.comm.size, rounding_mode="trunc"))

    def _sparse_allreduce(self, tensors, opts, ctx):
        """SUM of sparse COO tensors (as gloo's; DDP's gradients of nn.Embedding(sparse=True)):
        every rank's indices and values all-gathered (their counts first), then summed into
        one coalesced tensor that replaces each input's contents. Blocking: the second
        all-gather's counts come from the first."""
        if _kind(opts.reduceOp) != RED.SUM:
            raise InvalidArgumentError(f"{ctx}sparse tensors reduce with SUM only (as gloo's); "
                                       "call .to_dense() for another op")
        for t in tensors:
            if t.layout != torch.sparse_coo or t.device.type != "cpu":
                raise InvalidTypeError(
                    f"{ctx}a {t.layout} tensor on {t.device} with sparse ones: one call's "
                    "tensors are all sparse COO on the CPU, or all dense")
        for t in tensors:
            c = t.coalesce()
            index = c.indices().t().contiguous()  # nnz rows of sparse_dim indices
            value = c.values().contiguous()  # nnz rows of the dense part
            rows = np.empty(self.comm.size, np.int64)
            self.comm.allgather(np.array([index.shape[0]], np.int64), out=rows)
            counts = rows.tolist()
            indices = np.empty((sum(counts), index.shape[1]), np.int64)
            self.comm.allgather(index.numpy(), out=indices, counts=counts)
            values = value.new_empty((sum(counts),) + tuple(value.shape[1:]))
            width = int(np.prod(value.shape[1:], dtype=np.int64)) * value.element_size()
            if width:  # (the bytes of a row of values)
                self.comm.allgather(_byte_tensor(value).numpy().reshape(-1, width),
                                    out=_byte_tensor(values).numpy().reshape(-1, width),
                                    counts=counts)
            total = torch.sparse_coo_tensor(torch.from_numpy(indices).t(), values, t.shape)
            t.copy_(total.coalesce())
        return self._work([], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    @_collective("reduce")
    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        ctx = self._ctx("reduce")
        call, reqs = self._call(ctx, tensors), []
        root = self.comm.rank == opts.rootRank
        for t in tensors:  # the result lands in root's tensor; the others keep their values
            name = _op_name(opts.reduceOp, t.dtype, ctx)
            c = _premul(opts.reduceOp, call.contiguous(t, output=root), keep=not root)
            if root:
                self._then_average(opts.reduceOp, c, call)
            x = call.array(c, ctx, output=root)
            reqs.append(self._start(opts, call, "reduce", x, name, opts.rootRank,
                                    out=x if root else None))
        return self._work(reqs, tensors, call)

    def _reduce_scatter_into(self, out, flat, opts, ctx, call, counts=None, keep=True):
        """reduce_scatter of contiguous flat into out; keep: flat is the caller's input."""
        c = call.contiguous(out)
        name = _op_name(opts.reduceOp, flat.dtype, ctx)
        self._then_average(opts.reduceOp, c, call)
        flat = _premul(opts.reduceOp, flat, keep)
        return self._start(opts, call, "reduce_scatter",
                           call.array(flat, ctx, output=False).reshape(-1), name,
                           out=call.array(c, ctx).reshape(-1), counts=counts)

    @_collective("reduce_scatter")
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        ctx = self._ctx("reduce_scatter")
        call, reqs = self._call(ctx, output_tensors, *input_tensors), []
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([i.reshape(-1) for i in ins]) if ins else out.new_empty(0)
            reqs.append(self._reduce_scatter_into(out, flat, opts, ctx, call,
                                                  counts=[i.numel() for i in ins], keep=False))
        return self._work(reqs, output_tensors, call)

    @_collective("reduce_scatter")
    def _reduce_scatter_tensors(self, outputs, inputs, opts, name):
        """reduce_scatter_tensor and its coalesced form: input i's blocks, reduced, into
        output i."""
        opts = opts or dist.ReduceScatterOptions()
        ctx = self._ctx(name)
        call, reqs = self._call(ctx, outputs, inputs), []
        for out, inp in zip(outputs, inputs):
            flat = call.contiguous(inp, output=False)
            reqs.append(self._reduce_scatter_into(out, flat, opts, ctx, call))
        return self._work(reqs, outputs, call)

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
        ctx = self._ctx("broadcast")
        call, reqs = self._call(ctx, tensors), []
        for t in tensors:
            x = call.bytes(call.contiguous(t))
            reqs.append(self._start(opts, call, "broadcast", x, opts.rootRank))
        return self._work(reqs, tensors, call)

    def _gather_into(self, outs, inp, call, opts, root=None):
        """All-gather (root None) or gather of inp's bytes into the list outs, rank order."""
        src = call.bytes(call.contiguous(inp, output=False))
        counts = [o.nbytes for o in outs]
        buf = inp.new_empty(sum(counts), dtype=torch.uint8)
        call.unpack(buf, outs, counts)
        if root is None:
            return self._start(opts, call, "allgather", src, out=call.bytes(buf), counts=counts)
        on_root = self.comm.rank == root
        return self._start(opts, call, "gather", src, root,
                           out=call.bytes(buf) if on_root else None,
                           counts=counts if on_root else None)

    @_collective("allgather")
    def allgather(self, output_tensors, input_tensors, opts=None):
        call = self._call(self._ctx("allgather"), *output_tensors, input_tensors)
        reqs = [self._gather_into(outs, inp, call, opts)
                for outs, inp in zip(output_tensors, input_tensors)]
        return self._work(reqs, output_tensors, call)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # output_lists[r][i] is rank r's input i (allgather's lists are the other way round)
        if len(output_lists) != self.comm.size or any(
                len(outs) != len(input_list) for outs in output_lists):
            raise InvalidArgumentError(
                f"{self._ctx('allgather_coalesced')}output_tensor_lists must hold one list per "
                f"rank ({self.comm.size}), each with one tensor per input ({len(input_list)}); "
                f"got {[len(outs) for outs in output_lists]}")
        return self.allgather([list(outs) for outs in zip(*output_lists)], input_list, opts)

    @_collective("allgather")
    def _allgather_tensors(self, outputs, inputs, opts, name):
        """all_gather_into_tensor and its coalesced form: every rank's input i, in rank
        order, straight into output i."""
        call, reqs = self._call(self._ctx(name), outputs, inputs), []
        for out, inp in zip(outputs, inputs):
            src = call.bytes(call.contiguous(inp, output=False))
            dst = call.bytes(call.contiguous(out))
            reqs.append(self._start(opts, call, "allgather", src, out=dst))
        return self._work(reqs, outputs, call)

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
        ctx = self._ctx("gather")
        root = opts.rootRank
        outs = output_tensors[0] if self.comm.rank == root else []
        if self.comm.rank == root and len(outs) != self.comm.size:
            raise InvalidArgumentError(f"{ctx}root needs {self.comm.size} output tensors, got "
                                       f"{len(outs)}")
        call = self._call(ctx, outs, input_tensors)
        req = self._gather_into(outs, input_tensors[0], call, opts, root=root)
        return self._work([req], output_tensors, call)

    @_collective("scatter")
    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        ctx = self._ctx("scatter")
        root, out = opts.rootRank, output_tensors[0]
        ins = input_tensors[0] if self.comm.rank == root else []
        if self.comm.rank == root and len(ins) != self.comm.size:
            raise InvalidArgumentError(f"{ctx}root needs {self.comm.size} input tensors, "
                                       f"got {len(ins)}")
        call = self._call(ctx, out, ins)
        x = counts = None
        if self.comm.rank == root:
            x = call.bytes(torch.cat([_byte_tensor(i.contiguous()) for i in ins]))
            counts = [i.nbytes for i in ins]
        dst = call.bytes(call.contiguous(out))
        req = self._start(opts, call, "scatter", x, root, counts=counts, out=dst)
        return self._work([req], output_tensors, call)

    @_collective("alltoallv")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        call = self._call(self._ctx("alltoall"), output_tensors, input_tensors)
        if input_tensors:
            x = torch.cat([_byte_tensor(i.contiguous()) for i in input_tensors])
        else:
            x = torch.empty(0, dtype=torch.uint8,
                            device=output_tensors[0].device if output_tensors else "cpu")
        counts = [i.nbytes for i in input_tensors]
        recv = [o.nbytes for o in output_tensors]
        buf = x.new_empty(sum(recv))
        call.unpack(buf, output_tensors, recv)
        req = self._start(opts, call, "alltoallv", call.bytes(x), counts, out=call.bytes(buf),
                          recv_counts=recv)
        return self._work([req], output_tensors, call)

    @_collective("alltoallv")
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        ctx = self._ctx("all_to_all_single")
        call, p = self._call(ctx, output, input), self.comm.size
        src = call.contiguous(input, output=False)
        dst = call.contiguous(output)
        rows_in, rows_out = _split_rows(src, input_split_sizes, p, ctx, "input"), \
            _split_rows(dst, output_split_sizes, p, ctx, "output")
        x, y = _rows(call, src), _rows(call, dst)
        req = self._start(opts, call, "alltoallv", x, rows_in, out=y, recv_counts=rows_out)
        return self._work([req], [output], call)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        return self._work([self._start(opts, _Call(HostMemory(), None), "barrier")], [])

    # -- point-to-point -------------------------------------------------------------------
    def _p2p(self, request, result, call=None):
        """A Work that a second thread completes once request has (sends and receives are
        MPI requests, posted already: waiting for them in order blocks nothing)."""
        work = Work(result, self._ctx)

        def finish():
            try:
                request.wait()
                work._source = request.source  # a receive's sender (None for a send)
                if call is not None:
                    call.finish()
            except BaseException as exc:  # noqa: B036
                work._finish(exc)
                return
            work._finish()

        with self._lock:
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(1, thread_name_prefix="ringcoll-torch-p2p")
            self._waiter.submit(finish)
        return work

    # Sends and receives travel through host memory: ringcoll's point-to-point messages are
    # NumPy arrays. A CUDA tensor is copied to the host before its send (on its current
    # stream, which that copy synchronises) and a receive copied back on it, as gloo does.
    def send(self, tensors, dstRank, tag=0):
        ctx = self._ctx("send")
        (t,) = tensors
        call = self._call(ctx, t)
        c = call.contiguous(t, output=False).detach()
        if not call.memory.host:
            c = c.cpu()
        return self._p2p(self.comm.isend(_byte_tensor(c).numpy(), dstRank, tag), tensors)

    def recv(self, tensors, srcRank, tag=0, call_name="recv"):
        ctx = self._ctx(call_name)
        (t,) = tensors
        call = self._call(ctx, t)
        c = call.contiguous(t)
        if not call.memory.host:
            device, c = c, torch.empty(c.shape, dtype=c.dtype)
            call.later.insert(0, lambda: device.copy_(c))
        return self._p2p(self.comm.irecv(_byte_tensor(c).numpy(), srcRank, tag), tensors, call)

    def recv_anysource(self, tensors, tag=0):
        """dist.recv / dist.irecv without src: a receive from any rank of the group (MPI's
        matching rules); the Work's _source_rank() is the sender's group rank."""
        return self.recv(tensors, ANY_SOURCE, tag, "recv_anysource")

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
        self._source = None  # a receive's sender, set before the Work completes

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

    def _source_rank(self):
        """The group rank whose message a completed receive took (what dist.recv without src
        returns, as a global rank); torch's rule: only a receive's Work has one."""
        if self._source is None:
            raise ValueError(f"{self._ctx('_source_rank')}only a completed receive's Work "
                             "has a source rank; wait() for it first")
        return self._source

    def synchronize(self):
        """Nothing to do: a Work completes with its results in memory (a CUDA call's stream
        synchronised), and wait() is what blocks."""


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


def _rows(call, t):
    """t's bytes as a 2-D uint8 array view: one row per slice of dim 0."""
    rows = t.shape[0] if t.dim() else 1
    return call.bytes(t).reshape(rows, int(np.prod(t.shape[1:])) * t.element_size())
