"""The training loop both tiers of the re-partitioning tests run (tests/test_repartition.py on
threads, tests/mpi_repartition.py under mpiexec): scripts/train_digits.py's MLP in float64 on
synthetic data, with a Repartitioner and a recorded (fake) compute time per step, so the
splits are deterministic and nothing sleeps; and the single-process reference on the same
global batches.
"""

import sys
from pathlib import Path

import numpy as np

import ringcoll

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from train_digits import backward, forward, init_params, loss_and_grad_logits  # noqa: E402

SIZES = [12, 16, 8, 5]
BATCH = 30  # not divisible by 4 (nor by 7 = the 2x straggler's sevenths): uneven splits
STEPS_PER_EPOCH = 4  # an exchange every 3 steps re-splits in the middle of epochs
EPOCHS = 3
N = BATCH * STEPS_PER_EPOCH


def data(seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, SIZES[0]))
    y = (x[:, :SIZES[-1]].argmax(axis=1) + (x[:, -1] > 0.5)) % SIZES[-1]
    return x, y


def params64(seed=1):
    return {k: v.astype(np.float64) for k, v in init_params(SIZES, seed).items()}


def make_sgd(params):
    return ringcoll.optim.SGD(params, lr=0.2, momentum=0.9)


def batches(epochs=EPOCHS, seed=7):
    """Every global batch's row indices, in order: a new permutation per epoch (one seed:
    the same order on every rank)."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(N)
        for s in range(STEPS_PER_EPOCH):
            yield order[s * BATCH:(s + 1) * BATCH]


def reference():
    """One process, whole global batches: the synchronous trajectory."""
    x, y = data()
    params = params64()
    opt = make_sgd(params)
    for rows in batches():
        acts = forward(params, x[rows])
        _, dlogits = loss_and_grad_logits(acts[-1], y[rows], 1.0 / BATCH)
        grads = {}
        backward(params, acts, dlogits, grads.__setitem__)
        opt.step(grads)
    return params


def train(comm, slow_factors, every=3, hysteresis=0.1, cost=1e-3, overhead=0.0):
    """Re-partitioned data-parallel training; rank r's compute "takes"
    slow_factors[r] * (overhead + cost * rows) seconds (recorded, not slept).

    Returns (params, the Repartitioner, [counts of every step])."""
    x, y = data()
    params = params64(seed=1 + comm.rank)  # different on purpose: broadcast fixes it
    ringcoll.broadcast_parameters(params, comm=comm)
    rp = ringcoll.Repartitioner(comm, BATCH, every=every, hysteresis=hysteresis)
    opt = rp.distributed_optimizer(make_sgd(params), bucket_bytes=512)
    factor = slow_factors[comm.rank] if comm.rank < len(slow_factors) else 1.0
    used = []
    for batch in batches():
        rows = rp.shard(batch)
        used.append(rp.counts)
        acts = forward(params, x[rows])
        _, dlogits = loss_and_grad_logits(acts[-1], y[rows], rp.grad_scale)
        backward(params, acts, dlogits, opt.grad_ready)
        rp.record(factor * (overhead + cost * len(rows)))
        opt.step()
        rp.step()
    return params, rp, used


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
