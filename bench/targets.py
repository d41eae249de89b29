"""mpiexec -n 2 python bench/targets.py [--repeat K] [--json FILE] [--only T1,T4]

(and the same at -n 4). Checks ringcoll's performance targets side by side in one run and exits
non-zero when one is missed. It is a benchmark, not a unit test: timings never go in tests/.

Every figure is a RATIO measured in one run (these machines are shared and noisy), written so
that smaller is better and a target holds when  ratio <= limit.  All data is float32, op sum;
"auto" is ringcoll's default algorithm choice, "native" the MPI library's own collective
(ringcoll's algorithm="native"), "n" the message size in bytes and "p" the number of ranks.

  T1  all-reduce auto / native: <= 0.40 at 64 MiB, <= 0.75 at 16 MiB.
  T2  all-reduce auto / point-to-point bound, <= 1.5 at 16 and 64 MiB. The bound is
      2(p-1) x the time of one bare mpi4py comm.Sendrecv of an n/p-byte block between ring
      neighbours (send to rank+1, receive from rank-1), on a duplicate of COMM_WORLD, timed in
      the same rounds: what a ring all-reduce would cost if reducing and Python were free.
  T3  all-reduce auto / native <= 1.0 at 64 KiB, 256 KiB and 1 MiB.
  T4  all-reduce auto / native <= 1.5 at 8 B, 256 B and 1 KiB, enforced at p = 2 only
      (reported at other p); and auto / latency floor <= 1.5 at every p, the floor being
      ceil(log2 p) back-to-back bare Sendrecv calls of n bytes timed as one unit (partners
      rank XOR 2^k when p is a power of two, else rank +- 2^k, as recursive doubling /
      dissemination would).
  T5  all-reduce auto / torch.distributed all_reduce over Gloo: <= 0.1 (auto >= 10x faster)
      at 1 KiB and 1 MiB, <= 0.5 (>= 2x) at 64 MiB. Gloo runs in place (torch has no other
      form) and both ringcoll modes are compared with it. Only if torch imports on every
      rank; otherwise the line says "skipped: torch not installed" and nothing fails. Uses
      bench/harness.py's Gloo wrapper.
  T6  reduce_scatter and allgather auto / native <= 0.7 at 16 and 64 MiB, out of place (the
      API's only form); n = the full gathered size, as in bench/reduce_scatter.py and
      bench/allgather.py.
  T7  memory: the scratch of an in-place all-reduce (out=x) with auto, per rank, must stay
      <= n/p + 2 pipeline segments (the Communicator's options.segment_bytes, default 4 MiB).
      Ratio = peak extra bytes / that allowance, checked at 1, 16 and 64 MiB. On a fresh
      Communicator, with x already allocated: tracemalloc starts (numpy registers its buffers
      with it), the Communicator is built, one call runs (it may cache workspace), the peak is
      reset, a second call runs; the figure is the traced peak during that second call, which
      includes the cached workspace, max over ranks. Also reported, not enforced: growth of
      the process's peak RSS (getrusage ru_maxrss) over the two calls, after resetting the
      kernel's high-water mark (/proc/self/clear_refs; where that is refused the growth is
      only a lower bound and the line says so).

How times are measured (the nccl-tests convention of bench/harness.py):
- Per size, every call some selected target needs (all-reduce auto and native in both modes,
  the Sendrecv units, Gloo, reduce_scatter, allgather) is timed in the same rounds: each round
  runs a batch of every call in turn, in a shuffled order that is the same on every rank
  (seeded by repeat, size and round) and new every round, each batch after one untimed
  settling call and a barrier. Iteration counts fit --budget seconds per size (rank 0's
  decision from the slowest rank's probe call, so every rank runs the same count).
- The time of a call = max over ranks of the mean over its iterations; a ratio divides two
  times of the same round-robin.
- Out-of-place calls reduce integer-valued data into a separate buffer; in-place calls
  (out=x) work on a buffer of zeros, so repeated sums stay finite (as harness.measure does).
- --repeat K runs the whole measurement K times (default 3); each line judges the MEDIAN of
  its K ratios.
- Correctness: in the first repeat every ringcoll call timed (all-reduce auto in both modes,
  reduce_scatter, allgather) is checked once per size against an exact oracle
  (harness.Case's integer-valued data); any wrong element fails the run.

Output: one line per (target, size, mode) with the ratio of each repeat, the median, the limit
and PASS / MISS (or "info" where a target is only reported), the absolute times behind the
median, then a summary line. --json FILE writes every figure and the environment.
Exit status: 0 every enforced target passed, 3 a target missed, 1 a wrong result (wins over
3), 2 bad arguments.
"""

