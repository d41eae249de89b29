"""mpiexec -n 2 python bench/osu_wrap.py [--demos bcast,gather] [--repeats 5] [--limit 2.0]

mpi4py's own ports of the OSU latency benchmarks (demo/osu_*.py of the pinned mpi4py sdist,
fetched as scripts/mpi4py_suite.py fetches it) run unchanged, in one job, on plain mpi4py and
on ringcoll.wrap(MPI.COMM_WORLD), side by side: each demo's function is called as it is, once
with `from mpi4py import MPI` giving the real module and once giving a stand-in whose
COMM_WORLD is the wrapped communicator (every other name is the real module's). Only the demo
function's own keyword arguments are set: MAX_MSG_SIZE (--max-size, default 256 KiB, the
issue's range) and fewer iterations (--loop, --loop-large) so that the run stays short.

Demos: allgather, alltoall, alltoallv, barrier, bcast, gather, scatter. Each (demo, mode) runs
--repeats times, plain and wrap alternating (which goes first alternates too); per message size
the figure is the median of the repeats' latencies (rank 0's printed latency, as the demo
prints it), and the ratio wrap / plain.

Target (restated in issue 41): at every size from 1 B to 256 KiB (the 0-byte line is printed,
not judged), wrap within max(--limit x plain, plain + --added us) = max(2x, +2 us): the
median of the repeats against plain's median, and with no outliers: the slowest of wrap's
runs against the slowest of plain's, by the same bound (noise of the machine slows both
alike; a stall of ringcoll's own, such as one run of 1,106 us against 10 us, fails).
Exit 0 every size met, 3 a miss, 2 the sdist could not be had, 1 a demo failed.
"""

import argparse
import contextlib
import importlib.util
import io
import statistics
import sys
import types
from pathlib import Path

import mpi4py
from mpi4py import MPI

import ringcoll

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from mpi4py_suite import sdist_tests  # noqa: E402

DEMOS = ("allgather", "alltoall", "alltoallv", "barrier", "bcast", "gather", "scatter")
WORLD = MPI.COMM_WORLD


def stand_in(comm):
    """A module object that is mpi4py.MPI but for COMM_WORLD."""
    fake = types.ModuleType("mpi4py.MPI")
    fake.__dict__.update(MPI.__dict__)
    fake.COMM_WORLD = comm
    return fake


def load(folder, name):
    path = folder / f"osu_{name}.py"
    spec = importlib.util.spec_from_file_location(f"osu_{name}", path)
    return spec, path


def run_demo(folder, name, comm, args):
    """Run osu_<name>() with MPI.COMM_WORLD being comm; {size: latency us} from rank 0's output
    (the other ranks return {})."""
    spec, _ = load(folder, name)
    module = importlib.util.module_from_spec(spec)
    real = mpi4py.MPI
    mpi4py.MPI = stand_in(comm)  # what the demo's `from mpi4py import MPI` reads
    out = io.StringIO()
    try:
        spec.loader.exec_module(module)
        kwargs = {"MAX_MSG_SIZE": args.max_size, "loop": args.loop, "skip": args.loop // 10,
                  "loop_large": args.loop_large, "skip_large": max(1, args.loop_large // 10)}
        with contextlib.redirect_stdout(out):
            getattr(module, f"osu_{name}")(**kwargs)
    finally:
        mpi4py.MPI = real
    found = {}
    for line in out.getvalue().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            found[int(parts[0])] = float(parts[1])
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--demos", default=",".join(DEMOS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=float, default=2.0)
    ap.add_argument("--added", type=float, default=2.0,
                    help="us wrap may add where that is more than --limit allows (2.0)")
    ap.add_argument("--max-size", type=int, default=256 * 1024)
    ap.add_argument("--loop", type=int, default=2000, help="iterations below 8 KiB (2000)")
    ap.add_argument("--loop-large", type=int, default=100, help="iterations above (100)")
    ap.add_argument("--cache", default=str(ROOT / ".mpi4py-sdist"))
    args = ap.parse_args(argv)
    demos = [d.strip() for d in args.demos.split(",") if d.strip()]
    if any(d not in DEMOS for d in demos) or args.repeats < 1:
        ap.error(f"--demos takes a comma list of {', '.join(DEMOS)}; --repeats >= 1")
    rank = WORLD.Get_rank()
    folder = WORLD.bcast(str(sdist_tests(args.cache, rank).parent / "demo") if rank == 0
                         else None)
    folder = Path(folder)
    if not (folder / "osu_bcast.py").exists():
        if rank == 0:
            print(f"osu_wrap: no mpi4py demos at {folder}; see scripts/mpi4py_suite.py")
        return 2
    wrapped = ringcoll.wrap(WORLD)
    if rank == 0:
        print(f"# ringcoll bench: osu_wrap, -n {WORLD.Get_size()}, mpi4py {mpi4py.__version__}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# mpi4py's demo/osu_*.py, unchanged, on plain mpi4py and on ringcoll.wrap(); "
              f"median of {args.repeats} runs each; target wrap <= max({args.limit}x plain, "
              f"plain + {args.added} us) from 1 B to 256 KiB, median and slowest run alike")
    misses, failed = [], False
    for name in demos:
        runs = {"plain": [], "wrap": []}
        for k in range(args.repeats):
            order = ("plain", "wrap") if k % 2 == 0 else ("wrap", "plain")
            for mode in order:
                comm = WORLD if mode == "plain" else wrapped
                try:
                    runs[mode].append(run_demo(folder, name, comm, args))
                except SystemExit as exc:  # the demo's own refusal (e.g. one process)
                    if rank == 0:
                        print(f"# {name}: the demo stopped: {exc}")
                    failed = True
                    break
        if rank != 0 or failed:
            continue
        print(f"# osu_{name}\n# {'size':>8} {'plain us':>10} {'wrap us':>10} {'wrap/plain':>10}"
              f" {'bound us':>9} {'plain max':>10} {'wrap max':>9}")

        def bound(us):
            return max(args.limit * us, us + args.added)
        for size in sorted(runs["plain"][0]):
            plain = statistics.median(r[size] for r in runs["plain"])
            wrap = statistics.median(r[size] for r in runs["wrap"])
            slowest = (max(r[size] for r in runs["plain"]), max(r[size] for r in runs["wrap"]))
            ratio = wrap / plain if plain > 0 else float("inf")
            judged = 1 <= size <= 256 * 1024
            ok = wrap <= bound(plain) and slowest[1] <= bound(slowest[0])
            verdict = ("PASS" if ok else "MISS") if judged else "-"
            if judged and not ok:
                misses.append(f"{name} {size} B: median {wrap:.2f} us (bound {bound(plain):.2f}),"
                              f" slowest {slowest[1]:.2f} us (bound {bound(slowest[0]):.2f})")
            print(f"  {size:>8} {plain:>10.2f} {wrap:>10.2f} {ratio:>10.2f} {bound(plain):>9.2f}"
                  f" {slowest[0]:>10.2f} {slowest[1]:>9.2f}  {verdict}", flush=True)
    failed = WORLD.allreduce(failed, op=MPI.LOR)
    if rank == 0:
        for m in misses:
            print(f"# MISS {m}")
        print(f"# {len(misses)} size(s) missed" if misses else "# every judged size met")
    wrapped.ringcoll.close()
    return 1 if failed else 3 if WORLD.bcast(bool(misses)) else 0


if __name__ == "__main__":
    sys.exit(main())
