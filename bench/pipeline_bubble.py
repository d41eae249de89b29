"""python bench/pipeline_bubble.py            (thread ranks in one process)
mpiexec -n 4 python bench/pipeline_bubble.py  (MPI processes; p = 2 runs on ranks 0 and 1)

The pipeline bubble of GPipe and 1F1B, measured, next to the theory (p - 1)/(m + p - 1), at
p = 2 and 4 stages (--stages) and m = 1, 4 and 8 micro-batches (--micro-batches).

Every stage is one Linear layer of --width x --width on --rows rows per micro-batch, whose
forward also sleeps --forward-ms (20) and whose backward --backward-ms (40): compute that
leaves the CPU (as a GPU kernel does), so the measurement is of the schedule, not of how 2
shared cores take turns, and large enough to dominate the messages (the activations and
gradients still travel for real, point-to-point). One run: a barrier, then Pipeline.run on
every stage; then

    T      = the longest stage's time from its start to the end of its last action
    busy_s = the time stage s spent in forward, backward and loss
    bubble = 1 - sum_s busy_s / (p T)        (the idle fraction of the p x T stage-time)

The table shows the median of --repeat runs (after --warmup untimed ones), the theory, their
difference, T against the theory's (m + p - 1)(t_f + t_b), and the most micro-batches stage 0
held at once (GPipe m, 1F1B min(p, m)). Every run's gradients are checked against the unsplit
model on the whole batch (column #wrong: parameters off by more than 1e-9 relative).

Exit status: 0, or 1 if a gradient is wrong, or 3 if a measured bubble is more than
--tolerance (absolute, default 0.03) from the theory. --json F writes every figure.

Under MPI, a rank waiting in a blocking receive spins on its core; with more ranks than cores
(4 on this 2-core machine) the spinning delays the ranks that have work, so by default the
receives then poll every 50 us with a sleep in between (--poll-us; Pipeline(poll=)).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.parallel import (Linear, Pipeline, Sequential, default_poll,  # noqa: E402
                               micro_batches)


class SleepingLinear(Linear):
    """A Linear layer whose forward and backward also take a fixed time off the CPU."""

    def __init__(self, weight, bias, names, forward_s, backward_s):
        super().__init__(weight, bias, names)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        time.sleep(self.forward_s)
        return super().forward(x)

    def backward(self, dy, x, input_grad=True):
        time.sleep(self.backward_s)
        return super().backward(dy, x, input_grad)


def model(p, width, seed=0):
    rng = np.random.default_rng(seed)
    return {f"W{s}": rng.standard_normal((width, width)) / np.sqrt(width) for s in range(p)} | {
        f"b{s}": rng.standard_normal(width) * 0.1 for s in range(p)}


def reference_grads(params, p, x, target):
    """The unsplit model on the whole batch: gradients of 0.5 |y - target|^2."""
    layers = Sequential([Linear(params[f"W{s}"], params[f"b{s}"], (f"W{s}", f"b{s}"))
                         for s in range(p)])
    y, cache = layers.forward(x)
    return layers.backward(y - target, cache)[1]


def one_run(comm, schedule, m, args):
    """Run the pipeline once on comm (one stage per rank); returns (bubble, T, peak on stage
    0, wrong parameter count), the same on every rank."""
    p, s = comm.size, comm.rank
    params = model(p, args.width)
    stage = Sequential([SleepingLinear(params[f"W{s}"], params[f"b{s}"], (f"W{s}", f"b{s}"),
                                       args.forward_ms / 1e3, args.backward_ms / 1e3)])
    rng = np.random.default_rng(1)
    n = args.rows * m
    x, target = rng.standard_normal((n, args.width)), rng.standard_normal((n, args.width))
    slices = micro_batches(n, m)
    pipe = Pipeline(comm, stage, schedule, poll=args.poll)
    comm.barrier()
    res = pipe.run([args.rows] * m, inputs=[x[sl] for sl in slices] if s == 0 else None,
                   loss=(lambda j, y: (0.0, y - target[slices[j]])) if s == p - 1 else None)
    ref = reference_grads(params, p, x, target)
    wrong = sum(int(not np.allclose(g, ref[k], rtol=1e-9, atol=1e-9 * np.abs(ref[k]).max()))
                for k, g in res.grads.items())
    mine = np.array([res.busy, res.elapsed, res.peak_in_flight if s == 0 else 0, wrong])
    every = comm.allgather(mine.reshape(1, -1))
    busy, T = every[:, 0].sum(), every[:, 1].max()
    return 1 - busy / (p * T), T, int(every[:, 2].max()), int(every[:, 3].sum())


def measure(comm, args):
    """Every (schedule, m) at this communicator's p: rows of the table."""
    p, rows = comm.size, []
    for schedule in ("gpipe", "1f1b"):
        for m in args.micro_batches:
            for _ in range(args.warmup):  # first messages, first channel: not the schedule
                one_run(comm, schedule, m, args)
            runs = [one_run(comm, schedule, m, args) for _ in range(args.repeat)]
            bubble = statistics.median(r[0] for r in runs)
            T = statistics.median(r[1] for r in runs)
            rows.append({"schedule": schedule, "p": p, "m": m,
                         "theory": (p - 1) / (m + p - 1), "measured": bubble,
                         "seconds": T, "theory_seconds": (m + p - 1) * (args.forward_ms
                                                                        + args.backward_ms) / 1e3,
                         "peak_in_flight_stage0": runs[0][2],
                         "wrong": sum(r[3] for r in runs)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--forward-ms", type=float, default=20.0)
    ap.add_argument("--backward-ms", type=float, default=40.0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first, per row")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--poll-us", type=float, default=None,
                    help="receives poll every N us instead of blocking (default under MPI: "
                         "50 when the ranks outnumber the cores, else block; threads: block)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.poll = args.poll_us / 1e6 if args.poll_us else None

    under_mpi = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
    rows = []
    if under_mpi:
        world = ringcoll.Communicator()
        if args.poll_us is None:
            args.poll = default_poll(world)  # MPI's waits spin: give oversubscribed cores back
        for p in args.stages:
            if p > world.size:
                if world.rank == 0:
                    print(f"# p={p} skipped: only {world.size} processes", flush=True)
                continue
            sub = world.split(0 if world.rank < p else None)
            if sub is not None:
                found = measure(sub, args)
                if sub.rank == 0:
                    rows += found
                sub.close()
            world.barrier()
        transport = f"MPI, {world.size} processes"
        show = world.rank == 0
    else:
        for p in args.stages:
            rows += ringcoll.run_threads(p, lambda comm: measure(comm, args), timeout=600)[0]
        transport = "threads"
        show = True
    if not show:
        return 0

    wait = f"polled every {1e6 * args.poll:g} us" if args.poll else "blocking"
    print(f"# pipeline bubble over {transport}: forward {args.forward_ms:g} ms and backward "
          f"{args.backward_ms:g} ms per micro-batch and stage (sleep), {args.rows} x "
          f"{args.width} float64 activations, receives {wait}, median of {args.repeat} runs")
    print("# bubble = 1 - sum of the stages' busy time / (p x the longest stage's time); "
          "theory (p-1)/(m+p-1)")
    print(f"# {'schedule':>8} {'p':>2} {'m':>2} {'theory':>7} {'measured':>8} {'diff':>7} "
          f"{'T (ms)':>8} {'theory T':>8} {'peak s0':>7} {'#wrong':>6}")
    missed = wrong = 0
    for r in rows:
        diff = r["measured"] - r["theory"]
        missed += abs(diff) > args.tolerance
        wrong += r["wrong"]
        print(f"  {r['schedule']:>8} {r['p']:>2} {r['m']:>2} {r['theory']:7.3f} "
              f"{r['measured']:8.3f} {diff:+7.3f} {1e3 * r['seconds']:8.1f} "
              f"{1e3 * r['theory_seconds']:8.1f} {r['peak_in_flight_stage0']:>7} "
              f"{r['wrong']:>6}")
    status = 1 if wrong else 3 if missed else 0
    print(f"# {len(rows)} configurations; {missed} off the theory by more than "
          f"{args.tolerance}; {wrong} wrong gradients; exit status {status}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transport": transport, "args": vars(args), "rows": rows,
                       "exit_status": status}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
