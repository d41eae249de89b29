"""mpiexec -n 2 python scripts/ab_inprocess.py OLD_TREE [--rounds 40] [--limit 1.05]

A/B of two ringcoll versions in ONE job: the installed (new) ringcoll and the one in OLD_TREE
(a checkout or `git worktree add --detach /tmp/old REV`), imported side by side as the package
`ringcoll_old`, each with its own Communicator, timed in alternating blocks (old, new, new,
old, ...) so whatever the shared machine does hits both alike. Far steadier than comparing two
runs of bench/targets.py, whose absolute times drift 10-15% between jobs here.

Per size and mode (out of place, in place: out=x), all-reduce auto with out= (so the replayed
hot path at small sizes): the median over rounds of max-over-ranks time per call, both
versions, and new/old. Every result is checked (integer-valued data, exact sums). Exit 3 if a
new/old median exceeds --limit (default 1.05: within 5%), 1 on a wrong result.

Sizes: 8 B, 256 B, 1 KiB (1000 calls per block), 16 MiB and 64 MiB (3 per block).
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringcoll

SIZES = [(8, 1000), (256, 1000), (1024, 1000), (16 << 20, 3), (64 << 20, 3)]


def import_old(tree, into):
    """OLD_TREE's ringcoll (and its kernels/, installed as ringcoll.kernels) as ringcoll_old."""
    pkg = Path(into) / "ringcoll_old"
    shutil.copytree(Path(tree) / "ringcoll", pkg)
    if (Path(tree) / "kernels").is_dir():
        shutil.copytree(Path(tree) / "kernels", pkg / "kernels", dirs_exist_ok=True)
    sys.path.insert(0, str(into))
    import ringcoll_old  # noqa: E402 - the package only uses relative imports

    return ringcoll_old


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--limit", type=float, default=1.05)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    with tempfile.TemporaryDirectory() as tmp:
        old = import_old(args.old, tmp)
        comms = {"old": old.Communicator(), "new": ringcoll.Communicator()}
        p, rank = world.size, world.rank
        rows, wrong = [], 0
        for nbytes, calls in SIZES:
            n = nbytes // 4
            for mode in ("out-of-place", "in-place"):
                x = {k: np.zeros(n, np.float32) for k in comms}  # zeros: sums stay exact
                y = {k: x[k] if mode == "in-place" else np.empty_like(x[k]) for k in comms}
                if mode == "out-of-place":
                    for k in comms:
                        x[k][:] = rank + 1
                samples = {k: [] for k in comms}
                for k, c in comms.items():  # warm up: plans built, scratch allocated
                    for _ in range(min(calls, 20)):
                        c.allreduce(x[k], out=y[k])
                rounds = args.rounds if calls > 3 else max(4, args.rounds // 5)
                for rnd in range(rounds):
                    for k in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                        c, xk, yk = comms[k], x[k], y[k]
                        world.Barrier()
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            c.allreduce(xk, out=yk)
                        samples[k].append(world.allreduce((time.perf_counter() - t0) / calls,
                                                          op=MPI.MAX))
                want = 0 if mode == "in-place" else p * (p + 1) / 2
                wrong += sum(int(not (y[k].min() == want == y[k].max())) for k in comms)
                med = {k: statistics.median(v) for k, v in samples.items()}
                rows.append((nbytes, mode, med["old"], med["new"]))
        for c in comms.values():
            c.close()
    wrong = world.allreduce(wrong)
    worst = max(new / old for _, _, old, new in rows)
    if rank == 0:
        print(f"# A/B in one job at -n {p}: old = {args.old}, new = {ringcoll.__file__}")
        print(f"{'size':>10} {'mode':>13} {'old us':>10} {'new us':>10} {'new/old':>8}")
        for nbytes, mode, a, b in rows:
            print(f"{nbytes:>10} {mode:>13} {a * 1e6:10.2f} {b * 1e6:10.2f} {b / a:8.3f}")
        verdict = "PASS" if worst <= args.limit else "MISS"
        print(f"worst new/old {worst:.3f} (limit {args.limit}) -> {verdict}; wrong: {wrong}")
    sys.exit(1 if wrong else 0 if worst <= args.limit else 3)


if __name__ == "__main__":
    main()
