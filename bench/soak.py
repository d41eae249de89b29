"""mpiexec -n 2 python bench/soak.py [--calls 100000] [--max-bytes 800000] [--limit-mib 4]

Memory soak: does a long job whose message sizes keep changing hold its memory flat?

Every rank runs `--calls` all-reduces (float32, sum, algorithm auto) of sizes drawn uniformly
from 4 B .. --max-bytes (the same seeded sequence on every rank), each into a view of one
preallocated input and output buffer, so the arrays themselves never grow: what can grow is
what ringcoll remembers per size (auto's choices, partitions, pipeline segment lists,
schedules). Every result is checked exactly: rank r contributes r + 1, so every element must
be p(p+1)/2 (checked as min == max == p(p+1)/2: reductions that allocate nothing, so the check
itself does not churn the heap).

The resident set (VmRSS, /proc/self/status) and the peak (ru_maxrss) are sampled at 20 points;
the line per sample shows the max over ranks. The run passes when the peak RSS grows by at
most --limit-mib MiB from the 10% mark to the end (the first tenth of the calls warms the
caches to their bound and touches the buffers). Before the caches were bounded, this run grew
linearly: 69 -> 115 MiB over 100,000 calls at -n 2.

Exit status: 0 flat and correct, 3 RSS grew past the limit, 1 a wrong result (wins over 3).
"""

import argparse
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import ringcoll


def rss_mib():
    """(current VmRSS, peak ru_maxrss) of this process, in MiB."""
    current = 0.0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--max-bytes", type=int, default=800_000)
    ap.add_argument("--limit-mib", type=float, default=4.0,
                    help="allowed growth of the peak RSS from the 10%% mark to the end")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    comm = ringcoll.Communicator()
    p, rank = comm.size, comm.rank
    rng = np.random.default_rng(args.seed)  # the same sizes on every rank
    counts = rng.integers(1, args.max_bytes // 4 + 1, size=args.calls)
    _, first = np.unique(counts, return_index=True)  # distinct sizes so far, computed up front
    distinct = np.cumsum(np.isin(np.arange(args.calls), first))
    src = np.full(args.max_bytes // 4, rank + 1, np.float32)
    dst = np.empty_like(src)
    want = p * (p + 1) / 2
    samples = sorted({max(1, args.calls * k // 20) for k in range(1, 21)})
    mark = max(1, args.calls // 10)
    wrong, start, rows = 0, time.perf_counter(), []
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# soak: {args.calls} all-reduces, float32 sum, auto, 4 B .. {args.max_bytes} B, "
              f"{p} rank(s), ringcoll {ringcoll.__version__}, {library}")
        print(f"# {'calls':>7} {'distinct sizes':>14} {'RSS MiB':>8} {'peak MiB':>9} "
              f"{'seconds':>8}")
    for i, n in enumerate(counts, start=1):
        y = comm.allreduce(src[:n], out=dst[:n])
        if not y.min() == want == y.max():
            wrong += 1
        if i in samples or i == mark:
            current, peak = np.max(world.allgather(rss_mib()), axis=0)  # max over ranks
            rows.append((i, peak))
            if rank == 0 and i in samples:
                print(f"  {i:7d} {distinct[i - 1]:14d} {current:8.1f} {peak:9.1f} "
                      f"{time.perf_counter() - start:8.1f}")
    wrong = world.allreduce(wrong)
    at_mark = next(peak for i, peak in rows if i == mark)
    growth = rows[-1][1] - at_mark
    flat = growth <= args.limit_mib
    if rank == 0:
        print(f"peak RSS {at_mark:.1f} MiB at call {mark} -> {rows[-1][1]:.1f} MiB at call "
              f"{args.calls}: growth {growth:+.1f} MiB, limit {args.limit_mib} MiB -> "
              f"{'FLAT' if flat else 'GROWS'}; wrong results: {wrong}")
    comm.close()
    sys.exit(1 if wrong else 0 if flat else 3)


if __name__ == "__main__":
    main()
