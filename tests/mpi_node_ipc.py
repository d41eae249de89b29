"""mpiexec -n 3 python tests/mpi_node_ipc.py --prefix rcipc_test [--report FILE]

The node tier's device memory (transport/device.py's open_device_shared: CUDA IPC between
processes) under real MPI, on tests/_fake_device.py's fake device, whose "device memory" is
POSIX shared memory (/dev/shm/<prefix>_<pid>_<n>) and which enforces IPC's rules: a process
never opens its own handle, an owner frees only after every peer unmapped. Tests the set-up,
its agreement and its bookkeeping, not a GPU (tests/test_gpu.py has the real one).

Cases, each on fresh memory, every rank checking its results against NumPy:
  - node.allreduce through StagedTransport and CudaAwareTransport over the fake, ranks on one
    "GPU" and on one each: sizes 0, 1, p-1, p+1, thousands, many chunks (node_chunk 256), in
    and out of place, and a registered buffer; node.broadcast from the first and the last
    rank; then every peer's allocation was opened
    exactly once by every other rank, never its own, all closed and freed at close.
  - t.shared over a subset of the ranks (members), written by each and read by all.
  - one rank's GPU without peer access, one rank whose ipc_open fails, one whose alloc fails:
    t.shared raises NoSharedMemory on every rank, nothing stays open or allocated, and
    node.allreduce and node.broadcast still give the right results (the ring, the tree).
  - at the end no /dev/shm/<prefix>* is left.

Exit status 0 only if every check held on every rank; rank 0 writes a JSON report (--report).
"""

import argparse
import json
import os
import sys
import traceback
from collections import Counter

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fake_device import FakeDevice, leftovers  # noqa: E402

from ringcoll.algorithms import node  # noqa: E402
from ringcoll.arrays import Workspace  # noqa: E402
from ringcoll.ops import get_op  # noqa: E402
from ringcoll.transport.base import NoSharedMemory  # noqa: E402
from ringcoll.transport.device import CudaAwareTransport, StagedTransport  # noqa: E402
from ringcoll.transport.mpi import MPITransport  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
COMBINE = get_op("sum").bind(np.float64)
FAILURES = []
CHECKS = [0]


def check(ok, label):
    CHECKS[0] += 1
    if not ok:
        FAILURES.append(f"rank {RANK}: {label}")


def sizes():
    return sorted({0, 1, max(P - 1, 0), P + 1, 1000, 3001})


def expected(n, seed):
    """The sum over ranks of data(n, seed, r), exact: small integers in float64."""
    return sum(data(n, seed, r) for r in range(P))


def data(n, seed, rank):
    return ((np.arange(n) * 7 + 13 * rank + seed) % 101).astype(np.float64)


def allreduces(t, ws, dev, label, seed=0):
    """node.allreduce of every size, out of place and in place, on dev's arrays (their work
    queued on its compute stream, as on a GPU), checked on this rank."""
    for n in sizes():
        for inplace in (False, True):
            src = dev.array(data(n, seed + n, RANK))
            dst = src if inplace else dev.array(np.full(n, np.nan))
            node.allreduce(t, src, dst, COMBINE, ws)
            ok = np.array_equal(dst, expected(n, seed + n))
            check(ok, f"{label}: allreduce n={n} {'in place' if inplace else 'out of place'}")
    return True


def broadcasts(t, ws, dev, label, seed=0):
    """node.broadcast of every size from the first and the last rank, on dev's arrays,
    checked on this rank."""
    for n in sizes():
        for root in sorted({0, P - 1}):
            want = data(n, seed + 7 * n + root, root)
            buf = dev.array(want if RANK == root else np.full(n, np.nan))
            node.broadcast(t, buf, root, ws)
            check(np.array_equal(buf, want), f"{label}: broadcast n={n} root={root}")


def make(dev, wrap, inner):
    return StagedTransport(inner, dev, chunk_bytes=100) if wrap == "staged" \
        else CudaAwareTransport(inner, dev)


def bookkeeping(dev, label, expect_opens=True, group=None):
    """Every peer's exported segments opened exactly once here, never this rank's own; all
    closed again, every allocation freed, nothing live. group: the ranks that shared memory
    (default all); a rank outside it opens nothing."""
    exported = WORLD.allgather(list(dev.exported))
    group = range(P) if group is None else group
    opened, closed = Counter(dev.opened), Counter(dev.closed)
    peers = Counter(name for q, names in enumerate(exported)
                    if q != RANK and q in group and RANK in group for name in names)
    if expect_opens:
        check(opened == peers, f"{label}: opened {sorted(opened.items())} instead of each of "
                               f"the peers' {sorted(peers)} once")
    check(not set(opened) & set(dev.exported), f"{label}: opened its own handle")
    check(closed == opened, f"{label}: closed {sorted(closed)} but opened {sorted(opened)}")
    check(dev.allocs == dev.frees, f"{label}: {dev.allocs} allocations, {dev.frees} freed")
    check(dev.live() == ([], []), f"{label}: still live: {dev.live()}")


