"""python bench/straggler.py [--sizes 2,4] [--slowdowns 1,2,4] [--json F] [--plot F]

One slow rank (a straggler) against every training mode ringcoll has, side by side in one run.
The driver launches itself under mpiexec once per size (--sizes; each job runs every slowdown
and mode in turn), then prints one table, checks the targets, writes the JSON and the plot of
test accuracy against wall time, and exits non-zero if a target is missed.

Workload: scripts/train_digits.py's MLP and data (scikit-learn's digits), float32, SGD with
momentum, global batch --batch, wider than train_digits' (--hidden 1024 1024) so that a
step's compute outweighs its communication: a straggler is a compute problem, and with
sub-millisecond steps the per-step overheads, not the straggler, would be what is measured.
The last rank is slowed by ringcoll.straggler.Slowdown (it sleeps (factor - 1) x its compute,
so the shared cores stay fair) by each of --slowdowns. Every mode processes the same number
of samples (--steps x --batch) from the same initial parameters:

- sync: DistributedOptimizer, the global batch split equally: every step waits for the
  straggler.
- repartition: ringcoll.Repartitioner: every --every steps the ranks all-gather their seconds
  per sample and re-split the next global batches in proportion to speed (hysteresis
  --hysteresis), gradients weighted by sample count. Its final parameters must equal sync's
  (float32 reassociation only: checked, exit 1 otherwise).
- stale1: DistributedOptimizer(staleness=1): step t applies the averaged gradients of step
  t - 1, whose all-reduce ran behind step t's compute; equal split.
- local4, local16: LocalSGD(period=H): each rank steps on its own rows, parameters averaged
  every H steps; equal split.
- async: AsyncSGD: each rank pulls the parameters from the sharded one-sided store, computes on
  its own batch of --batch / p rows and pushes its update, at its own pace, until the store has
  received --steps x p pushes.

Per mode: wall time, samples/s, test accuracy, and the capacity bound: the sum of the ranks'
own sample rates, each rank's rows of the equal split over the median time of its forward +
backward (its slowdown included), measured with every rank computing at once and nothing
communicated, right before the modes (after a warm-up that absorbs first-call costs). It
counts compute only: the all-reduce and the optimizer's update are overhead every mode pays
(on this 2-core VM about 3 ms of a 36 ms step, so sync reaches ~90% of it unslowed).
Efficiency = samples/s / bound. For stale1 the exposed wait (the time step() blocked on an
all-reduce) over the wall time; for async the measured staleness and the fast ranks' sample
rate (their rows over their wall time). Every (slowdown, mode) runs --repeat times,
interleaved; the table shows the run of median efficiency and the range.

Targets (issue 18), judged at every size >= 2 with no more ranks than cores (with more, the
ranks time-share cores, a sleeping straggler hands its core to the others and the bench would
measure the OS scheduler: reported, not judged, unless --judge-oversubscribed):
  R  repartition, one rank slowed 2x: >= 90% of the capacity bound (median run).
  S  stale1, nobody slowed: >= 95% test accuracy and exposed wait <= 5% of the wall time.
  A  async, one rank slowed 4x: the fast ranks' sample rate (median) >= 90% of theirs
     unslowed (async at 1x), and >= 95% test accuracy.
Exit status: 0 all judged targets met, 3 a target missed, 1 a wrong result (repartition's
parameters differ from sync's by more than 1e-3: float32 reassociation grows over training to
~1e-5..1e-4 here; the float64 equality within 1e-10 is tests/test_repartition.py's), 2 a
worker job failed.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One BLAS thread per rank (before NumPy loads OpenBLAS): the ranks already fill the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
from train_digits import (accuracy, backward, forward, init_params, load_data,  # noqa: E402
                          loss_and_grad_logits)

MODES = ("sync", "repartition", "stale1", "local4", "local16", "async")
TARGET_REPARTITION = 0.90  # of the capacity bound, one rank slowed 2x
TARGET_ACCURACY = 0.95  # stale1 (1x) and async (4x)
TARGET_EXPOSED = 0.05  # stale1's exposed wait / wall, 1x
TARGET_ASYNC_RATE = 0.90  # async fast ranks' rate at 4x / at 1x


# -- one mode, on every rank of the worker job ----------------------------------------------------
class Clock:
    """Wall time of the run, with snapshots of the parameters for the accuracy curve (copied
    now, evaluated after the run, so evaluating costs the run nothing but the copy)."""

    def __init__(self, every):
        self.every = every
        self.snaps = []
        self.start = time.perf_counter()

    def snap(self, step, params, force=False):
        if force or step % self.every == 0:
            self.snaps.append((time.perf_counter() - self.start,
                               {k: v.copy() for k, v in params.items()}))


class Stream:
    """Row indices as one stream of epochs, each a fresh permutation; take(n) is the next n
    (a batch may span epochs, so a global batch may exceed the training set's 1437 rows)."""

    def __init__(self, n, seed):
        self.n, self.rng = n, np.random.default_rng(seed)
        self.buf = np.empty(0, np.int64)

    def take(self, count):
        while len(self.buf) < count:
            self.buf = np.concatenate([self.buf, self.rng.permutation(self.n)])
        out, self.buf = self.buf[:count], self.buf[count:]
        return out


def grads_of(params, x, y, scale, slow, ready=None):
    """Forward + backward under the slowdown; every gradient goes to ready(name, grad) as it
    is made (the optimizer's grad_ready, to overlap its all-reduce) or into the dict returned."""
    grads = {}
    with slow:
        acts = forward(params, x)
        _, dlogits = loss_and_grad_logits(acts[-1], y, scale)
        backward(params, acts, dlogits, ready or grads.__setitem__)
    return grads


def own_rate(comm, args, data, slow, steps):
    """This rank's own sample rate: its rows of the equal split over the median time of
    forward + backward (its slowdown included), every rank computing at once as in training
    but with no communication and nothing to wait for."""
    x_train, y_train = data[0], data[1]
    params = init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    share = args.batch // comm.size
    rows = np.arange(comm.rank * share, (comm.rank + 1) * share) % len(x_train)
    comm.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        grads_of(params, x_train[rows], y_train[rows], 1.0 / args.batch, slow)
        times.append(time.perf_counter() - t0)
    comm.barrier()
    return share / float(np.median(times))


def run_lockstep(ringcoll, comm, mode, args, data, slow):
    """sync, repartition, stale1, local4, local16: every rank runs args.steps steps of the
    same global batches (one global order), its share of each by the mode's split."""
    x_train, y_train = data[0], data[1]
    params = init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    sgd = ringcoll.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    bucket = args.bucket_kb << 10
    every = args.every if mode == "repartition" else args.steps + 1  # others: never re-split
    rp = ringcoll.Repartitioner(comm, args.batch, every=every, hysteresis=args.hysteresis)
    local = mode.startswith("local")
    if local:
        opt = ringcoll.LocalSGD(sgd, comm, period=int(mode[5:]))
        scale = 1.0 / rp.count  # each rank's own mean gradient
    else:
        opt = rp.distributed_optimizer(sgd, bucket_bytes=bucket,
                                       staleness=1 if mode == "stale1" else 0)
        scale = rp.grad_scale  # sum over the global batch / its size
    stream = Stream(len(x_train), args.seed + 1)  # the same order on every rank
    compute = rows_done = 0
    last = []  # the compute seconds of every step, for the balance at the end
    comm.barrier()
    clock = Clock(args.snap_every)
    for step in range(args.steps):
        rows = rp.shard(stream.take(args.batch))
        overlap = args.overlap and not local
        t0 = time.perf_counter()
        with rp.timed():
            grads = grads_of(params, x_train[rows], y_train[rows], scale, slow,
                             opt.grad_ready if overlap else None)
        last.append(time.perf_counter() - t0)
        compute += last[-1]
        rows_done += len(rows)
        opt.step(None if overlap else grads)
        rp.step()
        clock.snap(step + 1, params)
    if local:
        opt.average()
    elif mode == "stale1":
        opt.flush()  # the last step's update: the run's samples all count
    comm.barrier()
    wall = time.perf_counter() - clock.start
    clock.snap(args.steps, params, force=True)
    out = {"wall_s": wall, "samples": args.steps * args.batch,
           "own_rate": rows_done / compute, "rows": rows_done,
           "final_split": list(rp.counts), "resplits": len(rp.resplits),
           "last_ms": 1e3 * float(np.median(last[-10:]))}
    if mode == "stale1":
        out["exposed_s"] = opt.wait_seconds
    return out, params, clock


def run_async(ringcoll, comm, args, data, slow):
    """async: each rank its own batches of batch // p rows (its own order), pushing until the
    store has received steps x p pushes; the clock stops at this rank's last push."""
    x_train, y_train = data[0], data[1]
    params = init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    p = comm.size
    share = args.batch // p
    total = args.steps * p
    stream = Stream(len(x_train), args.seed + 101 + comm.rank)  # every rank its own order
    opt = ringcoll.AsyncSGD(params, comm, lr=args.lr, momentum=args.momentum)
    compute = rows_done = 0
    comm.barrier()
    clock = Clock(args.snap_every)
    while True:
        opt.pull()
        if opt.updates >= total:
            break
        rows = stream.take(share)
        t0 = time.perf_counter()
        grads = grads_of(params, x_train[rows], y_train[rows], 1.0 / args.batch, slow)
        compute += time.perf_counter() - t0
        rows_done += len(rows)
        opt.push(grads)
        if comm.rank == 0:
            clock.snap(opt.pushes, params)
    mine = time.perf_counter() - clock.start  # this rank's own working time
    opt.finish()  # every replica = the store
    wall = time.perf_counter() - clock.start
    clock.snap(0, params, force=True)
    stale = np.array(opt.staleness or [0])
    opt.close()
    out = {"wall_s": wall, "samples": opt.updates * share, "own_rate": rows_done / compute,
           "rows": rows_done, "pushes": opt.pushes, "rate": rows_done / mine,
           "staleness_mean": float(stale.mean()), "staleness_max": int(stale.max())}
    return out, params, clock


def worker(args):
    import ringcoll
    from ringcoll.straggler import Slowdown

    comm = ringcoll.Communicator(poll=args.poll_us * 1e-6 or None)
    p, rank = comm.size, comm.rank
    data = load_data(args.seed)
    x_test, y_test = data[2], data[3]
    rows = []
    own_rate(comm, args, data, Slowdown(1.0), 5)  # warm-up: first-call costs go here
    for factor, rep in [(f, k) for f in args.slowdowns for k in range(args.repeat)]:
        slow = Slowdown(factor if rank == p - 1 else 1.0, rank=rank)
        bound = sum(comm.allgather(np.array([own_rate(comm, args, data, slow, 10)])))
        finals = {}
        for mode in args.modes:
            if mode == "async":
                out, params, clock = run_async(ringcoll, comm, args, data, slow)
            else:
                out, params, clock = run_lockstep(ringcoll, comm, mode, args, data, slow)
            finals[mode] = params
            per_rank = {k: comm.allgather(np.array([float(out.get(k, 0.0))])).tolist()
                        for k in ("own_rate", "rate", "rows", "exposed_s", "last_ms")}
            row = {"p": p, "slow": factor, "mode": mode, "rep": rep, **out, "per_rank": per_rank,
                   "capacity_bound": float(bound),
                   "accuracy": accuracy(params, x_test, y_test),
                   "curve": [(t, accuracy(snap, x_test, y_test)) for t, snap in clock.snaps]
                   if rank == 0 else []}
            rows.append(row)
            if rank == 0:
                print(f"  -n {p} slow {factor:g}x {mode:12s} run {rep + 1} {out['wall_s']:7.2f} s "
                      f"{100 * row['accuracy']:6.2f}%", flush=True)
        if "sync" in finals and "repartition" in finals:
            diff = max(float(np.max(np.abs(finals["sync"][k] - finals["repartition"][k])))
                       for k in finals["sync"])
            rows[len(rows) - len(args.modes) + args.modes.index("repartition")][
                "diff_vs_sync"] = diff
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows))
    comm.close()


