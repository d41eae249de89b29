"""Data-parallel training: average gradients over ranks, overlapped with the backward pass.

    comm = ringcoll.Communicator()
    opt = ringcoll.DistributedOptimizer(ringcoll.optim.SGD(params, lr=0.1), comm)
    ringcoll.broadcast_parameters(params, comm=comm)      # every replica starts identical
    for batch in my_shard_of_the_data:
        for name, grad in backward(params, batch):        # last layer first
            opt.grad_ready(name, grad)                     # full buckets start averaging now
        opt.step()                                         # wait for the rest, then update

Buckets (gradient fusion). Parameters are grouped, in REVERSE registration order (back
propagation produces the last layer's gradient first), into flat buffers of one dtype and at
most `bucket_bytes` each, allocated once. `opt.grads[name]` is a view into its bucket, so a
backward pass can write a gradient straight into it (np.matmul(..., out=opt.grads["W"])) and
nothing is copied (PyTorch DDP's gradient_as_bucket_view).

Overlap. When every gradient of a bucket has been handed over, the bucket's all-reduce starts
on the communicator's background thread (iallreduce) while the caller computes the next
layer's gradient: MPI calls and large NumPy operations release the GIL, so both progress.
On a GPU (CuPy parameters) the all-reduces are also queued on a CUDA stream of their own
(_Streams), so the kernels of the rest of the backward pass do not wait behind them.
Buckets always start in bucket order (bucket k waits for k - 1 to start), whatever order the
gradients arrive in, so every rank issues the same collectives in the same order; debug mode
(RINGCOLL_DEBUG=1) checks each one, and the bucket layouts are compared once, at
construction, on every rank.

Accumulation. With backward_passes_per_step=k, gradients of k backward passes add up in the
buckets (grad_ready(name, grad) copies on the first pass and adds on the others) and only the
k-th pass starts the all-reduces; `with opt.no_sync():` marks passes that must not start them
(PyTorch DDP), the next pass outside it does.

Gradient clipping (Horovod's pattern): opt.synchronize() waits for the averaged gradients,
you clip opt.grads, then `with opt.skip_synchronize(): opt.step()`.

Bounded staleness (staleness=k > 0). Step t applies the average of the gradients of step
t - k, whose all-reduce ran in the background during the k steps in between:

    step t:   backward(t) fills slot t mod (k+1) ... its buckets start as they complete
              step() -> wait for slot (t-k)'s all-reduce, apply it, free that slot
    t < k:    nothing is applied (the first k steps only start all-reduces)
    flush():  wait for and apply the <= k updates still in flight, oldest first

There are k+1 sets of bucket buffers (slots), so memory for gradients is (k+1) x the model;
`opt.grads` is always the slot being filled: the dict is the same object, but its values are
re-pointed at the next slot by every step(), so look a gradient up again after a step rather
than keep a view across steps. Every rank issues the same collectives in the same order and
applies the same averaged buffers in the same order, so replicas stay bitwise identical.
Combinations: backward_passes_per_step and no_sync work per slot as above; op="sum" and
the cast compressions (fp16, bf16) work (each slot has its own payload); a compressor that
carries state between steps (top-k's residual, blocking anyway) is refused, and so are
synchronize() / skip_synchronize() (the gradients applied are k steps old: clip them
yourself before handing them over). The inner optimizer's hyper-parameters (a learning-rate
schedule) are those in effect when an update is applied, at step t, not at step t - k.
`opt.wait_seconds` is the exposed communication: the time step() blocked on an all-reduce
(with k >= 1, that of step t - k; flush() counts too, wrapper_state_dict's wait does not).
"""

import json
import time
import zlib
from collections import deque
from contextlib import contextmanager

import numpy as np

from .arrays import HALF_TYPES, array_module, is_array, is_device, memory_of, to_module
from .communicator import Communicator
from .compression import Compressor
from .errors import CollectiveMismatchError, InvalidArgumentError, RingcollError

DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb


class _Bucket:
    """One flat gradient buffer: the parameters it holds and the state of its all-reduce."""

    __slots__ = ("index", "buf", "names", "waiting", "handle", "state")

    def __init__(self, index, dtype, members, allocate):
        self.index = index
        self.buf = allocate(sum(size for _, size, _ in members), dtype)  # zeroed
        self.names = [name for name, _, _ in members]
        self.waiting = set()  # names whose gradient this pass has not handed over yet
        self.handle = None  # the compressor's handle while the all-reduce runs
        self.state = {}  # the compressor's per-bucket buffers (payload, residual)


