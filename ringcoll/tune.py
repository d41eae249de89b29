"""mpiexec -n 4 python -m ringcoll.tune -o tuning.json        (or: mpiexec -n 4 ringcoll tune ...)

Measure ringcoll's all-reduce algorithms on this machine at this process count, and write the
table `auto` then uses: RINGCOLL_TUNING=tuning.json, or Communicator(tuning="tuning.json").

At every size of -b/-e/-f (float32 sum) it
  1. (--repeat K times, whole sweeps one after another, median of the K figures) times
     ring, recursive_doubling and rabenseifner (and hierarchical where the ranks span
     more than one node and fewer than p nodes, node where they share one node: the
     algorithms auto can choose) through
     Communicator.allreduce(x, algorithm=name, out=...), out of place (out=y) and in place
     (out=x, x zeros so that repeated sums stay put). Each round times a batch of calls of
     every (algorithm, mode) in a shuffled order, the same on every rank, so the machine's
     noise hits them all alike; a round's figure is the slowest rank's time per call, and
     the median over rounds is the time;
  2. per mode, picks an algorithm at each size within 5% of the fastest there, with as few
     switches between algorithms as that allows (so an algorithm that wins one size by a
     hair is taken for noise, not a crossover), and merges consecutive sizes with the same
     pick into [max_bytes, algorithm] ranges: the crossover table. Where -o already holds
     an entry for 4 ranks on one node (and this run is another p on one node), of the
     algorithms within 5% here only those within 5% of the best of them at p=4 stay
     candidates: a tie goes to the algorithm that is faster at -n 4 too, not to this run's
     noise (so run p=4 first);
  3. fits CostModel's alpha, beta, gamma (>= 0), and the node tier's node_alpha, node_beta
     where it was measured, to the out-of-place times of the flat algorithms and the
     tier, minimising the squared relative error: the model auto falls back on at
     process counts the file has no table for, if its picks here were at least as good as
     those of CostModel()'s defaults (the summed time / fastest over all sizes and modes;
     otherwise the fit is recorded with "fallback": false and the defaults stay);
  4. on rank 0, writes the entry into -o, replacing the entry of the same p and node shape
     and keeping the others (one file can serve every process count of a machine), via a
     temporary file and a rename; and prints the fit, the crossovers, and how auto's choice
     before this run compared with the fastest algorithm at each size.

Regenerate the table shipped with ringcoll (its 2-core development machine, embedded MPICH):

    F=ringcoll/tuning_default.json
    for p in 4 2 3; do
      mpiexec -n $p python -m ringcoll.tune --repeat 3 -o $F
      for i in 2 3; do mpiexec -n $p python -m ringcoll.tune --repeat 3 --accumulate -o $F; done
    done

(p=4 first: its entry breaks the ties of the others; three launches each, since on the
development VM the node tier's speed differs from one launch to the next: see
docs/node_tier.md).

Exit status: 0 written, 2 bad arguments or an -o file that is not a tuning file (nothing is
measured then), 1 anything else (every rank is aborted, none is left waiting).
"""

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import shlex
import sys
import tempfile
import time
import traceback

import numpy as np
from mpi4py import MPI

import ringcoll

from .algorithms import FLAT, CostModel, bruck
from .tuning import FORMAT, MODES, VERSION, Tuning, TuningFileError, node_shape

SLACK = 0.05  # a table's pick may be this much slower than the fastest, for fewer crossovers
TIE_BREAK_P = 4  # ties within SLACK go to the algorithm faster at this p too (its entry)
MAX_ITERS = 500  # calls per batch at most (small sizes: enough to average out the timer)
QUICK = {"minbytes": 8, "maxbytes": 1 << 20, "stepfactor": 16, "rounds": 3, "budget": 0.1}
SHORT = {"recursive_doubling": "rec_doubling", "rabenseifner": "rabenseifner", "ring": "ring",
         "hierarchical": "hierarchical", "bruck": "bruck", "node": "node"}
#: algorithms timed only up to a size (bytes per rank): beyond it they cannot win and their
#: scratch grows with p x n; a size not timed counts as infinitely slow
SIZE_LIMITS = {"bruck": bruck.MAX_BYTES}


