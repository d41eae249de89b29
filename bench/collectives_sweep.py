"""mpiexec -n 2 python bench/collectives_sweep.py [-b 8 -e 64M -f 4] [--only allgather,scan]

Every collective of the Communicator against the MPI library's own, side by side in one run,
with the targets restated in issue 41; exits non-zero on a miss.

Collectives and what n means (bytes, float64 data):

  broadcast, reduce, scan, exscan      n = the whole buffer (the same on every rank)
  allgather, gather                    n = each rank's block (the result is p n)
  scatter, reduce_scatter              n = each rank's block (the input is p n)
  alltoall                             n = each block (every rank sends p blocks of n)
  alltoallv                            n = each block's base: rank i sends rank j
                                       n + 8 ((i + j) % 3) bytes (uneven; MPI_Alltoallv)
  barrier                              no data (one row, n = 0)

Per collective and size, in the same rounds: "mpi" (mpi4py's upper-case call on a duplicate
of COMM_WORLD: MPI_Bcast, MPI_Reduce, MPI_Scan, MPI_Exscan, MPI_Allgather, MPI_Gather,
MPI_Scatter, MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Alltoallv, MPI_Barrier), ringcoll's
"auto" (the
default), its own algorithm ("own": the collective's first, e.g. tree or ring) and, where the
collective has it, algorithm="native" (ringcoll's adapter over the MPI call). Every ringcoll
call passes out= and the same arrays each time, as a training loop does (the repeat path).
allgather, gather, scatter and alltoallv pass counts= (alltoallv: recv_counts=) and
declared=True on every rank: the contract of MPI_Allgather, MPI_Gather, MPI_Scatter and
MPI_Alltoallv, whose counts every rank knows, so the ranks agree on the counts once and a
repeated call moves only the data (--undeclared: without them, the general call whose row
counts may change from call to call, agreed on every call).

Timing: bench/targets.py's time_calls: a warm-up, then shuffled rounds (the same order on
every rank) of a batch of each call, each after a settling call and a barrier; the time of a
call in a round = max over ranks of its mean; a figure = the MEDIAN over rounds.

Targets, judged on the median time of auto against mpi's (smaller is better):
                      n < 64 KiB                     n >= 64 KiB
  counts / declared   <= max(1.5 x mpi, mpi + 1.5 us)  <= 1.10 x mpi
  --undeclared        <= max(2 x mpi, mpi + 4 us)      <= max(1.10 x mpi, mpi + 4 us)
With MPI's contract a repeated call moves only the data, so it answers to MPI's time, with a
bound of 1.5 us for the Python of one call where MPI's own time is a few us. Without counts
every call first agrees on them (one small all-gather of the counts: a latency, whatever n),
which the 4 us allow for at every size. When the ranks outnumber the cores (oversubscribed:
MPI's busy polling takes turns), "mpi" in these bounds is max(mpi, latency floor), the floor
being ceil(log2 p) back-to-back bare Sendrecv calls of n bytes (bench/targets.py's T4
floor), timed in the same rounds.

"auto ran" is the algorithm auto's plan named ("auto" for the all-gather, which picks
once the counts are in: ring or native from the table, by the gathered bytes).

Correctness: in the first round of every size each ringcoll call's result is compared with
MPI's, exactly (small integers in float64), on every rank; any difference fails the run.

--write-tuning FILE: after the sweep, writes (or updates) this p's entry of a tuning file
(ringcoll/tuning.py's format) with, per collective that has "native", the faster of own and
native at each size: the measured crossovers `auto` then follows. The all-reduce ranges of an
existing entry are kept (python -m ringcoll.tune measures those), and so are the ranges of
the collectives this run did not measure (--only).

Exit status: 0 every target met; 3 a target missed; 1 a wrong result; 2 bad arguments.
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_size  # noqa: E402
from targets import latency_partners, time_calls  # noqa: E402

import ringcoll  # noqa: E402

WORLD = MPI.COMM_WORLD
SMALL = 64 * 1024  # the two size classes of the targets (the module doc)
#: (ratio, added us) per (declared, small): the bound is max(ratio x mpi, mpi + added us)
LIMITS = {(True, True): (1.5, 1.5), (True, False): (1.10, 0.0),
          (False, True): (2.0, 4.0), (False, False): (1.10, 4.0)}


def bound_us(mpi_us, n, declared):
    """The most us auto may take at n bytes, where MPI takes mpi_us (the module doc)."""
    ratio, added = LIMITS[(declared, n < SMALL)]
    return max(ratio * mpi_us, mpi_us + added)
ORDER = ("broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
         "alltoallv", "scan", "exscan", "barrier")


def own_algorithm(name):
    return getattr(ringcoll.collectives, name).ALGORITHMS[0]


class Setup:
    """The arrays of one collective at one size and the calls over them: (calls, check)."""

    def __init__(self, name, n, comm, mpi, declared=True):
        self.name, self.comm, self.mpi = name, comm, mpi
        p, r = comm.size, comm.rank
        k = max(n // 8, 0) if name != "barrier" else 0
        self.k, self.p, self.r = k, p, r
        self.root = p - 1 if p > 1 else 0  # not 0: a root other than the default
        self.x = ((np.arange(k) + 3 * r) % 7).astype(np.float64)
        self.big = ((np.arange(k * p) + 5 * r) % 11).astype(np.float64)
        self.outs = {}  # one out per caller, so no two calls share a result
        # allgather, gather, scatter: MPI's contract (every rank knows the counts), or none
        self.counts, self.declared = ([k] * p, True) if declared else (None, False)
        # alltoallv: rank i sends rank j k + (i + j) % 3 rows
        self.sends = [k + (r + j) % 3 for j in range(p)]
        self.recvs = [k + (i + r) % 3 for i in range(p)]
        self.xv = ((np.arange(sum(self.sends)) + 5 * r) % 11).astype(np.float64)

    def out(self, who, size):
        if who not in self.outs:
            self.outs[who] = np.full(size, -1.0)
        return self.outs[who]

    def calls(self, algorithms):
        """{label: zero-argument call}; label 'mpi' or a ringcoll algorithm name."""
        name, comm, mpi, k, p = self.name, self.comm, self.mpi, self.k, self.p
        x, big, root = self.x, self.big, self.root
        c, d = self.counts, self.declared  # (passed as they are: a ** costs a call 0.2 us)
        made = {}
        for alg in ["mpi"] + algorithms:
            a = None if alg == "auto" else alg
            if name == "broadcast":
                buf = self.out(alg, k)
                buf[...] = x if comm.rank == root else -1
                made[alg] = (lambda b=buf: mpi.Bcast(b, root=root)) if alg == "mpi" else \
                    (lambda b=buf, a=a: comm.broadcast(b, root=root, algorithm=a))
            elif name == "reduce":
                o = self.out(alg, k)
                made[alg] = (lambda o=o: mpi.Reduce(x, o, root=root)) if alg == "mpi" else \
                    (lambda o=o, a=a: comm.reduce(x, root=root, out=o, algorithm=a))
            elif name in ("scan", "exscan"):
                o = self.out(alg, k)
                mpi_fn = mpi.Scan if name == "scan" else mpi.Exscan
                ours = comm.scan if name == "scan" else comm.exscan
                made[alg] = (lambda o=o, f=mpi_fn: f(x, o)) if alg == "mpi" else \
                    (lambda o=o, a=a, f=ours: f(x, out=o, algorithm=a))
            elif name == "allgather":
                o = self.out(alg, k * p)
                made[alg] = (lambda o=o: mpi.Allgather(x, o)) if alg == "mpi" else \
                    (lambda o=o, a=a: comm.allgather(x, out=o, algorithm=a, counts=c,
                                                     declared=d))
            elif name == "gather":
                o = self.out(alg, k * p)
                made[alg] = (lambda o=o: mpi.Gather(x, o, root=root)) if alg == "mpi" else \
                    (lambda o=o, a=a: comm.gather(x, root=root, out=o, algorithm=a, counts=c,
                                                  declared=d))
            elif name == "scatter":
                o = self.out(alg, k)
                made[alg] = (lambda o=o: mpi.Scatter(big, o, root=root)) if alg == "mpi" else \
                    (lambda o=o, a=a: comm.scatter(big, root=root, out=o, algorithm=a,
                                                   counts=c, declared=d))
            elif name == "reduce_scatter":
                o = self.out(alg, k)
                made[alg] = (lambda o=o: mpi.Reduce_scatter_block(big, o)) if alg == "mpi" \
                    else (lambda o=o, a=a: comm.reduce_scatter(big, out=o, algorithm=a))
            elif name == "alltoall":
                o = self.out(alg, k * p)
                made[alg] = (lambda o=o: mpi.Alltoall(big, o)) if alg == "mpi" else \
                    (lambda o=o, a=a: comm.alltoall(big, out=o, algorithm=a))
            elif name == "alltoallv":
                o = self.out(alg, sum(self.recvs))
                sc, rc, xv = self.sends, self.recvs, self.xv
                rcd = rc if d else None
                made[alg] = (lambda o=o: mpi.Alltoallv([xv, sc], [o, rc])) if alg == "mpi" \
                    else (lambda o=o, a=a: comm.alltoallv(xv, sc, out=o, recv_counts=rcd,
                                                          algorithm=a, declared=d))
            elif name == "barrier":
                made[alg] = mpi.Barrier if alg == "mpi" else \
                    (lambda a=a: comm.barrier(algorithm=a))
        return made

    def wrong(self, labels):
        """Elements where a ringcoll result differs from MPI's (the calls have run once)."""
        if self.name == "barrier":
            return 0
        want = self.outs["mpi"]
        skip_root_only = self.name in ("reduce", "gather") and self.r != self.root
        skip_exscan = self.name == "exscan" and self.r == 0  # MPI leaves it undefined
        if skip_root_only or skip_exscan:
            return 0
        return sum(int(np.count_nonzero(self.outs[a] != want)) for a in labels)


