"""Dynamic re-partitioning of the data: a slower rank gets fewer rows of each global batch.

    rp = ringcoll.Repartitioner(comm, global_batch=96, every=10, hysteresis=0.1)
    opt = rp.distributed_optimizer(ringcoll.optim.SGD(params, lr=0.05))   # op="sum"
    for step in range(steps):
        rows = rp.shard(order[step * 96:(step + 1) * 96])  # this rank's contiguous block
        with rp.timed():                                    # compute only, not the wait
            acts = forward(params, x[rows])
            _, dlogits = loss_and_grad_logits(acts[-1], y[rows], rp.grad_scale)  # sum / 96
            backward(params, acts, dlogits, opt.grad_ready)
        opt.step()
        rp.step()                                           # every 10th: maybe re-split

The split. The global batch (its size and its order) is fixed; what moves is where it is cut.
Rank r gets the contiguous rows [offset_r, offset_r + count_r) of every global batch, with
count_r in proportion to its measured speed (samples per second), rounded by the largest
remainder so the counts add up to the global batch, and every rank gets at least one row (so
every rank is measured; a global batch smaller than the number of ranks is refused). The first
split is equal (or follows `speeds=`).

Schedule. Each rank records its own compute time per step (record(seconds, samples), or
`with rp.timed():` around forward + backward; time the wait for the all-reduce and every rank
looks equally slow). Every `every` steps, rp.step() all-gathers one float per rank: this
rank's seconds per sample over the steps since the last exchange. From those same p floats,
every rank computes the same new split (the same float operations in the same order, so the
ranks agree bit for bit, with no second message). The new split replaces the current one only
if some rank's count would change by more than `hysteresis` (a fraction of its current count):
measurement noise of a few percent then never re-splits, a 2x straggler does. The new split
applies from the next step, which may be in the middle of an epoch: the data order does not
care where the cuts are.

Fixed point. With t_r = a + b_r * n_r (a per-step overhead a, per-row cost b_r), seconds per
sample overstate a rank with few rows, so one re-split undershoots; repeated re-splits
converge to counts with equal step times on every rank (the fixed point of n_r ~ n_r / t_r),
and the hysteresis stops them once the remaining change is small.

Cost: one all-gather of p float64 values every `every` steps, and O(p log p) arithmetic; the
gradient all-reduce is unchanged (same bytes, the sum instead of the average).

Gradient weighting, and the guarantee. Each rank computes the gradient of the SUM of its rows'
losses times grad_scale = 1 / global_batch, and the DistributedOptimizer sums (op="sum"), so
the update is sum over all rows of the batch / global_batch: exactly the global-batch mean,
whatever the split. Training therefore follows the trajectory of synchronous training on the
same global batches (equal up to float reassociation of the sums: float64 within 1e-10 on the
digits MLP, tested), however often and whenever the split changes.
"""

import time
from contextlib import contextmanager

import numpy as np

from .distributed import DistributedOptimizer
from .errors import InvalidArgumentError, RingcollError

#: seconds per sample below this count as this (a clock that did not tick): no division by 0
_MIN_SECONDS_PER_SAMPLE = 1e-12


def proportional_split(total, weights):
    """Split `total` rows into len(weights) counts in proportion to weights (all > 0).

    Largest-remainder rounding: each count is the floor of its quota total * w / sum(w), and
    the rows left over go to the largest remainders (ties: the lower rank). When total >= the
    number of weights, every count is at least 1 (rows are taken back from the counts most
    above their quota). Pure arithmetic on the given floats: the same inputs give the same
    counts on every rank.
    """
    p = len(weights)
    if p == 0 or total < 0:
        raise InvalidArgumentError(f"ringcoll, proportional_split: need >= 1 weight and "
                                   f"total >= 0, got {p} weights and total {total}")
    if not all(np.isfinite(w) and w > 0 for w in weights):
        raise InvalidArgumentError(f"ringcoll, proportional_split: weights must be finite and "
                                   f"> 0, got {list(weights)}")
    whole = float(sum(weights))
    quota = [total * float(w) / whole for w in weights]
    counts = [int(np.floor(q)) for q in quota]
    minimum = 1 if total >= p else 0
    counts = [max(c, minimum) for c in counts]
    left = total - sum(counts)
    while left > 0:  # largest remainder first, then the lower rank
        r = max(range(p), key=lambda i: (quota[i] - counts[i], -i))
        counts[r] += 1
        left -= 1
    while left < 0:  # the minimum overshot: take from the count most above its quota
        r = max((i for i in range(p) if counts[i] > minimum),
                key=lambda i: (counts[i] - quota[i], i))
        counts[r] -= 1
        left += 1
    return counts