class UsageError(Exception):
    """Bad arguments or output file: reported by rank 0, exit status 2 on every rank."""


# -- arguments -----------------------------------------------------------------------------------
def parse_size(text):
    """'8', '64K', '64M', '1G' -> bytes (powers of 1024, as nccl-tests)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    try:
        value = int(text[:-1] if text[-1:] in units else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (8, 64K, 64M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are >= 1 byte")
    return value


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m ringcoll.tune", description="Measure ringcoll's all-reduce algorithms "
        "here and write the tuning table auto uses (RINGCOLL_TUNING=FILE).")
    p.add_argument("-o", "--output", default="ringcoll-tuning.json", metavar="FILE",
                   help="tuning file to write; its entry for this p and node shape is "
                        "replaced, other entries kept (default: %(default)s)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20,
                   help="largest size (64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per size (5)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed calls per size, all algorithms and modes (1.0)")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="measure every size K times, one whole sweep after another, and "
                        "take the median of the K figures (1): a machine whose speed drifts "
                        "over minutes is then judged over K sweeps, not one")
    p.add_argument("--accumulate", action="store_true",
                   help="combine with the figures of earlier runs of the same p, node shape "
                        "and sizes in -o (kept in the entry's measured.launches): the table "
                        "is made from the median over every launch, for a machine whose "
                        "speed differs from one mpiexec launch to the next")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: 8 B to 1 MiB x16, 3 rounds, 0.1 s per size")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (they go to the terminal only)")
    return p


def parse_args(argv, rank):
    """Parsed arguments on every rank; only rank 0 prints usage and errors."""
    quiet = contextlib.nullcontext() if rank == 0 else _silenced()
    with quiet:
        args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.stepfactor < 2 or args.rounds < 1 or args.budget <= 0 or args.repeat < 1:
        raise UsageError("need -f >= 2, --rounds >= 1, --budget > 0 and --repeat >= 1")
    if args.minbytes > args.maxbytes:
        raise UsageError(f"-b {args.minbytes} is larger than -e {args.maxbytes}")
    return args


def progress_printer(enabled=True):
    """print-like function for progress lines. They go to the terminal where the job's stderr
    ends up, never into a file or pipe, so that output redirected to a file (`> out`, `2>&1`)
    holds the table alone. mpiexec pipes each rank's stderr through its proxy, so the rank's
    own stderr.isatty() cannot tell: follow the pipe up the process tree (rank, proxy,
    mpiexec) to the first process whose stderr is not a pipe and write there if that is a
    terminal. enabled False (-q, ranks but 0) or no terminal (CI, a detached job, or no /proc
    to read): a function that does nothing."""
    tty = _stderr_terminal() if enabled else None
    if tty is None:
        return lambda line: None

    def say(line):
        tty.write(f"{line}\n")
        tty.flush()
    return say


def _stderr_terminal(max_hops=8):
    """The terminal at the end of this process's stderr pipe chain, opened for writing; None
    if it ends in a file or anything but a terminal."""
    if sys.stderr is not None and sys.stderr.isatty():
        return sys.stderr
    pid = os.getpid()
    for _ in range(max_hops):
        try:
            target = os.readlink(f"/proc/{pid}/fd/2")
            if not target.startswith(("pipe:", "socket:")):
                if not target.startswith("/dev/"):
                    return None
                tty = open(target, "w", encoding="utf-8")  # noqa: SIM115 - kept for the run
                if tty.isatty():
                    return tty
                tty.close()
                return None
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])  # field 4: the parent
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


@contextlib.contextmanager
def _silenced():
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
            contextlib.redirect_stderr(null):
        yield


def make_sizes(minbytes, maxbytes, factor, itemsize=4):
    """Byte sizes minbytes, x factor, ... <= maxbytes, as whole float32 elements."""
    sizes, n = [], minbytes
    while n <= maxbytes:
        nbytes = max(1, n // itemsize) * itemsize
        if not sizes or nbytes > sizes[-1]:
            sizes.append(nbytes)
        n *= factor
    return sizes


# -- measuring ------------------------------------------------------------------------------------
def candidates(comm):
    """The algorithms auto can choose on this communicator."""
    names = list(FLAT)
    if 1 < len(comm.nodes) < comm.size:
        names.append("hierarchical")
    if len(comm.nodes) == 1 and comm.size > 1:
        names.append("node")  # the node tier (shared memory): every rank on one node
    return names


def measure(comm, world, sizes, algorithms, rounds, budget, progress):
    """{mode: {algorithm: [seconds per call at each size]}}."""
    runs = [(mode, name) for mode in MODES for name in algorithms]
    medians = {mode: {name: [] for name in algorithms} for mode in MODES}
    start = time.perf_counter()
    for i, nbytes in enumerate(sizes):
        here = [(mode, name) for mode, name in runs if nbytes <= SIZE_LIMITS.get(name, nbytes)]
        times, iters = measure_size(comm, world, nbytes, here, rounds, budget)
        timed = dict(zip(here, times, strict=True))
        for mode, name in runs:
            medians[mode][name].append(timed.get((mode, name), math.inf))
        progress(f"[tune] {i + 1}/{len(sizes)} {nbytes} B: {len(runs)} runs x {rounds} rounds "
                 f"x {int(iters.min())}..{int(iters.max())} calls, "
                 f"{time.perf_counter() - start:.1f} s elapsed")
    return medians


def measure_size(comm, world, nbytes, runs, rounds, budget):
    """Seconds per call of each (mode, algorithm) in runs at nbytes: the median over rounds of
    the slowest rank's time per call; and the calls per batch."""
    count = nbytes // 4
    zeros = np.zeros(count, np.float32)  # in place: sums of zeros stay zeros, at full cost
    bufs = {"outofplace": (np.ones(count, np.float32), np.empty(count, np.float32)),
            "inplace": (zeros, zeros)}
    calls = [(bufs[mode][0], name, bufs[mode][1]) for mode, name in runs]  # (x, algorithm, out)

    # Warm up (scratch buffers, schedules), then time one call of each run to size the
    # batches: every rank computes the same counts from the same max-over-ranks probe.
    probe = np.empty(len(runs))
    for j, (x, name, out) in enumerate(calls):
        comm.allreduce(x, algorithm=name, out=out)
        world.Barrier()
        t0 = time.perf_counter()
        comm.allreduce(x, algorithm=name, out=out)
        probe[j] = time.perf_counter() - t0
    world.Allreduce(MPI.IN_PLACE, probe, op=MPI.MAX)
    share = budget / (rounds * len(runs))
    iters = np.clip(share / np.maximum(probe, 1e-7), 1, MAX_ITERS).astype(int)

    per_call = np.empty((rounds, len(runs)))
    for k in range(rounds):
        for j in np.random.default_rng([nbytes, k]).permutation(len(runs)):
            x, name, out = calls[j]
            comm.allreduce(x, algorithm=name, out=out)  # settle, after the previous run
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters[j]):
                comm.allreduce(x, algorithm=name, out=out)
            per_call[k, j] = (time.perf_counter() - t0) / iters[j]
    world.Allreduce(MPI.IN_PLACE, per_call, op=MPI.MAX)
    return [float(t) for t in np.median(per_call, axis=0)], iters


