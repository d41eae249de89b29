"""Asynchronous SGD over a parameter store sharded across the ranks: nobody waits for anybody.

    comm = ringcoll.Communicator()
    opt = ringcoll.AsyncSGD(params, comm, lr=0.05, momentum=0.9)   # collective: rank 0's start
    while opt.updates < total_updates:      # every rank's pushes so far, as of the last pull
        opt.pull()                          # params[...] = the store's current values
        opt.push(backward(params, batch))   # the store += -lr * (momentum-corrected) gradient
    opt.finish()                            # collective: every replica = the store, bitwise
    opt.close()

The store. The parameters, flattened in dict order into one vector of N elements, are cut into
p contiguous shards (rank r holds elements [r N / p, (r + 1) N / p)), each in the owner's part
of one ringcoll Window (Communicator.window: over MPI, MPI_Win_allocate with one passive-target
epoch, MPI_Win_lock_all, for its whole life). One more window holds the update counter: one
int64 on rank 0. No server processes: every rank serves its shard, and serving costs it
nothing, since the origin's MPI reads and writes the owner's memory itself (on one node that
memory is shared; across nodes an RDMA network does the same; without either, MPI may need the
owner to enter MPI before a call completes: see docs/async.md).

Schedule of one worker step (any rank, at its own pace; no barrier, no collective):

    pull:  v0 <- counter                               1 Fetch_and_op(NO_OP) at rank 0
           for each shard r: flat[r] <- store[r]       p Get_accumulate(NO_OP) + flush
           params[...] <- flat
    (the user computes the gradient g on params)
    push:  m <- momentum * m + g  (m = g if momentum == 0)          this worker's own m
           for each shard r: store[r] += -lr * m[r]    p Accumulate(SUM) + flush
           v1 <- counter; counter += 1                 1 Fetch_and_op(SUM) at rank 0
           staleness <- v1 - v0

Cost per step: 2 (p + 1) one-sided calls, each completed before the next (flushed); the model's
bytes read once and added once; no rank's progress depends on another's.

Staleness, measured: v1 - v0 is the number of other workers' pushes that reached the counter
between this worker's pull and its own push; its gradient was computed on parameters that many
updates old. `staleness` keeps every push's value. A worker slowed k x sees about k (p - 1)
(its pushes are rare, the others' frequent); a fast one about (sum of the others' rates) /
its own rate.

Guarantees, and what is given up. Every pushed update lands exactly once, whatever the
interleaving (accumulates on one element are atomic: MPI's accumulate atomicity), so after
finish() the store holds the start plus the sum of every push's -lr m, up to float rounding:
the order of the additions is the arrival order, which varies from run to run. Floats are
therefore not bitwise reproducible across runs, while integer stores are exact (tested: the sum
of all pushed integer gradients equals what the shards received). A pull is atomic per element
but not across elements: it may see a concurrent push in some shards and not yet in others
(Hogwild-style inconsistency, harmless for SGD and the reason there are no locks around a
step). Between pulls the replicas differ (each worker holds the values of its last pull);
finish() makes them equal: a barrier, after which no push is in flight, then every rank pulls,
so every rank holds the store's final values, bitwise.

Momentum is each worker's own buffer of its own gradients (the store holds parameters only);
with staleness s the effective momentum is larger than `momentum`, so keep lr * momentum
modest as p grows. Weight decay adds weight_decay * params (the pulled values) to g.
"""

import numpy as np

from .errors import InvalidArgumentError, InvalidTypeError


