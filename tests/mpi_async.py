"""mpiexec -n P python tests/mpi_async.py: one-sided windows and asynchronous SGD under MPI.

Checks, each on every rank, with oracles computed through mpi4py directly (never ringcoll):
- windows: uneven parts (rank r holds r + 1 elements), add / fetch / fetch_add from every rank
  into every rank, int64 and float64, exact; fetch_add hands out every ticket exactly once;
- the parameter store's consistency in integer arithmetic: every rank pushes random int64
  deltas as fast as it can (the last rank sleeping between pushes, so the interleavings vary)
  and the store ends at start + the sum of every push (MPI.COMM_WORLD.Allreduce), exactly,
  at N = 1, p - 1, p + 1 and 4099 elements; the update counter equals the pushes;
- progress without the owner: the last rank sleeps 3 s without calling MPI while the others
  pull and push 50 times into every shard, its own included; they finish long before it wakes
  (the owner's participation is not needed: MPI_Win_allocate memory, passive target);
- AsyncSGD: integer-valued float64 gradients with lr = 1, so the final parameters are exactly
  the start minus every push; every replica bitwise equal after finish() (digests);
- AsyncSGD learns least squares with the last rank slowed 3x (ringcoll.straggler.Slowdown).
Prints 'OK <check> ...' per check; exits non-zero if any check fails on any rank.
"""

import hashlib
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.straggler import Slowdown

WORLD = MPI.COMM_WORLD
FAILURES = []


def check(label, ok, detail=""):
    if ok:
        if WORLD.rank == 0:
            print(f"OK {label} {detail}", flush=True)
    else:
        FAILURES.append(label)
        print(f"FAIL rank {WORLD.rank} {label} {detail}", flush=True)


def world_sum(x):
    out = np.empty_like(x)
    WORLD.Allreduce(np.ascontiguousarray(x), out, MPI.SUM)
    return out


def everywhere(flag):
    return WORLD.allreduce(int(bool(flag)), MPI.MIN) == 1


def same_on_every_rank(arrays):
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).digest()
    return len(set(WORLD.allgather(digest))) == 1


