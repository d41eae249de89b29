"""mpiexec -n 2 python bench/torch_allreduce.py -b 8 -e 64M -f 2

torch.distributed.all_reduce over ringcoll's backend against Gloo, in one job: the default
group is init_process_group("ringcoll") (`import ringcoll.torch`), and beside it a Gloo group
of the same ranks, dist.new_group(backend="gloo"). Every size times both, interleaved.

  bytes   S = the float32 tensor on each rank (-d for another type); count = S / its size
  busbw   algbw x 2(p-1)/p, as bench/allreduce.py
  run     dist.all_reduce(t, op, group=g), in place (torch's only form), on a torch.from_numpy
          view of bench/harness.py's buffers
  check   the first call of each group at each size runs on fresh data, integer-valued floats
          (harness.Case: rank r's own pattern of 0..4 for sum), and every element on every
          rank is compared with the exact reduction; the timed calls after it reduce zeros
          (the identity), so repeated sums stay finite
  ratio   vsGloo = gloo time / this time, same size and run (> 1: faster than Gloo)

Measured as every bench/ script (harness.measure): a check call per group, the iteration count
fitted to --budget seconds per size (rank 0's decision, the same on every rank), warm-up, then
--rounds rounds, each timing a batch of each group in a shuffled order after a settling call and
a barrier; time = max over ranks of the mean per call.

Until ringcoll.torch imports, the ringcoll rows are skipped with a note (the default group is
then Gloo, and only the gloo rows are timed).

Exit status: 0 ok; 1 a wrong result; 2 bad arguments, or --target-ratio without the ringcoll
backend; 3 --target-ratio R missed: gloo time / ringcoll time < R at a size >= --target-min-bytes.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
import traceback

import numpy as np
from harness import (IN, WORLD, Case, Gloo, Run, Spec, Table, UsageError, _type_name,
                     add_sweep_arguments, make_sizes, measure, parse_size, resolve_dtype,
                     results_for_size)
from mpi4py import MPI
from ringcoll.tune import progress_printer

BACKENDS = ("ringcoll", "gloo")


class TorchGroup(Gloo):
    """dist.all_reduce on one process group (None: the default), on cached torch.from_numpy
    views of the harness's buffers (harness.Gloo's tensor())."""

    def __init__(self, dist, torch, group):
        super().__init__(dist, torch, store=None)
        self.group = group

    def allreduce(self, x, op, inp=None):
        t = self.tensor(x)
        if inp is not None and inp is not x:
            t.copy_(self.tensor(inp))
        self.dist.all_reduce(t, op=getattr(self.dist.ReduceOp, self.OPS[op]), group=self.group)

    def close(self):
        pass  # the groups are destroyed once, at the end


def make(c, inplace):
    x = c.data(c.rank)
    return x, x


def build_parser():
    p = argparse.ArgumentParser(
        prog="bench/torch_allreduce.py",
        description="torch.distributed all_reduce: ringcoll's backend against Gloo, same job.",
        epilog="Example: mpiexec -n 2 python bench/torch_allreduce.py -b 8 -e 64M -f 2")
    add_sweep_arguments(p)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check the first call of each group at each size (default 1)")
    p.add_argument("-d", "--dtype", default="float32", help="default float32")
    p.add_argument("-o", "--op", default="sum", choices=tuple(Gloo.OPS),
                   help="reduction (default sum)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed iterations per size, both groups together (default 1)")
    p.add_argument("--rounds", type=int, default=5,
                   help="round-robin rounds the iterations are split into (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default cores // ranks, at least 1)")
    p.add_argument("--target-ratio", type=float, default=None,
                   help="exit 3 if gloo time / ringcoll time < this at any size >= "
                        "--target-min-bytes")
    p.add_argument("--target-min-bytes", type=parse_size, default=0)
    p.add_argument("--json", metavar="FILE", help="every figure and the environment")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (they go to the terminal only)")
    return p


def start_groups(torch, dist, notes):
    """(ringcoll TorchGroup or None, gloo TorchGroup, where ringcoll.torch came from)."""
    why = origin = None
    try:
        import ringcoll.torch

        origin = ringcoll.torch.__file__
    except Exception as e:  # noqa: BLE001 - the backend is not there (yet)
        why = f"import ringcoll.torch failed: {type(e).__name__}: {e}"
    whys = [w for w in WORLD.allgather(why) if w]
    if whys:
        notes.append(f"ringcoll skipped: {whys[0]}")
        from torch_ddp import init_gloo

        init_gloo(dist, MPI)
        rc = None
    else:
        dist.init_process_group("ringcoll")
        rc = TorchGroup(dist, torch, None)
    if dist.get_rank() != WORLD.Get_rank() or dist.get_world_size() != WORLD.Get_size():
        raise RuntimeError("the default group's ranks are not MPI's")
    return rc, TorchGroup(dist, torch, dist.new_group(backend="gloo")), origin


def main(argv=None):
    try:
        return _main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except UsageError as e:
        if WORLD.Get_rank() == 0:
            print(f"bench/torch_allreduce.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:  # one rank failing must not leave the others waiting
        sys.stderr.write(f"[rank {WORLD.Get_rank()}] bench/torch_allreduce.py failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        WORLD.Abort(1)


def _main(argv):
    args = build_parser().parse_args(argv)
    rank, p = WORLD.Get_rank(), WORLD.Get_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if args.iters < 1 or args.warmup_iters < 0 or args.rounds < 1 or args.budget <= 0:
        raise UsageError("need -n >= 1, -w >= 0, --rounds >= 1 and --budget > 0")
    dtype = resolve_dtype(args.dtype)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    threads = args.threads if args.threads is not None else max(1, cores // p)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    notes = []
    rc, gloo, origin = start_groups(torch, dist, notes)
    if args.target_ratio is not None and rc is None:
        raise UsageError("--target-ratio needs the ringcoll backend, which did not import")
    backends = [b for b, g in zip(BACKENDS, (rc, gloo)) if g is not None]
    for name, g in (("ringcoll", rc), ("gloo", gloo)):
        if g is not None and not g.supports(dtype, args.op, notes):
            raise UsageError(f"{name} cannot all_reduce {_type_name(dtype)} with {args.op}: "
                             f"{notes[-1]}")
    spec = Spec(name="torch_allreduce", busbw_factor=lambda n: 2 * (n - 1) / n,
                algorithms=BACKENDS, default_algorithms=lambda comm: list(BACKENDS),
                make=make, run=lambda comm, x, y, a, c: rc.allreduce(y, c.op),
                expect=lambda c: c.reduced(), result=lambda x, y, c: y, modes=(IN,),
                reduces=True)
    sizes = make_sizes(args, spec, p, dtype.itemsize)

    command = f"mpiexec -n {p} python {shlex.join(sys.argv)}"
    mpi = MPI.Get_library_version().strip().splitlines()[0]
    import ringcoll

    say("# ringcoll bench: torch_allreduce (torch.distributed all_reduce, ringcoll vs gloo)")
    say(f"# {command}")
    say(f"# {mpi}; torch {torch.__version__}; ringcoll {ringcoll.__version__}; numpy "
        f"{np.__version__}; python {platform.python_version()}")
    say(f"# {p} rank(s), {cores} core(s) available; torch threads {torch.get_num_threads()}")
    if origin:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        mine = os.path.abspath(origin).startswith(here + os.sep)
        say(f"# ringcoll.torch from {origin}" + ("" if mine else f" (NOT this checkout, {here})"))
    say(f"# minBytes {args.minbytes} maxBytes {args.maxbytes} step: "
        + (f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)")
        + f" iters <={args.iters} warmup <={args.warmup_iters} budget {args.budget:g} s/size "
          f"rounds {args.rounds} check {args.check} dtype {_type_name(dtype)} op {args.op}")
    say("# ringcoll = the default group, init_process_group(\"ringcoll\"); gloo = "
        "dist.new_group(backend=\"gloo\") on the same ranks; all_reduce in place")
    set_env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RINGCOLL_")]
    say(f"# RINGCOLL_* set: {' '.join(set_env) or '(none)'}")
    for n in notes:
        say(f"# note: {n}")
    say("# time = max over ranks of the mean per call; algbw = size/time (GB/s = 1e9 B/s); "
        f"busbw = algbw x {spec.busbw_factor(p):.4g}")
    say("# vsGloo = gloo time / this time, same run (> 1: faster than Gloo)")
    say("#")
    table = Table((IN,), max(map(len, backends)) + 1, ratio_label="vsGloo")
    for line in table.header():
        say(line)

    rows, start = [], time.perf_counter()
    progress = progress_printer(rank == 0 and not args.quiet)
    for i, (nbytes, count) in enumerate(sizes):
        case = Case(rank, p, count, dtype, args.op, -1)
        runs = [Run(b, IN, b) for b in backends]
        iters, warm = measure(spec, None, gloo, case, runs, args)
        progress(f"[torch_allreduce] {i + 1}/{len(sizes)} {nbytes} B: {len(runs)} groups x "
                 f"{iters} iters (+{warm} warm-up), {time.perf_counter() - start:.1f} s elapsed")
        new = results_for_size(spec, case, runs, iters, warm, p)
        ref = next(r["time_us"] for r in new if r["algorithm"] == "gloo")
        for r in new:
            r["ratio_to_native"] = ref / r["time_us"] if r["time_us"] > 0 else None
            r["gloo_over_this"] = r["ratio_to_native"]
        rows.extend(new)
        for line in table.rows(new):
            say(line)

    status = 0
    wrong = sum(r["wrong"] or 0 for r in rows)
    say(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
        + ("" if args.check else " (not checked: -c 0)"))
    if wrong:
        status = 1
    say("# Avg bus bandwidth (GB/s, all sizes): " + "  ".join(
        f"{b} {np.mean([r['busbw_GBps'] for r in rows if r['algorithm'] == b]):.3f}"
        for b in backends))
    if rc is not None:
        mine = [r for r in rows if r["algorithm"] == "ringcoll"]
        ratios = [r["gloo_over_this"] for r in mine]
        say(f"# gloo/ringcoll time: median {np.median(ratios):.2f}, lowest {min(ratios):.2f} at "
            f"{mine[int(np.argmin(ratios))]['size']} B, highest {max(ratios):.2f} at "
            f"{mine[int(np.argmax(ratios))]['size']} B")
    target = None
    if args.target_ratio is not None:
        checked = [r for r in rows if r["algorithm"] == "ringcoll"
                   and r["size"] >= args.target_min_bytes]
        failed = [r for r in checked if r["gloo_over_this"] < args.target_ratio]
        target = {"ratio": args.target_ratio, "min_bytes": args.target_min_bytes,
                  "passed": bool(checked) and not failed,
                  "failed_sizes": [r["size"] for r in failed]}
        for r in failed:
            say(f"# target FAILED at {r['size']} B: ringcoll is {r['gloo_over_this']:.2f}x "
                f"faster than gloo < {args.target_ratio:g}")
        if not checked:
            say(f"# target FAILED: no size >= {args.target_min_bytes} B was measured")
        if target["passed"]:
            say(f"# target passed: gloo/ringcoll >= {args.target_ratio:g} at all "
                f"{len(checked)} sizes >= {args.target_min_bytes} B")
        elif status == 0:
            status = 3
    if rank == 0 and args.json:
        env = {"mpi_library_version": MPI.Get_library_version().strip(),
               "torch_version": torch.__version__, "torch_num_threads": torch.get_num_threads(),
               "ringcoll_version": ringcoll.__version__, "ringcoll_torch_file": origin,
               "ringcoll_env": {k: v for k, v in os.environ.items()
                                if k.startswith("RINGCOLL_")},
               "numpy_version": np.__version__, "python_version": sys.version,
               "platform": platform.platform(), "cpu_count": cores, "processes": p,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "command": command}
        doc = {"benchmark": "torch_allreduce", "environment": env, "notes": notes,
               "parameters": {k: getattr(args, k) for k in (
                   "minbytes", "maxbytes", "stepfactor", "stepbytes", "iters", "warmup_iters",
                   "check", "op", "budget", "rounds")} | {"dtype": _type_name(dtype)},
               "results": rows, "target": target, "wrong_total": wrong,
               "exit_status": status, "elapsed_s": time.perf_counter() - start}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        say(f"# wrote {args.json}")
    status = WORLD.bcast(status, root=0)
    dist.destroy_process_group()
    WORLD.Barrier()  # no rank exits (rank 0 serves gloo's store) while another tears down
    return status


if __name__ == "__main__":
    raise SystemExit(main())
