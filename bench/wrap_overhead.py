"""mpiexec -n 2 python bench/wrap_overhead.py [--rounds 60] [--limit 1.3] [--all]

The adapter's cost: a repeated `ringcoll.wrap(comm).Allreduce(sendbuf, recvbuf)` against the
same `Communicator.allreduce(x, out=y)` call, both in one job, timed in alternating blocks
(wrap, core, core, wrap, ...) so the machine's noise hits both alike. float32 sum, auto, out of
place; 8 B, 256 B and 1 KiB (blocks of 500 calls), 16 MiB (blocks of 3). Every result is
checked exactly (rank r contributes r + 1).

Prints per size the median time per call (max over ranks) of each and wrap / core. Exit 3 if
wrap / core exceeds --limit (1.3) at a small size or 1.1 at 16 MiB, 1 on a wrong result.

--all: the same for every other blocking collective, each mpi4py call against the Communicator
call it becomes (Bcast / broadcast, Reduce / reduce, Allgather / allgather, Gather / gather,
Scatter / scatter, Alltoall / alltoall, Scan / scan, Exscan / exscan, Reduce_scatter_block /
reduce_scatter, Barrier / barrier), float64, root 0, at 8 B, 256 B and 1 KiB per rank's
block (blocks of 500 calls), limit --limit; the two results must be equal.
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
    ap.add_argument("--all", action="store_true", help="every blocking collective (see above)")
    args = ap.parse_args()
    if args.all:
        return every_collective(args)
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
        rounds = args.rounds if calls > 3 else max(6, args.rounds // 6)
        a, b = alternate(world, run, calls, rounds, warm=min(calls, 50))
        wrong += sum(int(not (y[k].min() == want == y[k].max())) for k in y)
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


def alternate(world, run, calls, rounds, warm):
    """Median seconds per call (max over ranks) of run["wrap"] and run["core"], timed in
    blocks of `calls` that alternate (wrap, core, core, wrap, ...) after `warm` calls each."""
    times = {k: [] for k in run}
    for k in run:
        for _ in range(warm):
            run[k]()
    for r in range(rounds):
        for k in (("wrap", "core") if r % 2 == 0 else ("core", "wrap")):
            call = run[k]
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            times[k].append(world.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
    return statistics.median(times["wrap"]), statistics.median(times["core"])


def pairs(wrapped, core, n, p, rank):
    """{name: (wrap call, core call, (wrap's result, core's result))} on fresh arrays."""
    x = {k: np.arange(n, dtype=np.float64) + rank for k in "wc"}
    big = {k: np.arange(n * p, dtype=np.float64) * (rank + 1) for k in "wc"}
    out = {name: {k: np.zeros(n * p) for k in "wc"} for name in
           ("Bcast", "Reduce", "Allgather", "Gather", "Scatter", "Alltoall", "Scan", "Exscan",
            "Reduce_scatter_block")}
    bc = {k: np.arange(n, dtype=np.float64) for k in "wc"}
    # one view per buffer, made once: a slice taken in the call would be a new array each
    # time, which neither wrap nor the core can tell from another call
    o = {name: tuple(v[k] if name in ("Allgather", "Gather", "Alltoall") else v[k][:n]
                     for k in "wc") for name, v in out.items()}
    # the core calls as wrap() makes them: Allgather, Gather and Scatter declare their
    # counts (MPI's contract), so each becomes a declared call of the core
    declared = {"counts": [n] * p, "declared": True}
    return {
        "Bcast": (lambda: wrapped.Bcast(bc["w"], 0), lambda: core.broadcast(bc["c"], 0),
                  (bc["w"], bc["c"])),
        "Reduce": (lambda: wrapped.Reduce(x["w"], o["Reduce"][0], root=0),
                   lambda: core.reduce(x["c"], root=0, out=o["Reduce"][1]), o["Reduce"]),
        "Allgather": (lambda: wrapped.Allgather(x["w"], o["Allgather"][0]),
                      lambda: core.allgather(x["c"], out=o["Allgather"][1], **declared), o["Allgather"]),
        "Gather": (lambda: wrapped.Gather(x["w"], o["Gather"][0], root=0),
                   lambda: core.gather(x["c"], root=0, out=o["Gather"][1],
                                              **declared), o["Gather"]),
        "Scatter": (lambda: wrapped.Scatter(big["w"], o["Scatter"][0], root=0),
                    lambda: core.scatter(big["c"], root=0, out=o["Scatter"][1],
                                                **declared),
                    o["Scatter"]),
        "Alltoall": (lambda: wrapped.Alltoall(big["w"], o["Alltoall"][0]),
                     lambda: core.alltoall(big["c"], out=o["Alltoall"][1]), o["Alltoall"]),
        "Scan": (lambda: wrapped.Scan(x["w"], o["Scan"][0]),
                 lambda: core.scan(x["c"], out=o["Scan"][1]), o["Scan"]),
        "Exscan": (lambda: wrapped.Exscan(x["w"], o["Exscan"][0]),
                   lambda: core.exscan(x["c"], out=o["Exscan"][1]), o["Exscan"]),
        "Reduce_scatter_block": (
            lambda: wrapped.Reduce_scatter_block(big["w"], o["Reduce_scatter_block"][0]),
            lambda: core.reduce_scatter(big["c"], out=o["Reduce_scatter_block"][1]),
            o["Reduce_scatter_block"]),
        "Barrier": (wrapped.Barrier, core.barrier, None),
    }


def every_collective(args):
    world = MPI.COMM_WORLD
    wrapped, core = ringcoll.wrap(world), ringcoll.Communicator()
    p, rank = world.Get_size(), world.Get_rank()
    rows, wrong, missed, calls = [], 0, False, 500
    for nbytes in (8, 256, 1024):
        for name, (wrap_call, core_call, results) in pairs(wrapped, core, nbytes // 8, p,
                                                           rank).items():
            run = {"wrap": wrap_call, "core": core_call}
            a, b = alternate(world, run, calls, max(6, args.rounds // 4), warm=50)
            if results is not None:
                wrong += int(results[0].tobytes() != results[1].tobytes())
            missed |= a / b > args.limit
            rows.append((name, nbytes, a, b))
    wrong = world.allreduce(wrong)
    if rank == 0:
        print(f"# wrap(comm).X vs the Communicator's call, -n {p}, float64, limit {args.limit}")
        print(f"{'call':<22} {'bytes':>6} {'wrap us':>9} {'core us':>9} {'wrap/core':>9}")
        for name, nbytes, a, b in rows:
            verdict = "PASS" if a / b <= args.limit else "MISS"
            print(f"{name:<22} {nbytes:>6} {a * 1e6:9.2f} {b * 1e6:9.2f} {a / b:9.3f}  {verdict}")
        print(f"wrong results: {wrong}")
    wrapped.Free()
    core.close()
    sys.exit(1 if wrong else 3 if missed else 0)


if __name__ == "__main__":
    main()
