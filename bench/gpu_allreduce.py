"""mpiexec -n 2 python bench/gpu_allreduce.py -b 1M -e 64M -f 4 --json gpu.json

All-reduce on GPU buffers (CuPy), against the bounds that limit it, all measured in one run.
Every rank uses GPU (node-local rank % GPUs): on a one-GPU machine all ranks share it.

Rows, per size n (bytes per rank), each timed round-robin in the same rounds:
  ringcoll <path> <algorithm>  comm.allreduce on CuPy arrays (out of place), <path> being how
                    the algorithm moves device buffers: "node tier" for auto and node on one
                    node (CUDA IPC, docs/node_tier.md), else what ringcoll chose for messages
                    (staged or cuda-aware, see docs/gpu.md); with --staging-bytes, also the
                    staged path forced, per chunk size
  ringcoll node tier registered  in place on a registered buffer (comm.shared_array with
                    xp=cupy): no copy into the tier's slots
  copy bound        D2H and H2D of V bytes at once (two streams, pinned host buffers, all
                    ranks together), V defined below
  MPI floor         2(p-1) MPI Sendrecv of n/p bytes between ring neighbours, pinned host
                    buffers (what the staged ring hands to MPI, without any copy or reduction)
  host ringcoll     ringcoll's all-reduce of NumPy arrays of n bytes (same algorithm choice)
  nccl              NCCL's all-reduce through cupy.cuda.nccl, where it can run (below)

The bounds. A ring all-reduce sends and receives V = 2(p-1)/p * n bytes per rank (busbw is
defined so that busbw = V / time). Staged, every byte sent is first copied device -> host and
every byte received host -> device: V bytes each way per rank, and the p ranks sharing a GPU
share its copy engines and PCIe link. Copies in the two directions can overlap (separate
engines, full-duplex link), so the copy bound is measured exactly so: every rank copying V
bytes D2H and V bytes H2D at once, all ranks at the same time; copy-bound busbw = V / that
time. No staged all-reduce can beat it. Nor can it beat its MPI leg: the same V bytes through
MPI between host buffers, the MPI floor, busbw = V / (2(p-1) Sendrecv(n/p)). The staging bound
is the lower of the two; the staged path pipelines copies and MPI (docs/gpu.md), so at best it
reaches that bound. The gate: at --gate-bytes (64 MiB) the staged ring must reach --gate
(0.7) of the staging bound, else exit 3. The ratio to the copy bound alone (the issue's
criterion) is printed too; where the MPI floor is the lower bound, no staging can reach 70% of
the copy bound, and the output says so. The host ringcoll all-reduce is reported beside it (it
also reduces on the CPU, which the staged path does on the GPU, so it is a reference, not a
bound).

NCCL needs one GPU per rank: it runs where every rank of a node has its own GPU, or at -n 1
(then an all-reduce is a copy, and busbw is 0 by definition: only time and algbw mean
anything). With several ranks on one GPU it is skipped with a note. CuPy 14 does not ship NCCL:
pip install nvidia-nccl-cu13 (or -cu12), else it is skipped with a note.

The node tier's targets (issue 27), judged on the faster of its two rows (plain, registered)
where the size was run and p is 2 or 4 (--no-node-gates: report only):
  p = 2: 1 MiB all-reduce <= 150 us; 64 MiB busbw >= 80 GB/s; 256 MiB busbw >= 200 GB/s
  p = 4: 64 MiB busbw >= 60 GB/s

Exit status: 0 ok, 1 wrong results, 2 bad arguments or no GPU, 3 a gate missed.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from harness import Case, UsageError, count_wrong, environment, parse_size, resolve_dtype

import ringcoll

WORLD = MPI.COMM_WORLD
#: the node tier's targets: p -> [(bytes, "busbw" GB/s at least | "time" us at most, value)]
NODE_GATES = {2: [(1 << 20, "time", 150.0), (64 << 20, "busbw", 80.0),
                  (256 << 20, "busbw", 200.0)],
              4: [(64 << 20, "busbw", 60.0)]}
RANK, P = WORLD.Get_rank(), WORLD.Get_size()


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"))
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-d", "--dtype", default="float32")
    ap.add_argument("-a", "--algorithms", default="auto,node,ring",
                    help="ringcoll algorithms on device buffers (default auto,node,ring)")
    ap.add_argument("--no-node-gates", action="store_true",
                    help="report the node tier's targets without judging them")
    ap.add_argument("--staging-bytes", default="",
                    help="also time the staged path forced, with these chunk sizes (e.g. 1M,4M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per size, all rows")
    ap.add_argument("--gate", type=float, default=0.7)
    ap.add_argument("--gate-bytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-host", action="store_true", help="skip the host ringcoll row")
    return ap.parse_args(argv)


def gpu():
    """(cupy, cupyx, device id) with this rank on GPU local_rank % GPUs, or a UsageError."""
    try:
        import cupy
        import cupyx

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no CuPy, or no usable GPU
        raise UsageError(f"needs CuPy and an NVIDIA GPU: {type(exc).__name__}: {exc}") from None
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    device = local_rank % count
    cupy.cuda.Device(device).use()
    return cupy, cupyx, device, local_size <= count


class Row:
    """One timed configuration at one size: call() runs it once (queues GPU work), sync()
    waits for the GPU; per round, the max over ranks of the mean per call is kept."""

    def __init__(self, name, call, sync, volume):
        self.name, self.call, self.sync, self.volume = name, call, sync, volume
        self.rounds, self.wrong = [], 0


def time_rows(rows, nbytes, args):
    """Round-robin: each round times a batch of every row in a shuffled order (the same on
    every rank), after one untimed call, behind a barrier."""
    probe = []
    for row in rows:
        WORLD.Barrier()
        t0 = time.perf_counter()
        row.call()
        row.sync()
        probe.append(time.perf_counter() - t0)
    probe = WORLD.allreduce(max(sum(probe), 1e-6), op=MPI.MAX)
    iters = WORLD.bcast(max(2, int(args.budget / probe / args.rounds)) if RANK == 0 else None)
    for k in range(args.rounds):
        for j in np.random.default_rng([nbytes, k]).permutation(len(rows)):
            row = rows[j]
            row.call()
            row.sync()
            WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                row.call()
            row.sync()
            row.rounds.append(WORLD.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))
    return iters


def main(argv=None):
    try:
        return _main(parse(argv))
    except UsageError as exc:
        say(f"bench/gpu_allreduce.py: error: {exc}")
        return 2


def _main(args):
    cupy, cupyx, device, own_gpu = gpu()
    dtype = resolve_dtype(args.dtype)
    comm = ringcoll.Communicator()
    path, why = comm.device_path(cupy.zeros(1, dtype=cupy.float32))
    chunks = [parse_size(c) for c in args.staging_bytes.split(",") if c.strip()]
    forced = {c: ringcoll.Communicator(cuda_aware=False, staging_bytes=c) for c in chunks}
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    nccl, nccl_why = start_nccl(cupy, own_gpu, dtype)
    env = environment(comm, args, None)
    env.update(cupy_version=cupy.__version__, gpu=gpu_name(cupy, device), device=device,
               path=path, path_why=why, staging_bytes=comm.options.staging_bytes)
    say("# ringcoll bench: all-reduce on GPU buffers (CuPy)")
    say(f"# {env['command']}")
    say(f"# {P} rank(s); GPU {env['gpu']} (rank 0 on device {device}); cupy {cupy.__version__};"
        f" {env['mpi_library_version'].splitlines()[0]}")
    say(f"# device path: {path} ({why}); staging chunk "
        f"{comm.options.staging_bytes} B" + (f"; forced staged chunks {chunks}" if chunks else ""))
    say(f"# nccl: {nccl_why}")
    say("# busbw = V / time, V = 2(p-1)/p * size: bytes each rank sends (and receives); copy "
        "bound: D2H + H2D of V at once, all ranks together; MPI floor: 2(p-1) Sendrecv(n/p)")
    say("#")
    say(f"# {'size':>11} {'row':<32} {'time(us)':>11} {'algbw':>8} {'busbw':>8} {'/copy':>6} "
        f"{'/stage':>6} {'#wrong':>6}")
    results, gates, wrong_total = [], [], 0
    size = args.minbytes
    while size <= args.maxbytes:
        count = max(1, size // dtype.itemsize)
        nbytes = count * dtype.itemsize
        rows = build_rows(cupy, cupyx, comm, forced, algorithms, nccl, dtype, count, args)
        iters = time_rows(rows, nbytes, args)
        out = report(rows, nbytes, count, dtype, iters)
        results += out
        wrong_total += sum(r["wrong"] or 0 for r in out)
        if P > 1 and nbytes == args.gate_bytes:
            gates.append(gate(out, args))
        gates += node_gates(out, nbytes, args)
        size *= args.stepfactor
        for row in rows:  # registered buffers are freed collectively, in row order
            getattr(row, "release", lambda: None)()
        del rows
    status = 1 if wrong_total else 0
    if P > 1 and not gates:
        say(f"# gate: no size equal to --gate-bytes {args.gate_bytes} was run: not judged")
    for g in gates:
        if g.get("kind") == "node":
            say(f"# node tier at {g['size']} B: {g['row']} {g['what']} {g['value']:.2f} "
                f"(target {g['op']} {g['target']}): "
                + ("PASS" if g["passed"] else "MISS" if g["enforced"] else "info"))
            if g["enforced"] and not g["passed"] and status == 0:
                status = 3
            continue
        say(f"# gate at {g['size']} B: staged ring {g['staged_busbw']:.2f} GB/s = "
            f"{g['ratio_staging']:.2f} of the staging bound {g['staging_bound']:.2f} GB/s "
            f"(= min(copy bound {g['copy_bound']:.2f}, MPI floor {g['mpi_floor']:.2f})), "
            f"needs {args.gate}: {'PASS' if g['passed'] else 'MISS'}; "
            f"{g['ratio_copy']:.2f} of the copy bound alone"
            + ("" if g["copy_bound"] <= g["mpi_floor"] else
               " (the MPI floor is below the copy bound here: no staging can reach "
               f"{args.gate} of the copy bound)"))
        if not g["passed"] and status == 0:
            status = 3
    say(f"# wrong elements: {wrong_total}; exit {status}")
    if RANK == 0 and args.json:
        doc = {"benchmark": "gpu_allreduce", "environment": env, "results": results,
               "gates": gates, "nccl": nccl_why, "exit_status": status,
               "parameters": {k: v for k, v in vars(args).items()}}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        say(f"# wrote {args.json}")
    for c in forced.values():
        c.close()
    comm.close()
    return WORLD.bcast(status, root=0)


def gpu_name(cupy, device):
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


_NCCL_TYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
               "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8",
               "int8": "NCCL_INT8", "bfloat16": "NCCL_BFLOAT16"}


def start_nccl(cupy, own_gpu, dtype):
    """(an NCCL communicator and its datatype, or None; why / what)."""
    try:
        from cupy.cuda import nccl
        available = nccl.available
    except Exception as exc:  # noqa: BLE001
        available, nccl = False, None
        why = f"{type(exc).__name__}: {exc}"
    else:
        why = "NCCL library not found (pip install nvidia-nccl-cu13 or -cu12)"
    if not all(WORLD.allgather(bool(available))):
        return None, f"skipped: {why}"
    if not all(WORLD.allgather(own_gpu)):
        return None, ("skipped: ranks share a GPU, and NCCL needs one GPU per rank (on a "
                      "one-GPU machine only -n 1 can run it)")
    name = _NCCL_TYPES.get(dtype.name if dtype.name != "void" else "bfloat16")
    if name is None or not hasattr(nccl, name):
        return None, f"skipped: no NCCL datatype for {dtype}"
    uid = WORLD.bcast(nccl.get_unique_id() if RANK == 0 else None)
    comm = nccl.NcclCommunicator(P, uid, RANK)
    version = nccl.get_version() if hasattr(nccl, "get_version") else "?"
    return (comm, getattr(nccl, name), nccl.NCCL_SUM), f"NCCL {version}, one GPU per rank"


def build_rows(cupy, cupyx, comm, forced, algorithms, nccl, dtype, count, args):
    case = Case(RANK, P, count, dtype, "sum", -1)
    nbytes = count * dtype.itemsize
    volume = 2 * (P - 1) / P * nbytes
    stream = cupy.cuda.get_current_stream()
    expect = case.reduced()
    rows = []

    def device_row(name, c, algorithm):
        x = cupy.asarray(case.data(RANK))
        y = cupy.empty_like(x)
        c.allreduce(x, algorithm=algorithm, out=y)
        stream.synchronize()
        row = Row(name, lambda: c.allreduce(x, algorithm=algorithm, out=y), stream.synchronize,
                  volume)
        row.wrong = WORLD.allreduce(count_wrong(cupy.asnumpy(y), expect, case), op=MPI.SUM)
        return row

    path = comm.device_path(cupy.zeros(1))[0]
    for a in algorithms:
        how = "node tier" if a in ("auto", "node") and len(comm.nodes) == 1 and P > 1 else path
        rows.append(device_row(f"ringcoll {how} {a}", comm, a))
    if P > 1 and len(comm.nodes) == 1:
        rows.append(registered_row(cupy, comm, case, count, dtype, expect, volume))
    for chunk, c in forced.items():
        rows.append(device_row(f"ringcoll staged ring chunk={chunk >> 10}K", c, "ring"))
    rows.append(copy_row(cupy, cupyx, int(volume)))
    rows.append(mpi_floor_row(cupyx, nbytes // P, volume))
    if not args.no_host:
        x, y = case.data(RANK), case.empty()
        comm.allreduce(x, out=y)
        row = Row("host ringcoll auto", lambda: comm.allreduce(x, out=y), lambda: None, volume)
        row.wrong = WORLD.allreduce(count_wrong(y, expect, case), op=MPI.SUM)
        rows.append(row)
    if nccl is not None:
        ncomm, ntype, nsum = nccl
        x = cupy.asarray(case.data(RANK))
        y = cupy.empty_like(x)

        def call():
            ncomm.allReduce(x.data.ptr, y.data.ptr, count, ntype, nsum, stream.ptr)
        call()
        stream.synchronize()
        row = Row("nccl", call, stream.synchronize, volume)
        row.wrong = WORLD.allreduce(count_wrong(cupy.asnumpy(y), expect, case), op=MPI.SUM)
        rows.append(row)
    return rows


def registered_row(cupy, comm, case, count, dtype, expect, volume):
    """In-place all-reduce of a registered device buffer (comm.shared_array, xp=cupy): checked
    once on the case's data, then timed on zeros (repeated sums stay zero)."""
    stream = cupy.cuda.get_current_stream()
    buf = comm.shared_array(count, dtype, xp=cupy)
    buf[...] = cupy.asarray(case.data(RANK))
    comm.allreduce(buf, algorithm="node", out=buf)
    stream.synchronize()
    wrong = WORLD.allreduce(count_wrong(cupy.asnumpy(buf), expect, case), op=MPI.SUM)
    buf[...] = 0
    row = Row("ringcoll node tier registered", lambda: comm.allreduce(buf, algorithm="node",
                                                                      out=buf),
              stream.synchronize, volume)
    row.wrong = wrong
    row.keep = (buf,)
    row.release = lambda: comm.release(buf)
    return row


