"""mpiexec -n 2 python bench/straggler.py [--slow 1:2] [--steps 300] [--json out.json]

One slow rank (a straggler) against data-parallel training: the digits MLP of
scripts/train_digits.py (scikit-learn's digits, global batch 96, SGD with momentum) for a fixed
number of steps, with rank 1 slowed by ringcoll.straggler.Slowdown (it sleeps (factor - 1) x
its compute, so the shared cores stay fair), in each mode:

- sync: synchronous data parallelism, the global batch split equally, never re-split: every
  step waits for the straggler;
- repartition: ringcoll.Repartitioner: every --every steps the ranks all-gather their seconds
  per sample and re-split the next global batches in proportion to speed (hysteresis
  --hysteresis), gradients weighted by sample count (op="sum" of sum-of-losses / batch).

Both run the same global batches in the same order from the same initial parameters, so
their final parameters must agree (float reassociation only): checked, printed.

The gradients are handed over after the backward pass (opt.step(grads)), not overlapped
with it: an all-reduce started during rank 0's backward could not progress before the
straggler's gradients exist, and its background thread, busy-polling MPI, would slow rank
0's compute on shared cores and spoil the very time being measured.

Per mode: the wall time of steps x batch samples, the samples/s, each rank's own sample rate
(its rows over its compute seconds, the straggler's sleep included), the final test accuracy.
The capacity bound is the sum of the ranks' own sample rates measured in the sync run (at the
equal split); a mode's efficiency is its samples/s over that bound. Target (issue 18):
repartition >= 90% of the bound with one rank slowed 2x (sync is expected near 67% at -n 2).
Exit 3 if the target is missed, 1 if the two modes' parameters differ.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

# One BLAS thread per rank (before NumPy loads OpenBLAS): the ranks already fill the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.straggler import Slowdown  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from train_digits import (accuracy, backward, forward, init_params, load_data,  # noqa: E402
                          loss_and_grad_logits)

TARGET = 0.90  # of the capacity bound, for repartition


def run_mode(comm, mode, args, data, slow):
    x_train, y_train, x_test, y_test = data
    params = init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    every = args.every if mode == "repartition" else args.steps + 1  # sync: never re-split
    rp = ringcoll.Repartitioner(comm, args.batch, every=every, hysteresis=args.hysteresis)
    opt = rp.distributed_optimizer(ringcoll.optim.SGD(params, lr=args.lr, momentum=0.9),
                                   bucket_bytes=64 << 10)
    rng = np.random.default_rng(args.seed + 1)  # the same order on every rank
    per_epoch = len(x_train) // args.batch
    order = None
    compute = 0.0
    rows_done = 0
    comm.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        if step % per_epoch == 0:
            order = rng.permutation(len(x_train))
        s = step % per_epoch
        rows = rp.shard(order[s * args.batch:(s + 1) * args.batch])
        t0 = time.perf_counter()
        grads = {}
        with rp.timed(), slow:
            acts = forward(params, x_train[rows])
            _, dlogits = loss_and_grad_logits(acts[-1], y_train[rows], rp.grad_scale)
            backward(params, acts, dlogits, grads.__setitem__)
        compute += time.perf_counter() - t0
        rows_done += len(rows)
        opt.step(grads)  # after the compute, not overlapped: see the docstring
        rp.step()
    comm.barrier()
    wall = time.perf_counter() - start
    own = comm.allgather(np.array([rows_done / compute])).tolist()
    per_step = comm.allgather(np.array([compute / args.steps])).tolist()
    return {"mode": mode, "wall_s": wall, "samples_per_s": args.steps * args.batch / wall,
            "wall_ms_per_step": 1e3 * wall / args.steps,
            "compute_ms_per_step": [1e3 * c for c in per_step], "own_rates": own,
            "accuracy": accuracy(params, x_test, y_test),
            "final_split": list(rp.counts), "resplits": len(rp.resplits)}, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", default=os.environ.get("RINGCOLL_BENCH_SLOW", "1:2"),
                    help="RANK:FACTOR[,...] (default 1:2, or $RINGCOLL_BENCH_SLOW)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--hysteresis", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    comm = ringcoll.Communicator()
    slow = Slowdown.for_rank(args.slow, comm.rank)
    data = load_data(args.seed)
    results, finals = [], []
    for mode in ("sync", "repartition"):
        result, params = run_mode(comm, mode, args, data, slow)
        results.append(result)
        finals.append(params)
    bound = sum(results[0]["own_rates"])
    diff = max(float(np.max(np.abs(finals[0][k].astype(np.float64) - finals[1][k])))
               for k in finals[0])
    for r in results:
        r["capacity_bound"] = bound
        r["efficiency"] = r["samples_per_s"] / bound
    status = 1 if diff > 1e-4 else (0 if results[1]["efficiency"] >= TARGET else 3)
    if comm.rank == 0:
        print(f"-n {comm.size}, slow {args.slow}, {args.steps} steps x {args.batch} samples; "
              f"capacity bound {bound:.0f} samples/s (own rates at the equal split: "
              f"{', '.join(f'{v:.0f}' for v in results[0]['own_rates'])})")
        print(f"{'mode':12s} {'wall s':>7s} {'samples/s':>10s} {'of bound':>9s} "
              f"{'accuracy':>9s}  final split (re-splits)")
        for r in results:
            print(f"{r['mode']:12s} {r['wall_s']:7.2f} {r['samples_per_s']:10.0f} "
                  f"{100 * r['efficiency']:8.1f}% {100 * r['accuracy']:8.2f}%  "
                  f"{r['final_split']} ({r['resplits']})  ms/step: wall "
                  f"{r['wall_ms_per_step']:.2f}, compute "
                  f"{', '.join(f'{c:.2f}' for c in r['compute_ms_per_step'])}")
        print(f"max abs diff of the final parameters, sync vs repartition (float32): "
              f"{diff:.2e}; repartition target >= {100 * TARGET:.0f}% of the bound: "
              f"{'PASS' if status == 0 else 'MISS' if status == 3 else 'WRONG'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"processes": comm.size, "slow": args.slow, "steps": args.steps,
                           "batch": args.batch, "results": results, "max_abs_diff": diff,
                           "exit_status": status}, f, indent=1)
    sys.exit(status)


if __name__ == "__main__":
    main()