def floor_call(n, mpi):
    """ceil(log2 p) back-to-back bare Sendrecv calls of n bytes (targets.py's T4 floor)."""
    steps = latency_partners(mpi.Get_rank(), mpi.Get_size())
    send, recv = np.zeros(max(n, 1), np.uint8), np.empty(max(n, 1), np.uint8)

    def call():
        for dest, source in steps:
            mpi.Sendrecv(send, dest, 7, recv, source, 7)
    return call


def sweep(args, comm, mpi):
    p = comm.size
    sizes, n = [], args.begin
    while n <= args.end:
        sizes.append(n)
        n = n * args.factor if n else 8
    oversubscribed = p > (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or 1)
    rows, wrong = [], 0
    for name in args.only:
        has_native = ("native" in getattr(ringcoll.collectives, name).ALGORITHMS
                      and hasattr(comm._g.t, "native_allreduce"))
        algorithms = ["auto", own_algorithm(name)] + (["native"] if has_native else [])
        for n in ([0] if name == "barrier" else sizes):
            setup = Setup(name, n, comm, mpi, declared=not args.undeclared)
            calls = setup.calls(algorithms)
            for fn in calls.values():
                fn()
            bad = setup.wrong(algorithms)
            bad = WORLD.allreduce(bad, op=MPI.SUM)
            wrong += bad
            if oversubscribed and p > 1:
                calls["floor"] = floor_call(n, mpi)
            _, plan = time_calls(calls, n, 0, args)
            calls["auto"]()  # last: what auto ran is the repeat it leaves
            ran = comm._runner._repeats.get(name)
            med = {k: statistics.median(v) for k, v in plan["round_us"].items()}
            ref = max(med["mpi"], med.get("floor", 0.0))
            ratio = med["auto"] / ref if ref > 0 else float("inf")
            limit = bound_us(ref, n, not args.undeclared) / ref if ref > 0 else float("inf")
            row = {"collective": name, "bytes": n, "us": med, "ratio": ratio,
                   "limit": limit, "bound_us": bound_us(ref, n, not args.undeclared),
                   "pass": med["auto"] <= bound_us(ref, n, not args.undeclared),
                   "wrong": bad, "rounds": plan["rounds"],
                   "iters": plan["iters"], "auto": None if ran is None else ran.plan.algorithm}
            rows.append(row)
            if comm.rank == 0:
                print(line(row, algorithms, oversubscribed), flush=True)
    return rows, wrong, oversubscribed


