"""mpiexec -n 2 python scripts/stale_digits.py [--staleness K | --local-period H] [--epochs 20]

scripts/train_digits.py's MLP and data, trained with DistributedOptimizer(staleness=K) (K = 0:
synchronous) or LocalSGD(period=H), to compare the final test accuracy and the exposed
communication: opt.wait_seconds (the time step() blocked on an all-reduce; with K >= 1 that
of step t - K) against opt.comm_seconds (how long the all-reduces ran, hidden or not).
Rank 0 prints one summary line.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as train_digits.py: one BLAS thread per rank
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import ringcoll  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import (accuracy, backward, forward, init_params, load_data,  # noqa: E402
                          loss_and_grad_logits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--bucket-bytes", type=int, default=64 << 10)
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--local-period", type=int, default=0, help="LocalSGD with this H")
    ap.add_argument("--poll-us", type=float, default=0,
                    help="Communicator(poll=): sleep between MPI tests instead of spinning "
                         "beside the computation (0: block inside MPI)")
    ap.add_argument("--skip-epochs", type=int, default=1,
                    help="epochs left out of the per-step times (warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    comm = ringcoll.Communicator(poll=args.poll_us * 1e-6 or None)
    p, rank = comm.size, comm.rank
    x_train, y_train, x_test, y_test = load_data(args.seed)
    params = init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    ringcoll.broadcast_parameters(params, comm=comm)
    inner = ringcoll.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    local = args.local_period > 0
    if local:
        opt = ringcoll.LocalSGD(inner, comm, period=args.local_period)
    else:
        opt = ringcoll.DistributedOptimizer(inner, comm, bucket_bytes=args.bucket_bytes,
                                            staleness=args.staleness)
    share = args.batch // p
    batch = share * p
    steps = len(x_train) // batch
    rng = np.random.default_rng(args.seed + 1)
    t_compute = t_step = wait0 = comm0 = 0.0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        if epoch == args.skip_epochs:  # measure from here (the first epoch warms up)
            t_compute = t_step = 0.0
            wait0 = getattr(opt, "wait_seconds", 0.0)
            comm0 = opt.comm_seconds
        order = rng.permutation(len(x_train))
        for step in range(steps):
            rows = order[step * batch + rank * share: step * batch + (rank + 1) * share]
            t0 = time.perf_counter()
            acts = forward(params, x_train[rows])
            if local:  # each rank's own mean gradient
                _, dlogits = loss_and_grad_logits(acts[-1], y_train[rows], 1.0 / share)
                grads = {}
                backward(params, acts, dlogits, grads.__setitem__)
                t1 = time.perf_counter()
                opt.step(grads)
            else:
                _, dlogits = loss_and_grad_logits(acts[-1], y_train[rows], p / batch)
                backward(params, acts, dlogits, opt.grad_ready)
                t1 = time.perf_counter()
                opt.step()
            t_compute += t1 - t0
            t_step += time.perf_counter() - t1
    # (measured before the final average / flush: those are not steps)
    if local:
        wait = comm_s = opt.comm_seconds - comm0  # blocking rounds: all of it is exposed
        opt.average()
    else:
        wait, comm_s = opt.wait_seconds - wait0, opt.comm_seconds - comm0
        opt.flush()
    elapsed = time.perf_counter() - start
    acc = accuracy(params, x_test, y_test)
    total = (args.epochs - min(args.skip_epochs, args.epochs - 1)) * steps  # measured steps
    if rank == 0:
        mode = f"local SGD H={args.local_period}" if local else f"staleness {args.staleness}"
        print(f"{mode}: final test accuracy {100 * acc:.2f}% after {args.epochs} epochs "
              f"({elapsed:.1f} s) on {p} rank(s), poll {args.poll_us:g} us; per step "
              f"(the last {total} steps): compute "
              f"{1e3 * t_compute / total:.3f} ms, step() {1e3 * t_step / total:.3f} ms, "
              f"exposed wait {1e3 * wait / total:.3f} ms (total {wait:.3f} s), all-reduce "
              f"ran {1e3 * comm_s / total:.3f} ms", flush=True)
    return acc


if __name__ == "__main__":
    main()