# -- the driver ---------------------------------------------------------------------------------
def fast_rate(row):
    """The mean sample rate of every rank but the slowed (last) one."""
    return float(np.mean(row["per_rank"]["rate"][:-1]))


def summarize(runs):
    """One row per (p, slow, mode): the run of median efficiency (samples/s over the run's
    capacity bound), with every run's efficiency (and for async its fast ranks' rate)."""
    for r in runs:
        r["samples_per_s"] = r["samples"] / r["wall_s"]
        r["efficiency"] = r["samples_per_s"] / r["capacity_bound"]
    groups = {}
    for r in runs:
        groups.setdefault((r["p"], r["slow"], r["mode"]), []).append(r)
    rows = []
    for group in groups.values():
        group.sort(key=lambda r: r["efficiency"])
        row = dict(group[(len(group) - 1) // 2])
        row["efficiency_runs"] = [r["efficiency"] for r in group]
        if row["mode"] == "async" and row["p"] > 1:
            row["fast_rate_median"] = float(np.median([fast_rate(r) for r in group]))
        rows.append(row)
    return rows


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def judge(rows, judged):
    """[(target, p, ok, text)] for every target whose rows ran, at the sizes in judged."""
    at = {(r["p"], r["slow"], r["mode"]): r for r in rows}
    verdicts = []
    for p in sorted({r["p"] for r in rows if r["p"] >= 2 and r["p"] in judged}):
        r = at.get((p, 2.0, "repartition"))
        if r is not None:
            ok = bool(r["efficiency"] >= TARGET_REPARTITION)
            verdicts.append(("R", p, ok, f"repartition at 2x: {100 * r['efficiency']:.1f}% of "
                             f"the bound (>= {100 * TARGET_REPARTITION:.0f}%)"))
        r = at.get((p, 1.0, "stale1"))
        if r is not None:
            exposed = max(r["per_rank"]["exposed_s"]) / r["wall_s"]
            ok = bool(r["accuracy"] >= TARGET_ACCURACY and exposed <= TARGET_EXPOSED)
            verdicts.append(("S", p, ok, f"stale1 at 1x: {100 * r['accuracy']:.2f}% accuracy "
                             f"(>= {100 * TARGET_ACCURACY:.0f}%), exposed wait "
                             f"{100 * exposed:.1f}% of the wall (<= {100 * TARGET_EXPOSED:.0f}%)"))
        r4, r1 = at.get((p, 4.0, "async")), at.get((p, 1.0, "async"))
        if r4 is not None and r1 is not None:
            fast4, fast1 = r4["fast_rate_median"], r1["fast_rate_median"]
            ok = bool(fast4 >= TARGET_ASYNC_RATE * fast1 and r4["accuracy"] >= TARGET_ACCURACY)
            verdicts.append(("A", p, ok, f"async at 4x: fast ranks {fast4:.0f} samples/s = "
                             f"{100 * fast4 / fast1:.1f}% of their {fast1:.0f} at 1x "
                             f"(>= {100 * TARGET_ASYNC_RATE:.0f}%), accuracy "
                             f"{100 * r4['accuracy']:.2f}% (>= {100 * TARGET_ACCURACY:.0f}%)"))
    return verdicts


def table(rows):
    lines = [f"{'-n':>3s} {'slow':>5s} {'mode':12s} {'wall s':>7s} {'samples/s':>10s} "
             f"{'of bound':>9s} {'accuracy':>9s}  notes"]
    for r in rows:
        eff = f"{100 * r['efficiency']:8.1f}%"
        note = ""
        if r["mode"] == "repartition":
            note = f"split {r['final_split']} ({r['resplits']} re-splits)"
            if "diff_vs_sync" in r:
                note += f", max|sync - repartition| {r['diff_vs_sync']:.1e}"
        elif r["mode"] == "stale1":
            note = f"exposed wait {100 * max(r['per_rank']['exposed_s']) / r['wall_s']:.1f}%"
        elif r["mode"] == "async":
            note = (f"rates {', '.join(f'{v:.0f}' for v in r['per_rank']['rate'])}/s, "
                    f"staleness mean {r['staleness_mean']:.1f} max {r['staleness_max']}")
        runs = r["efficiency_runs"]
        if len(runs) > 1:
            note = f"runs {100 * min(runs):.0f}-{100 * max(runs):.0f}%; {note}"
        lines.append(f"{r['p']:3d} {r['slow']:4g}x {r['mode']:12s} {r['wall_s']:7.2f} "
                     f"{r['samples_per_s']:10.0f} {eff} {100 * r['accuracy']:8.2f}%  {note}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["p"] for r in rows})
    slows = sorted({r["slow"] for r in rows})
    fig, axes = plt.subplots(len(sizes), len(slows), figsize=(4.2 * len(slows),
                             3.4 * len(sizes)), squeeze=False, sharey=True)
    for i, p in enumerate(sizes):
        for j, s in enumerate(slows):
            ax = axes[i][j]
            for r in rows:
                if r["p"] == p and r["slow"] == s and r["curve"]:
                    t, acc = zip(*r["curve"])
                    ax.plot(t, [100 * a for a in acc], label=r["mode"], marker=".")
            ax.set_title(f"-n {p}, last rank slowed {s:g}x")
            ax.set_xlabel("wall time (s)")
            ax.set_ylim(80, 100)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("test accuracy (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def mpiexec_command(args, n):
    exe = args.mpiexec or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("bench/straggler.py: no mpiexec (pip install mpich, or pass --mpiexec)")
    return [exe, *args.mpiexec_args.split(), "-n", str(n)]


def driver(args, argv):
    rows = []
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [*mpiexec_command(args, n), sys.executable, str(Path(__file__).resolve()),
                   "--worker", "--json", str(out), *argv]
            print(f"-n {n}: {' '.join(cmd[:-len(argv)] if argv else cmd)} ...", flush=True)
            started = time.perf_counter()
            rc = subprocess.call(cmd, timeout=args.job_timeout)
            if rc != 0 or not out.exists():
                print(f"bench/straggler.py: the -n {n} job failed (exit {rc})")
                return 2
            rows += json.loads(out.read_text())
            print(f"-n {n}: {time.perf_counter() - started:.0f} s", flush=True)
    runs, rows = rows, summarize(rows)
    print(f"\n{args.steps} steps x {args.batch} samples, hidden {args.hidden}, lr {args.lr}, "
          f"momentum {args.momentum}; the last rank slowed; bound = the ranks' own sample "
          f"rates summed; median of {args.repeat} run(s)")
    print(table(rows))
    wrong = [r for r in rows if r.get("diff_vs_sync", 0) > 1e-3]
    # More ranks than cores: the ranks time-share cores, so a rank's own rate depends on what
    # the others do at that moment (a sleeping straggler hands its core to them), and the
    # bench measures the OS scheduler. Such sizes are reported, not judged, unless asked.
    judged = [n for n in args.sizes if n <= cores() or args.judge_oversubscribed]
    verdicts = judge(rows, judged)
    print()
    for n in sorted(set(args.sizes) - set(judged)):
        print(f"targets -n {n}: NOT JUDGED: {n} ranks on {cores()} cores (oversubscribed; "
              "--judge-oversubscribed judges them anyway)")
    for name, p, ok, text in verdicts:
        print(f"target {name} -n {p}: {'PASS' if ok else 'MISS'}: {text}")
    for r in wrong:
        print(f"WRONG: -n {r['p']} slow {r['slow']:g}x: repartition's parameters differ from "
              f"sync's by {r['diff_vs_sync']:.2e} (> 1e-3)")
    status = 1 if wrong else 3 if not all(ok for *_, ok, _ in verdicts) else 0
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs,
                                               "targets": verdicts, "exit_status": status},
                                              indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return status


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4", help="process counts, one mpiexec job each")
    ap.add_argument("--slowdowns", default="1,2,4", help="factors of the last rank")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--hidden", type=int, nargs="*", default=[1024, 1024])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.8)
    ap.add_argument("--every", type=int, default=3, help="repartition's exchange period")
    ap.add_argument("--hysteresis", type=float, default=0.1)
    ap.add_argument("--bucket-kb", type=int, default=8192, help="DistributedOptimizer buckets")
    ap.add_argument("--overlap", action="store_true",
                    help="hand gradients to the optimizer during backward (grad_ready)")
    ap.add_argument("--poll-us", type=float, default=0,
                    help="Communicator(poll=): sleep between MPI tests (0: block in MPI)")
    ap.add_argument("--snap-every", type=int, default=5, help="steps between curve points")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of every (slowdown, mode); the table shows the median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows, targets and exit status here")
    ap.add_argument("--plot", help="write the accuracy-against-time plot here (PNG)")
    ap.add_argument("--mpiexec", help="default: the one beside this Python, else on PATH")
    ap.add_argument("--mpiexec-args", default="",
                    help="e.g. '--allow-run-as-root --oversubscribe' for Open MPI")
    ap.add_argument("--job-timeout", type=float, default=1800)
    ap.add_argument("--judge-oversubscribed", action="store_true",
                    help="judge the targets at sizes with more ranks than cores too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(v) for v in args.sizes.split(",")]
    args.slowdowns = [float(v) for v in args.slowdowns.split(",")]
    args.modes = args.modes.split(",")
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    # the worker gets the same options, minus the driver's own (with values, and flags)
    own = {"--json", "--plot", "--mpiexec", "--mpiexec-args", "--job-timeout", "--sizes"}
    passed, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=")[0]
        if key in own:
            skip = "=" not in a
        elif key != "--judge-oversubscribed":
            passed.append(a)
    return driver(args, passed)


if __name__ == "__main__":
    sys.exit(main())