def line(row, algorithms, oversubscribed):
    us = row["us"]
    own = algorithms[1]
    cols = " ".join(f"{us[a]:>9.1f}" if a in us else f"{'-':>9}" for a in ("mpi", own, "native"))
    floor = f" {us['floor']:>8.1f}" if "floor" in us else ""
    verdict = "PASS" if row["pass"] else "MISS"
    bad = "" if not row["wrong"] else f"  WRONG {row['wrong']}"
    return (f"{row['collective']:<15} {human(row['bytes']):>7} {cols} {us['auto']:>9.1f}"
            f"{floor} -> {row['auto'] or '-':<19} {row['ratio']:>6.2f} <= {row['limit']:.2f} "
            f"{verdict}{bad}")


def human(n):
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


#: the bytes auto looks up (ringcoll.tuning) per n of this sweep: p n where it is the input or
#: the gathered result; for alltoallv all that every rank sends, about p p n
SCALED = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")


def write_tuning(path, rows, comm):
    """This p's entry of the tuning file at path, with the winner (own or native) of every
    collective that has both, per size, as ringcoll.tune picks the all-reduce's: within its
    slack of the fastest, with the fewest switches (see the module doc)."""
    from ringcoll.tune import crossovers, to_json

    ranges = {}
    for name in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == name and "native" in r["us"]]
        if not mine:
            continue
        own = own_algorithm(name)
        scale = comm.size if name in SCALED else comm.size ** 2 if name == "alltoallv" else 1
        sizes = [r["bytes"] * scale for r in mine]
        ranges[name] = crossovers(sizes, {a: [r["us"][a] for r in mine] for a in (own, "native")})
    data = {"format": "ringcoll-tuning", "version": 1, "entries": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    nodes = [len(m) for m in comm.nodes]
    entry = next((e for e in data["entries"] if e["p"] == comm.size and e["nodes"] == nodes),
                 None)
    if entry is None:
        entry = {"p": comm.size, "nodes": nodes}
        data["entries"].append(entry)
    entry["collectives"] = {**entry.get("collectives", {}), **ranges}  # (--only: the rest stay)
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_json(data) + "\n")  # (ranges on one line each, as ringcoll.tune writes)
    return ranges


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("-b", "--begin", type=parse_size, default=8)
    ap.add_argument("-e", "--end", type=parse_size, default=64 << 20)
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("--only", default=",".join(ORDER),
                    help=f"comma list of collectives (default all: {','.join(ORDER)})")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per size (default 0.3)")
    ap.add_argument("--rounds", type=int, default=7, help="shuffled rounds per size (7)")
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("--write-tuning", metavar="FILE")
    ap.add_argument("--undeclared", action="store_true",
                    help="allgather, gather, scatter without counts= and declared=True")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in args.only if c not in ORDER]
    if unknown or args.factor < 2 or args.begin > args.end:
        ap.error(f"unknown collective(s) {unknown} (choose from {ORDER}), or -f < 2, or -b > -e")
    return args