import argparse
import ctypes
import gc
import importlib.util
import json
import math
import os
import resource
import sys
import time
import tracemalloc
import traceback
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.tune import progress_printer
from harness import IN, OUT, WORLD, Case, Gloo, count_wrong, environment, parse_size


@dataclass(frozen=True)
class Target:
    name: str  # what --only selects; several rows may share one
    collective: str  # allreduce, reduce_scatter, allgather
    reference: str  # native, p2p_bound, latency_floor, gloo, memory (see the docstring)
    sizes: tuple  # bytes, with K/M suffixes (powers of 1024)
    limit: float  # the target holds when ringcoll auto / reference <= limit
    only_p: int | None = None  # enforced only at this many ranks (reported at others)


# Every target in one table. ratio = ringcoll auto / reference, judged as median <= limit.
# References: native = the MPI library's collective, same mode; p2p_bound = 2(p-1) bare
# Sendrecv of n/p bytes; latency_floor = ceil(log2 p) bare Sendrecv of n bytes; gloo = torch
# Gloo all_reduce (limit 0.10: auto >= 10x faster); memory = n/p + 2 segments of scratch.
TARGETS = (
    #      name  collective        reference         sizes                    limit
    Target("T1", "allreduce",      "native",         ("64M",),                0.40),
    Target("T1", "allreduce",      "native",         ("16M",),                0.75),
    Target("T2", "allreduce",      "p2p_bound",      ("16M", "64M"),          1.50),
    Target("T3", "allreduce",      "native",         ("64K", "256K", "1M"),   1.00),
    Target("T4", "allreduce",      "native",         ("8", "256", "1K"),      1.50, only_p=2),
    Target("T4", "allreduce",      "latency_floor",  ("8", "256", "1K"),      1.50),
    Target("T5", "allreduce",      "gloo",           ("1K", "1M"),            0.10),
    Target("T5", "allreduce",      "gloo",           ("64M",),                0.50),
    Target("T6", "reduce_scatter", "native",         ("16M", "64M"),          0.70),
    Target("T6", "allgather",      "native",         ("16M", "64M"),          0.70),
    Target("T7", "allreduce",      "memory",         ("1M", "16M", "64M"),    1.00),
)

REFERENCE_TEXT = {
    "native": "native",
    "p2p_bound": "2(p-1) Sendrecv(n/p)",
    "latency_floor": "ceil(log2 p) Sendrecv(n)",
    "gloo": "Gloo",
    "memory": "n/p + 2 segments",
}
DTYPE = np.dtype(np.float32)
OP = "sum"
MIN_ITERS = 4  # so that even the largest size gets 2 interleaved rounds of 2 calls


def modes_of(t):
    """The modes a target is judged in: both for all-reduce timings, the API's only one else."""
    if t.reference == "memory":
        return (IN,)
    return (OUT, IN) if t.collective == "allreduce" else (OUT,)


def label(t):
    what = f"{t.collective} scratch" if t.reference == "memory" else f"{t.collective} auto"
    return f"{what} / {REFERENCE_TEXT[t.reference]}"


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_us(seconds):
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1e4 else f"{us:,.0f}"