class _Streams:
    """Where a GPU's bucket all-reduces are ordered: a CuPy stream of their own.

    ringcoll's device path queues a collective on the stream current when it is called and
    makes that stream wait for the collective's last copy. Called on the compute stream, a
    bucket's all-reduce would hold back every kernel the backward pass queues after it. So
    start() makes a stream of the buckets' own wait (an event, not the host) for the compute
    stream's work so far (the gradients written), then calls on it; finish() waits on it,
    then makes the compute stream wait for it, so the update reads the averaged gradients
    and the backward's kernels never wait for a collective. Host buckets: nothing to order.
    """

    def __init__(self, xp):
        cuda = getattr(xp, "cuda", None) if xp is not np else None
        self.cuda, self.stream = cuda, None

    @contextmanager
    def start(self):
        if self.cuda is None:
            yield
            return
        if self.stream is None:
            self.stream = self.cuda.Stream(non_blocking=True)
        self.stream.wait_event(self.cuda.get_current_stream().record())
        with self.stream:
            yield

    @contextmanager
    def finish(self):
        if self.stream is None:
            yield
            return
        compute = self.cuda.get_current_stream()
        with self.stream:  # (a compressor's decoding runs there too, after its collective)
            yield
        compute.wait_event(self.stream.record())


class DistributedOptimizer:
    """Wrap an optimizer so that step() applies gradients averaged over all ranks.

    Args:
        optimizer: a ringcoll.optim optimizer (anything with .params, a dict name -> array,
            and .step(grads)); its parameters must be the same names, shapes and dtypes on
            every rank (checked when constructed).
        comm: the ringcoll.Communicator to average over (default: a new one over
            MPI.COMM_WORLD).
        op: "avg" (default) or "sum".
        bucket_bytes: the largest bucket, in bytes (default 25 MiB, as PyTorch DDP); a
            parameter larger than that gets a bucket of its own.
        compression: a ringcoll.compression.Compressor (Compression.fp16, .bf16,
            .topk(density)); default none.
        backward_passes_per_step: backward passes whose gradients add up before one
            all-reduce and one update.
        staleness: k >= 0; step t applies the averaged gradients of step t - k (module
            docstring). 0 (default): the update of this step, as without the option.

    Attributes:
        grads: dict name -> the parameter's gradient, a view into its bucket (with
            staleness, into the bucket of the step being filled: re-pointed by step()).
        wait_seconds: the time step() (and synchronize()) blocked waiting for all-reduces:
            the communication that overlap did not hide.
        in_flight: (property) steps whose update has not been applied yet (<= staleness).
        bytes_sent: bytes this rank has handed to the wire so far (after compression).
        comm_seconds: the time this rank's bucket all-reduces have run so far, overlapped
            or not (the background thread's busy time, plus blocking exchanges such as
            top-k's all-gather): compare it with the time step() waits.
    """

    def __init__(self, optimizer, comm=None, op="avg", bucket_bytes=DEFAULT_BUCKET_BYTES,
                 compression=None, backward_passes_per_step=1, staleness=0):
        if comm is None:
            comm = Communicator()
        self.optimizer, self.comm = optimizer, comm
        ctx = f"ringcoll rank {comm.rank}, DistributedOptimizer: "
        if op not in ("avg", "sum"):
            raise InvalidArgumentError(f"{ctx}op must be 'avg' or 'sum', got {op!r}")
        if bucket_bytes < 1 or backward_passes_per_step < 1:
            raise InvalidArgumentError(f"{ctx}bucket_bytes and backward_passes_per_step must be "
                                       ">= 1")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise InvalidArgumentError(f"{ctx}staleness must be an int >= 0, got {staleness!r}")
        if staleness and compression is not None and compression.state_keys:
            raise InvalidArgumentError(
                f"{ctx}compression {compression.name} carries state between steps "
                f"({', '.join(compression.state_keys)}) and runs its exchange blocking, which "
                "staleness cannot hide; use staleness=0 or fp16/bf16/no compression")
        self.op = op
        self.staleness = staleness
        self.compression = compression or Compressor()
        self.backward_passes_per_step = backward_passes_per_step
        params = optimizer.params
        for name, p in params.items():
            if not (is_array(p) and (p.dtype.kind == "f" or p.dtype in HALF_TYPES)):
                got = f"dtype {p.dtype}" if is_array(p) else type(p).__name__
                raise InvalidArgumentError(f"{ctx}parameter {name!r} must be a floating-point "
                                           f"NumPy or CuPy array (float16/32/64, bfloat16), "
                                           f"got {got}")
        first = next(iter(params.values()), None)
        mixed = [n for n, p in params.items() if is_device(p) != is_device(first)]
        if mixed:
            raise InvalidArgumentError(
                f"{ctx}parameters {mixed} are not where the first one is ({memory_of(first)}); "
                "gradients are averaged in buckets of one memory: put the whole model on the "
                "GPU or on the host")
        #: the array module of the parameters, buckets and compression buffers (NumPy or CuPy)
        self.xp = xp = array_module(first) if first is not None else np
        self._streams = _Streams(xp)
        if xp is not np and getattr(self.compression, "host_only", False):
            raise InvalidArgumentError(f"{ctx}compression {self.compression.name} has no GPU "
                                       "form (CuPy has no bfloat16 dtype); use Compression.fp16")
        if op == "sum" and compression is not None:
            raise InvalidArgumentError(f"{ctx}compression applies to op='avg' (it divides by "
                                       "the process count before casting); drop one of them")
        # before any bucket: making them is collective, once per bucket on every rank alike
        _check_same_layout(comm, params, ctx)
        # k+1 slots of buckets (one without staleness): (buckets, name -> bucket, grads views);
        # the buffers are the node tier's registered memory (comm.shared_array) where it runs,
        # so each bucket's in-place all-reduce reads the peers' gradients where they lie
        slots = [_make_slot(params, bucket_bytes,
                            lambda n, dtype: comm.shared_array(n, dtype, xp=xp))
                 for _ in range(staleness + 1)]
        self.buckets, self._bucket_of, views = slots[0]
        self.grads = dict(views)
        self._free = deque(slots[1:])  # slots neither being filled nor in flight
        self._in_flight = deque()  # started (or completed) slots, oldest first
        self._filling = slots[0]
        self.bytes_sent = 0
        self.comm_seconds = 0.0
        self.wait_seconds = 0.0
        self._passes = 0  # backward passes completed since the last step
        self._next = 0  # the next bucket to start (they start in order)
        self._no_sync = self._skip = False
        self._reset_pass()

    # -- handing over gradients --------------------------------------------------------------
    def grad_ready(self, name, grad=None):
        """The gradient of parameter `name` for this backward pass is complete.

        grad: the gradient, copied into its bucket (added, on the 2nd..k-th accumulation
            pass); omit it if you wrote (or added) it into opt.grads[name] yourself.
        When this completes a bucket on the pass that synchronises, the bucket's all-reduce
        starts in the background (after all earlier buckets).
        """
        bucket = self._bucket_of.get(name)
        if bucket is None:
            raise InvalidArgumentError(f"ringcoll rank {self.comm.rank}, grad_ready: unknown "
                                       f"parameter {name!r}; the optimizer has "
                                       f"{list(self.grads)}")
        if name not in bucket.waiting:
            raise RingcollError(f"ringcoll rank {self.comm.rank}, grad_ready: the gradient of "
                                f"{name!r} was already handed over in this backward pass")
        if grad is not None:
            if is_device(grad) != (self.xp is not np):
                raise InvalidArgumentError(
                    f"ringcoll rank {self.comm.rank}, grad_ready: the gradient of {name!r} is "
                    f"{memory_of(grad)} but the parameters are not; move it there first "
                    "(cupy.asarray or cupy.asnumpy)")
            view = self.grads[name]
            if self._passes == 0:
                view[...] = grad
            else:
                view += grad
        bucket.waiting.discard(name)
        self._waiting -= 1
        if self._syncs_this_pass():
            self._start_ready_buckets()
        if self._waiting == 0:  # the pass is complete
            self._passes += 1
            self._reset_pass()

    def _syncs_this_pass(self):
        return not self._no_sync and self._passes + 1 >= self.backward_passes_per_step

    def _reset_pass(self):
        for b in self.buckets:
            b.waiting = set(b.names)
        self._waiting = len(self.grads)

    def _start_ready_buckets(self):
        while self._next < len(self.buckets) and not self.buckets[self._next].waiting:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket):
        with self._streams.start():
            if self.op == "sum":
                bucket.handle = self.comm.iallreduce(bucket.buf, op="sum", out=bucket.buf)
                self.bytes_sent += bucket.buf.nbytes
            else:
                bucket.handle = self.compression.start(self.comm, bucket.buf, bucket.state)
                self.bytes_sent += self.compression.wire_bytes(bucket.buf)

    # -- synchronising and stepping ------------------------------------------------------------
    def synchronize(self):
        """Wait until opt.grads hold the gradients averaged over all ranks (starting any
        bucket not started yet). Call it before clipping gradients; then step() inside
        skip_synchronize()."""
        if self.staleness:
            raise InvalidArgumentError(
                f"ringcoll rank {self.comm.rank}, synchronize: not available with "
                f"staleness={self.staleness} (step() applies gradients averaged {self.staleness} "
                "step(s) ago, not opt.grads); clip gradients before handing them over")
        self._check_pass_done("synchronize")
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        self._wait_for(self.buckets)

    def _check_pass_done(self, where):
        if self._waiting != len(self.grads):
            missing = [n for b in self.buckets for n in b.names if n in b.waiting]
            raise RingcollError(f"ringcoll rank {self.comm.rank}, {where}: the backward pass "
                                f"is incomplete; hand over the gradients of {missing} first")
        if self._passes < self.backward_passes_per_step:
            raise RingcollError(
                f"ringcoll rank {self.comm.rank}, {where}: {self._passes} of "
                f"{self.backward_passes_per_step} backward passes done "
                "(backward_passes_per_step); run the others first")

    def _wait_for(self, buckets, exposed=True):
        """Finish the all-reduces of these buckets, in bucket order."""
        for b in buckets:
            if b.handle is not None:
                start = time.perf_counter()
                with self._streams.finish():
                    if self.op == "sum":
                        b.handle.wait()
                    else:
                        self.compression.finish(b.handle)
                waited = time.perf_counter() - start
                if exposed:
                    self.wait_seconds += waited
                request = _request_in(b.handle)
                self.comm_seconds += request.seconds if request is not None else waited
                b.handle = None

    def step(self, grads=None):
        """Average the gradients over all ranks and apply the optimizer's update.

        grads: optional dict name -> gradient, handed over in bucket order now (for loops that
            compute every gradient first); otherwise use grad_ready during the backward pass.
        """
        if grads is not None:
            order = [n for b in self.buckets for n in b.names]
            missing = [n for n in order if n not in grads]
            unknown = [n for n in grads if n not in self._bucket_of]
            if missing or unknown:  # checked before anything is handed over
                raise InvalidArgumentError(
                    f"ringcoll rank {self.comm.rank}, step: grads must have exactly the "
                    f"optimizer's parameters; missing {missing}, unknown {unknown}")
            for name in order:
                self.grad_ready(name, grads[name])
        if self.staleness:
            self._stale_step()
            return
        if not self._skip:
            self.synchronize()
        self.optimizer.step(self.grads)
        self._passes = self._next = 0

    def _stale_step(self):
        """Start what is left of this step's slot, apply the slot of step t - k if there is
        one, and fill a free slot next."""
        self._check_pass_done("step")
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        self._in_flight.append(self._filling)
        self._passes = self._next = 0
        if len(self._in_flight) > self.staleness:
            self._apply_oldest()
        self._fill(self._free.popleft())

    def _apply_oldest(self, exposed=True):
        slot = self._in_flight.popleft()
        buckets, _, views = slot
        self._wait_for(buckets, exposed)
        self.optimizer.step(views)
        self._free.append(slot)

    def _fill(self, slot):
        """Make slot the one the next backward pass writes into (opt.grads re-pointed)."""
        self._filling = slot
        self.buckets, self._bucket_of, views = slot
        self.grads.update(views)
        self._reset_pass()

    @property
    def in_flight(self):
        """Steps whose averaged gradients are started or done but not applied yet."""
        return len(self._in_flight)

    def flush(self):
        """Apply every update still in flight (with staleness k, the last min(k, steps)
        steps'), oldest first, as step() would have; returns how many. Call it at the end of
        training (or before evaluating or changing the learning rate for the last steps'
        updates to be in). Nothing happens without staleness."""
        if self._passes or self._waiting != len(self.grads):
            raise RingcollError(f"ringcoll rank {self.comm.rank}, flush: a backward pass is in "
                                "progress; finish it with step() first")
        applied = 0
        while self._in_flight:
            self._apply_oldest()
            applied += 1
        return applied

    def zero_grad(self):
        """Set every gradient to zero (for loops that add into opt.grads themselves); with
        staleness, those of the step being filled (the ones in flight are not touched)."""
        for b in self.buckets:
            b.buf[...] = 0

    @contextmanager
    def skip_synchronize(self):
        """step() inside this block applies opt.grads as they are (after synchronize())."""
        if self.staleness:
            raise InvalidArgumentError(
                f"ringcoll rank {self.comm.rank}, skip_synchronize: not available with "
                f"staleness={self.staleness}; step() applies step t-{self.staleness}'s average")
        self._skip = True
        try:
            yield self
        finally:
            self._skip = False

    @contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate; the next one outside it
        starts the all-reduces (PyTorch DDP's no_sync)."""
        self._no_sync = True
        try:
            yield self
        finally:
            self._no_sync = False


    # -- checkpoints: the state the wrapper itself keeps, on this rank -------------------------
    def wrapper_state_dict(self):
        """What this rank's wrapper carries between steps, as plain data (the inner
        optimizer's state is self.optimizer.state_dict()):

            {"passes": backward passes accumulated since the last step,
             "backward_passes_per_step": k, "compression": its name, "op": "avg" | "sum",
             "buckets": [[parameter names] per bucket],
             "arrays": {"<bucket>/grads": the accumulated gradients (only while passes > 0),
                        "<bucket>/<key>": the compressor's carried state (top-k's residual)}}

        It differs from rank to rank (each has its own residual and gradients), so a
        checkpoint keeps every rank's. Refused between a bucket's start and step(): save
        between steps.

        With staleness k > 0 it also has "staleness": k and "pending": the steps in flight,
        whose all-reduces it waits for (all ranks started them: no rank blocks for long) and
        saves exactly, as "<bucket>/pending<i>" (i = 0 the oldest): averaged, identical on
        every rank. A wrapper that loads them applies them at its next steps, as this one
        would have, so a resumed run is bitwise the uninterrupted one."""
        if self._next or self._waiting != len(self.grads) or any(
                b.handle is not None for b in self.buckets):
            raise InvalidArgumentError(
                f"ringcoll rank {self.comm.rank}, DistributedOptimizer.wrapper_state_dict: a "
                "backward pass or an all-reduce is in progress; save between step() calls")
        arrays = {}
        for b in self.buckets:
            if self._passes:
                arrays[f"{b.index}/grads"] = b.buf.copy()
            for key in self.compression.state_keys:
                if key in b.state:
                    arrays[f"{b.index}/{key}"] = b.state[key].copy()
        state = {"passes": self._passes,
                 "backward_passes_per_step": self.backward_passes_per_step,
                 "compression": self.compression.name, "op": self.op,
                 "buckets": [list(b.names) for b in self.buckets], "arrays": arrays}
        if self.staleness:  # (keys absent at k = 0: checkpoints as before the option)
            for i, (buckets, _, _) in enumerate(self._in_flight):
                self._wait_for(buckets, exposed=False)
                for b in buckets:
                    arrays[f"{b.index}/pending{i}"] = b.buf.copy()
            state.update(staleness=self.staleness, pending=len(self._in_flight))
        return state

    def check_wrapper_state_dict(self, state):
        """Raise InvalidArgumentError unless load_wrapper_state_dict(state) would restore
        this wrapper exactly (same buckets, compressor and accumulation); changes nothing."""
        ctx = f"ringcoll rank {self.comm.rank}, DistributedOptimizer.load_wrapper_state_dict: "
        mine = {"buckets": [list(b.names) for b in self.buckets],
                "compression": self.compression.name, "op": self.op}
        for key, value in mine.items():
            if state.get(key) != value:
                raise InvalidArgumentError(
                    f"{ctx}the saved wrapper has {key} {state.get(key)!r}, this one "
                    f"{value!r}; build the DistributedOptimizer with the same parameters, "
                    "bucket_bytes, compression and op (or load only opt.optimizer)")
        staleness, pending = state.get("staleness", 0), state.get("pending", 0)
        if staleness != self.staleness:
            raise InvalidArgumentError(
                f"{ctx}the saved wrapper has staleness {staleness!r}, this one "
                f"{self.staleness}; build the DistributedOptimizer with the same staleness")
        if not isinstance(pending, int) or not 0 <= pending <= self.staleness:
            raise InvalidArgumentError(f"{ctx}{pending!r} steps in flight cannot resume with "
                                       f"staleness={self.staleness}")
        if self._in_flight:
            raise InvalidArgumentError(
                f"{ctx}this wrapper has {len(self._in_flight)} update(s) in flight; load into "
                "a fresh wrapper (or flush() first)")
        passes = state.get("passes")
        if not isinstance(passes, int) or not 0 <= passes < self.backward_passes_per_step:
            raise InvalidArgumentError(
                f"{ctx}{passes!r} accumulated backward passes cannot resume with "
                f"backward_passes_per_step={self.backward_passes_per_step}")
        expected = {f"{b.index}/grads": (b.buf.shape, b.buf.dtype) for b in self.buckets
                    if passes}
        expected.update({f"{b.index}/pending{i}": (b.buf.shape, b.buf.dtype)
                         for b in self.buckets for i in range(pending)})
        for key, a in state.get("arrays", {}).items():
            index, _, name = key.partition("/")
            if key in expected:
                ok = (a.shape, a.dtype) == expected[key]
            else:
                ok = (name in self.compression.state_keys and index.isdigit()
                      and int(index) < len(self.buckets)
                      and a.shape == self.buckets[int(index)].buf.shape)
            if not ok:
                raise InvalidArgumentError(f"{ctx}saved array {key!r} {a.shape} {a.dtype} does "
                                           "not fit this wrapper's buckets")
        missing = set(expected) - set(state.get("arrays", {}))
        if missing:
            raise InvalidArgumentError(f"{ctx}the accumulated or in-flight gradients "
                                       f"{sorted(missing)} are missing")

    def load_wrapper_state_dict(self, state):
        """Restore wrapper_state_dict()'s output (checked first; nothing changes on error)."""
        self.check_wrapper_state_dict(state)
        self._passes = state["passes"]
        pending = [self._free.popleft() for _ in range(state.get("pending", 0))]
        for i, (buckets, _, _) in enumerate(pending):
            for b in buckets:  # completed all-reduces: no handle, the average in the buffer
                b.buf[...] = to_module(self.xp, state["arrays"][f"{b.index}/pending{i}"])
        self._in_flight.extend(pending)
        for b in self.buckets:
            for key in self.compression.state_keys:
                b.state.pop(key, None)
        for key, a in state["arrays"].items():
            index, _, name = key.partition("/")
            bucket = self.buckets[int(index)]
            if name.startswith("pending"):
                continue  # restored above
            if name == "grads":
                bucket.buf[...] = to_module(self.xp, a)
            else:
                bucket.state[name] = self.xp.array(to_module(self.xp, a), copy=True)


def _request_in(handle):
    """The background Request inside a compressor's handle, if it has one."""
    items = handle if isinstance(handle, tuple) else (handle,)
    return next((h for h in items if hasattr(h, "seconds") and hasattr(h, "wait")), None)


def _make_slot(params, bucket_bytes, allocate):
    """One set of buckets: (buckets, name -> bucket, name -> gradient view in registration
    order)."""
    buckets = _make_buckets(params, bucket_bytes, allocate)
    views = {}
    for b in buckets:
        offset = 0
        for name in b.names:
            p = params[name]
            views[name] = b.buf[offset:offset + p.size].reshape(p.shape)
            offset += p.size
    return (buckets, {name: b for b in buckets for name in b.names},
            {name: views[name] for name in params})


def _make_buckets(params, bucket_bytes, allocate):
    """Buckets in reverse registration order, one dtype each, at most bucket_bytes each.

    The order is kept strictly (a bucket closes when the next parameter does not fit or has
    another dtype), so gradients that back-propagation produces early are in early buckets
    and start averaging early, also in models that mix dtypes.
    """
    buckets, members, dtype, used = [], [], None, 0
    for name in reversed(list(params)):
        p = params[name]
        if members and (p.dtype != dtype or used + p.nbytes > bucket_bytes):
            buckets.append(_Bucket(len(buckets), dtype, members, allocate))
            members, used = [], 0
        members.append((name, p.size, p.shape))
        dtype, used = p.dtype, used + p.nbytes
    if members:
        buckets.append(_Bucket(len(buckets), dtype, members, allocate))
    return buckets


def _layout(params):
    return [[name, list(p.shape), p.dtype.name] for name, p in params.items()]


def _check_same_layout(comm, params, ctx):
    """Every rank must register the same parameters: compare a digest of names, shapes and
    dtypes once (8 bytes per rank), so buckets line up and nothing hangs later."""
    digest = zlib.crc32(json.dumps(_layout(params)).encode())
    everyone = comm.allgather(np.array([digest], dtype=np.int64))
    differ = [r for r, d in enumerate(everyone.tolist()) if d != digest]
    if differ:
        raise CollectiveMismatchError(
            f"{ctx}rank(s) {differ} registered other parameters (names, shapes or dtypes) than "
            f"this rank ({len(params)} parameters); build the same model on every rank")


def broadcast_parameters(params, root=0, comm=None):
    """Copy root's parameters into every rank's, in place (so all replicas start identical).

    params: dict name -> array, the same names, shapes and dtypes on every rank (checked).
    """
    comm = _comm(comm)
    _check_same_layout(comm, params, f"ringcoll rank {comm.rank}, broadcast_parameters: ")
    for p in params.values():
        comm.broadcast(p, root=root)


def broadcast_optimizer_state(optimizer, root=0, comm=None):
    """Copy root's optimizer state (momentum buffers, step counts, hyper-parameters) into
    every rank's optimizer, also before the first step when the others have no state yet."""
    comm = _comm(comm)
    state = optimizer.state_dict() if comm.rank == root else None
    if comm.rank == root:
        meta, arrays = _split_state(state)
    else:
        meta, arrays = None, None
    meta = json.loads(broadcast_bytes(comm, json.dumps(meta).encode() if meta else None, root))
    if comm.rank != root:
        arrays = [np.empty(shape, dtype) for shape, dtype in meta["arrays"]]
    for a in arrays:
        comm.broadcast(a, root=root)
    if comm.rank != root:
        optimizer.load_state_dict(_join_state(meta, arrays))


def _split_state(state):
    """A state_dict as (JSON-able metadata, list of host arrays) for broadcasting or saving
    (a GPU optimizer's state is copied to the host: load_state_dict copies it back)."""
    arrays, entries = [], {}
    for name, slots in state["state"].items():
        entries[name] = {}
        for key, value in slots.items():
            if is_array(value):
                entries[name][key] = {"array": len(arrays)}
                arrays.append(np.ascontiguousarray(to_module(np, value)))
            else:
                entries[name][key] = {"value": value}
    meta = {"type": state["type"], "hyper": state["hyper"], "state": entries,
            "arrays": [[list(a.shape), a.dtype.name] for a in arrays]}
    return meta, arrays


def _join_state(meta, arrays):
    state = {name: {key: arrays[v["array"]] if "array" in v else v["value"]
                    for key, v in slots.items()}
             for name, slots in meta["state"].items()}
    return {"type": meta["type"], "hyper": meta["hyper"], "state": state}


def broadcast_bytes(comm, data, root=0):
    """root's bytes on every rank (data is ignored elsewhere)."""
    size = np.array([len(data) if comm.rank == root else 0], dtype=np.int64)
    comm.broadcast(size, root=root)
    buf = (np.frombuffer(data, dtype=np.uint8).copy() if comm.rank == root
           else np.empty(int(size[0]), dtype=np.uint8))
    comm.broadcast(buf, root=root)
    return buf.tobytes()


def _comm(comm):
    if comm is None:
        comm = Communicator()
    return comm
