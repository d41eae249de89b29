"""mpiexec -n 2 python bench/textbook_ring.py -b 1M -e 64M

ringcoll's ring all-reduce against the 20-line textbook ring (below: blocking Sendrecv of
whole blocks into a temporary, then `+=`) and MPI's own MPI_Allreduce, interleaved in one run.
The textbook ring already beats MPICH at large sizes on a small shared-memory machine;
ringcoll's must beat the textbook one. Prints the median of --rounds rounds per size and the
ratios, checks every result, and exits 1 on a wrong result, 3 if ringcoll's ring is not
faster than the textbook ring at every size >= --target-min-bytes (default 16M).
"""

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import ringcoll
from harness import parse_size


def textbook_ring(comm, x, out):
    """The classic ring: reduce-scatter then all-gather, one whole block per step."""
    p, r = comm.Get_size(), comm.Get_rank()
    out[...] = x
    q, m = divmod(out.size, p)
    start = [b * q + min(b, m) for b in range(p + 1)]
    block = [slice(start[b], start[b + 1]) for b in range(p)]
    tmp = np.empty(q + 1, out.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send, recv = block[(r - s) % p], block[(r - s - 1) % p]
        t = tmp[:recv.stop - recv.start]
        comm.Sendrecv(out[send], right, 0, t, left, 0)
        out[recv] += t
    for s in range(p - 1):
        send, recv = block[(r - s + 1) % p], block[(r - s) % p]
        comm.Sendrecv(out[send], right, 0, out[recv], left, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", default="1M", help="smallest size in bytes (K/M/G suffixes)")
    ap.add_argument("-e", default="64M", help="largest size in bytes")
    ap.add_argument("-f", type=int, default=4, help="size factor between steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-min-bytes", default="16M")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comm = ringcoll.Communicator()
    raw = world.Dup()  # the textbook ring's own communicator
    rank, p = world.Get_rank(), world.Get_size()
    target = parse_size(args.target_min_bytes)
    runs = {
        "ring": lambda x, y: comm.allreduce(x, algorithm="ring", out=y),
        "textbook": lambda x, y: textbook_ring(raw, x, y),
        "native": lambda x, y: comm.allreduce(x, algorithm="native", out=y),
    }
    status = 0
    if rank == 0:
        print(f"# {p} ranks, float32 sum, median of {args.rounds} rounds, time in us")
        print(f"# {'size':>10} {'ring':>10} {'textbook':>10} {'native':>10} "
              f"{'ring/textbook':>14} {'ring/native':>12}")
    size = parse_size(args.b)
    while size <= parse_size(args.e):
        n = size // 4
        x = (np.arange(n) % 7 + rank).astype(np.float32)
        expect = (np.arange(n) % 7 * p + p * (p - 1) // 2).astype(np.float32)
        y = np.empty_like(x)
        iters = max(2, min(50, int(2e8 // size)))
        times = {name: [] for name in runs}
        for name, fn in runs.items():  # check every result once
            y.fill(-1)
            fn(x, y)
            wrong = world.allreduce(int(np.count_nonzero(y != expect)))
            if wrong:
                status = 1
                if rank == 0:
                    print(f"# {name} at {size} B: {wrong} wrong elements", file=sys.stderr)
        for _ in range(args.rounds):
            for name, fn in runs.items():
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(x, y)
                times[name].append(world.allreduce((time.perf_counter() - t0) / iters, MPI.MAX))
        med = {name: sorted(v)[len(v) // 2] * 1e6 for name, v in times.items()}
        vs_textbook, vs_native = med["textbook"] / med["ring"], med["native"] / med["ring"]
        if rank == 0:
            print(f"  {size:>10} {med['ring']:>10.1f} {med['textbook']:>10.1f} "
                  f"{med['native']:>10.1f} {vs_textbook:>14.2f} {vs_native:>12.2f}")
        if size >= target and vs_textbook <= 1.0:
            status = status or 3
            if rank == 0:
                print(f"# target missed: ring is not faster than the textbook ring at {size} B")
        size *= args.f
    raw.Free()
    return status


if __name__ == "__main__":
    sys.exit(main())