# -- what the measurements say --------------------------------------------------------------------
def crossovers(sizes, times, slack=SLACK, reference=None):
    """[[max_bytes, algorithm], ...] from {algorithm: [seconds at each size]}.

    At every size the pick is within `slack` of the fastest there; among all such sequences,
    the one with the fewest switches between algorithms, then the smallest summed time /
    fastest. With slack=0 that is the fastest at every size; with a little slack, an
    algorithm that wins one size by a hair between sizes another one wins is noise, not a
    crossover. Consecutive sizes with the same pick are merged into one range.

    reference ({nbytes: {algorithm: seconds}}, the same mode measured at another process
    count, see tie_break_reference) breaks ties: of the algorithms within slack here, only
    those also within slack of the best of them there stay candidates. Two algorithms this
    run cannot tell apart then go to the one that is faster elsewhere too, rather than to
    whichever this run's noise favoured.
    """
    paths = {}  # algorithm -> (switches, summed ratio, picks) of the best sequence ending in it
    for i, nbytes in enumerate(sizes):
        fastest = min(t[i] for t in times.values())
        near = [name for name, t in times.items() if t[i] <= (1 + slack) * fastest]
        there = (reference or {}).get(nbytes, {})
        known = [name for name in near if math.isfinite(there.get(name, math.inf))]
        if known:
            best_there = min(there[name] for name in known)
            near = [name for name in near if name not in there
                    or there[name] <= (1 + slack) * best_there]
        grown = {}
        for name in near:
            ratio = times[name][i] / fastest
            if not paths:  # the first size
                grown[name] = (0, ratio, [name])
                continue
            grown[name] = min(((switches + (prev != name), total + ratio, picks + [name])
                               for prev, (switches, total, picks) in paths.items()),
                              key=lambda path: path[:2])
        paths = grown
    picks = min(paths.values(), key=lambda path: path[:2])[2]
    ranges = []
    for nbytes, name in zip(sizes, picks, strict=True):
        if ranges and ranges[-1][1] == name:
            ranges[-1][0] = nbytes
        else:
            ranges.append([nbytes, name])
    return ranges