class ParameterStore:
    """Named arrays sharded over one Window: pull everything, add into everything.

    Args:
        values (dict[str, np.ndarray]): the starting values; rank 0's are broadcast, so the
            other ranks' only give names, shapes and the dtype (the same on every rank).
        comm: the ringcoll.Communicator of every rank (collective construction).

    The dtype must be one a Window holds (float32, float64, int32, int64, uint32, uint64)
    and common to every array. Attributes: names, shapes, size (N), bounds (the p + 1 shard
    edges), dtype, win (the shards), counter (the update counter window).
    """

    def __init__(self, values, comm):
        ctx = f"ringcoll rank {comm.rank}, ParameterStore: "
        if not isinstance(values, dict) or not values:
            raise InvalidTypeError(f"{ctx}values must be a non-empty dict name -> np.ndarray, "
                                   f"got {type(values).__name__}")
        dtypes = {np.asarray(v).dtype for v in values.values()}
        if len(dtypes) != 1:
            raise InvalidArgumentError(f"{ctx}every array must have one dtype, got "
                                       f"{sorted(d.name for d in dtypes)}; cast them first")
        self.comm = comm
        self.dtype = dtypes.pop()
        self.names = list(values)
        self.shapes = [np.shape(values[k]) for k in self.names]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = n = sum(sizes)
        edges = np.cumsum([0] + sizes)
        p = comm.size
        self.bounds = [r * n // p for r in range(p + 1)]
        self._flat = np.empty(n, self.dtype)  # pull's landing buffer and push's staging
        self._views = [self._flat[a:b].reshape(s) for a, b, s in
                       zip(edges[:-1], edges[1:], self.shapes)]
        for view, k in zip(self._views, self.names):
            view[...] = values[k]
        comm.broadcast(self._flat, root=0)  # every rank starts from rank 0's values
        lo, hi = self.bounds[comm.rank], self.bounds[comm.rank + 1]
        self.win = comm.window(self._flat[lo:hi].copy())
        self.counter = comm.window(np.zeros(1 if comm.rank == 0 else 0, np.int64))
        self._ctx = ctx

    def _shards(self):
        return ((r, self.bounds[r], self.bounds[r + 1]) for r in range(self.comm.size)
                if self.bounds[r + 1] > self.bounds[r])

    def updates(self):
        """The update counter now (pushes that have landed, every rank's)."""
        return self.counter.fetch_add(0, 0, 0)

    def pull(self, into):
        """into[name][...] = the store's values (a dict of arrays shaped like the values);
        returns the update counter read just before the shards."""
        version = self.updates()
        for r, lo, hi in self._shards():
            self.win.fetch(self._flat[lo:hi], r, 0)
        for view, k in zip(self._views, self.names):
            np.copyto(into[k], view, casting="same_kind")
        return version

    def add(self, deltas):
        """The store += deltas (a dict name -> array shaped like the values; every name);
        returns the update counter before this push's increment."""
        for view, k in zip(self._views, self.names):
            np.copyto(view, deltas[k], casting="same_kind")
        for r, lo, hi in self._shards():
            self.win.add(self._flat[lo:hi], r, 0)
        return self.counter.fetch_add(1, 0, 0)

    def close(self):
        """Collective: free both windows."""
        self.win.close()
        self.counter.close()


class AsyncSGD:
    """SGD whose every step reads from and adds into a shared ParameterStore; see the module
    docstring for the schedule, the staleness it measures and what it guarantees.

    Args:
        params (dict[str, np.ndarray]): this rank's replica, overwritten by pull() and
            finish(); rank 0's values are the start (construction is collective).
        comm: the ringcoll.Communicator of every worker.
        lr: the learning rate (> 0); momentum (0 <= momentum < 1) and weight_decay (>= 0)
            act on this worker's own gradients.

    Attributes:
        updates: the store's update counter as of this rank's last pull or push (every rank's
            pushes). pushes: this rank's own pushes. staleness: for every push of this rank,
            how many pushes landed between its pull and it. hyper: {"lr", "momentum",
            "weight_decay"}, mutable between steps.
    """

    def __init__(self, params, comm, lr, momentum=0.0, weight_decay=0.0):
        ctx = f"ringcoll rank {comm.rank}, AsyncSGD: "
        if not isinstance(params, dict) or not params:
            raise InvalidTypeError(f"{ctx}params must be a non-empty dict name -> np.ndarray, "
                                   f"got {type(params).__name__}")
        if not all(isinstance(v, np.ndarray) for v in params.values()):
            raise InvalidTypeError(f"{ctx}every parameter must be a NumPy array (the store "
                                   "lives in host memory)")
        self.hyper = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self._check_hyper(ctx)
        self.params = params
        self.comm = comm
        self._ctx = ctx
        self.store = ParameterStore(params, comm)
        if not np.issubdtype(self.store.dtype, np.floating):
            self.store.close()
            raise InvalidArgumentError(f"{ctx}parameters must be float32 or float64, got "
                                       f"{self.store.dtype}")
        self._momentum = None  # this worker's buffer, made at its first push
        self._delta = {k: np.empty_like(v) for k, v in params.items()}
        self._pulled = None
        self.updates = 0
        self.pushes = 0
        self.staleness = []
        self.store.pull(params)

    def _check_hyper(self, ctx):
        h = self.hyper
        if not h["lr"] > 0 or not 0 <= h["momentum"] < 1 or not h["weight_decay"] >= 0:
            raise InvalidArgumentError(f"{ctx}need lr > 0, 0 <= momentum < 1 and weight_decay "
                                       f">= 0, got {h}")

    def pull(self):
        """This replica <- the store's current values (no waiting for any other rank)."""
        self._pulled = self.updates = self.store.pull(self.params)

    def push(self, grads):
        """Add this worker's update for `grads` (gradients at the last pulled parameters, a
        dict with every parameter's name) to the store. Returns this push's staleness."""
        if self._pulled is None:
            raise InvalidArgumentError(f"{self._ctx}push() needs a pull() first: the gradient "
                                       "must be of pulled parameters (staleness counts from "
                                       "the pull)")
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise InvalidArgumentError(f"{self._ctx}push: no gradient for {missing}; pass one "
                                       "for every parameter")
        self._check_hyper(self._ctx)
        lr, mu, wd = self.hyper["lr"], self.hyper["momentum"], self.hyper["weight_decay"]
        if mu and self._momentum is None:
            self._momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
        for k, p in self.params.items():
            g = grads[k]
            if np.shape(g) != p.shape:
                raise InvalidArgumentError(f"{self._ctx}push: gradient {k!r} has shape "
                                           f"{np.shape(g)}, its parameter {p.shape}")
            if wd:
                g = g + wd * p
            if mu:
                m = self._momentum[k]
                m *= mu
                m += g
                g = m
            np.multiply(g, -lr, out=self._delta[k], casting="same_kind")
        landed = self.store.add(self._delta)
        self.staleness.append(landed - self._pulled)
        self.updates = landed + 1
        self.pushes += 1
        self._pulled = None
        return self.staleness[-1]

    def finish(self):
        """Collective: wait for every rank's last push, then every replica takes the store's
        final values (bitwise equal on every rank). Returns the total number of updates."""
        self.comm.barrier()  # every push before it has completed: each is flushed on return
        self.pull()
        self._pulled = None
        return self.updates

    def close(self):
        """Collective: free the store's windows (the parameters keep their last values)."""
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        return False
