"""Shared harness of the ringcoll benchmarks, after nccl-tests.

Every bench/<collective>.py is a small Spec (bytes moved, busbw factor, how to run one call, what
each rank must hold afterwards) handed to main(). This module does the rest, the same way for
all of them:

- sizes from -b/-e/-f (or -i), with K/M/G suffixes (powers of 1024, as nccl-tests);
- for every size, every requested algorithm (and mode: out-of-place, in-place) is run once and
  checked against an exact oracle (-c 1), then timed round-robin: several rounds, each timing a
  batch of every algorithm in turn (in a fresh order each round, after one untimed settling
  call, behind a barrier), so the machine's noise hits them all alike;
- time = max over ranks of the mean time of one call after warm-up; algbw = bytes / time
  (decimal GB/s); busbw = algbw x the collective's factor; ratio = native time / this time;
- the iteration count shrinks at large sizes to fit --budget seconds per size: rank 0 decides
  from the slowest rank's first call and broadcasts it, so every rank runs the same number;
- a table on stdout, a progress line per size on the terminal only (never in redirected
  output), and optional --json/--csv/--plot.

Exit status: 0 ok, 1 wrong results (#wrong > 0), 2 bad arguments or a missing optional
dependency that was asked for (--plot without matplotlib), 3 a --target-ratio miss.
"""

import argparse
import csv
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.tune import progress_printer

WORLD = MPI.COMM_WORLD  # the harness's own coordination (barriers, max of times): never ringcoll
OUT, IN = "out-of-place", "in-place"
REDUCING = ("sum", "prod", "max", "min", "avg")
PERIOD = 1009  # test data repeats every PERIOD elements: a prime, so no block size is a multiple
SENTINEL = 99  # what output buffers hold before a call: never a value of the test data (0..96)
RINGCOLL_SIDE = "ringcoll"  # the algorithms that are not 'native' or 'gloo'

try:
    from ml_dtypes import bfloat16 as _bf16

    BFLOAT16 = np.dtype(_bf16)
except ImportError:  # ringcoll accepts bfloat16 only where ml_dtypes is installed
    BFLOAT16 = None

# -d accepts numpy names and the nccl-tests spellings.
DTYPE_ALIASES = {
    "float": "float32", "float32": "float32", "f32": "float32",
    "double": "float64", "float64": "float64", "f64": "float64",
    "half": "float16", "float16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16",
    "int32": "int32", "int": "int32", "uint32": "uint32",
    "int64": "int64", "uint64": "uint64",
}


@dataclass
class Spec:
    """One collective, as the harness needs to know it.

    make(case, inplace) -> (inp, out): fresh buffers, inp holding this rank's data, out holding
        SENTINEL (out is inp for in-place, None where this rank gets nothing).
    run(comm, inp, out, algorithm, case): one call of the collective.
    expect(case) -> array this rank must hold afterwards (None: nothing to check here).
    result(inp, out, case) -> the array that should equal expect(case).
    """

    name: str
    busbw_factor: Callable[[int], float]
    algorithms: tuple  # every name -a accepts ('native' included)
    default_algorithms: Callable  # comm -> list of names
    make: Callable
    run: Callable
    expect: Callable
    result: Callable
    modes: tuple = (OUT, IN)  # which the API supports
    blocked: bool = False  # the buffer is p equal blocks: count is rounded to a multiple of p
    reduces: bool = False  # takes -o
    rooted: bool = False  # takes -r
    picked: Callable | None = None  # (comm, nbytes, inplace) -> the algorithm 'auto' runs
    gloo: bool = False  # offers --gloo (torch.distributed all_reduce, backend gloo)
    notes: list = field(default_factory=list)


# -- the data and its oracle -----------------------------------------------------------------
class Case:
    """One size: the element count, dtype, op and root, and exact test data for every rank.

    Rank r's data is periodic in the element index (period PERIOD) with small integer values,
    so every partial result of every algorithm is exact in every dtype (bfloat16 included, up
    to 64 ranks for sum) and the oracle is computed on one period, then tiled.
    """

    def __init__(self, rank, size, count, dtype, op, root):
        self.rank, self.size, self.count = rank, size, count
        self.dtype, self.op, self.root = dtype, op, root
        self.nbytes = count * dtype.itemsize
        self.block = count // size  # elements per rank's block (blocked collectives)
        self._acc = np.int64 if dtype.kind in "iu" else np.float64
        self._periods = {}

    def _period(self, r):
        """Rank r's values on one period, in int64/float64."""
        if r not in self._periods:
            v = (7 * np.arange(PERIOD, dtype=np.int64) + 13 * r) % PERIOD
            if self.op in ("sum", "avg"):
                v = v % 5  # sums stay <= 4p: exact everywhere
            elif self.op == "prod":
                v = 1 + v % 2  # powers of two: exact everywhere
            else:
                v = v % 97  # max, min, and data that is only moved
            self._periods[r] = v.astype(self._acc)
        return self._periods[r]

    def _tile(self, period, n, start):
        rolled = np.roll(period, -(start % PERIOD))
        if self.dtype.kind == "f" or self.dtype == BFLOAT16:
            rolled = rolled.astype(np.float64)
        return np.resize(rolled.astype(self.dtype), n)  # astype wraps integers as MPI does

    def data(self, r, n=None, start=0):
        """A fresh array: elements [start, start + n) of rank r's data."""
        return self._tile(self._period(r), self.count if n is None else n, start)

    def reduced(self, n=None, start=0):
        """A fresh array: elements [start, start + n) of the reduction over all ranks."""
        stack = np.stack([self._period(r) for r in range(self.size)])
        if self.op in ("sum", "avg"):
            v = stack.sum(axis=0)
            if self.op == "avg":
                v = v / self.size
        elif self.op == "prod":
            v = stack.prod(axis=0)
        elif self.op == "max":
            v = stack.max(axis=0)
        elif self.op == "min":
            v = stack.min(axis=0)
        else:
            raise ValueError(f"no reduction {self.op!r}")
        return self._tile(v, self.count if n is None else n, start)

    def empty(self, n=None):
        """An output buffer holding SENTINEL, so a call that writes nothing is caught."""
        return np.full(self.count if n is None else n, SENTINEL, dtype=self.dtype)


