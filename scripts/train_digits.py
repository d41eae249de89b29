"""mpiexec -n 4 python scripts/train_digits.py [--epochs 20] [--compression fp16] [--no-overlap]
                                            [--xp cupy]

Data-parallel training of a NumPy (or CuPy) MLP (hand-written backward pass) on scikit-learn's
handwritten digits (sklearn.datasets.load_digits: 1797 8x8 images, shipped with scikit-learn,
no download), with ringcoll.DistributedOptimizer averaging the gradients.

--xp cupy runs the same code on the GPU: data, parameters, gradients, buckets and optimizer
state in device memory, each rank on GPU (local rank mod the GPUs it sees), so ranks share one
GPU or have one each (`mpiexec -n 2 python scripts/train_digits.py --xp cupy`; needs CuPy:
pip install -e ".[examples,gpu]").

Every rank holds the whole data set and, at each step, takes its 1/p share of the same global
batch (the same shuffled order on every rank: one seed), so p ranks follow the very same
trajectory as 1 rank on the global batch. The backward pass hands each layer's gradient to
the optimizer as soon as it exists (last layer first), so its all-reduce overlaps the
gradients of the layers below. Rank 0 prints a progress bar, then per epoch: the training
loss, the test accuracy, and the time per step split into compute (forward + backward),
communication (how long the gradient all-reduces ran, overlapped or not) and exposed
communication (the wait in opt.step() that compute did not hide).

Needs scikit-learn: pip install -e ".[examples]".
"""

import argparse
import os
import sys
import time

# One BLAS thread per rank (before NumPy loads OpenBLAS): the ranks already fill the cores, and
# OpenBLAS's spinning threads fight MPI's busy-polling ones. Measured on 2 cores at -n 2: 40 ms
# per training step of the digits MLP without this, 0.5 ms with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.arrays import array_module  # noqa: E402


def load_data(seed=0, test_fraction=0.2):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def init_params(sizes, seed=0):
    """He-initialised weights and zero biases, registered input layer first."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"W{i}"] = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
                           ).astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def forward(params, x):
    """Activations of every layer (ReLU between layers, logits last), in x's array module."""
    xp = array_module(x)
    layers = len(params) // 2
    acts = [x]
    for i in range(layers):
        z = acts[-1] @ params[f"W{i}"] + params[f"b{i}"]
        acts.append(xp.maximum(z, 0) if i < layers - 1 else z)
    return acts


def loss_and_grad_logits(logits, y, scale):
    """Softmax cross-entropy summed over the batch times `scale`, and d(loss)/d(logits)."""
    xp = array_module(logits)
    z = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -xp.log(p[xp.arange(len(y)), y] + 1e-12).sum() * scale
    p[xp.arange(len(y)), y] -= 1
    return float(loss), p * scale


def backward(params, acts, dlogits, ready):
    """Hand every gradient to ready(name, grad) as soon as it exists: last layer first."""
    layers = len(params) // 2
    delta = dlogits
    for i in reversed(range(layers)):
        ready(f"W{i}", acts[i].T @ delta)
        ready(f"b{i}", delta.sum(axis=0))
        if i:
            delta = (delta @ params[f"W{i}"].T) * (acts[i] > 0)


def accuracy(params, x, y):
    return float((forward(params, x)[-1].argmax(axis=1) == y).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=96, help="global batch (split over ranks)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--compression", choices=["none", "fp16", "bf16", "topk"], default="none")
    ap.add_argument("--density", type=float, default=0.01, help="top-k's fraction sent")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 10)
    ap.add_argument("--no-overlap", action="store_true",
                    help="hand every gradient over after the backward pass (step(grads))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--xp", choices=["numpy", "cupy"], default="numpy",
                    help="the array module: cupy trains on the GPU")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    comm = ringcoll.Communicator()
    p, rank = comm.size, comm.rank
    xp = np
    if args.xp == "cupy":
        import cupy as xp
        xp.cuda.Device(comm.local_rank % xp.cuda.runtime.getDeviceCount()).use()
    x_train, y_train, x_test, y_test = map(xp.asarray, load_data(args.seed))
    params = {name: xp.asarray(a)
              for name, a in init_params([x_train.shape[1], *args.hidden, 10], args.seed).items()}
    ringcoll.broadcast_parameters(params, comm=comm)  # identical already; this proves it cheap
    compression = {"none": None, "fp16": ringcoll.Compression.fp16,
                   "bf16": ringcoll.Compression.bf16,
                   "topk": ringcoll.Compression.topk(args.density)}[args.compression]
    opt = ringcoll.DistributedOptimizer(
        ringcoll.optim.SGD(params, lr=args.lr, momentum=args.momentum), comm,
        bucket_bytes=args.bucket_bytes, compression=compression)

    share = args.batch // p  # this rank's rows of every global batch
    batch = share * p
    steps = len(x_train) // batch
    rng = np.random.default_rng(args.seed + 1)  # the same order on every rank
    show = rank == 0 and not args.quiet
    history = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        t_compute = t_exposed = 0.0
        comm_before = opt.comm_seconds
        loss_sum = 0.0
        for step in range(steps):
            rows = xp.asarray(order[step * batch + rank * share:
                                    step * batch + (rank + 1) * share])
            t0 = time.perf_counter()
            acts = forward(params, x_train[rows])
            # mean over the GLOBAL batch: each rank's sum / batch, averaged (op avg) * p
            loss, dlogits = loss_and_grad_logits(acts[-1], y_train[rows], p / batch)
            if args.no_overlap:
                grads = {}
                backward(params, acts, dlogits, grads.__setitem__)
                t1 = time.perf_counter()
                opt.step(grads)
            else:
                backward(params, acts, dlogits, opt.grad_ready)
                t1 = time.perf_counter()
                opt.step()
            t2 = time.perf_counter()
            t_compute += t1 - t0
            t_exposed += t2 - t1
            loss_sum += loss / p
            if show:
                done = int(30 * (step + 1) / steps)
                print(f"\repoch {epoch:3d} [{'#' * done}{'.' * (30 - done)}]", end="",
                      file=sys.stderr, flush=True)
        # the epoch's mean loss over all ranks' shares, and the test accuracy (same on all)
        loss = float(comm.allreduce(np.array([loss_sum / steps]), op="sum")[0])
        acc = accuracy(params, x_test, y_test)
        elapsed = time.perf_counter() - start
        history.append((epoch, loss, acc, elapsed))
        if show:
            print(f"\repoch {epoch:3d}  {elapsed:5.1f} s  loss {loss:.4f}  "
                  f"test accuracy {100 * acc:5.1f}%  "
                  f"per step: compute {1e3 * t_compute / steps:5.2f} ms, communication "
                  f"{1e3 * (opt.comm_seconds - comm_before) / steps:5.2f} ms, exposed "
                  f"{1e3 * t_exposed / steps:5.2f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        kb = opt.bytes_sent / 1024
        first = next((e for e, _, a, _ in history if a >= 0.95), None)
        reached = (f"95% first reached at epoch {first} ({history[first - 1][3]:.1f} s); "
                   if first else "95% not reached; ")
        print(f"{reached}final test accuracy {100 * history[-1][2]:.2f}% after {args.epochs} "
              f"epochs ({history[-1][3]:.1f} s) on "
              f"{p} rank(s), global batch {batch}, compression {args.compression}; this rank "
              f"sent {kb:.0f} KiB of gradients", file=sys.stderr, flush=True)  # after the bar
    return history


if __name__ == "__main__":
    main()
