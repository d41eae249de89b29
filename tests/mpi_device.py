"""mpiexec -n 3 python tests/mpi_device.py --device fake|cupy [--chunk BYTES] [--report FILE]

Every ringcoll collective (every algorithm, 'native' included) on device buffers under real
MPI, checked on every rank against NumPy oracles and for bitwise agreement between ranks
(tests/_device_suite.py). Two devices:

--device fake: the *staging schedule* on a CPU. Every message goes through StagedTransport
    over the MPI transport with tests/_fake_device.py's NumPy "device" (copies deferred, so a
    send before its copy finished, or a host block reused too early, gives wrong bytes). Tests
    the staging, not a GPU.
--device cupy: CuPy arrays on the GPU(s), each rank on GPU (node-local rank % GPUs), the path
    (CUDA-aware or staged) chosen as in real use: RINGCOLL_CUDA_AWARE, else the MPI library.

Also records what MPIX_Query_cuda_support says. Exit status 0 only if every check passed on
every rank; rank 0 writes a JSON report (--report).
"""

import argparse
import hashlib
import json
import os
import sys
import traceback

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _oracle as O  # noqa: E402
from _device_suite import cupy_bfloat16_ok, run_suite  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.transport.device import for_device, staged  # noqa: E402
from ringcoll.transport.mpi import MPITransport  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()


def fake_setup(args):
    from _fake_device import FakeDevice

    inner = MPITransport(WORLD, timeout=60)
    aware, why = inner.cuda_support()
    path = for_device(inner, FakeDevice(), None, args.chunk)[1]
    dev = FakeDevice(seed=RANK)
    comm = ringcoll.Communicator(transport=staged(inner, dev, args.chunk), local_size=2)
    info = {"cuda_support": [aware, why], "path": path, "device": "fake"}
    return comm, (lambda a: a), (lambda a: a), None, info, lambda: dev.copies


def cupy_setup(args):
    import cupy

    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    local_rank = local.Get_rank()
    local.Free()
    gpus = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(local_rank % gpus).use()
    comm = ringcoll.Communicator(local_size=2, staging_bytes=args.chunk)
    aware, why = comm._g.t.cuda_support()
    probe = cupy.zeros(1, dtype=cupy.float32)
    path, why_path = comm.device_path(probe)
    side = comm._g.sides.devices[probe.device.id]
    dtypes = [d for d in O.ALL_DTYPES if d != O.BFLOAT16 or cupy_bfloat16_ok(cupy)]
    info = {"cuda_support": [aware, why], "path": path, "why": why_path,
            "device": f"cupy {cupy.__version__}, GPU {probe.device.id} of {gpus}",
            "bfloat16": O.BFLOAT16 in dtypes}
    pool = getattr(side.t, "pool", None)
    return (comm, cupy.asarray, cupy.asnumpy, dtypes, info,
            lambda: pool.allocated if pool is not None else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["fake", "cupy"], default="fake")
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--large", type=int, default=1001)
    ap.add_argument("--report")
    args = ap.parse_args()
    failures = []

    setup = fake_setup if args.device == "fake" else cupy_setup
    comm, to_dev, to_host, dtypes, info, staged_count = setup(args)
    if args.device == "fake" and info["path"] != (
            "cuda-aware" if info["cuda_support"][0] else "staged"):
        failures.append(f"rank {RANK}: for_device took {info['path']} although "
                        f"cuda_support said {info['cuda_support']}")
    digests = []

    def agree(label, a):
        digests.append((label, a.dtype.str, a.shape, hashlib.sha1(a.tobytes()).hexdigest()))

    checks, fails = run_suite(comm, to_dev, to_host, agree, native=True, large=args.large,
                              dtypes=dtypes)
    failures += fails
    every = WORLD.gather(digests, root=0)
    count = staged_count()
    comm.close()
    if RANK == 0:
        for r, theirs in enumerate(every):
            if theirs != every[0]:
                bad = next((a[0] for a, b in zip(every[0], theirs) if a != b),
                           "a different number of results")
                failures.append(f"rank {r} differs bitwise from rank 0 at {bad}")
    gathered = WORLD.gather(failures, root=0)
    total_checks = WORLD.reduce(checks, op=MPI.SUM, root=0)
    counts = WORLD.reduce(count, op=MPI.SUM, root=0)
    if RANK == 0:
        failures = [f for fl in gathered for f in fl]
        report = {"p": P, "chunk": args.chunk, "checks": total_checks, "failures": failures,
                  "staged": counts, **info}
        print(f"mpi_device {args.device} P={P} chunk={args.chunk}: {total_checks} checks, "
              f"{len(failures)} failures, {counts} staged (copies / pinned bytes); "
              f"{info['cuda_support'][1]} -> {info['path']}", flush=True)
        for f in failures[:30]:
            print("FAIL " + f, flush=True)
        if args.report:
            with open(args.report, "w") as fh:
                json.dump(report, fh, indent=1)
    ok = WORLD.bcast(not failures if RANK == 0 else None, root=0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - never leave the other ranks hanging
        print(f"rank {RANK}/{P}: unexpected exception, aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
