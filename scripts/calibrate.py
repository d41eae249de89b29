"""mpiexec -n 2 python scripts/calibrate.py [-b 16K] [-e 16M] [-f 2] [--json FILE] [--model FILE]

Calibrate the alpha-beta-gamma cost model on this machine and show how well it predicts.

Times ring, recursive doubling and Rabenseifner all-reduce (the algorithms `auto` runs from
64 KiB on; Bruck is a small-message algorithm, capped at 64 KiB) out of place at each size,
with the tuner's measurement (ringcoll.tune: shuffled round-robin, median of rounds, the
slowest rank's time per call). Then it fits two models, each on every point at once:

- the tuner's: one alpha, beta and gamma for every algorithm (ringcoll.tune.fit, the
  CostModel `auto` falls back on). On this machine it cannot follow the data: a ring step
  (segmented isend/irecv/wait, Python bookkeeping) costs several times a replayed Sendrecv
  step, and bytes cost about half as much while the buffer stays in cache;
- the calibrated one: the same CostModel formulas (their step, byte and reduction counts),
  with an alpha per algorithm and a beta and gamma per regime, below and above a buffer size
  (the knee, chosen among a few sizes), fitted for the smallest worst relative error.

It prints measured against predicted time per algorithm and size for both, and exits 3 if the
calibrated model's error at or above --min-bytes (64 KiB) exceeds --target (25%).

A model fitted to the points it is judged on flatters itself. `--model FILE` loads the
calibrated model a previous run wrote with `--json FILE` and only predicts: run once to fit,
then again (a fresh measurement) to see how well the fitted numbers predict times they never
saw. The verdict is then on those held-out predictions.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per rank (docs/data_parallel.md)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll import tune  # noqa: E402
from ringcoll.algorithms import CostModel  # noqa: E402


CALIBRATED = ("ring", "recursive_doubling", "rabenseifner")
KNEES = (128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)
LAWSON_ROUNDS = 60
UNITS = (CostModel(alpha=1, beta=0, gamma=0), CostModel(alpha=0, beta=1, gamma=0),
         CostModel(alpha=0, beta=0, gamma=1))


class Calibrated:
    """CostModel's formulas with an alpha per algorithm and (beta, gamma) below / above knee."""

    def __init__(self, p, knee, alphas, small, large):
        self.p, self.knee, self.alphas, self.small, self.large = p, knee, alphas, small, large

    def terms(self, name, nbytes):
        """(steps, bytes, reduced bytes) of the formula: its coefficients of alpha, beta, g."""
        return [unit.allreduce(name, nbytes, self.p) for unit in UNITS]

    def predict(self, name, nbytes):
        steps, moved, reduced = self.terms(name, nbytes)
        beta, gamma = self.small if nbytes < self.knee else self.large
        return self.alphas[name] * steps + beta * moved + gamma * reduced

    @classmethod
    def load(cls, path, p):
        """The model an earlier run wrote with --json, for the same number of ranks."""
        with open(path) as f:
            saved = json.load(f)
        if saved["p"] != p:
            sys.exit(f"calibrate.py: {path} was fitted at -n {saved['p']}; this run has -n {p}. "
                     f"Fit a model at -n {p} first (--json), or run with -n {saved['p']}.")
        return cls(p, saved["knee"], saved["alphas"], tuple(saved["small"]),
                   tuple(saved["large"]))

    @classmethod
    def fit(cls, p, points, min_bytes):
        """The best knee's model for points [(name, nbytes, seconds)] and its worst |error| at
        >= min_bytes. Every parameter >= 0; the fit minimises the WORST relative error, the
        quantity the target bounds (Lawson's iteratively reweighted least squares: after each
        solve, every point's weight grows with its error)."""
        names = sorted({name for name, _, _ in points})
        best = None
        for knee in KNEES:
            rows = []
            for name, nbytes, seconds in points:
                steps, moved, reduced = [u.allreduce(name, nbytes, p) for u in UNITS]
                row = np.zeros(len(names) + 4)
                row[names.index(name)] = steps
                regime = len(names) + (0 if nbytes < knee else 2)
                row[regime:regime + 2] = moved, reduced
                rows.append(row / seconds)
            a, weights = np.array(rows), np.full(len(rows), 1.0 / len(rows))
            for _ in range(LAWSON_ROUNDS):
                root = np.sqrt(weights)
                x = tune._nonnegative_least_squares(a * root[:, None], root)
                weights = weights * (np.abs(a @ x - 1) + 1e-12)
                weights /= weights.sum()
            model = cls(p, knee, dict(zip(names, x[:len(names)])), tuple(x[-4:-2]),
                        tuple(x[-2:]))
            worst = max((abs(model.predict(n, b) / t - 1) for n, b, t in points
                         if b >= min_bytes), default=0.0)
            if best is None or worst < best[1]:
                best = (model, worst)
        return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("-b", "--minbytes", default="16K")
    ap.add_argument("-e", "--maxbytes", default="16M")
    ap.add_argument("-f", "--stepfactor", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per size")
    ap.add_argument("--min-bytes", default="64K", help="smallest size the target applies to")
    ap.add_argument("--target", type=float, default=0.25, help="largest relative error")
    ap.add_argument("--json", help="write the table and the fitted model here (rank 0)")
    ap.add_argument("--model", help="predict with the model an earlier --json run fitted "
                    "instead of fitting one to this run's measurements")
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    comm = ringcoll.Communicator(tuning=False)
    p = comm.size
    sizes = tune.make_sizes(tune.parse_size(args.minbytes), tune.parse_size(args.maxbytes),
                            args.stepfactor)
    medians = tune.measure(comm, world, sizes, list(CALIBRATED), args.rounds, args.budget,
                           lambda line: print(line, file=sys.stderr, flush=True)
                           if comm.rank == 0 else None)["outofplace"]
    min_bytes = tune.parse_size(args.min_bytes)
    points = [(name, nbytes, seconds) for name in CALIBRATED
              for nbytes, seconds in zip(sizes, medians[name], strict=True)]
    single, rms = tune.fit(sizes, medians, p)
    if args.model:
        model = Calibrated.load(args.model, p)
        worst = max((abs(model.predict(n, b) / t - 1) for n, b, t in points if b >= min_bytes),
                    default=0.0)
    else:
        model, worst = Calibrated.fit(p, points, min_bytes)
    rows = [{"algorithm": name, "bytes": nbytes, "measured_s": seconds,
             "predicted_s": model.predict(name, nbytes),
             "error": model.predict(name, nbytes) / seconds - 1,
             "single_model_error": single.allreduce(name, nbytes, p) / seconds - 1}
            for name, nbytes, seconds in points]
    if comm.rank == 0:
        print(f"# mpiexec -n {p} python scripts/calibrate.py {' '.join(sys.argv[1:])}")
        print(f"# the tuner's single model: alpha {single.alpha * 1e6:.2f} us, beta "
              f"{single.beta * 1e9:.4f} ns/B, gamma {single.gamma * 1e9:.4f} ns/B")
        alphas = ", ".join(f"{name} {a * 1e6:.1f} us" for name, a in model.alphas.items())
        source = (f"fitted by an earlier run ({args.model}), held out: not fitted to these "
                  "measurements" if args.model else "fitted to these measurements")
        print(f"# calibrated ({source}): alpha per step {alphas}; "
              f"below {tune.fmt_bytes(model.knee)}: "
              f"beta {model.small[0] * 1e9:.3f} + gamma {model.small[1] * 1e9:.3f} ns/B; "
              f"above: beta {model.large[0] * 1e9:.3f} + gamma {model.large[1] * 1e9:.3f} ns/B")
        print(f"{'algorithm':>20} {'size':>10} {'measured us':>12} {'predicted us':>13} "
              f"{'error':>8} {'single model':>13}")
        for row in rows:
            mark = "" if row["bytes"] < min_bytes else (
                " <- over target" if abs(row["error"]) > args.target else "")
            print(f"{row['algorithm']:>20} {tune.fmt_bytes(row['bytes']):>10} "
                  f"{1e6 * row['measured_s']:12.1f} {1e6 * row['predicted_s']:13.1f} "
                  f"{100 * row['error']:+7.1f}% {100 * row['single_model_error']:+12.1f}%{mark}")
        worst_single = max(abs(r["single_model_error"]) for r in rows if r["bytes"] >= min_bytes)
        verdict = "PASS" if worst <= args.target else "MISS"
        print(f"# largest |error| at >= {tune.fmt_bytes(min_bytes)}: calibrated "
              f"{100 * worst:.1f}% (target {100 * args.target:.0f}%): {verdict}; the tuner's "
              f"single model {100 * worst_single:.1f}% (rms {100 * rms:.1f}% over all sizes)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"p": p, "knee": model.knee, "alphas": model.alphas,
                           "small": model.small, "large": model.large, "rows": rows}, f,
                          indent=1)
    return 0 if worst <= args.target else 3


if __name__ == "__main__":
    sys.exit(main())