def node_gates(out, nbytes, args):
    """The node tier's targets at this size (NODE_GATES), judged on its faster row."""
    found = []
    rows = [r for r in out if r["row"] in ("ringcoll node tier node",
                                           "ringcoll node tier registered")]
    for size, what, target in NODE_GATES.get(P, []):
        if size != nbytes or not rows:
            continue
        if what == "time":
            best = min(rows, key=lambda r: r["time_us"])
            value, passed, op = best["time_us"], best["time_us"] <= target, "<="
        else:
            best = max(rows, key=lambda r: r["busbw_GBps"])
            value, passed, op = best["busbw_GBps"], best["busbw_GBps"] >= target, ">="
        found.append({"kind": "node", "size": nbytes, "row": best["row"],
                      "what": "time (us)" if what == "time" else "busbw (GB/s)",
                      "value": value, "target": target, "op": op, "passed": passed,
                      "enforced": not args.no_node_gates})
    return found


def copy_row(cupy, cupyx, volume):
    """D2H and H2D of `volume` bytes at once, on two streams, one call = both finished."""
    n = max(volume, 1)
    src, dst = cupy.zeros(n, dtype=cupy.uint8), cupy.empty(n, dtype=cupy.uint8)
    down, up = cupyx.empty_pinned((n,), np.uint8), cupyx.empty_pinned((n,), np.uint8)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime
    down_ptr, up_ptr = down.ctypes.data, up.ctypes.data

    def call():
        rt.memcpyAsync(down_ptr, src.data.ptr, volume, rt.memcpyDeviceToHost, s1.ptr)
        rt.memcpyAsync(dst.data.ptr, up_ptr, volume, rt.memcpyHostToDevice, s2.ptr)

    def sync():
        s1.synchronize()
        s2.synchronize()

    row = Row("copy bound (D2H+H2D of V)", call, sync, volume)
    row.keep = (src, dst, down, up)
    return row


