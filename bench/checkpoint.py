"""mpiexec -n 2 python bench/checkpoint.py [-b 1M] [-e 256M] [-f 4] [--repeats 5] [--dir D]

The cost of ringcoll's checkpoint protocol: ringcoll.save_checkpoint and load_checkpoint
against a plain np.save / np.load of the same bytes by one process, timed side by side in one
job.

  model   S bytes of float32 (the sweep -b .. -e, times -f each step) in --tensors equal 2-D
          tensors (default 8) of --cols columns (default 1024; fewer when a tensor is
          smaller), back to back in one flat buffer, deterministic random values
  layouts replicated  data parallel: every rank holds every tensor whole; only rank 0
                      writes (the others checksum their copies, as save does)
          sharded     each rank holds 1/p of every tensor, passed with shards=: the even
                      tensors as blocks of columns (ColumnParallelLinear), the odd ones as
                      blocks of rows (RowParallelLinear); every rank writes its own blocks,
                      in parallel, into its own shard file
          resharded   load only: the sharded checkpoint loaded whole (replicated) on every
                      rank, so each rank reads, checks and reassembles every rank's blocks
  bases   rank 0 alone, the other ranks waiting in a sleeping poll (an MPI barrier would
          spin and take a core from rank 0 when ranks outnumber cores):
          np.save        np.save(file, flat): one .npy of all S bytes (the flat buffer the
                         replicated tensors are views of, so nothing is concatenated)
          atomic np.save np.save into a new file beside the previous one, flush, os.fsync,
                         os.replace over it: the same bytes saved durably and atomically by
                         one process, which is what save_checkpoint does too (new files,
                         fsynced, renamed into place). A new file, not the same one
                         overwritten: on this VM's ext4 a rewrite of a file truncated in place
                         measured 6x faster than writing a new one (0.11 s against 0.66 s
                         for 256 MiB), which no atomic save can use
          np.load        np.load(file) of that .npy: a fresh array, read from the page cache
          np.load+crc32  np.load, then zlib.crc32 of the array (load_checkpoint checks the
                         crc32 of every piece it reads)
          Both sides replace their previous file / checkpoint at the same path.
  timing  per size: one untimed warm-up of every operation, then --repeats rounds, each
          running every operation once in a shuffled order (the same on every rank, new each
          round) behind a barrier; an operation's time = max over ranks of its wall time
          (the collective's time); the table gives the median over rounds. Each ratio is
          the median over rounds of the ratio within one round (side by side), so it is not
          exactly the ratio of the median times next to it.
  check   after every timed load, every element of every loaded array against the saved
          data (outside the timing; the destination is zeroed before each load); a wrong
          element is a wrong result (exit 1)
  columns bytes (the whole model, S), save and load ms, the baselines' ms, save/np.save,
          save/(atomic np.save), load/np.load, load/(np.load+crc32), and save / load GB/s
          (S / time, 10^9 B/s)

Targets (the script's own, as bench/overlap.py's and bench/textbook_ring.py's; bench/targets.py
holds the collectives'), at every size >= --target-min-bytes (default 64M), replicated layout:
  save  save / (atomic np.save) <= --target-save (1.5): both write S bytes once and fsync them.
  load  load / (np.load+crc32) <= --target-load (2.0). Not load / np.load <= 2, as first
        asked: no load that checks what it reads can meet that. zlib's crc32 runs at 2.5-4
        GB/s here, np.load from the page cache at 3.5-8 GB/s, so np.load+crc32 alone measured
        2-4x np.load (16 .. 256 MiB); and the protocol's all-or-nothing rule adds one copy
        (the staged arrays go into the parameters only once every rank has read everything).
        load / np.load is still printed.
  from 64 MiB, not 16 MiB as first asked: a save has a fixed cost besides the bytes (mkdir,
        the manifest and its fsync, two directory fsyncs, two renames), 2-4 ms here (save -
        atomic np.save at 1 MiB), and one crc32 pass, which overlaps the write only where a
        core is free; at 16 MiB (atomic np.save 11-13 ms) they come to 0.6-0.9x. At 64 MiB
        and above the bytes dominate (see bench/README.md, "Checkpoints", for the misses at
        -n 2 and 4 on 2 cores).
--target-min-bytes, --target-save and --target-load move them.

--poll SECONDS: the Communicator's exchanges wait with sleeps (Communicator(poll=...))
instead of spinning inside MPI; for more ranks than cores, where the spinning ranks take the
cores the writing and checksumming ranks need.

--profile: after the sweep, one more save and load of each layout at --profile-bytes
(default 64M) under cProfile on every rank; prints each rank's top functions by own time
(--profile-top, default 12), as a percentage of that operation's wall time.

Exit status: 0 ok; 1 a wrong result; 2 bad arguments; 3 a target missed (each printed).
"""

