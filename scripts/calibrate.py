"""mpiexec -n 2 python scripts/calibrate.py [-b 4K] [-e 16M] [-f 4] [--json FILE] [--target 0.25]

Calibrate the alpha-beta-gamma cost model on this machine and show how well it predicts.

Times every flat all-reduce algorithm (ring, recursive doubling, Rabenseifner, and Bruck where
it is a candidate) out of place at each size, with the tuner's measurement (ringcoll.tune:
shuffled round-robin, median of rounds, the slowest rank's time per call), fits alpha, beta and
gamma to all of them at once (ringcoll.tune.fit: least squares on relative error, the same
CostModel formulas `auto` uses), then prints measured against predicted time per algorithm and
size with the relative error. Exit 3 if an error at or above --min-bytes (64 KiB) exceeds
--target (25%).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per rank (see the README)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll import tune  # noqa: E402
from ringcoll.algorithms import FLAT  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("-b", "--minbytes", default="4K")
    ap.add_argument("-e", "--maxbytes", default="16M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per size")
    ap.add_argument("--min-bytes", default="64K", help="smallest size the target applies to")
    ap.add_argument("--target", type=float, default=0.25, help="largest relative error")
    ap.add_argument("--json", help="write the table here (rank 0)")
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    comm = ringcoll.Communicator(tuning=False)
    p = comm.size
    sizes = tune.make_sizes(tune.parse_size(args.minbytes), tune.parse_size(args.maxbytes),
                            args.stepfactor)
    algorithms = list(FLAT)
    medians = tune.measure(comm, world, sizes, algorithms, args.rounds, args.budget,
                           lambda line: print(line, file=sys.stderr, flush=True)
                           if comm.rank == 0 else None)["outofplace"]
    model, rms = tune.fit(sizes, medians, p)
    min_bytes = tune.parse_size(args.min_bytes)
    rows, worst = [], 0.0
    for name in algorithms:
        for nbytes, measured in zip(sizes, medians[name], strict=True):
            if not np.isfinite(measured):
                continue
            predicted = model.allreduce(name, nbytes, p)
            error = predicted / measured - 1
            rows.append({"algorithm": name, "bytes": nbytes, "measured_s": measured,
                         "predicted_s": predicted, "error": error})
            if nbytes >= min_bytes:
                worst = max(worst, abs(error))
    if comm.rank == 0:
        print(f"# mpiexec -n {p} python scripts/calibrate.py {' '.join(sys.argv[1:])}")
        print(f"# fitted: alpha {model.alpha * 1e6:.2f} us, beta {model.beta * 1e9:.4f} ns/B "
              f"({1 / model.beta / 1e9 if model.beta else float('inf'):.2f} GB/s), gamma "
              f"{model.gamma * 1e9:.4f} ns/B; rms relative error {100 * rms:.1f}% over all "
              "points")
        print(f"{'algorithm':>20} {'size':>10} {'measured us':>12} {'predicted us':>13} "
              f"{'error':>8}")
        for row in rows:
            mark = "" if row["bytes"] < min_bytes else (
                " <- over target" if abs(row["error"]) > args.target else "")
            print(f"{row['algorithm']:>20} {tune.fmt_bytes(row['bytes']):>10} "
                  f"{1e6 * row['measured_s']:12.1f} {1e6 * row['predicted_s']:13.1f} "
                  f"{100 * row['error']:+7.1f}%{mark}")
        verdict = "PASS" if worst <= args.target else "MISS"
        print(f"# largest |error| at >= {tune.fmt_bytes(min_bytes)}: {100 * worst:.1f}% "
              f"(target {100 * args.target:.0f}%): {verdict}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"p": p, "alpha": model.alpha, "beta": model.beta,
                           "gamma": model.gamma, "rms": rms, "rows": rows}, f, indent=1)
    return 0 if worst <= args.target else 3


if __name__ == "__main__":
    sys.exit(main())