FITTED = ("alpha", "beta", "gamma", "node_alpha", "node_beta")


def fit(sizes, times, p):
    """CostModel alpha, beta, gamma >= 0 (and node_alpha, node_beta where `times` has the
    node tier) that minimise the summed squared relative error of its predictions for the
    flat algorithms and the node tier in `times` ({algorithm: [seconds at each size]}).

    The model is linear in its five terms, so its coefficients at each point are the
    predictions of the unit models (one term 1, the others 0): the fit follows CostModel's
    formulas whatever they become. The node tier shares gamma (the same ufuncs reduce) and
    has its own handoff and copy terms. Returns (CostModel, rms relative error).
    """
    names = [n for n in (*FLAT, "node") if n in times]
    terms = FITTED if "node" in names else FITTED[:3]
    units = [CostModel(**{k: float(k == term) for k in FITTED}) for term in terms]
    rows, measured = [], []
    for name in names:
        for nbytes, seconds in zip(sizes, times[name], strict=True):
            if not math.isfinite(seconds):  # not timed at this size
                continue
            rows.append([u.allreduce(name, nbytes, p) for u in units])
            measured.append(seconds)
    t = np.array(measured)
    a = np.array(rows) / t[:, None]  # relative error: every size weighs the same
    x = _nonnegative_least_squares(a, np.ones(len(t)))
    rms = float(np.sqrt(np.mean((a @ x - 1) ** 2)))
    return CostModel(**{k: float(v) for k, v in zip(terms, x, strict=True)}), rms


def _nonnegative_least_squares(a, b):
    """argmin |a x - b| over x >= 0, for a handful of columns: the optimum is the plain least
    squares solution on its own support, so try every support and keep the best feasible."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(b @ b)
    for support in itertools.product((False, True), repeat=k):
        cols = np.flatnonzero(support)
        if cols.size == 0:
            continue
        sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = np.zeros(k)
        x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


# -- the file -------------------------------------------------------------------------------------
def read_existing(path):
    """The decoded tuning file at path (checked), or None if there is none yet."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        Tuning.from_dict(data, path)
    except (OSError, json.JSONDecodeError, TuningFileError) as e:
        raise UsageError(f"-o {path} exists but is not a usable tuning file ({e}); delete it "
                         "or pick another -o, so that nothing of yours is overwritten") from None
    return data


def merge(existing, entry):
    """The file's entries with this entry in place of the one of the same p and node shape
    (whose "collectives" ranges, measured by bench/collectives_sweep.py, are kept)."""
    same = [e for e in (existing or {}).get("entries", [])
            if (e.get("p"), e.get("nodes")) == (entry["p"], entry["nodes"])]
    if same and "collectives" in same[0] and "collectives" not in entry:
        entry = {**entry, "collectives": same[0]["collectives"]}
    kept = [e for e in (existing or {}).get("entries", [])
            if (e.get("p"), e.get("nodes")) != (entry["p"], entry["nodes"])]
    entries = sorted(kept + [entry], key=lambda e: (e["p"], e["nodes"]))
    return {"format": FORMAT, "version": VERSION, "entries": entries}


