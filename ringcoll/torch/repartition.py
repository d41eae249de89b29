"""Dynamic re-partitioning for PyTorch: a batch sampler and a weighted gradient all-reduce.

    import torch.distributed as dist
    import ringcoll, ringcoll.torch
    from ringcoll.torch import RepartitionSampler, allreduce_gradients

    dist.init_process_group("ringcoll")
    rp = ringcoll.Repartitioner(ringcoll.torch.communicator(), global_batch=96, every=10)
    sampler = RepartitionSampler(rp, len(dataset), shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)   # num_workers=0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:                       # this rank's rows of one global batch
            opt.zero_grad()
            with rp.timed():                      # compute only, not the all-reduce
                loss = F.cross_entropy(model(x), y, reduction="sum") * rp.grad_scale
                loss.backward()
            allreduce_gradients(model, 1.0)       # a SUM over the ranks (1.0: already scaled)
            opt.step()
            rp.step()                             # every 10th step: maybe re-split

The schedule. Every rank draws the same order of the epoch (a torch.Generator seeded with
seed + epoch, as DistributedSampler does) and cuts it into global batches of rp.global_batch
rows. At each batch the sampler reads rp's current split (rp.start, rp.stop) and yields this
rank's rows [start, stop) of that batch; rank 0 the first block, rank 1 the next, and so on. It
reads the split when the DataLoader asks for the batch, not at the start of the epoch, so a
re-split by rp.step() applies from the next batch, in the middle of an epoch too.

The guarantee. Each rank computes the gradient of the SUM of its rows' losses times
rp.grad_scale (1 / global_batch), and allreduce_gradients sums them (all_reduce with
ReduceOp.SUM, not an average): the update is sum over every row of the batch / global_batch,
the global-batch mean, whatever the split and however often it changes. Training follows
single-process training on the same global batches up to the reassociation of float sums
(float64 within 1e-10, tests/mpi_torch_repartition.py at -n 1..4).

Timing. rp.timed() must time this rank's compute only (forward + backward), never the
all-reduce: with the wait for the slowest rank inside, every rank's step takes the same time
T, its seconds per sample are T / count, and the split they give is the current one: it never
moves. allreduce_gradients runs after backward, outside the timed block. DDP's all-reduces run
inside backward, which ends by waiting for them; so under DDP with sum_hook the weighting is
right, but time the compute some other way (rp.record(seconds)) or keep a split you set
(Repartitioner(speeds=...) with `every` beyond the last step).

DataLoader workers. With num_workers > 0 the DataLoader asks for the indices of
prefetch_factor x num_workers batches before their steps, so a re-split reaches the rows that
many batches late: the blocks still tile each batch only if every rank asks for it after the
same rp.step(), and timed() records the new count for rows of the old split. That is not
tested: use num_workers=0 (the default), where each batch's indices are asked for just before
its step.
"""

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import InvalidArgumentError, InvalidTypeError, where

_NAME = "RepartitionSampler"


def _rank_of(rp):
    comm = getattr(rp, "comm", None)
    return getattr(comm, "rank", "?")