def mpi_floor_row(cupyx, block, volume):
    """2(p-1) Sendrecv of one n/p-byte block between ring neighbours, pinned host buffers."""
    raw = WORLD.Dup()
    a, b = cupyx.empty_pinned((max(block, 1),), np.uint8), cupyx.empty_pinned((max(block, 1),),
                                                                             np.uint8)
    right, left = (RANK + 1) % P, (RANK - 1) % P
    send, recv = [a[:block], MPI.BYTE], [b[:block], MPI.BYTE]

    def call():
        for _ in range(2 * (P - 1)):
            raw.Sendrecv(send, right, 0, recv, left, 0)

    row = Row("MPI floor 2(p-1) Sendrecv(n/p)", call, lambda: None, volume)
    row.keep = (raw, a, b)
    return row


def report(rows, nbytes, count, dtype, iters):
    by = {r.name: float(np.median(r.rounds)) for r in rows}
    copy = rows[[r.name for r in rows].index("copy bound (D2H+H2D of V)")]
    volume = copy.volume
    copy_bw = volume / by[copy.name] / 1e9 if P > 1 else float("nan")
    mpi_bw = volume / by["MPI floor 2(p-1) Sendrecv(n/p)"] / 1e9 if P > 1 else float("nan")
    stage_bw = min(copy_bw, mpi_bw)
    out = []
    for r in rows:
        t = by[r.name]
        busbw = volume / t / 1e9 if t > 0 else float("nan")
        rec = {"size": nbytes, "count": count, "type": dtype.name, "row": r.name,
               "time_us": t * 1e6, "algbw_GBps": nbytes / t / 1e9 if t > 0 else float("nan"),
               "busbw_GBps": busbw, "to_copy_bound": busbw / copy_bw if P > 1 else None,
               "to_staging_bound": busbw / stage_bw if P > 1 else None,
               "copy_bound_GBps": copy_bw, "mpi_floor_GBps": mpi_bw, "wrong": r.wrong,
               "iters": iters, "rounds_us": [v * 1e6 for v in r.rounds]}
        out.append(rec)
        say(f"  {nbytes:>11} {r.name:<32} {t * 1e6:>11.1f} {rec['algbw_GBps']:>8.2f} "
            f"{busbw:>8.2f} {_ratio(rec['to_copy_bound'])} {_ratio(rec['to_staging_bound'])} "
            f"{r.wrong:>6}")
    return out