import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
import traceback
import zlib

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.tune import progress_printer
from harness import WORLD, _Parser, environment, parse_size
from ringcoll.checkpoint import shard

SAVES = ("replicated", "sharded")
LOADS = ("replicated", "sharded", "resharded")
BASES = ("np.save", "atomic np.save", "np.load", "np.load+crc32")
TARGET_EXIT = 3


def parse_args(argv):
    ap = _Parser(
        prog="bench/checkpoint.py",
        description="ringcoll.save_checkpoint / load_checkpoint against np.save / np.load of "
                    "the same bytes, timed side by side in one job.",
        epilog="Example: mpiexec -n 2 python bench/checkpoint.py -b 1M -e 256M -f 4")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"),
                    help="smallest model in bytes (K/M/G suffixes; default 1M)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"),
                    help="largest model in bytes (default 256M)")
    ap.add_argument("-f", "--stepfactor", type=int, default=4,
                    help="multiply the size by this each step (default 4)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds per size; the table gives medians (default 5)")
    ap.add_argument("--tensors", type=int, default=8, help="tensors in the model (default 8)")
    ap.add_argument("--cols", type=int, default=1024,
                    help="columns of each 2-D tensor, at most (default 1024)")
    ap.add_argument("--dir", default=None,
                    help="where to write (a fresh temporary directory is made inside it and "
                         "removed at the end; default: the system's temporary directory)")
    ap.add_argument("--target-save", type=float, default=1.5,
                    help="limit of replicated save / (atomic np.save) (default 1.5)")
    ap.add_argument("--target-load", type=float, default=2.0,
                    help="limit of replicated load / (np.load+crc32) (default 2.0)")
    ap.add_argument("--target-min-bytes", type=parse_size, default=parse_size("64M"),
                    help="judge the targets at sizes >= this (default 64M)")
    ap.add_argument("--poll", type=float, default=None, metavar="SECONDS",
                    help="Communicator(poll=SECONDS): the checkpoint's exchanges wait with "
                         "sleeps instead of spinning in MPI (for more ranks than cores)")
    ap.add_argument("--profile", action="store_true",
                    help="after the sweep, cProfile one save and load of each layout")
    ap.add_argument("--profile-bytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--json", metavar="FILE", help="every figure and the environment")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress lines (they go to the terminal only)")
    args = ap.parse_args(argv)
    if args.minbytes < 4 * args.tensors or args.maxbytes < args.minbytes:
        ap.error(f"need {4 * args.tensors} <= -b <= -e")
    if args.stepfactor < 2 or args.repeats < 1 or args.tensors < 1 or args.cols < 1:
        ap.error("-f must be >= 2, --repeats, --tensors and --cols >= 1")
    return args


def sizes(args):
    out, n = [], args.minbytes
    while n <= args.maxbytes:
        out.append(n)
        n *= args.stepfactor
    return out