class RepartitionSampler(Sampler):
    """This rank's rows of every global batch of the epoch, under rp's current split.

    A batch sampler: ``DataLoader(dataset, batch_sampler=sampler)``; each item is the list of
    this rank's dataset indices for one step. Every rank draws the same order of the epoch;
    at each batch, rank r gets rows [rp.start, rp.stop) of it, read from rp when the batch is
    asked for, so a re-split (rp.step()) applies from the next batch, mid-epoch too. Over the
    ranks the blocks of one batch are, in rank order, exactly that batch.

    Building the sampler is collective over rp.comm (one all-gather of six integers): a rank
    with another dataset length, shuffle, seed or drop_last would draw other batches and train
    silently wrong, so that raises on every rank instead. set_epoch must be called alike on
    every rank (it is not checked: that would cost a collective per epoch).

    Args:
        rp (ringcoll.Repartitioner): the split (on the Communicator of the data-parallel
            ranks); rp.global_batch rows per step.
        dataset (int or Sized): the dataset, or its length.
        shuffle (bool): a new permutation per epoch (torch.randperm with a torch.Generator
            seeded by seed + epoch, as DistributedSampler); False: indices in order.
        seed (int): 0 <= seed < 2**62, the same on every rank.
        drop_last (bool): True drops the rows after the last full global batch; False pads
            the epoch's order with its own first indices to a whole number of global batches
            (as DistributedSampler pads), so every step has rp.global_batch rows and
            rp.grad_scale stays right.

    ``len(sampler)`` is the number of global batches (steps) per epoch; ``epoch`` is the one
    set last.

    Example::

        # 2 ranks, rp.counts == (2, 1), shuffle=False, a dataset of 6: rank 0 yields [0, 1]
        # and [3, 4], rank 1 [2] and [5]
    """

    def __init__(self, rp, dataset, shuffle=True, seed=0, drop_last=True):
        ctx = where(_rank_of(rp), _NAME)
        comm = getattr(rp, "comm", None)
        if comm is None or not all(hasattr(rp, a) for a in ("global_batch", "start", "stop")):
            raise InvalidTypeError(f"{ctx}rp must be a ringcoll.Repartitioner (global_batch, "
                                   f"start, stop, comm), got {type(rp).__name__}; build one "
                                   "with ringcoll.Repartitioner(comm, global_batch)")
        self.rp, self._ctx = rp, ctx
        # bad input is found here and raised after the all-gather, so that no rank is left
        # waiting in it for one that raised
        length, problem = -1, None
        if isinstance(dataset, (int, np.integer)) and not isinstance(dataset, bool):
            length = int(dataset)
        elif hasattr(dataset, "__len__"):
            length = len(dataset)
        else:
            problem = (f"dataset must be a dataset with len() or its length (an int), got "
                       f"{type(dataset).__name__}")
        batch = int(rp.global_batch)
        good_seed = isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) \
            and 0 <= seed < 2 ** 62
        if problem is None and not good_seed:
            problem = f"seed must be an integer in [0, 2**62), got {seed!r}"
        elif problem is None and length < 1:
            problem = "the dataset is empty: give the dataset (or its length) with its rows"
        elif problem is None and drop_last and length < batch:
            problem = (f"a dataset of {length} rows has no full global batch of {batch}: use "
                       f"a smaller global_batch (Repartitioner) or drop_last=False (pads)")
        mine = np.array([[length, batch, bool(shuffle), int(seed) if good_seed else -1,
                          bool(drop_last), problem is None]], dtype=np.int64)
        every = comm.allgather(mine)
        if problem is not None:
            raise InvalidArgumentError(ctx + problem)
        refused = [r for r in range(len(every)) if not every[r, 5]]
        if refused:
            raise InvalidArgumentError(f"{ctx}rank(s) {refused} refused their arguments (see "
                                       "their errors); fix those and build it again")
        names = ["dataset length", "global_batch", "shuffle", "seed", "drop_last"]
        differ = {names[i]: every[:, i].tolist() for i in range(5)
                  if (every[:, i] != every[0, i]).any()}
        if differ:
            raise InvalidArgumentError(
                f"{ctx}the ranks disagree on {differ} (per rank): every rank must draw the same "
                "global batches; give every rank the same dataset, shuffle, seed and drop_last")
        self.length, self.global_batch = length, batch
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0

    def __len__(self):
        if self.drop_last:
            return self.length // self.global_batch
        return math.ceil(self.length / self.global_batch)

    def set_epoch(self, epoch):
        """The epoch whose order the next iteration draws (call it alike on every rank)."""
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise InvalidArgumentError(f"{self._ctx}set_epoch needs an integer >= 0, got "
                                       f"{epoch!r}")
        self.epoch = int(epoch)

    def order(self):
        """This epoch's global order: len(self) x global_batch dataset indices (a tensor),
        the same on every rank; global batch b is order[b * global_batch:(b + 1) * ...]."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.length, generator=g)
        else:
            indices = torch.arange(self.length)
        total = len(self) * self.global_batch
        if total > self.length:  # drop_last=False: pad with the order's own first indices
            indices = indices.repeat(math.ceil(total / self.length))
        return indices[:total]

    def __iter__(self):
        order = self.order()
        batch = self.global_batch
        for b in range(len(self)):
            # read at every batch, not once an epoch: rp.step() may have re-split since
            start, stop = self.rp.start, self.rp.stop
            if self.rp.global_batch != batch or not 0 <= start < stop <= batch:
                raise InvalidArgumentError(
                    f"{self._ctx}rp's split of this rank is rows [{start}, {stop}) of a global "
                    f"batch of {self.rp.global_batch}, not a non-empty block of the sampler's "
                    f"{batch}: keep one Repartitioner per sampler and change it only by step()")
            yield order[b * batch + start:b * batch + stop].tolist()


def _parameters(module_or_params, ctx):
    if isinstance(module_or_params, torch.nn.Module):
        return [p for p in module_or_params.parameters() if p.requires_grad]
    if isinstance(module_or_params, torch.Tensor):
        raise InvalidTypeError(f"{ctx}give a module or an iterable of parameters, not one "
                               "tensor: wrap it in a list")
    try:
        params = list(module_or_params)
    except TypeError:
        raise InvalidTypeError(f"{ctx}expected a torch.nn.Module or an iterable of parameters, "
                               f"got {type(module_or_params).__name__}") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise InvalidTypeError(f"{ctx}every parameter must be a torch.Tensor")
    return [p for p in params if p.requires_grad]


def allreduce_gradients(module_or_params, rp_or_scale, group=None):
    """Sum every parameter's .grad over the group's ranks, in place, each first times a scale.

    The re-partitioned all-reduce: each rank's gradient, of the sum of its rows' losses, is
    multiplied by the scale and summed (ReduceOp.SUM, not the average DDP takes), so with the
    scale 1 / global_batch the result is the gradient of the global-batch mean, whatever the
    split. Every rank ends with the same .grad tensors (the backend's all-reduce is bitwise
    identical on every rank: ringcoll's and gloo's are).

    Schedule: the gradients are flattened into one buffer per dtype (in parameter order), the
    buffers' all-reduces are started together (async_op) and waited for, and the sums copied
    back into each .grad; one collective per dtype, not per parameter.

    Args:
        module_or_params (torch.nn.Module or iterable of Tensor): the same parameters in the
            same order on every rank; those with requires_grad=False are left alone. A
            parameter whose .grad is None on this rank (unused by its rows) counts as zeros
            and is given a zero .grad: every rank must hand the collective the same tensors.
        rp_or_scale (ringcoll.Repartitioner or float): a Repartitioner means its grad_scale
            (1 / global_batch), for a loss that is the plain sum over this rank's rows
            (reduction="sum"); a number multiplies as given: 1.0 when the loss was already
            multiplied by rp.grad_scale.
        group (ProcessGroup): default the default group (any backend: "ringcoll", gloo).

    Example::

        # 2 ranks, rp.counts == (2, 1), global_batch 3: rank 0's loss is the sum of its two
        # rows' losses, rank 1's of its one row's; after the call every rank's .grad is the
        # gradient of the mean of all three rows' losses
        loss = F.mse_loss(model(x), y, reduction="sum")
        loss.backward()
        allreduce_gradients(model, rp)
    """
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else "?"
    ctx = where(rank, "allreduce_gradients")
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(f"{ctx}torch.distributed is not initialised: call "
                                   "dist.init_process_group('ringcoll') on every rank first")
    scale = getattr(rp_or_scale, "grad_scale", rp_or_scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale):
        raise InvalidArgumentError(f"{ctx}rp_or_scale must be a Repartitioner or a finite "
                                   f"number, got {rp_or_scale!r}")
    scale = float(scale)
    flats = {}  # (dtype, device) -> [parameters], in parameter order: the same on every rank
    for p in _parameters(module_or_params, ctx):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.layout != torch.strided:
            raise InvalidTypeError(f"{ctx}a {p.grad.layout} gradient: only dense gradients "
                                   "are summed (use dense embeddings, sparse=False)")
        flats.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    works = []
    for params in flats.values():
        flat = torch.cat([p.grad.detach().reshape(-1) for p in params])
        if scale != 1.0:
            flat.mul_(scale)
        works.append((params, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group,
                                                    async_op=True)))
    for params, flat, work in works:
        work.wait()
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.grad.detach().copy_(piece.view_as(p.grad))


def sum_hook(process_group, bucket):
    """A DDP comm hook that sums the gradients instead of averaging them.

    ``ddp.register_comm_hook(None, sum_hook)`` (or a group as the state): DDP then all-reduces
    each bucket with ReduceOp.SUM and does not divide by the world size, so with each rank's
    loss = (sum of its rows' losses) x rp.grad_scale the update is the global-batch mean
    whatever the split. The all-reduce runs asynchronously, as DDP's own hook's does.
    (Time the compute with record(), not timed() around backward: DDP waits for the
    all-reduces at the end of backward; see the module's docstring.)
    """
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group,
                          async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def communicator(group=None):
    """The ringcoll Communicator under a "ringcoll" torch group (default: the default group),
    for a Repartitioner of the same ranks: ringcoll.Repartitioner(communicator(), 96)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError("ringcoll, communicator: torch.distributed is not "
                                   "initialised: call dist.init_process_group('ringcoll') first")
    pg = dist.group.WORLD if group is None else group
    comm = getattr(pg, "comm", None)
    if comm is None:
        raise InvalidArgumentError(
            f"ringcoll rank {dist.get_rank()}, communicator: the group runs on "
            f"{dist.get_backend(pg)!r}, not ringcoll; use ringcoll.Communicator() (a "
            "Communicator over MPI_COMM_WORLD) for the Repartitioner instead")
    return comm