def _ratio(v):
    return f"{v:6.2f}" if v is not None else f"{'-':>6}"


def gate(rows, args):
    staged = [r for r in rows if r["row"].startswith("ringcoll staged ring")
              or r["row"] == "ringcoll staged ring"]
    best = max(staged, key=lambda r: r["busbw_GBps"]) if staged else None
    if best is None:
        return {"size": rows[0]["size"], "passed": True, "staged_busbw": float("nan"),
                "note": "no staged ring row (the path is cuda-aware): add --staging-bytes",
                "ratio_staging": float("nan"), "ratio_copy": float("nan"),
                "staging_bound": float("nan"), "copy_bound": rows[0]["copy_bound_GBps"],
                "mpi_floor": rows[0]["mpi_floor_GBps"]}
    copy_bw, mpi_bw = best["copy_bound_GBps"], best["mpi_floor_GBps"]
    stage = min(copy_bw, mpi_bw)
    return {"size": best["size"], "row": best["row"], "staged_busbw": best["busbw_GBps"],
            "copy_bound": copy_bw, "mpi_floor": mpi_bw, "staging_bound": stage,
            "ratio_staging": best["busbw_GBps"] / stage, "ratio_copy": best["busbw_GBps"] / copy_bw,
            "passed": best["busbw_GBps"] >= args.gate * stage}


if __name__ == "__main__":
    sys.exit(main())