# -- the model ---------------------------------------------------------------------------------
def blocks(n, p):
    """[start, stop) of each of p near-equal blocks of range(n)."""
    return [(r * n // p, (r + 1) * n // p) for r in range(p)]


class Model:
    """S bytes of float32 in `tensors` 2-D tensors: the whole of them (views of one flat
    buffer) and this rank's blocks of them (copies) with their shards."""

    def __init__(self, nbytes, tensors, max_cols, rank, p):
        per = nbytes // (4 * tensors)
        cols = min(max_cols, per)
        rows = per // cols
        self.shape = (rows, cols)
        self.flat = np.random.default_rng(nbytes).random(tensors * rows * cols,
                                                         dtype=np.float32)
        self.nbytes = self.flat.nbytes
        self.names = [f"layer{i}.weight" for i in range(tensors)]
        whole = self.flat.reshape(tensors, rows, cols)
        self.whole = {name: whole[i] for i, name in enumerate(self.names)}
        self.local, self.shards = {}, {}
        for i, name in enumerate(self.names):
            if i % 2 == 0:  # a column-parallel weight: a block of columns
                a, b = blocks(cols, p)[rank]
                index = (slice(None), slice(a, b))
            else:  # a row-parallel weight: a block of rows
                a, b = blocks(rows, p)[rank]
                index = (slice(a, b), slice(None))
            self.local[name] = np.ascontiguousarray(self.whole[name][index])
            self.shards[name] = shard(self.shape, index)
        self.dst_whole = {k: np.zeros_like(v) for k, v in self.whole.items()}
        self.dst_local = {k: np.zeros_like(v) for k, v in self.local.items()}

    def wrong(self, got, want):
        """Elements of got that differ from want, then got zeroed for the next load."""
        bad = 0
        for k in got:
            bad += int(np.count_nonzero(got[k] != want[k]))
            got[k].fill(0)
        return bad


# -- the operations ----------------------------------------------------------------------------
class Bench:
    def __init__(self, comm, folder):
        self.comm, self.folder = comm, folder
        self.rank = comm.rank
        self.paths = {"replicated": os.path.join(folder, "replicated"),
                      "sharded": os.path.join(folder, "sharded")}
        self.npy = os.path.join(folder, "baseline.npy")
        self.wrong = 0

    def operations(self, m):
        """{name: (fn, collective?, check)}: check() runs after fn, untimed."""
        comm, paths, npy = self.comm, self.paths, self.npy
        ops = {
            "save/replicated": (lambda: ringcoll.save_checkpoint(
                paths["replicated"], m.whole, comm=comm), True, None),
            "save/sharded": (lambda: ringcoll.save_checkpoint(
                paths["sharded"], m.local, comm=comm, shards=m.shards), True, None),
            "load/replicated": (lambda: ringcoll.load_checkpoint(
                paths["replicated"], m.dst_whole, comm=comm), True,
                lambda: m.wrong(m.dst_whole, m.whole)),
            "load/sharded": (lambda: ringcoll.load_checkpoint(
                paths["sharded"], m.dst_local, comm=comm, shards=m.shards), True,
                lambda: m.wrong(m.dst_local, m.local)),
            "load/resharded": (lambda: ringcoll.load_checkpoint(
                paths["sharded"], m.dst_whole, comm=comm), True,
                lambda: m.wrong(m.dst_whole, m.whole)),
            "np.save": (lambda: np.save(npy, m.flat), False, None),
            "atomic np.save": (lambda: save_atomic(npy, m.flat), False, None),
        }
        loaded = {}

        def np_load():
            loaded["a"] = np.load(npy)

        def np_check():
            a = loaded.pop("a")
            return int(a.shape != m.flat.shape or np.count_nonzero(a != m.flat))

        def np_load_crc():
            loaded["a"] = np.load(npy)
            zlib.crc32(loaded["a"])

        ops["np.load"] = (np_load, False, np_check)
        ops["np.load+crc32"] = (np_load_crc, False, np_check)
        return ops

    def time_op(self, op):
        """Wall time of one operation, the max over ranks (rank 0's alone for a baseline)."""
        fn, collective, check = op
        WORLD.Barrier()
        dt = 0.0
        if collective or self.rank == 0:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        if not collective:
            sleeping_barrier()
        if check is not None and (collective or self.rank == 0):
            self.wrong += check()
        return WORLD.allreduce(dt, op=MPI.MAX)


def save_atomic(path, a):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, a)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sleeping_barrier():
    """A barrier that waits without spinning: ranks idle during a baseline leave the cores to
    rank 0 (MPICH's barrier polls, which at -n 4 on 2 cores would slow rank 0)."""
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def measure(bench, m, args, log):
    """{operation: [seconds per round]}."""
    ops = bench.operations(m)
    order = ["save/replicated", "save/sharded", "np.save", "atomic np.save", "load/replicated",
             "load/sharded", "load/resharded", "np.load", "np.load+crc32"]
    for name in order:  # warm-up; also makes the files the loads read
        bench.time_op(ops[name])
    times = {name: [] for name in order}
    for r in range(args.repeats):
        for j in np.random.default_rng([m.nbytes, r]).permutation(len(order)):
            times[order[j]].append(bench.time_op(ops[order[j]]))
        log(f"{m.nbytes} B: round {r + 1}/{args.repeats} done")
    return times


# -- the table ---------------------------------------------------------------------------------
def med(xs):
    return float(np.median(xs))


def rows_for(nbytes, t, args):
    """One row per layout: median times (s) and median per-round ratios."""
    rows = []
    base = {b: med(t[b]) for b in BASES}
    for layout in LOADS:
        save = t.get(f"save/{layout}")
        load = t[f"load/{layout}"]
        row = {"bytes": nbytes, "layout": layout, "save_s": save and med(save),
               "load_s": med(load), **{f"{b}_s": base[b] for b in BASES},
               "save_s_rounds": save, "load_s_rounds": load,
               **{f"{b}_s_rounds": t[b] for b in BASES}}
        if save:
            row["save/np.save"] = med([s / b for s, b in zip(save, t["np.save"])])
            row["save/atomic np.save"] = med([s / b for s, b in zip(save, t["atomic np.save"])])
        else:
            row["save/np.save"] = row["save/atomic np.save"] = None
        row["load/np.load"] = med([s / b for s, b in zip(load, t["np.load"])])
        row["load/np.load+crc32"] = med([s / b for s, b in zip(load, t["np.load+crc32"])])
        row["save_GBps"] = nbytes / row["save_s"] / 1e9 if save else None
        row["load_GBps"] = nbytes / row["load_s"] / 1e9
        rows.append(row)
    return rows


def judge(rows, args):
    """[(bytes, what, ratio, limit)] of every missed target."""
    missed = []
    for row in rows:
        if row["layout"] != "replicated" or row["bytes"] < args.target_min_bytes:
            continue
        row["verdict"] = "PASS"
        for what, limit in (("save/atomic np.save", args.target_save),
                            ("load/np.load+crc32", args.target_load)):
            if row[what] > limit:
                missed.append((row["bytes"], what, row[what], limit))
                row["verdict"] = "MISS"
    return missed


HEADER = (f"{'bytes':>10} {'layout':<10} {'save ms':>9} {'load ms':>9} {'np.save':>9} "
          f"{'atomic':>9} {'np.load':>9} {'+crc32':>9} {'sv/npsv':>8} {'sv/atomic':>9} "
          f"{'ld/npld':>8} {'ld/+crc32':>9} "
          f"{'save GB/s':>9} {'load GB/s':>9}")


def fmt_row(row):
    def ms(x):
        return f"{'-':>9}" if x is None else f"{x * 1e3:9.2f}"

    def ratio(x, w=8):
        return f"{'-':>{w}}" if x is None else f"{x:{w}.2f}"

    gb = "-" if row["save_GBps"] is None else f"{row['save_GBps']:.2f}"
    return (f"{row['bytes']:>10} {row['layout']:<10} {ms(row['save_s'])} {ms(row['load_s'])} "
            f"{ms(row['np.save_s'])} {ms(row['atomic np.save_s'])} {ms(row['np.load_s'])} "
            f"{ms(row['np.load+crc32_s'])} {ratio(row['save/np.save'])} "
            f"{ratio(row['save/atomic np.save'], 9)} {ratio(row['load/np.load'])} "
            f"{ratio(row['load/np.load+crc32'], 9)} {gb:>9} {row['load_GBps']:9.2f}"
            + (f"  {row['verdict']}" if "verdict" in row else ""))


# -- profile -----------------------------------------------------------------------------------
def profile(bench, args, say):
    """One save and load of each layout at --profile-bytes under cProfile, on every rank."""
    m = Model(args.profile_bytes, args.tensors, args.cols, bench.rank, bench.comm.size)
    ops = bench.operations(m)
    for name in ("save/replicated", "save/sharded", "load/replicated", "load/sharded"):
        bench.time_op(ops[name])  # warm-up (and the files the loads read)
    report = {}
    for name in ("save/replicated", "load/replicated", "save/sharded", "load/sharded",
                 "load/resharded"):
        fn, _, check = ops[name]
        prof = cProfile.Profile()
        WORLD.Barrier()
        t0 = time.perf_counter()
        prof.runcall(fn)
        wall = time.perf_counter() - t0
        if check is not None:
            bench.wrong += check()
        st = pstats.Stats(prof)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:args.profile_top]
        mine = {"wall_s": wall, "top": [(_label(f), s[1], s[2], s[3]) for f, s in top]}
        report[name] = WORLD.gather(mine, root=0)
    say("#")
    say(f"# profile: cProfile of one call per operation at {m.nbytes} B, every rank; own time "
        "(tottime) of the top functions, % of that rank's wall time of the call")
    if bench.rank != 0:
        return report
    for name, per_rank in report.items():
        for r, rec in enumerate(per_rank):
            say(f"# {name}, rank {r}: {rec['wall_s'] * 1e3:.1f} ms")
            for label, ncalls, tottime, cumtime in rec["top"]:
                say(f"#   {100 * tottime / rec['wall_s']:5.1f}%  {tottime * 1e3:8.2f} ms own  "
                    f"{cumtime * 1e3:8.2f} ms cum  {ncalls:6d}x  {label}")
    return report