def write_atomic(path, data):
    """Write JSON via a temporary file in the same folder and a rename: a reader (or a tune
    run killed half-way) never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ringcoll-tuning-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_json(data) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def to_json(obj, indent=""):
    """JSON with one key per line but lists of numbers and ranges on one line each: people
    read (and edit) tuning files too."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {to_json(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        return ("[\n" + ",\n".join(inner + to_json(v, inner) for v in obj) + "\n" + indent
                + "]")
    return json.dumps(obj)


def slowdown(model, sizes, medians, p, nodes):
    """The summed time / fastest of a cost model's picks over every measured size and mode."""
    total = 0.0
    tier = "node" in medians["outofplace"]
    for mode in MODES:
        for i, nbytes in enumerate(sizes):
            at = {name: t[i] for name, t in medians[mode].items()}
            total += at[model.choose_allreduce(nbytes, p, nodes, tier)] / min(at.values())
    return total


def median_of(figures, sizes):
    """{mode: {algorithm: [seconds]}}: the median at each size over a list of such figures
    (sweeps of one launch, or launches)."""
    first = figures[0]
    return {mode: {name: [float(np.median([f[mode][name][i] for f in figures]))
                          for i in range(len(sizes))]
                   for name in first[mode]}
            for mode in first}


def seconds_to_us(figures):
    return {mode: {name: [round(s * 1e6, 3) if math.isfinite(s) else None for s in t]
                   for name, t in by.items()}
            for mode, by in figures.items()}


def earlier_launches(existing, p, nodes, sizes, like):
    """The figures of earlier --accumulate runs kept in the file's entry for this p and node
    shape ({mode: {algorithm: [seconds]}} each), or of its one run; [] where the entry is
    missing or measured other sizes or algorithms (then this run starts afresh)."""
    for e in (existing or {}).get("entries", []):
        if (e.get("p"), e.get("nodes")) != (p, node_shape(nodes)):
            continue
        measured = e.get("measured", {})
        if measured.get("sizes") != sizes:
            return []
        found = measured.get("launches") or [{m: measured.get(m) for m in MODES}]
        runs = []
        for run in found:
            if any(set((run.get(m) or {})) != set(like[m]) for m in MODES):
                return []
            runs.append({m: {name: [u / 1e6 if u is not None else math.inf for u in us]
                             for name, us in run[m].items()} for m in MODES})
        return runs
    return []


def tie_break_reference(existing, p, nodes, mode):
    """{nbytes: {algorithm: seconds}} of `mode` in the file's entry for 4 ranks on one node
    (the shipped table's largest process count that does not oversubscribe a 4-core
    machine), what crossovers breaks ties with; None when this run is that entry, or the
    file has none, or its medians are not in it. One node only: across nodes the
    algorithms' order at another p says little."""
    if p == TIE_BREAK_P or len(nodes) != 1:
        return None
    for e in (existing or {}).get("entries", []):
        measured = e.get("measured", {})
        if e.get("p") == TIE_BREAK_P and e.get("nodes") == [TIE_BREAK_P] \
                and mode in measured and "sizes" in measured:
            return {nbytes: {name: (us[i] / 1e6 if us[i] is not None else math.inf)
                             for name, us in measured[mode].items()}
                    for i, nbytes in enumerate(measured["sizes"])}
    return None