def split_change(old, new):
    """The largest change of one rank's count, as a fraction of its old count."""
    return max(abs(n - o) / max(o, 1) for o, n in zip(old, new))


class Repartitioner:
    """This rank's share of every global batch, re-split every `every` steps by speed.

    Args:
        comm: the ringcoll.Communicator of the data-parallel ranks.
        global_batch: rows per global batch (>= comm.size), fixed.
        every: steps between exchanges of the measured times (>= 1).
        hysteresis: re-split only if some rank's count would change by more than this
            fraction of its current count (>= 0; 0 = whenever the split differs).
        speeds: optional initial relative speeds, one per rank (> 0); default equal.
        clock: seconds for timed() (default time.perf_counter); tests pass a fake.

    Attributes:
        counts: rows of each rank (a tuple, the same on every rank); offsets: where each
            rank's block starts; start, stop: this rank's block.
        grad_scale: 1 / global_batch: multiply the sum of this rank's losses by it.
        steps: rp.step() calls so far. per_sample: the last exchanged seconds per sample of
            every rank (None before the first exchange). resplits: [(step, counts)] of every
            re-split so far.
    """

    def __init__(self, comm, global_batch, every=10, hysteresis=0.1, speeds=None,
                 clock=time.perf_counter):
        self.comm = comm
        p, rank = comm.size, comm.rank
        self._ctx = ctx = f"ringcoll rank {rank}, Repartitioner: "
        if not isinstance(global_batch, (int, np.integer)) or global_batch < p:
            raise InvalidArgumentError(
                f"{ctx}global_batch must be an integer >= the {p} ranks (every rank needs a "
                f"row to be measured), got {global_batch!r}; use a larger batch or fewer ranks")
        if not isinstance(every, (int, np.integer)) or every < 1:
            raise InvalidArgumentError(f"{ctx}every must be an integer >= 1, got {every!r}")
        if not hysteresis >= 0:
            raise InvalidArgumentError(f"{ctx}hysteresis must be >= 0, got {hysteresis!r}")
        if speeds is None:
            speeds = [1.0] * p
        if len(speeds) != p:
            raise InvalidArgumentError(f"{ctx}speeds needs one value per rank ({p}), got "
                                       f"{len(speeds)}")
        self.global_batch, self.every, self.hysteresis = int(global_batch), int(every), hysteresis
        self.grad_scale = 1.0 / self.global_batch
        self._clock = clock
        self.steps = 0
        self.per_sample = None
        self.resplits = []
        self._seconds = 0.0  # this rank's compute time and samples since the last exchange
        self._samples = 0
        self._set(proportional_split(self.global_batch, [float(s) for s in speeds]))

    def _set(self, counts):
        self.counts = tuple(counts)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.counts[:-1]))
        self.start = self.offsets[self.comm.rank]
        self.stop = self.start + self.counts[self.comm.rank]

    # -- the data ------------------------------------------------------------------------------
    @property
    def count(self):
        """This rank's rows of every global batch."""
        return self.counts[self.comm.rank]

    @property
    def rows(self):
        """slice(start, stop): this rank's block of a global batch."""
        return slice(self.start, self.stop)

    def shard(self, batch):
        """This rank's contiguous block of one global batch (an index array, or the rows)."""
        if len(batch) != self.global_batch:
            raise InvalidArgumentError(f"{self._ctx}shard: a global batch has "
                                       f"{self.global_batch} rows, got {len(batch)}")
        return batch[self.start:self.stop]

    def distributed_optimizer(self, optimizer, **kwargs):
        """ringcoll.DistributedOptimizer over this communicator with op="sum", the weighting
        this split needs (each rank hands over grad_scale x the gradient of its losses' sum)."""
        if kwargs.get("op", "sum") != "sum":
            raise InvalidArgumentError(f"{self._ctx}the gradients must be summed (op='sum'): "
                                       "each rank already divides by the global batch")
        kwargs["op"] = "sum"
        return DistributedOptimizer(optimizer, self.comm, **kwargs)

    # -- measuring -----------------------------------------------------------------------------
    def record(self, seconds, samples=None):
        """This rank computed `samples` rows (default: its count) in `seconds`."""
        samples = self.count if samples is None else samples
        if not seconds >= 0 or samples < 0:
            raise InvalidArgumentError(f"{self._ctx}record needs seconds >= 0 and samples >= "
                                       f"0, got {seconds!r} and {samples!r}")
        self._seconds += float(seconds)
        self._samples += int(samples)

    @contextmanager
    def timed(self, samples=None):
        """Record the block's time for `samples` rows (default: this rank's count)."""
        start = self._clock()
        yield self
        self.record(self._clock() - start, samples)

    # -- re-splitting --------------------------------------------------------------------------
    def step(self):
        """One training step is done; every `every` steps, exchange and maybe re-split.

        Call it on every rank after the step's update (a collective every `every` steps).
        Returns True if the split changed (it applies from the next step)."""
        self.steps += 1
        if self.steps % self.every:
            return False
        mine = (self._seconds / self._samples) if self._samples else -1.0  # -1: unmeasured
        self._seconds, self._samples = 0.0, 0
        times = self.comm.allgather(np.array([mine], dtype=np.float64)).tolist()
        silent = [r for r, t in enumerate(times) if t < 0]
        if silent:  # every rank sees the same list: they all raise, nobody waits
            raise RingcollError(
                f"{self._ctx}rank(s) {silent} recorded no samples in the {self.every} steps "
                "before this exchange; call record() or wrap the compute in timed() on every "
                "rank every step")
        self.per_sample = tuple(times)
        speeds = [1.0 / max(t, _MIN_SECONDS_PER_SAMPLE) for t in times]
        new = proportional_split(self.global_batch, speeds)
        if tuple(new) == self.counts or split_change(self.counts, new) <= self.hysteresis:
            return False
        self._set(new)
        self.resplits.append((self.steps, self.counts))
        return True

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self):
        """The split and the measurements so far, as plain data (differs per rank only in
        the time measured since the last exchange)."""
        return {"counts": list(self.counts), "steps": self.steps, "seconds": self._seconds,
                "samples": self._samples, "global_batch": self.global_batch,
                "resplits": [[s, list(c)] for s, c in self.resplits]}

    def load_state_dict(self, state):
        """Restore state_dict()'s output (same global batch and number of ranks)."""
        counts = [int(c) for c in state["counts"]]
        if state["global_batch"] != self.global_batch or len(counts) != self.comm.size or \
                sum(counts) != self.global_batch or min(counts) < 1:
            raise InvalidArgumentError(
                f"{self._ctx}load_state_dict: saved split {counts} of a global batch of "
                f"{state['global_batch']} does not fit {self.comm.size} ranks and a global "
                f"batch of {self.global_batch}")
        self._set(counts)
        self.steps = int(state["steps"])
        self._seconds, self._samples = float(state["seconds"]), int(state["samples"])
        self.resplits = [(int(s), tuple(c)) for s, c in state["resplits"]]
