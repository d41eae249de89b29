"""mpiexec -n 4 python tests/mpi_node.py [--dead-peer]

The node tier over MPI-3 shared windows, checked on every rank against MPI's own collectives
(and bitwise agreement between ranks): all-reduce through the tier (one chunk, many chunks,
in place and out, several dtypes and ops), reduce-scatter, all-gather and broadcast (every
kind of root, a registered one too) through it,
registered buffers alone and mixed with ordinary arrays, hierarchical over fake nodes whose
intra-node stage uses the tier, and DistributedOptimizer's buckets in shared memory. Every rank
prints "mpi_node: ok" when all its checks held; any failure exits 1 on that rank.

--dead-peer: rank 1 stops answering inside the tier's second all-reduce (sleeps); the others
must not wait forever: with RINGCOLL_TIMEOUT set, the watchdog aborts the job, naming the
tier's wait, and the job exits non-zero (tests/test_node.py).
"""

import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.optim import SGD

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
FAILURES = []


def check(ok, label):
    if not ok:
        FAILURES.append(label)


def same_everywhere(label, y):
    crc = zlib.crc32(np.ascontiguousarray(y).view(np.uint8).tobytes())
    check(len(set(WORLD.allgather(crc))) == 1, f"{label}: ranks differ")


def data(seed, n, dtype):
    rng = np.random.default_rng(seed * 1000 + RANK)
    return rng.integers(-50, 50, n).astype(dtype)


MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def check_allreduce(comm, name):
    for i, n in enumerate(sorted({0, 1, max(P - 1, 0), P + 1, 10007, 300001})):
        for dtype in (np.int32, np.float64, np.float32):
            for op in ("sum", "max"):
                x = data(i, n, dtype)
                ref = np.empty_like(x)
                WORLD.Allreduce(x, ref, op=MPI_OPS[op])
                label = f"{name} allreduce n={n} {np.dtype(dtype)} {op}"
                y = comm.allreduce(x, op=op, algorithm="node")
                check(np.array_equal(y, ref), label)
                z = x.copy()
                check(comm.allreduce(z, op=op, algorithm="node", out=z) is z
                      and np.array_equal(z, ref), label + " in place")
                same_everywhere(label, y)
        x = data(i, n, np.float64) / 7  # not exact: avg and bitwise agreement
        y = comm.allreduce(x, op="avg", algorithm="node")
        ref = np.empty_like(x)
        WORLD.Allreduce(x, ref, op=MPI.SUM)
        check(np.allclose(y, ref / P), f"{name} avg n={n}")
        same_everywhere(f"{name} avg n={n}", y)


def check_reduce_scatter_allgather(comm, name):
    for i, rows in enumerate(sorted({0, 1, P + 1, 2 * P + 3, 4099})):
        x = data(50 + i, rows, np.float64)
        counts = [len(b) for b in np.array_split(np.empty(rows), P)]
        ref = np.empty(counts[RANK])
        WORLD.Reduce_scatter(x, ref, counts, op=MPI.SUM)
        y = comm.reduce_scatter(x, algorithm="node")
        check(np.array_equal(y, ref), f"{name} reduce_scatter rows={rows}")
        mine = data(60 + i, (rows + RANK) % 13, np.int64)
        got = comm.allgather(mine, algorithm="node")
        check(np.array_equal(got, np.concatenate(WORLD.allgather(mine))),
              f"{name} allgather rows={rows}")


def check_broadcast(comm, name):
    for i, n in enumerate(sorted({0, 1, P + 1, 10007, 300001})):
        for root in sorted({0, P - 1, P // 2}):
            x = data(80 + i, n, np.float64) if RANK == root else np.full(n, np.nan)
            ref = x.copy()
            WORLD.Bcast(ref, root=root)
            y = comm.broadcast(x, root=root, algorithm="node")
            check(y is x and np.array_equal(x, ref), f"{name} broadcast n={n} root={root}")
    g = comm.shared_array(70001, np.int32)  # a registered root
    g[...] = np.arange(70001) if RANK == P - 1 else -1
    comm.broadcast(g, root=P - 1, algorithm="node")
    check(np.array_equal(g, np.arange(70001)), f"{name} broadcast registered")
    comm.release(g)


def check_registered(comm, name):
    for i, n in enumerate((0, 1, P + 1, 70001)):
        g = comm.shared_array(n, np.float64)
        check(comm.is_shared(g) == (P > 1), f"{name} is_shared n={n}")
        for rep in range(3):
            x = data(70 + i + rep, n, np.float64)
            ref = np.empty_like(x)
            WORLD.Allreduce(x, ref, op=MPI.SUM)
            g[...] = x
            comm.allreduce(g, algorithm="node", out=g)
            check(np.array_equal(g, ref), f"{name} registered n={n} rep {rep}")
            h = g if RANK % 2 == 0 else x.copy()  # mixed: odd ranks pass ordinary arrays
            h[...] = x
            comm.allreduce(h, algorithm="node", out=h)
            check(np.array_equal(h, ref), f"{name} mixed n={n} rep {rep}")
        comm.release(g)


def check_hierarchical(comm, name):
    for i, n in enumerate((0, 3, 10007)):
        x = data(90 + i, n, np.int64)
        ref = np.empty_like(x)
        WORLD.Allreduce(x, ref, op=MPI.SUM)
        check(np.array_equal(comm.allreduce(x, algorithm="hierarchical"), ref),
              f"{name} hierarchical n={n}")


def check_optimizer(comm, name):
    params = {"w": np.zeros(3000), "b": np.zeros(7)}
    opt = ringcoll.DistributedOptimizer(SGD(params, lr=1.0), comm, bucket_bytes=8192)
    check(all(comm.is_shared(b.buf) for b in opt.buckets) == (P > 1), f"{name} buckets shared")
    for step in range(3):
        opt.step({"w": np.full(3000, float(RANK + step)), "b": np.full(7, 2.0 * RANK)})
    mean_rank = (P - 1) / 2
    check(np.allclose(params["w"], -(3 * mean_rank + 3)), f"{name} optimizer w")
    same_everywhere(f"{name} optimizer", params["w"])


def dead_peer():
    comm = ringcoll.Communicator()
    x = np.ones(1000)
    comm.allreduce(x, algorithm="node")
    if RANK == 1:
        time.sleep(120)  # never arrives; the others' watchdogs must end the job
    comm.allreduce(x, algorithm="node")
    print(f"rank {RANK}: the second all-reduce returned without rank 1", flush=True)
    return 1


def main():
    if "--dead-peer" in sys.argv:
        return dead_peer()
    comms = {"default": ringcoll.Communicator(),
             "chunk256": ringcoll.Communicator(node_chunk=256),
             "ls2": ringcoll.Communicator(local_size=2, node_chunk=4096)}
    start = time.time()
    check_allreduce(comms["default"], "default")
    check_allreduce(comms["chunk256"], "chunk256")
    check_reduce_scatter_allgather(comms["default"], "default")
    check_reduce_scatter_allgather(comms["chunk256"], "chunk256")
    check_broadcast(comms["default"], "default")
    check_broadcast(comms["chunk256"], "chunk256")
    check_registered(comms["default"], "default")
    check_registered(comms["chunk256"], "chunk256")
    check_hierarchical(comms["ls2"], "ls2")
    check_optimizer(comms["default"], "default")
    for comm in comms.values():
        comm.close()
    for label in FAILURES[:30]:
        print(f"rank {RANK}: FAILED {label}", flush=True)
    if FAILURES:
        return 1
    print(f"rank {RANK}: mpi_node: ok ({time.time() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