def count_wrong(got, want, case):
    """Elements of got that differ from want: exactly, or within 2 ulp for 'avg'."""
    if want is None:
        return 0
    if got is None:
        return int(want.size)
    g, w = np.asarray(got).reshape(-1), want.reshape(-1)
    if g.size != w.size:
        return int(max(g.size, w.size))
    if case.op == "avg":
        eps = _finfo(case.dtype).eps
        g, w = g.astype(np.float64), w.astype(np.float64)
        return int(np.count_nonzero(~(np.abs(g - w) <= 2 * eps * np.abs(w))))  # NaN is wrong
    if case.dtype == BFLOAT16 or case.dtype == np.float16:
        g, w = g.astype(np.float32), w.astype(np.float32)
    return int(np.count_nonzero(g != w))


def _finfo(dtype):
    if dtype == BFLOAT16:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


# -- command line -----------------------------------------------------------------------------
def parse_size(text):
    """'64M' -> 67108864: K, M, G are powers of 1024 (as nccl-tests); a trailing B is allowed."""
    s = str(text).strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    if scale > 1:
        s = s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 8, 16K, 64M, 1G)")
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


class _Parser(argparse.ArgumentParser):
    """argparse that prints only on rank 0, so p ranks do not print p copies."""

    def _print_message(self, message, file=None):
        if WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def add_sweep_arguments(p):
    """nccl-tests' size sweep and iteration options (-b -e -f -i -n -w), shared by every
    benchmark that sweeps sizes."""
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                   help="smallest size in bytes (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest size in bytes (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this each step (default 2; 1 = use -i)")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"),
                   help="add this many bytes each step when -f is 1 (default 1M)")
    # nccl-tests' default is 20; a call of a few microseconds on a shared machine needs more
    # to average out one preemption (20 calls of 3 us: one 100 us hiccup doubles the mean).
    # --budget cuts large sizes down to what fits, so more costs nothing there.
    p.add_argument("-n", "--iters", type=int, default=100,
                   help="timed iterations per size, at most (default 100; fewer at large sizes, "
                        "see --budget)")
    p.add_argument("-w", "--warmup_iters", type=int, default=10,
                   help="warm-up iterations per size, at most (default 10)")


def build_parser(spec):
    p = _Parser(prog=f"bench/{spec.name}.py",
                description=f"nccl-tests-style benchmark of ringcoll {spec.name} against the "
                            "MPI library's own collective, timed in the same run.",
                epilog="Example: mpiexec -n 4 python bench/%s.py -b 8 -e 64M -f 2" % spec.name)
    add_sweep_arguments(p)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check every result against the exact answer (default 1)")
    single_node = SimpleNamespace(nodes=[[0]], size=1, rank=0)
    default = ", ".join(spec.default_algorithms(single_node))
    if "hierarchical" in spec.algorithms:
        default += ", and hierarchical when the ranks span more than one node"
    p.add_argument("-a", "--algorithms", default=None,
                   help=f"comma list from: {', '.join(spec.algorithms)} (default: {default})")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32 (default), float64, float16, bfloat16, int8..uint64; "
                        "float16/bfloat16 run only ringcoll algorithms (MPI has no such type)")
    # -o and -r are accepted by every script (as nccl-tests), so one command line fits all.
    p.add_argument("-o", "--op", default=None, choices=REDUCING,
                   help="reduction (default sum)" if spec.reduces else
                   f"ignored: {spec.name} does not reduce")
    p.add_argument("-r", "--root", type=int, default=None,
                   help="root rank (default 0)" if spec.rooted else
                   f"ignored: {spec.name} has no root")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--inplace", dest="modes", action="store_const", const=(IN,),
                      help="time only in-place calls")
    mode.add_argument("--outofplace", dest="modes", action="store_const", const=(OUT,),
                      help="time only out-of-place calls")
    mode.add_argument("--both", dest="modes", action="store_const", const=(OUT, IN),
                      help="time both (default, as nccl-tests; where the API has both)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed iterations per size, all algorithms together; "
                        "fewer iterations (at least 2) where -n would take longer (default 1.0)")
    p.add_argument("--rounds", type=int, default=5,
                   help="round-robin rounds the iterations are split into (default 5)")
    p.add_argument("--target-ratio", type=float, default=None,
                   help="exit 3 if the best ringcoll algorithm's ratio to native falls below "
                        "this at any size >= --target-min-bytes")
    p.add_argument("--target-min-bytes", type=parse_size, default=0,
                   help="smallest size the --target-ratio applies to (default 0)")
    if spec.gloo:
        p.add_argument("--gloo", action="store_true",
                       help="also time torch.distributed all_reduce over Gloo (needs torch; "
                            "skipped with a message otherwise)")
    p.add_argument("--json", metavar="FILE", help="write every figure and the environment here")
    p.add_argument("--csv", metavar="FILE", help="write one row per size, algorithm and mode")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw and ratio vs size "
                                                      "(needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (they go to the terminal only)")
    p.set_defaults(modes=None, gloo=False)
    return p


