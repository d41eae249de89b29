"""Local SGD: every rank steps on its own gradients; parameters are averaged every H steps.

    comm = ringcoll.Communicator()
    ringcoll.broadcast_parameters(params, comm=comm)          # every replica starts identical
    opt = ringcoll.LocalSGD(ringcoll.optim.SGD(params, lr=0.1, momentum=0.9), comm, period=4)
    for batch in my_shard_of_the_data:
        opt.step(backward(params, batch))                     # local; every 4th also averages
    opt.average()                                             # end on identical replicas

Schedule (period H, p ranks). Step s runs the inner optimizer on this rank's gradients only,
no communication. After every H-th local step (a "round") one fused all-reduce (one per
parameter dtype; the usual all-float32 model: exactly one) averages the parameters, and with
average_state=True the inner optimizer's array state too (momentum buffers, Adam's moments;
step counts are equal on every rank anyway). Then:

- outer_lr == 1 and outer_momentum == 0 (default; post-local SGD): the parameters become the
  average itself, bitwise (no update arithmetic).
- otherwise (DiLoCo): with the anchor x (the parameters at the previous round, identical on
  every rank) and the average a, the outer gradient is d = x - a, and the anchor takes one
  step of SGD with momentum mu = outer_momentum (Nesterov if nesterov=True):
      b <- mu * b + d   (b = d on the first round)
      x <- x - outer_lr * (d + mu * b  if nesterov  else  b)
  and every rank's parameters become x. (ringcoll.optim.SGD's rule, as torch.optim.SGD's.)

Guarantee: right after a round the replicas are bitwise identical (one all-reduce result,
the same arithmetic on every rank); between rounds they differ. H = 1 with SGD (momentum,
Nesterov and weight decay included, with or without average_state: the update is linear in
the gradients, so the average of the momentum buffers follows the averaged gradients) is
synchronous data parallelism up to rounding: the average of the p stepped replicas, in
place of one step on the averaged gradient. Adam is not linear, so H = 1 Adam is not DP.

Cost: per round one all-reduce of the model (2 x with average_state for SGD momentum, 3 x
for Adam), so per step 1/H of data parallelism's bytes, and no rank waits for another
between rounds; memory: a flat buffer per dtype of the model (+ state), and with the outer
optimizer the anchor and its momentum buffer. `comm_seconds` is the time the rounds' all-
reduces took (blocking: local SGD has nothing to overlap them with), `bytes_sent` the bytes.
"""

import time

from .arrays import array_module, is_array, is_device
from .communicator import Communicator
from .distributed import _check_same_layout
from .errors import InvalidArgumentError
from .optim import SGD


class LocalSGD:
    """Wrap an optimizer so that step() is local and every `period` steps averages.

    Args:
        optimizer: a ringcoll.optim optimizer over the parameters (the same names, shapes and
            dtypes on every rank, checked; start them identical: broadcast_parameters).
        comm: the ringcoll.Communicator to average over (default: over MPI.COMM_WORLD).
        period: H >= 1, local steps per averaging round.
        average_state: also average the optimizer's array state in each round.
        outer_lr, outer_momentum, nesterov: the outer (anchor) update, module docstring.

    Attributes:
        steps: local steps taken; rounds: averaging rounds done.
        comm_seconds, bytes_sent: the rounds' communication so far.
    """

    def __init__(self, optimizer, comm=None, period=1, average_state=False, outer_lr=1.0,
                 outer_momentum=0.0, nesterov=False):
        if comm is None:
            comm = Communicator()
        self.optimizer, self.comm = optimizer, comm
        ctx = f"ringcoll rank {comm.rank}, LocalSGD: "
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise InvalidArgumentError(f"{ctx}period must be an int >= 1, got {period!r}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise InvalidArgumentError(f"{ctx}need outer_lr > 0 and 0 <= outer_momentum < 1, "
                                       f"got {outer_lr!r} and {outer_momentum!r}")
        if nesterov and not outer_momentum:
            raise InvalidArgumentError(f"{ctx}nesterov needs outer_momentum > 0")
        self.period, self.average_state = period, bool(average_state)
        self.params = optimizer.params
        _check_same_layout(comm, self.params, ctx)
        self.steps = self.rounds = 0
        self.comm_seconds, self.bytes_sent = 0.0, 0
        self._plain = outer_lr == 1.0 and outer_momentum == 0.0
        self._outer = None
        if not self._plain:
            # the anchor: this round's starting point, stepped by an SGD of its own
            self._anchor = {n: p.copy() for n, p in self.params.items()}
            self._outer = SGD(self._anchor, lr=float(outer_lr), momentum=float(outer_momentum),
                              nesterov=bool(nesterov))
            self._delta = {n: array_module(p).empty_like(p) for n, p in self.params.items()}
        self._state_digest = None

    def step(self, grads):
        """One local step of the inner optimizer on this rank's gradients; every period-th
        also averages (a collective: every rank must step equally often)."""
        self.optimizer.step(grads)
        self.steps += 1
        if self.steps % self.period == 0:
            self.average()

    def average(self):
        """Average now (a collective): parameters (and state), then the outer update."""
        arrays = list(self.params.values())
        if self.average_state:
            arrays += self._state_arrays()
        start = time.perf_counter()
        for group in _by_dtype(arrays):  # (one memory per group: NumPy or CuPy arrays)
            flat = array_module(group[0]).concatenate([a.reshape(-1) for a in group])
            self.comm.allreduce(flat, op="avg", out=flat)
            self.bytes_sent += flat.nbytes
            offset = 0
            for a in group:
                a[...] = flat[offset:offset + a.size].reshape(a.shape)
                offset += a.size
        self.comm_seconds += time.perf_counter() - start
        if self._outer is not None:
            for n, p in self.params.items():
                array_module(p).subtract(self._anchor[n], p, out=self._delta[n])
            self._outer.step(self._delta)
            for n, p in self.params.items():
                p[...] = self._anchor[n]
        self.rounds += 1

    def _state_arrays(self):
        """The inner optimizer's arrays, in a fixed order; checked once to be the same
        (names, keys, shapes, dtypes) on every rank, or the fused buffers would not line up."""
        keys = [(n, k) for n, st in self.optimizer.state.items() for k in sorted(st)
                if is_array(st[k])]
        arrays = [self.optimizer.state[n][k] for n, k in keys]
        digest = (tuple(keys), tuple((a.shape, a.dtype.name) for a in arrays))
        if digest != self._state_digest:
            fake = {f"{n}/{k}": a for (n, k), a in zip(keys, arrays)}
            _check_same_layout(self.comm, fake, f"ringcoll rank {self.comm.rank}, LocalSGD "
                               "average_state: ")
            self._state_digest = digest
        return arrays


def _by_dtype(arrays):
    groups = {}
    for a in arrays:
        groups.setdefault((a.dtype.str, is_device(a)), []).append(a)
    return list(groups.values())