def make_entry(comm, sizes, medians, model, rms, args, argv, hosts, existing=None):
    """This run's entry of the tuning file (the format: ringcoll.tuning's docstring)."""
    fallback = (slowdown(model, sizes, medians, comm.size, comm.nodes)
                <= slowdown(CostModel(), sizes, medians, comm.size, comm.nodes))
    us = {mode: {name: [round(s * 1e6, 3) if math.isfinite(s) else None for s in t]
                 for name, t in medians[mode].items()}
          for mode in MODES}  # None: not timed at that size (SIZE_LIMITS)
    return {
        "p": comm.size,
        "nodes": node_shape(comm.nodes),
        **{mode: crossovers(sizes, medians[mode], reference=tie_break_reference(
            existing, comm.size, comm.nodes, mode)) for mode in ("outofplace", "inplace")},
        "tie_break": (f"within {SLACK:.0%}, the faster at p={TIE_BREAK_P} (this file's "
                      "entry)" if tie_break_reference(existing, comm.size, comm.nodes,
                                                      "outofplace") else "none"),
        "model": {**{k: float(f"{getattr(model, k):.4g}") for k in FITTED
                     if getattr(model, k) is not None},
                  "fitted_to": "out-of-place medians of " + ", ".join(medians["outofplace"])
                               + "; least squares of the relative error",
                  "rms_relative_error": round(rms, 4), "fallback": fallback},
        "measured": {"dtype": "float32", "op": "sum", "unit": "us per call",
                     "rounds": args.rounds, "budget_s_per_size": args.budget,
                     "repeat": args.repeat,
                     "segment_bytes": comm.options.segment_bytes, "sizes": sizes, **us},
        "ringcoll_version": ringcoll.__version__,
        "mpi_library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "hosts": hosts,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"mpiexec -n {comm.size} python -m ringcoll.tune {shlex.join(argv)}".strip(),
    }


