"""python bench/torch_ddp.py --nprocs 2 --width 1024 --repeats 5   (or --all)

DistributedDataParallel training step over ringcoll's torch.distributed backend, against Gloo
and against no communication at all. The same model is trained in three modes:

  gloo      DDP over torch.distributed's Gloo backend
  ringcoll  DDP over ringcoll's backend (`import ringcoll.torch`; init_process_group("ringcoll"))
  none      no process group: the plain model, compute alone, each rank its own process

The model: nn.Linear(W, W), ReLU, nn.Linear(W, W), ReLU, nn.Linear(W, 10), input dim W, batch
32, cross-entropy loss, torch.optim.SGD (lr 0.01). W=1024: 2,109,450 parameters (8.4 MB of
float32 gradients); W=4096: 33,603,594 (134 MB). Every rank has its own fixed random batches.

Step time = the median over --steps timed steps, after --warmup steps, of one
forward + backward + optimizer step on each rank (zero_grad is outside the timed span), then the
max over ranks of those medians. DDP's backward returns only when every bucket's all-reduce has
finished, so the communication is inside the step.

This file is both the driver and the worker. The driver (no --worker) launches
  mpiexec -n P python bench/torch_ddp.py --worker MODE ...
once per mode, in the order gloo, ringcoll, none, and that --repeats times, back to back (so
the machine's noise reaches every mode alike), each launch under a deadline (--launch-timeout;
its whole process group is killed past it). Per mode it reports the median of the launches'
step times and the ratios ringcoll/none and ringcoll/gloo, judged against the targets:

  -n 2, width 1024:  ringcoll <= 1.10 x none   and <= 0.70 x gloo
  -n 2, width 4096:  ringcoll <= 1.15 x none   and <= 0.68 x gloo
  -n 4, width 1024:  ringcoll <= 1.10 x none   and <= 0.60 x gloo

--device cuda: the model, batches and gradients on the GPU (rank r on GPU
local_rank mod the GPUs it sees, so ranks may share one), DDP given that device, each timed
span closed by torch.cuda.synchronize; gloo all-reduces CUDA tensors through the host, ringcoll
through its CuPy path. Target there (the GPU training issue's):

  -n 2, width 1024, cuda:  ringcoll <= 0.50 x gloo   (none: reported, not judged)

(--all runs the CPU three; --target-none/--target-gloo replace the limits; another -n/width has
no target unless given.)

Checks, in the gloo and ringcoll modes: on the first step, DDP's averaged gradients against
a plain copy of the model's local gradients all-reduced by mpi4py in float64 (relative error
<= 1e-5 of each tensor's largest element); after training, the parameters of every rank
bitwise identical (sha256 of their bytes). A failed check, or a launch that fails or hangs,
is a wrong result.

--timeline: one more ringcoll launch per configuration (its times are not counted) whose DDP
carries a comm hook wrapping the default all-reduce hook; it records, for one step, when each
bucket's all-reduce was handed over (the hook's call) and when its future completed (fut.then),
in ms after backward began, next to when backward ended: overlap is visible as buckets that
finish before backward ends.

cpu/wall (per launch, max over ranks): the CPU time of all the rank's threads over the timed
steps divided by their wall time; above the torch thread count, something else (a
communication thread polling, say) kept a core busy; well below 1, other jobs starved the rank
(the timings are then noise).

Threads: torch.set_num_threads(--threads) in every mode alike (default: cores // nprocs, at
least 1), and OMP_NUM_THREADS the same. RINGCOLL_* variables of the caller's environment are
dropped from the launches (listed in the header); --env KEY=VALUE passes one on purpose.

Exit status: 0 every target met; 3 a target missed (each miss printed); 1 a wrong result or a
failed launch; 2 bad arguments, or the ringcoll backend cannot be imported (its launches are
skipped with the reason, and the targets are not judged).
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
MODES = ("gloo", "ringcoll", "none")
CLASSES = 10
RESULT = "@@torch_ddp-result "  # the worker's one line of JSON on stdout (rank 0)

# (nprocs, width) -> (limit of ringcoll/none, limit of ringcoll/gloo), from the issue
TARGETS = {(2, 1024): (1.10, 0.70), (2, 4096): (1.15, 0.68), (4, 1024): (1.10, 0.60)}
TARGETS_CUDA = {(2, 1024): (None, 0.50)}
ALL = ((2, 1024), (2, 4096), (4, 1024))


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def find_mpiexec():
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH (as
    tests/_mpirun.py)."""
    import shutil

    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpi_library_version():
    """MPI_Get_library_version, which MPI allows before MPI_Init: the driver never inits MPI."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        return MPI.Get_library_version().strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001 - only for the header
        return f"unknown ({type(e).__name__}: {e})"


# -- worker ---------------------------------------------------------------------------------
def build_model(torch, width):
    nn = torch.nn
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def init_gloo(dist, MPI):
    """What torchrun would set, from MPI: rank 0 picks a free port (bound to port 0 and
    released, then broadcast: a small race with other jobs, which init would report)."""
    import socket

    world = MPI.COMM_WORLD
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(world.Get_rank()), WORLD_SIZE=str(world.Get_size()))
    dist.init_process_group("gloo")


def pick_device(torch, name, world, MPI):
    """(device, sync): sync() waits for the device's queued work and returns perf_counter.
    On CUDA each rank takes GPU local_rank mod the GPUs it sees (its rank among the ranks of
    its node), so ranks share a GPU when there are fewer GPUs than ranks."""
    if name == "cpu":
        return torch.device("cpu"), time.perf_counter
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() "
                           "is False); run on a machine with one, or use --device cpu")
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
    local.Free()
    torch.cuda.set_device(device)

    def sync():
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return device, sync


def grad_check(torch, ddp, x, y, world, MPI):
    """The DDP gradients of the step just run (no optimizer step yet) against the local
    gradients of a plain copy, summed by mpi4py in float64 and divided by p: the largest
    relative error over the tensors (error / the tensor's largest magnitude)."""
    import copy

    import numpy as np

    ref = copy.deepcopy(ddp.module)
    ref.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    worst = 0.0
    for (name, p_ddp), p_ref in zip(ddp.module.named_parameters(), ref.parameters()):
        local = p_ref.grad.detach().cpu().numpy().astype(np.float64)
        total = np.empty_like(local)
        world.Allreduce(local, total, op=MPI.SUM)
        want = total / world.Get_size()
        got = p_ddp.grad.detach().cpu().numpy().astype(np.float64)
        scale = max(float(np.abs(want).max()), 1e-30)
        worst = max(worst, float(np.abs(got - want).max()) / scale)
    return worst


def worker(args):
    mode = args.worker
    why_not = origin = None
    if mode == "ringcoll":
        try:
            import ringcoll.torch  # registers backend "ringcoll", fills MASTER_*

            origin = ringcoll.torch.__file__
        except Exception as e:  # noqa: BLE001 - not there (yet): skip, with the reason
            why_not = f"import ringcoll.torch failed: {type(e).__name__}: {e}"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    whys = [w for w in world.allgather(why_not) if w]
    if whys:
        if rank == 0:
            print(RESULT + json.dumps({"mode": mode, "skipped": whys[0]}), flush=True)
        return 0
    try:
        return _worker(args, mode, world, MPI, origin)
    except BaseException:  # one rank failing must not leave the others waiting
        import traceback

        sys.stderr.write(f"[rank {rank}] torch_ddp worker ({mode}) failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)


def _worker(args, mode, world, MPI, origin):
    import hashlib

    import torch
    import torch.distributed as dist

    rank, p = world.Get_rank(), world.Get_size()
    torch.set_num_threads(args.threads)
    device, sync = pick_device(torch, args.device, world, MPI)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts anyway)
    model = build_model(torch, args.width).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    batches = [(torch.randn(args.batch, args.width, generator=gen).to(device),
                torch.randint(0, CLASSES, (args.batch,), generator=gen).to(device))
               for _ in range(4)]

    ddp = None
    if mode == "gloo":
        init_gloo(dist, MPI)
    elif mode == "ringcoll":
        dist.init_process_group("ringcoll")
    if mode != "none":
        if dist.get_world_size() != p or dist.get_rank() != rank:
            raise RuntimeError(f"process group rank {dist.get_rank()}/{dist.get_world_size()} "
                               f"is not MPI's {rank}/{p}")
        # bucket_cap_mb left unset unless asked for: DDP's default then also gives the first
        # bucket of its rebuild 1 MiB (any explicit value, 25 included, turns that off)
        cap = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        if device.type == "cuda":
            cap["device_ids"] = [device.index]
        ddp = torch.nn.parallel.DistributedDataParallel(model, **cap)
    net = ddp if ddp is not None else model
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)

    timeline = []  # (bucket index, bytes, handed over, completed), perf_counter seconds
    if args.timeline and ddp is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            t_call = time.perf_counter()
            index, buf = bucket.index(), bucket.buffer()
            nbytes = buf.numel() * buf.element_size()

            def done(fut):
                timeline.append((index, nbytes, t_call, time.perf_counter()))
                return fut.value()

            return default_hooks.allreduce_hook(state, bucket).then(done)

        ddp.register_comm_hook(None, hook)  # state None: the default group, as DDP's own

    steps, marks, grad_err = [], [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # the CPU time of the timed span, every thread of this process
            cpu0, wall0 = time.process_time(), time.perf_counter()
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        del timeline[:]
        t0 = sync()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        t1 = sync()
        loss.backward()
        t2 = sync()
        if i == 0 and ddp is not None:  # before the update changes the weights
            grad_err = grad_check(torch, ddp, x, y, world, MPI)
        opt.step()
        t3 = sync()
        if i >= args.warmup:
            steps.append(t3 - t0)
            marks = [(t0, t1, t2, t3), sorted(timeline)]  # the last step's timeline is kept
    busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    final_loss = float(loss)

    median = statistics.median(steps)
    medians = world.gather(median, root=0)
    digest = None
    if ddp is not None:
        h = hashlib.sha256()
        for t in net.module.parameters():
            h.update(t.detach().cpu().numpy().tobytes())
        digest = h.hexdigest()
    digests = world.gather(digest, root=0)
    errs = world.gather(grad_err, root=0)
    lines = world.gather(marks if args.timeline else None, root=0)
    losses = world.gather(final_loss, root=0)
    busies = world.gather(busy, root=0)
    if rank == 0:
        mpi_version = MPI.Get_library_version().strip().splitlines()[0]
        out = {"mode": mode, "nprocs": p, "width": args.width,
               "params": sum(t.numel() for t in model.parameters()),
               "step_s": max(medians), "step_s_per_rank": medians,
               "cpu_over_wall": max(busies), "cpu_over_wall_per_rank": busies,
               "steps": args.steps, "warmup": args.warmup,
               "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
               "mpi_library_version": mpi_version, "final_loss": losses,
               "device": str(device), "ddp": ddp is not None, "identical": None, "grad_rel_err": None,
               "backend_file": origin}
        if ddp is not None:
            out["identical"] = len(set(digests)) == 1
            out["sha256"] = digests
            out["grad_rel_err"] = max(errs)
            data = ddp._get_ddp_logging_data()
            out["buckets"] = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes"))
            if args.timeline:
                out["timeline"] = lines
        print(RESULT + json.dumps(out), flush=True)
    if ddp is not None:
        # gloo's rendezvous store is served by rank 0: a rank still tearing its group down
        # when rank 0 exits aborts in C++ ('terminate called without an active exception',
        # one launch in five on 2 cores). Every rank destroys, then all leave together.
        world.Barrier()
        dist.destroy_process_group()
        world.Barrier()
    return 0


# -- driver ---------------------------------------------------------------------------------
def threads_for(args, nprocs):
    return args.threads if args.threads is not None else max(1, cores() // nprocs)


def launch_env(args, nprocs):
    """The caller's environment without its RINGCOLL_* variables (reported), plus --env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOLL_")}
    given = {kv.partition("=")[0] for kv in args.env}
    dropped = sorted(k for k in os.environ if k.startswith("RINGCOLL_") and k not in given)
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    env.update(OMP_NUM_THREADS=str(threads_for(args, nprocs)), PYTHONUNBUFFERED="1")
    pp = [str(ROOT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pp))  # ringcoll from this checkout
    return env, dropped


def worker_argv(args, nprocs, width, mode, timeline=False):
    cmd = [args.mpiexec, "-n", str(nprocs), sys.executable, str(HERE.relative_to(ROOT)),
           "--worker", mode, "--width", str(width), "--steps", str(steps_for(args, width)),
           "--warmup", str(args.warmup), "--threads", str(threads_for(args, nprocs)),
           "--batch", str(args.batch), "--lr", str(args.lr), "--seed", str(args.seed),
           "--device", args.device]
    if args.bucket_cap_mb is not None:
        cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    return cmd + (["--timeline", "1"] if timeline else [])


def steps_for(args, width):
    return args.steps if args.steps else (100 if width <= 2048 else 30)


def run_launch(cmd, env, timeout):
    """One mpiexec job; (result dict or None, output, seconds). Past the deadline the job's
    whole process group is killed (it runs in a session of its own)."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=str(ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out + f"\n*** killed after the {timeout:g} s deadline ***", \
            time.time() - start
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
    if proc.returncode != 0:
        result = None
    return result, out, time.time() - start


def tail(text, n=30):
    return "\n".join("#   " + x for x in text.rstrip().splitlines()[-n:])


def notes(result, seen):
    """Once per configuration: where ringcoll.torch came from, and DDP's buckets."""
    where = result.get("backend_file")
    if where and where not in seen:
        seen.add(where)
        mine = Path(where).resolve().is_relative_to(ROOT)
        print(f"# note: ringcoll.torch imported from {where}"
              + ("" if mine else f" (NOT this checkout, {ROOT})"))
    buckets = result.get("buckets")
    if buckets and "buckets" not in seen:
        seen.add("buckets")
        print(f"# note: DDP's buckets after its rebuild (bytes): {buckets}")


def print_timeline(result):
    print(f"# timeline of one {result['mode']} step (the last timed one; ms after backward "
          "began):")
    for rank, marks in enumerate(result.get("timeline") or []):
        if not marks:
            continue
        (t0, t1, t2, t3), buckets = marks
        print(f"#   rank {rank}: forward {1e3 * (t1 - t0):.2f} ms, backward {1e3 * (t2 - t1):.2f}"
              f" ms, optimizer {1e3 * (t3 - t2):.2f} ms")
        print(f"#   {'bucket':>6} {'bytes':>11} {'started':>9} {'finished':>9} "
              f"{'backward ended at':>18}")
        for index, nbytes, start, end in buckets:
            print(f"#   {index:>6} {nbytes:>11} {1e3 * (start - t1):>9.2f} "
                  f"{1e3 * (end - t1):>9.2f} {1e3 * (t2 - t1):>18.2f}")
        if buckets:
            last = max(start for _, _, start, _ in buckets)
            busy = sum(end - start for *_, start, end in buckets)
            print(f"#   last bucket handed over at {1e3 * (last - t1):.2f} ms; backward ended "
                  f"{1e3 * (t2 - last):.2f} ms later (communication no compute was left to "
                  f"hide); all-reduces in flight {1e3 * busy:.2f} ms in all")


def run_config(args, nprocs, width, limits):
    """All launches of one (nprocs, width); returns a summary dict."""
    env, _ = launch_env(args, nprocs)
    cmd = worker_argv(args, nprocs, width, "MODE")
    print(f"# -n {nprocs}, width {width}: {steps_for(args, width)} timed steps after "
          f"{args.warmup} warm-up, {args.repeats} launches per mode, threads "
          f"{threads_for(args, nprocs)} per rank")
    print(f"# launch: {shlex.join(cmd)}")
    times = {m: [] for m in args.modes}
    info, wrong, skipped, seen = {}, [], None, set()
    print(f"# {'launch':>6} {'mode':<9} {'step (ms)':>10} {'per rank (ms)':<30} "
          f"{'cpu/wall':>8} {'wall (s)':>8}  checks")
    for rep in range(args.repeats):
        for mode in args.modes:
            if mode == "ringcoll" and skipped:
                continue
            result, out, wall = run_launch(worker_argv(args, nprocs, width, mode), env,
                                           args.launch_timeout)
            if result is None:
                wrong.append(f"FAILED: {mode} launch {rep + 1}")
                print(f"# {rep + 1:>6} {mode:<9} FAILED after {wall:.1f} s; its output:")
                print(tail(out))
                continue
            if result.get("skipped"):
                skipped = result["skipped"]
                print(f"# {rep + 1:>6} {mode:<9} skipped: {skipped}")
                continue
            info = result
            notes(result, seen)
            times[mode].append(result["step_s"])
            checks = "-"
            if result["ddp"]:
                ok = result["identical"] and result["grad_rel_err"] <= 1e-5
                checks = (f"replicas {'identical' if result['identical'] else 'DIFFER'}, "
                          f"grad rel err {result['grad_rel_err']:.1e}"
                          f"{'' if result['grad_rel_err'] <= 1e-5 else ' (> 1e-5: WRONG)'}")
                if not ok:
                    wrong.append(f"WRONG: {mode} launch {rep + 1}: {checks}")
            per_rank = " ".join(f"{1e3 * t:.2f}" for t in result["step_s_per_rank"])
            print(f"# {rep + 1:>6} {mode:<9} {1e3 * result['step_s']:>10.2f} {per_rank:<30} "
                  f"{result['cpu_over_wall']:>8.2f} {wall:>8.1f}  {checks}", flush=True)
    for mode in args.timeline:
        if mode == "ringcoll" and skipped:
            continue
        result, out, wall = run_launch(worker_argv(args, nprocs, width, mode, True), env,
                                       args.launch_timeout)
        if result is None:
            wrong.append(f"FAILED: {mode} --timeline launch")
            print(f"# {mode} timeline launch FAILED; its output:")
            print(tail(out))
        elif not result.get("skipped"):
            notes(result, seen)
            print(f"# {mode} timeline launch (not counted): step {1e3 * result['step_s']:.2f} ms")
            print_timeline(result)
    med = {m: statistics.median(v) for m, v in times.items() if v}
    summary = {"nprocs": nprocs, "width": width, "params": info.get("params"),
               "median_s": med, "launch_s": times, "wrong": wrong, "skipped": skipped,
               "misses": [], "ratios": {}, "judged": 0}
    print(f"# {'mode':<9} {'median step (ms)':>16}   launches (ms)")
    for m in args.modes:
        if m in med:
            print(f"# {m:<9} {1e3 * med[m]:>16.2f}   "
                  + " ".join(f"{1e3 * t:.2f}" for t in times[m]))
    lim_none, lim_gloo = limits
    for other, limit in (("none", lim_none), ("gloo", lim_gloo)):
        if "ringcoll" not in med or other not in med:
            continue
        ratio = med["ringcoll"] / med[other]
        summary["ratios"][other] = ratio
        summary["judged"] += limit is not None
        verdict = "" if limit is None else f" (target <= {limit:.2f}: " + \
            ("PASS)" if ratio <= limit else "MISS)")
        if limit is not None and ratio > limit:
            summary["misses"].append(f"-n {nprocs} width {width}: ringcoll/{other} "
                                     f"{ratio:.3f} > {limit:.2f}")
        print(f"# ringcoll/{other:<5} = {ratio:.3f}{verdict}")
    if skipped:
        print(f"# ringcoll skipped ({skipped}): targets not judged")
    print("#")
    return summary


def driver(args):
    if args.mpiexec is None:
        print("torch_ddp.py: no mpiexec next to this Python or on PATH", file=sys.stderr)
        return 2
    configs = ALL if args.all else ((args.nprocs, args.width),)
    _, dropped = launch_env(args, 1)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_ddp.py: --device cuda, but torch sees no CUDA GPU "
              "(torch.cuda.is_available() is False); use --device cpu", file=sys.stderr)
        return 2
    print("# ringcoll bench: torch_ddp (DDP training step: gloo, ringcoll, none)")
    print(f"# command: {shlex.join([Path(sys.executable).name] + sys.argv)}")
    print(f"# torch {torch.__version__}; {mpi_library_version()}; python "
          f"{sys.version.split()[0]}; {cores()} core(s) available")
    threads = (f"{args.threads}" if args.threads is not None else
               f"cores // nprocs = {', '.join(str(threads_for(args, n)) for n, _ in configs)}")
    print(f"# settings: device {args.device}, threads {threads} per rank (torch.set_num_threads and "
          f"OMP_NUM_THREADS, every mode), batch {args.batch}, model Linear(W,W)-ReLU-"
          f"Linear(W,W)-ReLU-Linear(W,{CLASSES}), cross-entropy, SGD lr {args.lr}, DDP "
          f"bucket_cap_mb {args.bucket_cap_mb or 'default'}, modes in order "
          f"{', '.join(args.modes)}")
    print("# step = median over timed steps of forward+backward+optimizer step, max over "
          "ranks; per mode: median over launches")
    print("# cpu/wall = CPU time of all a rank's threads over the timed steps / their wall "
          "time, max over ranks (1.0: one core busy the whole time)")
    print(f"# RINGCOLL_* dropped from the launches: {', '.join(dropped) or '(none set)'}; "
          f"--env: {' '.join(args.env) or '(none)'}")
    print("#")
    summaries = []
    for nprocs, width in configs:
        given = (args.target_none, args.target_gloo)
        table = (TARGETS if args.device == "cpu" else TARGETS_CUDA).get((nprocs, width),
                                                                        (None, None))
        limits = tuple(g if g is not None else t for g, t in zip(given, table))
        summaries.append(run_config(args, nprocs, width, limits))
    if len(summaries) > 1:
        print(f"# {'config':<18} {'params':>11} {'none ms':>9} {'gloo ms':>9} "
              f"{'ringcoll ms':>11} {'rc/none':>8} {'rc/gloo':>8}")
        for s in summaries:
            m = {k: f"{1e3 * s['median_s'][k]:.2f}" if k in s["median_s"] else "-"
                 for k in MODES}
            r = {k: f"{s['ratios'][k]:.3f}" if k in s["ratios"] else "-" for k in ("none",
                                                                                 "gloo")}
            print(f"# -n {s['nprocs']} width {s['width']:<6} {s['params'] or '-':>11} "
                  f"{m['none']:>9} {m['gloo']:>9} {m['ringcoll']:>11} {r['none']:>8} "
                  f"{r['gloo']:>8}")
    wrong = [w for s in summaries for w in s["wrong"]]
    misses = [x for s in summaries for x in s["misses"]]
    skipped = next((s["skipped"] for s in summaries if s["skipped"]), None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "configs": summaries, "dropped_env": dropped}, f,
                      indent=1)
            f.write("\n")
    for w in wrong:
        print(f"# {w}")
    for x in misses:
        print(f"# target MISSED: {x}")
    if wrong:
        return 1
    if skipped and "ringcoll" in args.modes:
        print("# targets not judged: the ringcoll backend is not available")
        return 2
    if misses:
        return 3
    judged = sum(s["judged"] for s in summaries)
    print(f"# all {judged} targets met" if judged else "# no target judged (none for this "
          "configuration: --target-none / --target-gloo set one)")
    return 0


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: python bench/torch_ddp.py --nprocs 2 "
                                        "--width 1024 --repeats 5")
    ap.add_argument("--nprocs", "-n", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--width", type=int, default=1024, help="W (default 1024)")
    ap.add_argument("--all", action="store_true",
                    help="the issue's three configurations: -n 2 W 1024, -n 2 W 4096, "
                         "-n 4 W 1024")
    ap.add_argument("--repeats", type=int, default=5, help="launches per mode (default 5)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per launch (default 100 at width <= 2048, else 30)")
    ap.add_argument("--warmup", type=int, default=10,
                    help="untimed steps first, at least 2 (default 10)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads in every mode (default cores // nprocs, >= 1)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and its gradients live (default cpu)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb (default: DDP's own, 25 MiB with a 1 MiB first "
                         "bucket)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma list, the launch order (default gloo,ringcoll,none)")
    ap.add_argument("--target-none", type=float, default=None,
                    help="limit of ringcoll/none (default: the issue's, per configuration)")
    ap.add_argument("--target-gloo", type=float, default=None,
                    help="limit of ringcoll/gloo (default: the issue's, per configuration)")
    ap.add_argument("--timeline", nargs="?", const="ringcoll", default="", metavar="MODES",
                    help="one extra launch (default: of ringcoll; or a comma list of gloo, "
                         "ringcoll) recording when each DDP bucket's all-reduce ran")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the launches (e.g. RINGCOLL_ALGO=ring)")
    ap.add_argument("--launch-timeout", type=float, default=600.0,
                    help="seconds one mpiexec launch may take (default 600)")
    ap.add_argument("--mpiexec", default=None, help="default: the one next to this Python")
    ap.add_argument("--json", metavar="FILE", help="every launch's figures to a file")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        ap.error(f"--modes takes a comma list of distinct {', '.join(MODES)}")
    args.modes = tuple(modes)
    if args.worker is None:
        args.timeline = tuple(m.strip() for m in args.timeline.split(",") if m.strip())
        if any(m not in ("gloo", "ringcoll") for m in args.timeline):
            ap.error("--timeline takes gloo, ringcoll or both")
    if args.repeats < 1 or args.warmup < 2 or (args.steps is not None and args.steps < 1):
        ap.error("need --repeats >= 1, --warmup >= 2 (the first step holds the checks, the "
                 "second DDP's bucket rebuild) and --steps >= 1")
    if any("=" not in kv for kv in args.env):
        ap.error("--env takes KEY=VALUE")
    if args.worker is not None and args.threads is None:
        args.threads = 1
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.worker is None and args.mpiexec is None:
        args.mpiexec = find_mpiexec()
    return args


def main(argv=None):
    args = parse(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