def _label(func):
    filename, line, name = func
    if filename == "~":
        return name  # a built-in: {built-in method zlib.crc32}
    parts = filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({name})"


# -- main --------------------------------------------------------------------------------------
def main(argv=None):
    rank = WORLD.Get_rank()
    try:
        return _main(argv)
    except SystemExit as e:  # argparse: -h or a usage error
        return e.code if isinstance(e.code, int) else 2
    except BaseException:  # a failure on one rank must not leave the others hanging
        sys.stderr.write(f"[rank {rank}] bench/checkpoint.py failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        WORLD.Abort(1)


def _main(argv):
    args = parse_args(argv)
    start = time.perf_counter()
    comm = ringcoll.Communicator(poll=args.poll)
    rank, p = comm.rank, comm.size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    progress = progress_printer(rank == 0 and not args.quiet)

    def log(msg):
        progress(f"[checkpoint {time.perf_counter() - start:6.1f} s] {msg}")

    folder = None
    if rank == 0:
        folder = tempfile.mkdtemp(prefix="ringcoll-ckpt-bench-", dir=args.dir)
    folder = WORLD.bcast(folder, root=0)
    bench = Bench(comm, folder)
    env = environment(comm, args, None)
    rows, prof = [], None
    try:
        say("# ringcoll checkpoint bench: save_checkpoint / load_checkpoint against np.save / "
            "np.load of the same bytes on rank 0")
        say(f"# {env['command']}")
        say(f"# {env['mpi_library_version'].splitlines()[0]}; ringcoll {ringcoll.__version__}; "
            f"numpy {np.__version__}; git {env['git_commit']}")
        say(f"# {p} rank(s) on {len(set(env['hostnames']))} host(s); {args.tensors} float32 "
            f"tensors of <= {args.cols} columns; repeats {args.repeats}; poll {args.poll}; "
            f"dir {folder} ({_fs_type(folder)})")
        say("# time = max over ranks, median over rounds (ms); ratios = median of per-round "
            "ratios; GB/s = bytes / time (1e9 B/s)")
        say("# baselines: rank 0 alone; np.save of one .npy of all bytes; atomic np.save: into a "
            "new file, fsync, rename over the previous; np.load of it")
        say("# layouts: replicated (rank 0 writes), sharded (1/p of each tensor per rank, all "
            "write), resharded (sharded checkpoint loaded whole on every rank)")
        say("#")
        say(HEADER)
        for n in sizes(args):
            m = Model(n, args.tensors, args.cols, rank, p)
            t = measure(bench, m, args, log)
            new = rows_for(m.nbytes, t, args)
            judge(new, args)
            for row in new:
                say(fmt_row(row))
            rows += new
            del m
            if rank == 0:
                for path in bench.paths.values():
                    shutil.rmtree(path, ignore_errors=True)
            WORLD.Barrier()
        if args.profile:
            prof = profile(bench, args, say)
    finally:
        WORLD.Barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    wrong = WORLD.allreduce(bench.wrong)
    missed = judge(rows, args)
    say("#")
    judged = [r for r in rows if "verdict" in r]
    if not judged:
        say(f"# target: no size >= {args.target_min_bytes} B; nothing judged")
    for nbytes, what, ratio, limit in missed:
        say(f"# MISS: replicated {what} = {ratio:.2f} > {limit:.2f} at {nbytes} B")
    status = 1 if wrong else TARGET_EXIT if missed else 0
    say(f"# target: replicated save <= {args.target_save:g} x (atomic np.save) and load <= "
        f"{args.target_load:g} x (np.load+crc32) at >= {args.target_min_bytes} B: "
        f"{len(judged)} size(s) judged, {len(missed)} miss(es); wrong elements: {wrong}; "
        f"{time.perf_counter() - start:.1f} s; exit {status}")
    if rank == 0 and args.json:
        doc = {"benchmark": "checkpoint", "environment": env, "parameters": vars(args),
               "rows": rows, "missed": [{"bytes": b, "ratio": w, "value": r, "limit": lim}
                                        for b, w, r, lim in missed],
               "profile": prof, "wrong_total": wrong, "exit_status": status}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        say(f"# wrote {args.json}")
    comm.close()
    return WORLD.bcast(status, root=0)


def _fs_type(folder):
    """The filesystem type of folder, from /proc/mounts (longest mount point prefix)."""
    try:
        best, kind = "", "?"
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype = line.split()[:3]
                if (folder + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                    best, kind = mount, fstype
        return kind
    except OSError:
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