# -- the summary ----------------------------------------------------------------------------------
def fmt_bytes(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def describe(ranges):
    """'recursive_doubling <= 128 KiB < ring': a table's crossovers in one line."""
    parts = [f"{name} <= {fmt_bytes(top)}" for top, name in ranges[:-1]]
    return " < ".join(parts + [ranges[-1][1]])


def summary(sizes, medians, entry, nodes, before, model, rms, seconds):
    """The lines rank 0 prints: the fit, the crossovers, and at every size the times and how
    three choices compare with the fastest: the new table's, auto's before this run
    (`before`: (nbytes, inplace) -> name) and the fitted model's alone. nodes: the
    communicator's (lists of ranks)."""
    p = entry["p"]
    lines = [(f"# ringcoll tune: p={p}, nodes {entry['nodes']}, {entry['mpi_library']}, "
              f"{len(sizes)} sizes in {seconds:.0f} s"),
             (f"# fitted cost model: alpha {model.alpha * 1e6:.2f} us, beta "
              f"{model.beta * 1e9:.4f} ns/B, gamma {model.gamma * 1e9:.4f} ns/B"
              + (f", node tier {model.node_alpha * 1e6:.2f} us per handoff and "
                 f"{model.node_beta * 1e9:.4f} ns/B copied" if model.node_beta is not None
                 else "")
              + f" (rms relative error {rms:.0%})")]
    for mode in MODES:
        lines.append(f"# crossovers {mode:>10}: {describe(entry[mode])}")
    names = list(medians["outofplace"])
    table = Tuning.from_dict(merge(None, entry)).tables[0]
    choosers = {"new table": lambda n, inplace: table.choose(n, inplace),
                "auto before": before,
                "fitted model": lambda n, inplace: model.choose_allreduce(
                    n, p, nodes, tier="node" in names)}
    lines.append("#")
    lines.append("# time per call (us; median of rounds, slowest rank); 'x' = that pick's time "
                 "/ the fastest's")
    lines.append(f"# {'size':>9} {'mode':>10} " + " ".join(f"{SHORT[n]:>12}" for n in names)
                 + "".join(f"  {label:>12} {'x':>5}" for label in choosers))
    ratios = {label: [] for label in choosers}
    for mode in MODES:
        inplace = mode == "inplace"
        for i, nbytes in enumerate(sizes):
            at = {n: medians[mode][n][i] for n in names}
            line = (f"# {fmt_bytes(nbytes):>9} {mode:>10} "
                    + " ".join(f"{at[n] * 1e6:>12.1f}" for n in names))
            for label, choose in choosers.items():
                pick = choose(nbytes, inplace)
                ratio = at[pick] / min(at.values())
                ratios[label].append((ratio, nbytes, mode))
                line += f"  {SHORT[pick]:>12} {ratio:>5.2f}"
            lines.append(line)
    lines.append("#")
    for label, rs in ratios.items():
        worst = max(rs)
        lines.append(f"# {label:>12}: within 10% of the fastest at "
                     f"{sum(r <= 1.10 for r, _, _ in rs)}/{len(rs)} size-modes, worst "
                     f"{worst[0]:.2f}x at {fmt_bytes(worst[1])} {worst[2]}")
    lines.append(f"# (the new table is within {SLACK:.0%} of the fastest here by construction; "
                 "bench/allreduce.py checks it on fresh timings)")
    lines.append("# the fitted model is auto's fallback at process counts without a table: "
                 + ("yes" if entry["model"]["fallback"] else
                    "no, CostModel()'s defaults picked better here"))
    return lines


# -- main -----------------------------------------------------------------------------------------
def main(argv=None):
    """Run the tuner (under mpiexec); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        return _main(argv, world)
    except SystemExit as e:  # argparse: -h or a usage error, on every rank alike
        return e.code if isinstance(e.code, int) else 2
    except UsageError as e:
        if rank == 0:
            print(f"ringcoll tune: error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:  # noqa: BLE001 - one failing rank must not leave the others waiting
        sys.stderr.write(f"[rank {rank}] ringcoll tune failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)


def _main(argv, world):
    rank, p = world.Get_rank(), world.Get_size()
    args = parse_args(argv, rank)
    say = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    progress = progress_printer(rank == 0 and not args.quiet)
    if p < 2:
        raise UsageError("an all-reduce on 1 process moves nothing; run it under "
                         "mpiexec -n P with P >= 2, once per process count you use")
    # Check the output before spending a minute measuring: rank 0 reads, everyone learns.
    existing, problem = None, None
    if rank == 0:
        try:
            existing = read_existing(args.output)
        except UsageError as e:
            problem = str(e)
    problem = world.bcast(problem, root=0)
    if problem:
        raise UsageError(problem)

    notes = []
    try:  # auto's choices before this run: RINGCOLL_TUNING's table, or the built-in one
        comm = ringcoll.Communicator(debug=False)  # RINGCOLL_DEBUG would log every call
    except TuningFileError as e:
        notes.append(f"# note: the current tuning table is unusable, so 'auto before' is the "
                     f"cost model's choice ({e})")
        comm = ringcoll.Communicator(debug=False, tuning=False)
    hosts = sorted(set(world.allgather(MPI.Get_processor_name())))
    sizes = make_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    start = time.perf_counter()
    sweeps = [measure(comm, world, sizes, candidates(comm), args.rounds, args.budget, progress)
              for _ in range(args.repeat)]
    launch = median_of(sweeps, sizes)  # (one sweep: its own figures)
    seconds = time.perf_counter() - start
    existing = world.bcast(existing, root=0)  # its p=4 entry breaks ties (on every rank alike)
    launches = (earlier_launches(existing, p, comm.nodes, sizes, launch) if args.accumulate
                else []) + [launch]
    medians = median_of(launches, sizes)
    model, rms = fit(sizes, medians["outofplace"], p)
    entry = make_entry(comm, sizes, medians, model, rms, args, argv, hosts, existing)
    if len(launches) > 1:
        entry["measured"]["launches"] = [seconds_to_us(m) for m in launches]
    if rank == 0:
        data = merge(existing, entry)
        Tuning.from_dict(data, args.output)  # what auto will read back must load
        write_atomic(args.output, data)
        for line in notes + summary(sizes, medians, entry, comm.nodes,
                                    comm.auto_algorithm, model, rms, seconds):
            say(line)
        say(f"# wrote the entry for p={p}, nodes {entry['nodes']} to {args.output}; use it "
            f"with RINGCOLL_TUNING={os.path.abspath(args.output)}")
    world.Barrier()  # nobody exits (and tears MPI down) before the file is written
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
