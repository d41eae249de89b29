"""mpiexec -n 2 python bench/wrap_overhead.py [--rounds 60] [--limit 1.3]

The adapter's cost: a repeated `ringcoll.wrap(comm).Allreduce(sendbuf, recvbuf)` against the
same `Communicator.allreduce(x, out=y)` call, both in one job, timed in alternating blocks
(wrap, core, core, wrap, ...) so the machine's noise hits both alike. float32 sum, auto, out of
place; 8 B, 256 B and 1 KiB (blocks of 500 calls), 16 MiB (blocks of 3). Every result is
checked exactly (rank r contributes r + 1).

Prints per size the median time per call (max over ranks) of each and wrap / core. Exit 3 if
wrap / core exceeds --limit (1.3) at a small size or 1.1 at 16 MiB, 1 on a wrong result.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import ringcoll

SIZES = [(8, 500), (256, 500), (1024, 500), (16 << 20, 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--limit", type=float, default=1.3)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    wrapped, core = ringcoll.wrap(world), ringcoll.Communicator()
    p, rank = world.Get_size(), world.Get_rank()
    want = p * (p + 1) / 2
    rows, wrong, missed = [], 0, False
    for nbytes, calls in SIZES:
        x = {k: np.full(nbytes // 4, rank + 1, np.float32) for k in ("wrap", "core")}
        y = {k: np.empty_like(x[k]) for k in x}
        run = {"wrap": lambda: wrapped.Allreduce(x["wrap"], y["wrap"]),
               "core": lambda: core.allreduce(x["core"], out=y["core"])}
        times = {k: [] for k in run}
        for k in run:
            for _ in range(min(calls, 50)):
                run[k]()
        rounds = args.rounds if calls > 3 else max(6, args.rounds // 6)
        for r in range(rounds):
            for k in (("wrap", "core") if r % 2 == 0 else ("core", "wrap")):
                call = run[k]
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                times[k].append(world.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
        wrong += sum(int(not (y[k].min() == want == y[k].max())) for k in y)
        a, b = statistics.median(times["wrap"]), statistics.median(times["core"])
        limit = args.limit if nbytes <= 1024 else 1.1
        missed |= a / b > limit
        rows.append((nbytes, a, b, limit))
    wrong = world.allreduce(wrong)
    if rank == 0:
        print(f"# wrap(comm).Allreduce vs Communicator.allreduce(x, out=y), -n {p}, float32")
        print(f"{'bytes':>10} {'wrap us':>10} {'core us':>10} {'wrap/core':>10} {'limit':>6}")
        for nbytes, a, b, limit in rows:
            verdict = "PASS" if a / b <= limit else "MISS"
            print(f"{nbytes:>10} {a * 1e6:10.2f} {b * 1e6:10.2f} {a / b:10.3f} {limit:6.2f}  "
                  f"{verdict}")
        print(f"wrong results: {wrong}")
    wrapped.Free()
    core.close()
    sys.exit(1 if wrong else 3 if missed else 0)


if __name__ == "__main__":
    main()