def case_tier(args, wrap, one_gpu):
    label = f"tier {wrap} {'one GPU' if one_gpu else 'a GPU each'}"
    inner = MPITransport(WORLD, timeout=60)
    dev = FakeDevice(seed=RANK, device_id=0 if one_gpu else RANK, prefix=args.prefix)
    t = make(dev, wrap, inner)
    for chunk in (256, 1 << 16):
        ws = Workspace(4 << 20, node_chunk=chunk, device=True)
        allreduces(t, ws, dev, f"{label} node_chunk={chunk}")
        broadcasts(t, ws, dev, f"{label} node_chunk={chunk}")
        tier = node.tier_of(t, ws)
        check(tier is not None, f"{label}: no tier was made")
        if tier is not None and chunk == 256:  # a registered buffer: the peers read it in place
            n = 3001
            segment = tier.register(n * 8)
            x = segment[:n * 8].view(np.float64)
            x[...] = data(n, 5, RANK)
            node.allreduce(t, x, x, COMBINE, ws)
            check(np.array_equal(x, expected(n, 5)), f"{label}: registered allreduce")
            check(tier.locate(x)[0] == 1, f"{label}: the registered buffer was not found")
        ws.close_resident()
    if P > 1:
        check(dev.fences > 0, f"{label}: never fenced")
        check(dev.allocs >= 3, f"{label}: {dev.allocs} allocations (two tiers, a registration)")
    bookkeeping(dev, label)
    inner.close()


def case_members(args):
    """shared() over members [0, P-1] only: the others take no part."""
    members = [0, P - 1]
    inner = MPITransport(WORLD, timeout=60)
    dev = FakeDevice(device_id=RANK, prefix=args.prefix)
    t = StagedTransport(inner, dev, chunk_bytes=100)
    if RANK in members:
        shared = t.shared(16, members)
        flags = t.flags(1, members)
        me = members.index(RANK)
        check(shared.rank == me and shared.size == 2, "members: rank/size of the group")
        shared.segments[me][:] = 10 + RANK
        shared.fence()
        flags.post(0, 1)
        flags.wait_all(0, 1)
        shared.fence()
        got = [int(seg[15]) for seg in shared.segments]
        check(got == [10 + m for m in members], f"members: read {got}")
        flags.close()
        shared.close()
    bookkeeping(dev, "members", group=members)
    check(dev.allocs == (RANK in members), f"members: {dev.allocs} allocations")
    inner.close()


def case_refused(args, what, bad):
    """Rank `bad`'s device fails (`what`): every rank gets NoSharedMemory from t.shared, and
    the tier runs the ring (and the tree) with the right results."""
    label = f"refused ({what} on rank {bad})"
    inner = MPITransport(WORLD, timeout=60)
    settings = {"peer": {"peer_access": False}, "open": {"fail_open": True},
                "alloc": {"fail_alloc": True}}[what] if RANK == bad else {}
    dev = FakeDevice(device_id=RANK, prefix=args.prefix, **settings)
    t = make(dev, "staged", inner)
    try:
        t.shared(1000).close()
        raised = None
    except NoSharedMemory as exc:
        raised = str(exc)
    check(raised is not None, f"{label}: t.shared did not raise NoSharedMemory")
    if raised is not None:
        want = {"peer": f"GPU {bad} (rank {bad}) has no peer access to GPU",
                "open": "fail_open=True", "alloc": "fail_alloc=True"}[what]
        check(want in raised and f"rank {bad}:" in raised,
              f"{label}: the message does not say what failed where: {raised}")
    agreed = WORLD.allgather(raised is not None)
    check(all(agreed), f"{label}: NoSharedMemory on ranks {agreed} only")
    bookkeeping(dev, label, expect_opens=False)
    if what == "open" and RANK != bad:  # the others opened theirs before the meeting
        check(len(dev.opened) == P - 1, f"{label}: opened {dev.opened}")
    ws = Workspace(4 << 20, node_chunk=256, device=True)
    allreduces(t, ws, dev, label, seed=3)
    broadcasts(t, ws, dev, label, seed=3)
    check(node.tier_of(t, ws) is None, f"{label}: a tier was made")
    ws.close_resident()
    bookkeeping(dev, label + ", after the ring", expect_opens=False)
    inner.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", required=True, help="names of the fake's /dev/shm segments")
    ap.add_argument("--report")
    args = ap.parse_args()
    args.prefix = f"{args.prefix}_r{RANK}"  # (leftovers below look for all ranks' at once)
    for wrap in ("staged", "cuda-aware"):
        for one_gpu in (True, False):
            case_tier(args, wrap, one_gpu)
    if P >= 2:
        case_members(args)
        for what, bad in (("peer", P - 1), ("open", 1), ("alloc", 0)):
            case_refused(args, what, bad)
    WORLD.Barrier()
    left = leftovers(args.prefix.rsplit("_r", 1)[0] + "_r")
    check(not left, f"/dev/shm still holds {left}")
    failures = WORLD.gather(FAILURES, root=0)
    checks = WORLD.reduce(CHECKS[0], op=MPI.SUM, root=0)
    ok = True
    if RANK == 0:
        failures = [f for fl in failures for f in fl]
        ok = not failures
        print(f"mpi_node_ipc P={P}: {checks} checks, {len(failures)} failures", flush=True)
        for f in failures[:40]:
            print("FAIL " + f, flush=True)
        if args.report:
            with open(args.report, "w") as fh:
                json.dump({"p": P, "checks": checks, "failures": failures}, fh, indent=1)
    sys.exit(0 if WORLD.bcast(ok, root=0) else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - never leave the other ranks hanging
        print(f"rank {RANK}/{P}: unexpected exception, aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