def windows(comm, p, r):
    for dtype in (np.int64, np.float64):
        win = comm.window(np.full(r + 1, 1000 * r, dtype))
        for t in range(p):
            win.add(np.full(t + 1, r + 1, dtype), t, 0)
            win.add(np.array([7], dtype), t, t)  # the last element of each part once more
        WORLD.Barrier()
        ok = True
        for t in range(p):
            out = np.empty(t + 1, dtype)
            win.fetch(out, t, 0)
            want = np.full(t + 1, 1000 * t + p * (p + 1) // 2, dtype)
            want[t] += 7 * p
            ok &= np.array_equal(out, want)
        ok &= np.array_equal(win.local[:r], np.full(r, 1000 * r + p * (p + 1) // 2, dtype))
        WORLD.Barrier()
        win.close()
        check(f"window add/fetch {np.dtype(dtype).name} p={p}", everywhere(ok))
    counter = comm.window(np.zeros(1, np.int64))
    tickets = [counter.fetch_add(1, p - 1, 0) for _ in range(20)]
    WORLD.Barrier()
    final = counter.fetch_add(0, p - 1, 0)
    every = sorted(t for mine in WORLD.allgather(tickets) for t in mine)
    WORLD.Barrier()
    counter.close()
    check(f"window fetch_add tickets p={p}", everywhere(every == list(range(20 * p))
                                                       and final == 20 * p))


def store_consistency(comm, p, r):
    for n in sorted({1, max(p - 1, 1), p + 1, 4099}):
        shapes = {"a": (n,)} if n < 4 else {"w": (n // 3, 3), "b": (n - 3 * (n // 3),)}
        start = {k: np.arange(int(np.prod(s)), dtype=np.int64).reshape(s) - 5 for k, s in
                 shapes.items()}
        store = ringcoll.ParameterStore(start, comm)
        rng = np.random.default_rng(100 + r)
        pushed = {k: np.zeros(s, np.int64) for k, s in shapes.items()}
        pushes = 60
        for i in range(pushes):
            delta = {k: rng.integers(-2**45, 2**45, s) for k, s in shapes.items()}
            store.add(delta)
            for k in delta:
                pushed[k] += delta[k]
            if r == p - 1 and p > 1:
                time.sleep(0.001)  # the others overtake it: varied interleavings
        WORLD.Barrier()
        final = {k: np.empty(s, np.int64) for k, s in shapes.items()}
        version = store.pull(final)
        ok = version == p * pushes
        for k in shapes:
            ok &= np.array_equal(final[k], start[k] + world_sum(pushed[k]))
        WORLD.Barrier()
        store.close()
        check(f"store == start + every push (int64) N={n} p={p}", everywhere(ok),
              f"{p * pushes} pushes")


def progress_without_owner(comm, p, r):
    store = ringcoll.ParameterStore({"x": np.zeros(64 * p, np.int64)}, comm)
    delta = {"x": np.ones(64 * p, np.int64)}
    out = {"x": np.empty(64 * p, np.int64)}
    WORLD.Barrier()
    start = time.perf_counter()
    if r == p - 1 and p > 1:
        time.sleep(3.0)  # no MPI call at all: the owner of the last shard is busy
        took = 0.0
    else:
        for _ in range(50):
            store.pull(out)
            store.add(delta)
        took = time.perf_counter() - start
    WORLD.Barrier()
    store.pull(out)
    workers = p - 1 if p > 1 else 1
    ok = np.array_equal(out["x"], np.full(64 * p, 50 * workers)) and took < 1.5
    WORLD.Barrier()
    store.close()
    check(f"pull/push progress while an owner sleeps p={p}", everywhere(ok),
          f"50 pull+push took {WORLD.allreduce(took, MPI.MAX):.3f} s (the owner slept 3 s)")


def async_exact(comm, p, r):
    steps = 30
    params = {"w": np.full((4, 5), 3.0 * r), "b": np.zeros(7)}  # rank 0's start: w = 0
    opt = ringcoll.AsyncSGD(params, comm, lr=1.0)
    rng = np.random.default_rng(200 + r)
    pushed = {k: np.zeros_like(v) for k, v in params.items()}
    for _ in range(steps):
        opt.pull()
        g = {k: rng.integers(-1000, 1000, v.shape).astype(np.float64) for k, v in params.items()}
        opt.push(g)
        for k in g:
            pushed[k] += g[k]
    total = opt.finish()
    ok = total == p * steps and len(opt.staleness) == steps
    ok &= all(0 <= s < p * steps for s in opt.staleness)
    for k in params:
        ok &= np.array_equal(params[k], -world_sum(pushed[k]))
    same = same_on_every_rank([params["w"], params["b"]])
    opt.close()
    stale = WORLD.allgather(max(opt.staleness))
    check(f"AsyncSGD lands every push exactly, replicas equal p={p}", everywhere(ok) and same,
          f"max staleness per rank {stale}")


def async_learns(comm, p, r):
    rng = np.random.default_rng(0)
    w_true = rng.standard_normal(8)
    x = rng.standard_normal((500, 8))
    y = x @ w_true
    params = {"w": np.zeros(8)}
    opt = ringcoll.AsyncSGD(params, comm, lr=0.05, momentum=0.5)
    slow = Slowdown(3.0 if r == p - 1 and p > 1 else 1.0, rank=r)
    local = np.random.default_rng(r)
    while True:
        opt.pull()
        if opt.updates >= 400:
            break
        rows = local.integers(0, len(x), 16)
        with slow:
            err = x[rows] @ params["w"] - y[rows]
            grad = x[rows].T @ err / len(rows)
        opt.push({"w": grad})
    opt.finish()
    err = float(np.max(np.abs(params["w"] - w_true)))
    pushes = WORLD.allgather(opt.pushes)
    same = same_on_every_rank([params["w"]])
    opt.close()
    # a straggler's last push may carry a gradient many updates old: the bound leaves room
    start = float(np.max(np.abs(w_true)))
    check(f"AsyncSGD learns with a 3x straggler p={p}", everywhere(err < 0.01 * start) and same,
          f"max |w - w_true| {err:.1e} (from {start:.1f}), pushes per rank {pushes}")


def main():
    comm = ringcoll.Communicator()
    p, r = comm.size, comm.rank
    try:
        windows(comm, p, r)
        store_consistency(comm, p, r)
        progress_without_owner(comm, p, r)
        async_exact(comm, p, r)
        async_learns(comm, p, r)
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {r}:\n{traceback.format_exc()}", flush=True)
        WORLD.Abort(1)
    comm.close()
    if WORLD.allreduce(len(FAILURES)):
        sys.exit(1)


if __name__ == "__main__":
    main()