def main(argv=None):
    args = parse(argv)
    mpi = WORLD.Dup()
    comm = ringcoll.Communicator(WORLD)
    if comm.rank == 0:
        print(f"# ringcoll bench: collectives_sweep, -n {comm.size}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# us per call, median of {args.rounds} shuffled rounds (max over ranks); "
              "ratio = auto / mpi (auto / max(mpi, floor) when oversubscribed); the bound, "
              + ("without counts: max(2x, mpi + 4 us) below 64 KiB, max(1.10x, mpi + 4 us) "
                 "from 64 KiB" if args.undeclared else
                 "with counts/declared: max(1.5x, mpi + 1.5 us) below 64 KiB, 1.10x from "
                 "64 KiB") + ", as a ratio")
        print(f"# {'collective':<13} {'bytes':>7} {'mpi':>9} {'own':>9} {'native':>9} "
              f"{'auto':>9}  auto ran             ratio")
    rows, wrong, over = sweep(args, comm, mpi)
    misses = [r for r in rows if not r["pass"]]
    if comm.rank == 0:
        if over:
            print("# oversubscribed: ratios are against max(mpi, the latency floor)")
        print(f"# {len(rows) - len(misses)} of {len(rows)} targets met; "
              f"{wrong} wrong element(s)")
        for r in misses:
            print(f"# MISS {r['collective']} {human(r['bytes'])}: {r['us']['auto']:.1f} us > "
                  f"{r['bound_us']:.1f} us ({r['ratio']:.2f} x mpi > {r['limit']:.2f})")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"p": comm.size, "oversubscribed": over, "rows": rows}, f, indent=1)
        if args.write_tuning:
            ranges = write_tuning(args.write_tuning, rows, comm)
            print(f"# wrote the p={comm.size} collectives ranges to {args.write_tuning}: "
                  f"{json.dumps(ranges)}")
    comm.close()
    return 1 if wrong else 3 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