class UsageError(Exception):
    """Bad arguments: every rank raises it the same way and exits 2 without aborting MPI."""


def resolve_dtype(name):
    key = DTYPE_ALIASES.get(name.lower())
    if key is None:
        raise UsageError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPE_ALIASES))}")
    if key == "bfloat16":
        if BFLOAT16 is None:
            raise UsageError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return BFLOAT16
    return np.dtype(key)


def make_sizes(args, spec, p, itemsize):
    """[(bytes, count)] to run: nccl-tests sweep, counts rounded to whole elements/blocks."""
    if args.minbytes > args.maxbytes:
        raise UsageError(f"-b {args.minbytes} is larger than -e {args.maxbytes}")
    if args.stepfactor < 1 or (args.stepfactor == 1 and args.stepbytes <= 0):
        raise UsageError("-f must be >= 1, and -i > 0 when -f is 1")
    if args.minbytes == 0 and args.stepfactor > 1:
        raise UsageError("-b 0 with -f > 1 would never grow; use -b 1 or more")
    out, seen, s = [], set(), args.minbytes
    while s <= args.maxbytes:
        elems = s // itemsize
        count = max(1, elems // p) * p if spec.blocked else max(1, elems)
        if count not in seen:
            seen.add(count)
            out.append((count * itemsize, count))
        s = s * args.stepfactor if args.stepfactor > 1 else s + args.stepbytes
    return out


def validate(args, spec, comm):
    """Return (dtype, algorithms, modes, notes) or raise UsageError; identical on every rank."""
    notes = list(spec.notes)
    dtype = resolve_dtype(args.dtype)
    if not spec.reduces and args.op is not None:
        notes.append(f"-o {args.op} ignored: {spec.name} does not reduce")
    if not spec.rooted and args.root is not None:
        notes.append(f"-r {args.root} ignored: {spec.name} has no root")
    args.op = (args.op or "sum") if spec.reduces else None
    args.root = (0 if args.root is None else args.root) if spec.rooted else -1
    if spec.reduces and args.op == "avg" and dtype.kind in "iu":
        raise UsageError(f"-o avg needs a float dtype; {dtype} cannot hold the mean")
    if spec.rooted and not 0 <= args.root < comm.size:
        raise UsageError(f"-r {args.root} is not a rank (0..{comm.size - 1})")
    if args.iters < 1 or args.warmup_iters < 0 or args.rounds < 1 or args.budget <= 0:
        raise UsageError("need -n >= 1, -w >= 0, --rounds >= 1 and --budget > 0")
    if args.algorithms:
        algs = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    else:
        algs = list(spec.default_algorithms(comm))
    bad = [a for a in algs if a not in spec.algorithms]
    if bad or not algs:
        raise UsageError(f"unknown algorithm(s) {bad}; -a takes a comma list from "
                         f"{', '.join(spec.algorithms)}")
    algs = list(dict.fromkeys(algs))  # drop repeats, keep order
    half = dtype == np.float16 or dtype == BFLOAT16
    if half and "native" in algs:
        algs.remove("native")
        notes.append(f"native skipped: MPI has no {dtype} datatype (ringcoll algorithms "
                     "accumulate it in float32); the ratio column is '-'")
    if not algs:
        raise UsageError("no algorithm left to run")
    asked = args.modes or spec.modes  # default: every form the API has (nccl-tests: both)
    modes = tuple(m for m in (OUT, IN) if m in asked and m in spec.modes)
    if not modes:
        raise UsageError(f"{spec.name} has no {' / '.join(asked)} form in ringcoll's API; "
                         f"it supports: {', '.join(spec.modes)}")
    for m in asked:
        if m not in spec.modes:
            notes.append(f"{m} skipped: {spec.name} has no {m} form in ringcoll's API")
    if args.target_ratio is not None and "native" not in algs:
        raise UsageError("--target-ratio compares with native: add native to -a "
                         "(and use a dtype MPI knows)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot {args.plot}: matplotlib is not installed "
                         "(pip install matplotlib), so no plot can be drawn; run without "
                         "--plot, or install it")
    return dtype, algs, modes, notes


# -- Gloo (optional) --------------------------------------------------------------------------
class Gloo:
    """torch.distributed all_reduce over the Gloo backend, on tensors sharing the numpy buffers.

    The group is built from the MPI world (same ranks, same size): rank 0 serves a TCPStore on
    127.0.0.1 at a port the OS picks and broadcasts it over MPI, so concurrent runs on one
    machine never collide on a port. What is timed, on torch.from_numpy views (zero-copy):
    in-place, dist.all_reduce(x); out-of-place, out.copy_(inp) then dist.all_reduce(out), which
    is how a torch user gets a separate result (torch has no out-of-place all_reduce).
    """

    OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN"}

    def __init__(self, dist, torch, store):
        self.dist, self.torch, self._views = dist, torch, {}
        self._store = store  # rank 0 serves the rendezvous: keep it alive until close()

    @classmethod
    def start(cls, notes):
        """Init the gloo process group on every rank, or None (with a note) if impossible."""
        try:
            import torch
            import torch.distributed as dist

            why = None if dist.is_available() and dist.is_gloo_available() else \
                f"torch {torch.__version__} was built without torch.distributed's Gloo backend"
        except Exception as e:  # noqa: BLE001 - any import failure means: no Gloo comparison
            torch = dist = None
            why = f"torch is not importable ({type(e).__name__}: {e})"
        whys = [w for w in WORLD.allgather(why) if w]
        if whys:
            notes.append(f"--gloo skipped: {whys[0]}")
            return None
        if len(set(WORLD.allgather(MPI.Get_processor_name()))) > 1:
            notes.append("--gloo skipped: its rendezvous store is on 127.0.0.1, so it "
                         "runs only when all ranks share one host")
            return None
        # Port 0: the OS picks a free one while rank 0 binds it (no probe-then-bind race).
        timeout, rank, size = datetime.timedelta(seconds=120), WORLD.Get_rank(), WORLD.Get_size()
        store = port = why = None
        try:
            if rank == 0:
                store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                port = store.port
        except Exception as e:  # noqa: BLE001 - e.g. no loopback TCP: no Gloo comparison
            why = f"rank 0 could not open its rendezvous store ({type(e).__name__}: {e})"
        port = WORLD.bcast(port, root=0)  # None: rank 0 failed, and says why below
        try:
            if rank != 0 and port is not None:
                store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            why = f"rank {rank} could not reach the rendezvous store ({type(e).__name__}: {e})"
        whys = [w for w in WORLD.allgather(why) if w]
        if whys:
            notes.append(f"--gloo skipped: {whys[0]}")
            return None
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        return cls(dist, torch, store)

    def supports(self, dtype, op, notes):
        """Try one tiny all_reduce; False (with a note) where torch or Gloo refuses the type."""
        try:
            self.allreduce(np.ones(2, dtype=dtype), op)
            ok, why = True, ""
        except Exception as e:  # noqa: BLE001 - the same refusal happens on every rank
            ok, why = False, f"{type(e).__name__}: {e}"
        if not all(WORLD.allgather(ok)):
            notes.append(f"--gloo skipped: Gloo cannot all_reduce {_type_name(dtype)} with "
                         f"{op} ({why or 'refused on another rank'})")
            return False
        return True

    def tensor(self, x):
        """A tensor sharing x's memory, cached so the timed loop does not build one per call."""
        hit = self._views.get(id(x))
        if hit is None or hit[0] is not x:  # the cache holds x itself, so ids are not reused
            if len(self._views) > 8:
                self._views.clear()
            if x.dtype == BFLOAT16:  # torch cannot read ml_dtypes' bfloat16: share the bits
                t = self.torch.from_numpy(x.view(np.int16)).view(self.torch.bfloat16)
            else:
                t = self.torch.from_numpy(x)
            hit = self._views[id(x)] = (x, t)
        return hit[1]

    def allreduce(self, x, op, inp=None):
        """all_reduce x in place; out-of-place (inp given, not x): x.copy_(inp) first."""
        t = self.tensor(x)
        if inp is not None and inp is not x:
            t.copy_(self.tensor(inp))
        self.dist.all_reduce(t, op=getattr(self.dist.ReduceOp, self.OPS[op]))

    def close(self):
        """Local (no MPI call), so it is safe on a subset of ranks."""
        self.dist.destroy_process_group()
        self._store = None


# -- measuring ----------------------------------------------------------------------------------
@dataclass
class Run:
    """One (algorithm, mode) of one size."""

    algorithm: str
    mode: str
    label: str
    picked: str | None = None
    probe_s: float = 0.0
    total_s: float = 0.0  # this rank's timed total
    rounds_s: list = field(default_factory=list)  # this rank's time per call, each round
    wrong: int | None = None
    time_s: float = float("nan")  # max over ranks of the mean
    round_us: list = field(default_factory=list)  # max over ranks, each round


def _call(spec, comm, gloo, run, bufs, case):
    inp, out = bufs
    if run.algorithm == "gloo":
        gloo.allreduce(out, case.op, inp)
    else:
        spec.run(comm, inp, out, run.algorithm, case)


def measure(spec, comm, gloo, case, runs, args):
    """Check, warm up, and time `runs` at one size; fill in their figures. Returns (iters, warm)."""
    timing = {m: spec.make(case, m == IN) for m in {r.mode for r in runs}}
    if IN in timing and case.op in ("sum", "prod"):
        # Repeated in-place sums (products) would grow to inf; the op's identity stays put and
        # costs the same to add (no denormals), so the timed calls work on steady data.
        timing[IN][0][...] = 0 if case.op == "sum" else 1
    expect = spec.expect(case) if args.check else None
    # 1. one call each, on fresh data: the correctness check, and the cost probe.
    for r in runs:
        bufs = spec.make(case, r.mode == IN) if args.check else timing[r.mode]
        WORLD.Barrier()
        t0 = time.perf_counter()
        _call(spec, comm, gloo, r, bufs, case)
        r.probe_s = time.perf_counter() - t0
        if args.check:
            r.wrong = count_wrong(spec.result(*bufs, case), expect, case)
        del bufs
    probe = np.array([r.probe_s for r in runs])
    WORLD.Allreduce(MPI.IN_PLACE, probe, op=MPI.MAX)
    if args.check:
        wrong = np.array([r.wrong for r in runs], dtype=np.int64)
        WORLD.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
        for r, w in zip(runs, wrong):
            r.wrong = int(w)
    # 2. rank 0 sizes the warm-up and the timed iterations to the budget, for every rank.
    plan = None
    if WORLD.Get_rank() == 0:
        per_round = max(float(probe.sum()), 1e-9)  # one call of every run, slowest rank
        affordable = args.budget // per_round  # calls of every run that fit the budget
        iters = int(min(args.iters, max(2, affordable * 4 // 5)))  # the rest: settling calls
        warm = int(min(args.warmup_iters, max(min(1, args.warmup_iters),
                                              0.25 * args.budget // per_round)))
        plan = (iters, warm)
    iters, warm = WORLD.bcast(plan, root=0)
    # 3. warm-up, round-robin.
    for w in range(warm):
        for j in np.random.default_rng([case.nbytes, 1000 + w]).permutation(len(runs)):
            _call(spec, comm, gloo, runs[j], timing[runs[j].mode], case)
    # 4. timed rounds: each round times a batch of every run in turn, in a fresh order (the
    # same on every rank: seeded by size and round), each batch after one untimed settling
    # call. A fixed cyclic order made a run inherit its neighbour's cache footprint: the run
    # after `native` at 8 MiB came out ~35% slower than the same algorithm elsewhere.
    rounds = min(args.rounds, iters)
    batches = [iters // rounds + (1 if k < iters % rounds else 0) for k in range(rounds)]
    for r in runs:
        r.total_s, r.rounds_s = 0.0, [0.0] * rounds
    for k, batch in enumerate(batches):
        for j in np.random.default_rng([case.nbytes, k]).permutation(len(runs)):
            r = runs[j]
            bufs = timing[r.mode]
            _call(spec, comm, gloo, r, bufs, case)  # settle: steady state, as back-to-back calls
            WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(batch):
                _call(spec, comm, gloo, r, bufs, case)
            dt = time.perf_counter() - t0
            r.total_s += dt
            r.rounds_s[k] = dt / batch
    # 5. time = max over ranks of the mean.
    mean = np.array([r.total_s / iters for r in runs])
    WORLD.Allreduce(MPI.IN_PLACE, mean, op=MPI.MAX)
    per_round = np.array([r.rounds_s for r in runs])
    WORLD.Allreduce(MPI.IN_PLACE, per_round, op=MPI.MAX)
    for r, t, rs in zip(runs, mean, per_round):
        r.time_s = float(t)
        r.round_us = [round(float(v) * 1e6, 3) for v in rs]
    return iters, warm


# -- reporting ----------------------------------------------------------------------------------
def _is_ringcoll(alg):
    return alg not in ("native", "gloo")


def results_for_size(spec, case, runs, iters, warm, p):
    """One dict per run: the figures of the table, the CSV and the JSON."""
    factor = spec.busbw_factor(p)
    native = {r.mode: r.time_s for r in runs if r.algorithm == "native"}
    rows = []
    for r in runs:
        algbw = case.nbytes / r.time_s / 1e9 if r.time_s > 0 else float("nan")
        ratio = native[r.mode] / r.time_s if r.mode in native and r.time_s > 0 else None
        rows.append({
            # count as nccl-tests: elements per rank's block where the buffer is p blocks
            "size": case.nbytes, "count": case.block if spec.blocked else case.count,
            "type": _type_name(case.dtype),
            "redop": case.op or "none", "root": case.root,
            "algorithm": r.algorithm, "picked": r.picked, "label": r.label, "mode": r.mode,
            "time_us": r.time_s * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
            "wrong": r.wrong, "ratio_to_native": ratio, "iters": iters, "warmup": warm,
            "round_us": r.round_us, "round_median_us": float(np.median(r.round_us)),
        })
    return rows


def _type_name(dtype):
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


class Table:
    """nccl-tests layout: one row per algorithm, one column group per mode. The last column
    is each row's ratio_to_native, headed ratio_label."""

    def __init__(self, modes, label_width, ratio_label="vsMPI"):
        self.modes, self.w, self.ratio_label = modes, max(label_width, 9), ratio_label

    def header(self):
        lead = f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}  " \
               f"{'algorithm':<{self.w}}"
        unit = f"{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5}  {'':<{self.w}}"
        top = " " * len(lead)
        for m in self.modes:
            top += f"  {m:^45}"
            lead += "  " + (f"{'time':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>8} "
                            f"{self.ratio_label:>8}")
            unit += "  " + f"{'(us)':>9} {'(GB/s)':>8} {'(GB/s)':>8} {'':>8} {'':>8}"
        return [("#" + line[1:]).rstrip() for line in (top, lead, unit)]

    def rows(self, rows):
        by_label = {}
        for row in rows:
            by_label.setdefault(row["label"], {})[row["mode"]] = row
        lines = []
        for label, modes in by_label.items():
            first = next(iter(modes.values()))
            line = (f"{first['size']:>12} {first['count']:>12} {first['type']:>8} "
                    f"{first['redop']:>6} {first['root']:>5}  {label:<{self.w}}")
            for m in self.modes:
                r = modes.get(m)
                if r is None:
                    line += "  " + f"{'n/a':>9} {'':>8} {'':>8} {'':>8} {'':>8}"
                    continue
                wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
                ratio = "-" if r["ratio_to_native"] is None else f"{r['ratio_to_native']:.2f}"
                line += "  " + (f"{_fmt_time(r['time_us']):>9} {r['algbw_GBps']:>8.3f} "
                                f"{r['busbw_GBps']:>8.3f} {wrong:>8} {ratio:>8}")
            lines.append(line.rstrip())
        return lines


def _fmt_time(us):
    return f"{us:.2f}" if us < 1e4 else f"{us:.0f}" if us < 1e7 else f"{us:.3g}"


def auto_report(rows):
    """For each size and mode: auto's time vs the best other ringcoll algorithm measured.

    The verdict compares medians over the timed rounds (round_median_us), not the means of
    the table: a mean carries every context switch of a shared machine, and at a few
    microseconds two rows running the very same code differed by up to 25% in their means."""
    out = []
    groups = {}
    for r in rows:
        groups.setdefault((r["size"], r["mode"]), []).append(r)
    for (size, mode), rs in groups.items():
        auto = next((r for r in rs if r["algorithm"] == "auto"), None)
        others = [r for r in rs if _is_ringcoll(r["algorithm"]) and r["algorithm"] != "auto"]
        if auto is None or not others:
            continue
        best = min(others, key=lambda r: r["round_median_us"])
        rel = auto["round_median_us"] / best["round_median_us"]
        # the same decision judged on the row that ran the picked algorithm by name: equal
        # code, so the gap between the two figures is the machine's noise at that size
        twin = next((r for r in others if r["algorithm"] == auto["picked"]), None)
        pick_rel = twin["round_median_us"] / best["round_median_us"] if twin else None
        out.append({"size": size, "mode": mode, "picked": auto["picked"],
                    "auto_us": auto["round_median_us"], "best": best["algorithm"],
                    "best_us": best["round_median_us"], "auto_over_best": rel,
                    "pick_over_best": pick_rel,
                    "within_10pct": rel <= 1.10, "picked_best": auto["picked"] == best["algorithm"],
                    "picked_measured": any(r["algorithm"] == auto["picked"] for r in others)})
    return out


def target_report(rows, ratio, min_bytes):
    """For each size >= min_bytes and mode: the best ringcoll algorithm's ratio to native."""
    out = []
    groups = {}
    for r in rows:
        if r["size"] >= min_bytes:
            groups.setdefault((r["size"], r["mode"]), []).append(r)
    for (size, mode), rs in groups.items():
        mine = [r for r in rs if _is_ringcoll(r["algorithm"]) and r["ratio_to_native"]]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["ratio_to_native"])
        out.append({"size": size, "mode": mode, "best": best["label"],
                    "ratio": best["ratio_to_native"], "passed": best["ratio_to_native"] >= ratio})
    return out


def environment(comm, args, gloo):
    hosts = WORLD.allgather(MPI.Get_processor_name())
    env = {
        "mpi_library_version": MPI.Get_library_version().strip(),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi_thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized",
                             MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread()),
        "mpi4py_version": __import__("mpi4py").__version__,
        "processes": comm.size,
        "hostnames": hosts,
        "nodes": comm.nodes,
        "ringcoll_version": ringcoll.__version__,
        "ringcoll_cost_model": asdict(comm.cost_model),
        "ringcoll_options": asdict(comm.options),
        "ringcoll_env": {k: v for k, v in os.environ.items() if k.startswith("RINGCOLL_")},
        "numpy_version": np.__version__,
        "python_version": sys.version,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "command": f"mpiexec -n {comm.size} python {shlex.join(sys.argv)}",
        "git_commit": _git_commit(),
    }
    if gloo is not None:
        env["torch_version"] = gloo.torch.__version__
        env["torch_num_threads"] = gloo.torch.get_num_threads()
    if BFLOAT16 is not None:
        env["ml_dtypes_version"] = __import__("ml_dtypes").__version__
    return env


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


CSV_FIELDS = ("size", "count", "type", "redop", "root", "algorithm", "picked", "label", "mode",
              "time_us", "algbw_GBps", "busbw_GBps", "wrong", "ratio_to_native", "iters",
              "warmup")


def write_csv(path, rows):
    _parent(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_plot(path, spec, rows, env, dtype_name, op):
    """Three log-scaled panels against size: busbw, latency (time per call) and the ratio to
    native; one line per algorithm and mode (out-of-place solid, in-place dashed), native in
    black so every other line reads against it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, lat, ratio) = plt.subplots(1, 3, figsize=(18, 5.5))
    series = {}
    for r in rows:
        series.setdefault((r["label"].split("->")[0], r["mode"]), []).append(r)
    for (alg, mode), rs in series.items():
        look = dict(linestyle="-" if mode == OUT else "--", marker="o", ms=3,
                    label=f"{alg} ({mode})")
        if alg == "native":
            look.update(color="black", lw=2.2, zorder=5)
        sizes = [r["size"] for r in rs]
        bw.plot(sizes, [r["busbw_GBps"] for r in rs], **look)
        lat.plot(sizes, [r["time_us"] for r in rs], **look)
        if any(r["ratio_to_native"] for r in rs):
            ratio.plot(sizes, [r["ratio_to_native"] or float("nan") for r in rs], **look)
    for ax, ylabel in ((bw, "busbw (GB/s)"), (lat, "time per call (us, max over ranks)"),
                       (ratio, "native time / time  (>1: faster than MPI)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=7)
    ratio.axhline(1.0, color="black", lw=0.8)
    fig.suptitle(f"ringcoll {spec.name}, {env['processes']} ranks, {dtype_name}"
                 f"{'' if op is None else ', ' + op}  ({env['date']})", fontsize=10)
    fig.tight_layout()
    _parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parent(path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


# -- main -----------------------------------------------------------------------------------------
def main(spec, argv=None):
    """Run the benchmark of `spec` on every rank; returns the exit status (same on all ranks)."""
    rank = WORLD.Get_rank()
    try:
        return _main(spec, argv)
    except SystemExit as e:  # argparse: -h, or a usage error (already printed by rank 0)
        return e.code if isinstance(e.code, int) else 2
    except UsageError as e:
        if rank == 0:
            print(f"bench/{spec.name}.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:  # a failure on one rank must not leave the others hanging
        sys.stderr.write(f"[rank {rank}] bench/{spec.name}.py failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        WORLD.Abort(1)


def _main(spec, argv):
    args = build_parser(spec).parse_args(argv)
    comm = ringcoll.Communicator()
    rank, p = comm.rank, comm.size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    dtype, algs, modes, notes = validate(args, spec, comm)
    op = args.op
    gloo = None
    if args.gloo:
        if op == "avg":
            notes.append("--gloo skipped: Gloo has no average reduction")
        else:
            gloo = Gloo.start(notes)
            if gloo is not None and not gloo.supports(dtype, op, notes):
                gloo.close()
                gloo = None
            elif gloo is not None:
                notes.append(f"gloo = torch {gloo.torch.__version__} dist.all_reduce over Gloo on "
                             "torch.from_numpy views: in place; out-of-place = out.copy_(inp) "
                             f"+ all_reduce(out); torch threads {gloo.torch.get_num_threads()}")
    sizes = make_sizes(args, spec, p, dtype.itemsize)
    env = environment(comm, args, gloo)

    labels = [a if a != "auto" or spec.picked is None else "auto->" + max(
        (spec.picked(comm, n) for n, _ in sizes), key=len) for a in algs]
    if gloo is not None:
        labels.append("gloo")
    table = Table(modes, max(len(x) for x in labels) + 1)
    say(f"# ringcoll bench: {spec.name}")
    say(f"# {env['command']}")
    say(f"# {env['mpi_library_version'].splitlines()[0]}; ringcoll {ringcoll.__version__}; "
        f"numpy {np.__version__}; python {platform.python_version()}")
    say(f"# {p} rank(s) on {len(set(env['hostnames']))} host(s) "
        f"({', '.join(sorted(set(env['hostnames'])))}), {len(comm.nodes)} ringcoll node(s)")
    say(f"# minBytes {args.minbytes} maxBytes {args.maxbytes} step: "
        + (f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)")
        + f" iters <={args.iters} warmup <={args.warmup_iters} budget {args.budget:g} s/size "
          f"rounds {args.rounds} check {args.check} dtype {_type_name(dtype)}"
        + (f" op {op}" if op else "") + (f" root {args.root}" if spec.rooted else ""))
    say(f"# algorithms: {', '.join(algs + (['gloo'] if gloo else []))}")
    for n in notes:
        say(f"# note: {n}")
    say("# time = max over ranks of the mean per call; algbw = size/time (GB/s = 1e9 B/s); "
        f"busbw = algbw x {spec.busbw_factor(p):.4g}")
    say("# vsMPI = native time / this time, same run and mode (> 1: faster than MPI's own)")
    say("#")
    for line in table.header():
        say(line)

    rows, start = [], time.perf_counter()
    progress = progress_printer(rank == 0 and not args.quiet)
    for i, (nbytes, count) in enumerate(sizes):
        case = Case(rank, p, count, dtype, op, args.root)
        runs = []
        for m in modes:
            for a in algs:
                picked = spec.picked(comm, nbytes, m == IN) if a == "auto" and spec.picked else None
                runs.append(Run(a, m, f"auto->{picked}" if picked else a, picked))
            if gloo is not None:
                runs.append(Run("gloo", m, "gloo"))
        iters, warm = measure(spec, comm, gloo, case, runs, args)
        progress(f"[{spec.name}] {i + 1}/{len(sizes)} {nbytes} B: {len(runs)} runs x "
                 f"{iters} iters (+{warm} warm-up), {time.perf_counter() - start:.1f} s elapsed")
        new = results_for_size(spec, case, runs, iters, warm, p)
        rows.extend(new)
        for line in table.rows(new):
            say(line)

    status = 0
    wrong = sum(r["wrong"] or 0 for r in rows)
    say(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
        + ("" if args.check else " (not checked: -c 0)"))
    if wrong:
        status = 1
    avg = {}
    for r in rows:
        avg.setdefault(r["label"].split("->")[0], []).append(r["busbw_GBps"])
    say("# Avg bus bandwidth (GB/s, all sizes and modes): "
        + "  ".join(f"{a} {np.mean(v):.3f}" for a, v in avg.items()))

    autos = auto_report(rows)
    if autos:
        say("#")
        say("# auto vs the best ringcoll algorithm measured at each size (same run; times are "
            "medians of the rounds):")
        say(f"# {'size':>11} {'mode':>12}  {'auto ran':<20} {'time(us)':>10}  "
            f"{'best measured':<20} {'time(us)':>10} {'auto/best':>9}  within 10%  "
            f"{'pick/best':>9}")
        for a in autos:
            pick = "-" if a["pick_over_best"] is None else f"{a['pick_over_best']:.2f}"
            say(f"# {a['size']:>11} {a['mode']:>12}  {a['picked']:<20} "
                f"{_fmt_time(a['auto_us']):>10}  {a['best']:<20} {_fmt_time(a['best_us']):>10} "
                f"{a['auto_over_best']:>9.2f}  {'yes' if a['within_10pct'] else 'NO ':<10}  "
                f"{pick:>9}")
        ok = sum(a["within_10pct"] for a in autos)
        picked = sum(a["picked_best"] for a in autos)
        pick_ok = sum(a["pick_over_best"] is not None and a["pick_over_best"] <= 1.10
                      for a in autos)
        say(f"# auto within 10% of the best at {ok}/{len(autos)} size-modes; it picked the "
            f"fastest measured algorithm at {picked}/{len(autos)}, and one within 10% of it "
            f"(pick/best: the picked algorithm's own row) at {pick_ok}/{len(autos)}")

    target = None
    if args.target_ratio is not None:
        checks = target_report(rows, args.target_ratio, args.target_min_bytes)
        failed = [c for c in checks if not c["passed"]]
        target = {"ratio": args.target_ratio, "min_bytes": args.target_min_bytes,
                  "checked": checks, "passed": bool(checks) and not failed}
        say("#")
        if not checks:
            say(f"# target FAILED: no size >= {args.target_min_bytes} B was measured with native")
        for c in failed:
            say(f"# target FAILED at {c['size']} B {c['mode']}: best ringcoll {c['best']} is "
                f"{c['ratio']:.2f}x native < {args.target_ratio:g}")
        if target["passed"]:
            worst = min(checks, key=lambda c: c["ratio"])
            say(f"# target passed: best ringcoll >= {args.target_ratio:g}x native at all "
                f"{len(checks)} size-modes >= {args.target_min_bytes} B (lowest "
                f"{worst['ratio']:.2f} at {worst['size']} B {worst['mode']})")
        elif status == 0:
            status = 3

    if rank == 0:
        doc = {"benchmark": spec.name, "environment": env,
               "parameters": {"minbytes": args.minbytes, "maxbytes": args.maxbytes,
                              "stepfactor": args.stepfactor, "stepbytes": args.stepbytes,
                              "iters_max": args.iters, "warmup_max": args.warmup_iters,
                              "budget_s": args.budget, "rounds": args.rounds,
                              "check": args.check, "dtype": _type_name(dtype), "op": op,
                              "root": args.root if spec.rooted else None,
                              "modes": list(modes), "algorithms": algs,
                              "gloo": gloo is not None,
                              "busbw_factor": spec.busbw_factor(p), "notes": notes},
               "results": rows, "auto": autos, "target": target,
               "wrong_total": wrong, "exit_status": status,
               "elapsed_s": time.perf_counter() - start}
        if args.json:
            _parent(args.json)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=_jsonable)
                f.write("\n")
        if args.csv:
            write_csv(args.csv, rows)
        if args.plot:
            write_plot(args.plot, spec, rows, env, _type_name(dtype), op)
        for path in (args.json, args.csv, args.plot):
            if path:
                print(f"# wrote {path}", flush=True)
    if gloo is not None:
        gloo.close()
    comm.close()
    return WORLD.bcast(status, root=0)


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)