# -- command line ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse that prints only on rank 0."""

    def _print_message(self, message, file=None):
        if WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def parse_args(argv):
    names = sorted({t.name for t in TARGETS})
    ap = _Parser(prog="bench/targets.py",
                 description="Check ringcoll's performance targets (ratios measured side by "
                             "side in one run); exit 3 if one is missed, 1 on a wrong result.",
                 epilog="Example: mpiexec -n 4 python bench/targets.py --repeat 5 --json t.json")
    ap.add_argument("--repeat", type=int, default=3,
                    help="run the whole measurement K times and judge the median (default 3)")
    ap.add_argument("--json", metavar="FILE", help="write every figure and the environment here")
    ap.add_argument("--only", metavar="NAMES",
                    help=f"comma list of targets to check, from {','.join(names)} (default all)")
    ap.add_argument("--budget", type=float, default=1.0,
                    help="seconds of timed calls per size and repeat, all calls together "
                         "(default 1.0; at least %d iterations each)" % MIN_ITERS)
    ap.add_argument("--max-iters", type=int, default=20000,
                    help="timed iterations per call and size at most (default 20000)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="round-robin rounds the iterations are split into, at most (default 5)")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress lines (they go to the terminal only)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.budget <= 0 or args.max_iters < MIN_ITERS or args.rounds < 1:
        ap.error(f"need --repeat >= 1, --budget > 0, --max-iters >= {MIN_ITERS}, --rounds >= 1")
    if args.only:
        want = {s.strip().upper() for s in args.only.split(",") if s.strip()}
        bad = sorted(want - set(names))
        if bad or not want:
            ap.error(f"--only: unknown target(s) {bad}; choose from {','.join(names)}")
        args.targets = [t for t in TARGETS if t.name in want]
    else:
        args.targets = list(TARGETS)
    return args


# -- what to run at one size ------------------------------------------------------------------
def run_key(collective, algorithm, mode=OUT):
    return f"{collective}/{algorithm}/{mode}"


P2P_BOUND = "sendrecv/n_over_p"  # one bare Sendrecv of n/p bytes, ring neighbours
LATENCY_FLOOR = "sendrecv/log2p_x_n"  # ceil(log2 p) bare Sendrecv of n bytes
GLOO = "gloo/allreduce/in-place"  # torch.distributed all_reduce, Gloo backend


def needed(t, mode, p, gloo):
    """Run keys whose times one (target, mode) needs: (numerator, denominator), or None."""
    auto = run_key(t.collective, "auto", mode)
    ref = {
        "native": run_key(t.collective, "native", mode),
        "p2p_bound": P2P_BOUND if p > 1 else None,
        "latency_floor": LATENCY_FLOOR if p > 1 else None,
        "gloo": GLOO if gloo is not None else None,
    }.get(t.reference)
    return None if ref is None else (auto, ref)


def reference_time(t, ref_s, p):
    return ref_s * 2 * (p - 1) if t.reference == "p2p_bound" else ref_s


class Buffers:
    """The timing buffers of one size, shared by the calls that can share them."""

    def __init__(self, case, keys):
        p, rank = case.size, case.rank
        self.case = case
        self.x = case.data(rank)  # read-only input of every out-of-place call
        self.y = case.empty()  # output of out-of-place all-reduce and allgather
        self.z = np.zeros(case.count, DTYPE)  # in-place buffer: zeros, so sums stay finite
        blocked = max(1, case.count // p) * p  # reduce_scatter / allgather: p equal blocks
        self.block = blocked // p
        self.rs_in = self.x[:blocked] if blocked <= case.count else np.resize(self.x, blocked)
        self.rs_out = np.zeros(self.block, DTYPE)
        self.ag_in = self.rs_in[:self.block]
        self.ag_out = self.y[:blocked] if blocked <= case.count else np.zeros(blocked, DTYPE)
        if P2P_BOUND in keys:  # n/p bytes each way
            self.sr_send = np.ones(max(1, case.count // p), DTYPE)
            self.sr_recv = np.zeros_like(self.sr_send)
        if LATENCY_FLOOR in keys:  # n bytes each way
            self.lat_send = np.ones(case.count, DTYPE)
            self.lat_recv = np.zeros_like(self.lat_send)


def latency_partners(rank, p):
    """(dest, source) of each of the ceil(log2 p) steps of the latency floor."""
    steps = math.ceil(math.log2(p)) if p > 1 else 0
    if p & (p - 1) == 0:
        return [(rank ^ (1 << k), rank ^ (1 << k)) for k in range(steps)]
    return [((rank + (1 << k)) % p, (rank - (1 << k)) % p) for k in range(steps)]


def make_calls(keys, comm, raw, gloo, b):
    """key -> a zero-argument function that makes one call."""
    rank, p = comm.rank, comm.size
    right, left = (rank + 1) % p, (rank - 1) % p
    partners = latency_partners(rank, p)
    calls = {}
    for key in keys:
        if key == P2P_BOUND:
            calls[key] = lambda: raw.Sendrecv(b.sr_send, right, 0, b.sr_recv, left, 0)
        elif key == LATENCY_FLOOR:
            def floor():
                for dest, source in partners:
                    raw.Sendrecv(b.lat_send, dest, 0, b.lat_recv, source, 0)
            calls[key] = floor
        elif key == GLOO:
            calls[key] = lambda: gloo.allreduce(b.z, OP)
        else:
            coll, alg, mode = key.split("/")
            if coll == "allreduce" and mode == OUT:
                calls[key] = lambda alg=alg: comm.allreduce(b.x, op=OP, algorithm=alg, out=b.y)
            elif coll == "allreduce":
                calls[key] = lambda alg=alg: comm.allreduce(b.z, op=OP, algorithm=alg, out=b.z)
            elif coll == "reduce_scatter":
                calls[key] = lambda alg=alg: comm.reduce_scatter(b.rs_in, op=OP, out=b.rs_out,
                                                                 algorithm=alg)
            elif coll == "allgather":
                calls[key] = lambda alg=alg: comm.allgather(b.ag_in, out=b.ag_out, algorithm=alg)
            else:
                raise ValueError(f"no call for {key}")
    return calls


# -- correctness ----------------------------------------------------------------------------------
def check(comm, case, b, keys):
    """Wrong elements of every ringcoll call in keys, summed over ranks: {key: count}."""
    rank, p = case.rank, case.size
    wrong = {}
    for key in keys:
        coll, alg, mode = (key.split("/") + ["", ""])[:3]
        if alg != "auto":
            continue
        if coll == "allreduce":
            if mode == OUT:
                got = comm.allreduce(b.x, op=OP, algorithm="auto", out=case.empty())
            else:
                got = case.data(rank)
                comm.allreduce(got, op=OP, algorithm="auto", out=got)
            wrong[key] = count_wrong(got, case.reduced(), case)
        elif coll == "reduce_scatter":
            c = Case(rank, p, b.rs_in.size, DTYPE, OP, -1)
            got = comm.reduce_scatter(c.data(rank), op=OP, out=c.empty(c.block), algorithm="auto")
            wrong[key] = count_wrong(got, c.reduced(c.block, start=rank * c.block), c)
        elif coll == "allgather":
            c = Case(rank, p, b.ag_out.size, DTYPE, None, -1)
            got = comm.allgather(c.data(rank, c.block), out=c.empty(), algorithm="auto")
            want = np.concatenate([c.data(r, c.block) for r in range(p)])
            wrong[key] = count_wrong(got, want, c)
    names = sorted(wrong)
    counts = np.array([wrong[k] for k in names], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    return {k: int(v) for k, v in zip(names, counts)}


# -- timing ------------------------------------------------------------------------------------
def time_calls(calls, nbytes, repeat, args):
    """Time every call side by side; {key: max over ranks of the mean per call (s)}, plan."""
    keys = sorted(calls)  # the same order on every rank
    probe = np.zeros(len(keys))
    for i, k in enumerate(keys):
        calls[k]()  # warm-up: first calls cache workspace and connections
        WORLD.Barrier()
        t0 = time.perf_counter()
        calls[k]()
        probe[i] = time.perf_counter() - t0
    WORLD.Allreduce(MPI.IN_PLACE, probe, op=MPI.MAX)
    plan = None
    if WORLD.Get_rank() == 0:
        per_pass = max(float(probe.sum()), 1e-9)
        iters = int(min(args.max_iters, max(MIN_ITERS, args.budget // per_pass)))
        rounds = max(2, min(args.rounds, iters // 2))  # >= 2 shuffled rounds, batches >= 2
        plan = (iters, rounds)
    iters, rounds = WORLD.bcast(plan, root=0)
    batches = [iters // rounds + (1 if k < iters % rounds else 0) for k in range(rounds)]
    total = np.zeros(len(keys))
    per_round = np.zeros((len(keys), rounds))
    for k, batch in enumerate(batches):
        for j in np.random.default_rng([repeat, nbytes, k]).permutation(len(keys)):
            fn = calls[keys[j]]
            fn()  # settle: time back-to-back calls, not the first after another call
            WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            dt = time.perf_counter() - t0
            total[j] += dt
            per_round[j, k] = dt / batch
    mean = total / iters
    WORLD.Allreduce(MPI.IN_PLACE, mean, op=MPI.MAX)
    WORLD.Allreduce(MPI.IN_PLACE, per_round, op=MPI.MAX)
    times = {k: float(t) for k, t in zip(keys, mean)}
    rounds_us = {k: [round(float(v) * 1e6, 3) for v in r] for k, r in zip(keys, per_round)}
    return times, {"iters": iters, "rounds": rounds, "round_us": rounds_us}


# -- memory (T7) -------------------------------------------------------------------------------
def _reset_rss_peak():
    """Reset the kernel's peak-RSS mark to the current RSS; False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _release_free_heap():
    """glibc's malloc_trim(0): hand freed heap pages back to the kernel, so that buffers
    freed by the timing of an earlier size cannot be reused unseen by the RSS figure."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the RSS growth may then read low
        pass


def memory(nbytes):
    """Peak scratch of a second in-place auto all-reduce, per rank (max over ranks)."""
    x = np.empty(nbytes // DTYPE.itemsize, DTYPE)
    x.fill(0)  # zeros keep the sums finite; fill, not np.zeros, so x's pages are resident
    # before the RSS baseline (np.zeros maps untouched pages that the call would fault in)
    gc.collect()
    _release_free_heap()
    WORLD.Barrier()
    reset = _reset_rss_peak()
    rss0 = _maxrss_bytes()
    tracemalloc.start()
    comm = ringcoll.Communicator()  # fresh: nothing cached yet, so the workspace counts
    try:
        comm.allreduce(x, op=OP, algorithm="auto", out=x)
        tracemalloc.reset_peak()
        comm.allreduce(x, op=OP, algorithm="auto", out=x)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rss = _maxrss_bytes() - rss0
        segment = comm.options.segment_bytes
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        comm.close()
    fig = np.array([peak, rss], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, fig, op=MPI.MAX)
    reset_all = all(WORLD.allgather(reset))
    allowance = nbytes // WORLD.Get_size() + 2 * segment
    return {"traced_peak_bytes": int(fig[0]), "rss_growth_bytes": int(fig[1]),
            "rss_exact": reset_all, "segment_bytes": segment, "allowance_bytes": allowance}


# -- Gloo (T5) ---------------------------------------------------------------------------------
def start_gloo(notes):
    """harness's Gloo wrapper, or None and the reason, agreed on every rank."""
    if not all(WORLD.allgather(importlib.util.find_spec("torch") is not None)):
        return None, "torch not installed"
    try:
        gloo = Gloo.start(notes)
        ok = gloo is not None and gloo.supports(DTYPE, OP, notes)
        why = "" if ok else (notes[-1] if notes else "Gloo did not start")
    except Exception as e:  # noqa: BLE001 - any failure here means: no Gloo comparison
        gloo, ok, why = None, False, f"Gloo failed to start ({type(e).__name__}: {e})"
    if not all(WORLD.allgather(ok)):
        if gloo is not None:
            try:
                gloo.close()
            except Exception:  # noqa: BLE001
                pass
        return None, why or "Gloo failed on another rank"
    return gloo, ""


# -- one repeat ----------------------------------------------------------------------------------
def plan_sizes(targets, p, gloo):
    """{nbytes: sorted run keys} of the timing targets, and the memory sizes."""
    runs, mem = {}, set()
    for t in targets:
        for s in t.sizes:
            n = parse_size(s)
            if t.reference == "memory":
                mem.add(n)
                continue
            for m in modes_of(t):
                pair = needed(t, m, p, gloo)
                if pair is not None:
                    runs.setdefault(n, set()).update(pair)
    return {n: sorted(k) for n, k in sorted(runs.items())}, sorted(mem)


def one_repeat(repeat, comm, raw, gloo, sizes, mem_sizes, args, wrong, log):
    out = {"times": {}, "plans": {}, "memory": {}}
    for n in mem_sizes:
        out["memory"][n] = memory(n)
        log(f"repeat {repeat + 1}: memory at {human(n)} done")
    for n, keys in sizes.items():
        case = Case(comm.rank, comm.size, max(1, n // DTYPE.itemsize), DTYPE, OP, -1)
        b = Buffers(case, keys)
        if repeat == 0:
            for k, w in check(comm, case, b, keys).items():
                wrong[(k, n)] = w
        calls = make_calls(keys, comm, raw, gloo, b)
        t0 = time.perf_counter()
        out["times"][n], out["plans"][n] = time_calls(calls, n, repeat, args)
        plan = out["plans"][n]
        log(f"repeat {repeat + 1}: {human(n)}: {len(keys)} calls x {plan['iters']} iters in "
            f"{plan['rounds']} rounds, {time.perf_counter() - t0:.1f} s")
        del calls, b, case
        gc.collect()
    return out


# -- judging -----------------------------------------------------------------------------------
def judge(targets, reps, p, gloo, gloo_why):
    """One line dict per (target, size, mode)."""
    lines = []
    for t in targets:
        for s in t.sizes:
            n = parse_size(s)
            for m in modes_of(t):
                row = {"target": t.name, "what": label(t), "collective": t.collective,
                       "reference": t.reference, "size": n, "mode": m, "limit": t.limit,
                       "ratios": [], "median": None, "verdict": None, "note": ""}
                lines.append(row)
                if t.reference == "memory":
                    figs = [r["memory"][n] for r in reps]
                    row["ratios"] = [f["traced_peak_bytes"] / f["allowance_bytes"] for f in figs]
                    row["memory"] = figs
                else:
                    pair = needed(t, m, p, gloo)
                    if pair is None:
                        row["verdict"] = "skipped"
                        row["note"] = (f"skipped: {gloo_why}" if t.reference == "gloo"
                                       else "skipped: needs p > 1")
                        continue
                    auto, ref = pair
                    nums = [r["times"][n][auto] for r in reps]
                    dens = [reference_time(t, r["times"][n][ref], p) for r in reps]
                    row["ratios"] = [a / d if d > 0 else float("inf") for a, d in zip(nums, dens)]
                    row["auto_s"], row["reference_s"] = nums, dens
                row["median"] = float(np.median(row["ratios"]))
                if t.only_p is not None and p != t.only_p:
                    row["verdict"] = "info"
                    row["note"] = f"reported only: enforced at p={t.only_p}"
                else:
                    row["verdict"] = "PASS" if row["median"] <= t.limit else "MISS"
    return lines


def detail(row):
    """The absolute figures behind a line's median."""
    if row["reference"] == "memory":
        i = int(np.argsort(row["ratios"])[len(row["ratios"]) // 2])
        f = row["memory"][i]
        rss = f"{f['rss_growth_bytes'] / (1 << 20):.1f} MiB" + ("" if f["rss_exact"] else
                                                               " (lower bound)")
        return (f"tracemalloc {f['traced_peak_bytes'] / (1 << 20):.3f} MiB of "
                f"{f['allowance_bytes'] / (1 << 20):.3f} MiB allowed; RSS growth {rss}")
    if not row["ratios"]:
        return row["note"]
    i = int(np.argsort(row["ratios"])[len(row["ratios"]) // 2])
    ref = REFERENCE_TEXT[row["reference"]]
    text = f"auto {fmt_us(row['auto_s'][i])} us, {ref} {fmt_us(row['reference_s'][i])} us"
    return text + (f"; {row['note']}" if row["note"] else "")


# -- main --------------------------------------------------------------------------------------
def main(argv=None):
    rank = WORLD.Get_rank()
    try:
        return _main(argv)
    except SystemExit as e:  # argparse: -h or a usage error, already printed by rank 0
        return e.code if isinstance(e.code, int) else 2
    except BaseException:  # a failure on one rank must not leave the others hanging
        sys.stderr.write(f"[rank {rank}] bench/targets.py failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        WORLD.Abort(1)


def _main(argv):
    args = parse_args(argv)
    start = time.perf_counter()
    comm = ringcoll.Communicator()
    raw = WORLD.Dup()  # the bare Sendrecv units' own communicator
    rank, p = comm.rank, comm.size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    progress = progress_printer(rank == 0 and not args.quiet)

    def log(msg):
        progress(f"[targets {time.perf_counter() - start:6.1f} s] {msg}")

    notes, gloo, gloo_why = [], None, ""
    if any(t.reference == "gloo" for t in args.targets):
        gloo, gloo_why = start_gloo(notes)
    env = environment(comm, args, gloo)
    sizes, mem_sizes = plan_sizes(args.targets, p, gloo)

    say("# ringcoll performance targets: ratio = ringcoll auto / reference, smaller is better; "
        "a target holds when the median ratio <= its limit")
    say(f"# {env['command']}")
    say(f"# {env['mpi_library_version'].splitlines()[0]}; ringcoll {ringcoll.__version__}; "
        f"numpy {np.__version__}; git {env['git_commit']}")
    say(f"# {p} rank(s) on {len(set(env['hostnames']))} host(s) "
        f"({', '.join(sorted(set(env['hostnames'])))}); float32 sum; repeat {args.repeat}; "
        f"budget {args.budget:g} s per size; segment {comm.options.segment_bytes} B")
    for n in notes:
        say(f"# note: {n}")
    picked = {}
    for n in sorted(set(sizes) | set(mem_sizes)):
        try:
            picked[n] = comm.cost_model.choose_allreduce(n, p, comm.nodes)
        except Exception:  # noqa: BLE001 - only a label
            picked[n] = "?"
    say("# auto all-reduce picks: " + ", ".join(f"{human(n)} {a}" for n, a in picked.items()))

    wrong, reps = {}, []
    for r in range(args.repeat):
        reps.append(one_repeat(r, comm, raw, gloo, sizes, mem_sizes, args, wrong, log))

    lines = judge(args.targets, reps, p, gloo, gloo_why)
    say("#")
    say(f"# {'target':<6} {'what':<44} {'size':>8} {'mode':<12} "
        f"{'ratio per repeat':<{7 * args.repeat}} {'median':>7} {'limit':>6}  verdict  detail")
    for row in lines:
        ratios = " ".join(f"{v:6.3f}" for v in row["ratios"]) or "-"
        median = "-" if row["median"] is None else f"{row['median']:.3f}"
        say(f"  {row['target']:<6} {row['what']:<44} {human(row['size']):>8} {row['mode']:<12} "
            f"{ratios:<{7 * args.repeat}} {median:>7} {row['limit']:>6.2f}  "
            f"{row['verdict']:<7}  {detail(row)}")
    bad = {k: w for k, w in wrong.items() if w}
    for (k, n), w in sorted(bad.items()):
        say(f"# WRONG: {k} at {human(n)}: {w} wrong element(s) summed over ranks")

    count = {v: sum(1 for x in lines if x["verdict"] == v)
             for v in ("PASS", "MISS", "info", "skipped")}
    missed = sorted({x["target"] for x in lines if x["verdict"] == "MISS"})
    status = 1 if bad else 3 if count["MISS"] else 0
    elapsed = time.perf_counter() - start
    say(f"# summary: {count['PASS'] + count['MISS']} enforced: {count['PASS']} PASS, "
        f"{count['MISS']} MISS" + (f" ({', '.join(missed)})" if missed else "")
        + f"; {count['info']} reported only; {count['skipped']} skipped; "
        f"{sum(wrong.values())} wrong element(s) in {len(wrong)} checks; "
        f"{elapsed:.1f} s; exit {status}")

    if rank == 0 and args.json:
        doc = {"benchmark": "targets", "environment": env,
               "parameters": {"repeat": args.repeat, "budget_s": args.budget,
                              "max_iters": args.max_iters, "rounds": args.rounds,
                              "only": args.only, "dtype": "float32", "op": OP,
                              "min_iters": MIN_ITERS},
               "targets": [asdict(t) for t in args.targets],
               "auto_picks": {str(n): a for n, a in picked.items()},
               "lines": lines,
               "repeats": [{"times_s": {str(n): v for n, v in r["times"].items()},
                            "plans": {str(n): v for n, v in r["plans"].items()},
                            "memory": {str(n): v for n, v in r["memory"].items()}}
                           for r in reps],
               "wrong": [{"call": k, "size": n, "wrong": w} for (k, n), w in sorted(wrong.items())],
               "notes": notes, "exit_status": status, "elapsed_s": elapsed}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=_jsonable)
            f.write("\n")
        say(f"# wrote {args.json}")

    if gloo is not None:
        gloo.close()
    raw.Free()
    comm.close()
    return WORLD.bcast(status, root=0)


def _jsonable(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


if __name__ == "__main__":
    raise SystemExit(main())
