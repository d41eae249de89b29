"""mpiexec -n P python tests/mpi_stale_local.py [--tmpdir DIR]: bounded staleness and local SGD.

The MLP of scripts/train_digits.py on synthetic data (as tests/mpi_dp.py), each rank on its
1/P share of every global batch, compared with references this rank computes alone:
- staleness k: one process on the whole global batch whose step t applies the gradient of
  step t - k (computed at step t - k's parameters), the last k at flush();
- local SGD: P replicas simulated in one process, each on its share, averaged every H steps
  (then the outer update); the final parameters are averaged by opt.average().
They must agree within float32 rounding and be bitwise identical on every rank.
Prints 'OK <check> ...' per check; exits non-zero if any check fails on any rank.
"""

import argparse
import os
import sys
import traceback
from collections import deque
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringcoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_dp import SIZES, data, grads_of, init_params, make_opt, max_diff  # noqa: E402
from mpi_dp import same_on_every_rank  # noqa: E402

STEPS = 6
BATCH = 24
TOL = 2e-5
FAILURES = []


def check(label, ok, detail=""):
    if ok:
        if MPI.COMM_WORLD.rank == 0:
            print(f"OK {label} {detail}", flush=True)
    else:
        FAILURES.append(label)
        print(f"FAIL rank {MPI.COMM_WORLD.rank} {label} {detail}", flush=True)


def stale_reference(kind, k, steps=STEPS):
    x, y = data()
    params = init_params(SIZES, seed=1)
    opt = make_opt(kind, params)
    queue = deque()
    for s in range(steps):
        rows = slice(s * BATCH, (s + 1) * BATCH)
        queue.append(grads_of(params, x[rows], y[rows], 1.0 / BATCH))
        if len(queue) > k:
            opt.step(queue.popleft())
    while queue:
        opt.step(queue.popleft())
    return params


def stale_train(comm, kind, k, steps=STEPS, params=None, opt=None, start=0, flush=True,
                **options):
    x, y = data()
    p, r = comm.size, comm.rank
    share = BATCH // p
    if params is None:
        params = init_params(SIZES, seed=1 + r)
        ringcoll.broadcast_parameters(params, comm=comm)
    if opt is None:
        opt = ringcoll.DistributedOptimizer(make_opt(kind, params), comm, bucket_bytes=256,
                                            staleness=k, **options)
    for s in range(start, start + steps):
        rows = slice(s * BATCH + r * share, s * BATCH + (r + 1) * share)
        g = grads_of(params, x[rows], y[rows], p / BATCH)
        for name in reversed(list(g)):  # backward order
            opt.grad_ready(name, g[name])
        opt.step()
    if flush:
        opt.flush()
    return params, opt


def local_reference(p, kind, period, steps, **outer):
    """p replicas in one process; the end state is their average."""
    x, y = data()
    share = BATCH // p
    replicas = [init_params(SIZES, seed=1) for _ in range(p)]
    opts = [make_opt(kind, rep) for rep in replicas]
    anchor = {n: a.astype(np.float64) for n, a in replicas[0].items()}
    buf = None
    lr, mu, nesterov = outer.get("outer_lr", 1.0), outer.get("outer_momentum", 0.0), \
        outer.get("nesterov", False)

    def average():
        nonlocal anchor, buf
        avg = {n: sum(rep[n].astype(np.float64) for rep in replicas) / p for n in anchor}
        if lr == 1.0 and mu == 0.0:
            new = avg
        else:
            d = {n: anchor[n] - avg[n] for n in anchor}
            buf = d if buf is None else {n: mu * buf[n] + d[n] for n in d}
            upd = {n: d[n] + mu * buf[n] for n in d} if nesterov else buf
            anchor = {n: anchor[n] - lr * upd[n] for n in d}
            new = anchor
        for rep in replicas:
            for n in rep:
                rep[n][...] = new[n]

    for s in range(steps):
        for r in range(p):
            rows = slice(s * BATCH + r * share, s * BATCH + (r + 1) * share)
            opts[r].step(grads_of(replicas[r], x[rows], y[rows], 1.0 / share))
        if (s + 1) % period == 0:
            average()
    if steps % period:
        average()
    return replicas[0]


def local_train(comm, kind, period, steps, **outer):
    x, y = data()
    p, r = comm.size, comm.rank
    share = BATCH // p
    params = init_params(SIZES, seed=1)
    opt = ringcoll.LocalSGD(make_opt(kind, params), comm, period=period, **outer)
    for s in range(steps):
        rows = slice(s * BATCH + r * share, s * BATCH + (r + 1) * share)
        opt.step(grads_of(params, x[rows], y[rows], 1.0 / share))
    if steps % period:
        opt.average()
    return params, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmpdir", default=".")
    args = ap.parse_args()
    comm = ringcoll.Communicator()
    p = comm.size
    try:
        for kind in ("sgd", "adam"):
            for k in (0, 1, 2):
                got, opt = stale_train(comm, kind, k)
                d = max_diff(got, stale_reference(kind, k))
                check(f"staleness {kind} k={k} p={p}", d < TOL and same_on_every_rank(comm, got),
                      f"max abs diff {d:.2e}, waited {opt.wait_seconds * 1e3:.1f} ms")
        plain, _ = stale_train(comm, "adam", 0)
        params = init_params(SIZES, seed=1)
        opt = ringcoll.DistributedOptimizer(make_opt("adam", params), comm, bucket_bytes=256)
        x, y = data()
        share = BATCH // p
        for s in range(STEPS):
            rows = slice(s * BATCH + comm.rank * share, s * BATCH + (comm.rank + 1) * share)
            opt.step(grads_of(params, x[rows], y[rows], p / BATCH))
        same = all(np.array_equal(plain[n], params[n]) for n in params)
        check(f"staleness 0 is the plain optimizer bitwise p={p}", same)

        # k > steps: nothing moves before flush(), then the reference
        start = init_params(SIZES, seed=1)
        got, opt = stale_train(comm, "sgd", 8, flush=False)
        still = all(np.array_equal(got[n], start[n]) for n in got) and opt.in_flight == STEPS
        applied = opt.flush()
        d = max_diff(got, stale_reference("sgd", 8))
        check(f"staleness k=8 > {STEPS} steps p={p}",
              still and applied == STEPS and d < TOL and same_on_every_rank(comm, got),
              f"unchanged before flush {still}, flush applied {applied}, max abs diff {d:.2e}")

        # fp16 with k = 1: close to the reference, identical replicas
        got, _ = stale_train(comm, "sgd", 1, compression=ringcoll.Compression.fp16)
        d = max_diff(got, stale_reference("sgd", 1))
        check(f"staleness fp16 k=1 p={p}", d < 2e-2 and same_on_every_rank(comm, got),
              f"max abs diff {d:.2e}")

        # checkpoint with 2 updates in flight: resume == uninterrupted, bitwise
        path = os.path.join(args.tmpdir, "stale_ckpt")
        params, opt = stale_train(comm, "adam", 2, steps=3, flush=False)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, extra={"step": 3})
        straight, _ = stale_train(comm, "adam", 2, steps=3, params=params, opt=opt, start=3)
        fresh = init_params(SIZES, seed=99)
        fresh_opt = ringcoll.DistributedOptimizer(make_opt("adam", fresh), comm,
                                                  bucket_bytes=256, staleness=2)
        extra = ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm)
        in_flight = fresh_opt.in_flight
        resumed, _ = stale_train(comm, "adam", 2, steps=3, params=fresh, opt=fresh_opt, start=3)
        same = all(np.array_equal(straight[n], resumed[n]) for n in straight)
        check(f"staleness checkpoint with updates in flight p={p}",
              same and in_flight == 2 and extra == {"step": 3},
              f"bitwise {same}, in flight after load {in_flight}")

        for kind, period, steps, outer in (("sgd", 1, 4, {}), ("sgd", 4, 10, {}),
                                           ("adam", 4, 8, {}),
                                           ("sgd", 3, 9, dict(outer_lr=0.7, outer_momentum=0.9,
                                                              nesterov=True))):
            got, opt = local_train(comm, kind, period, steps, **outer)
            d = max_diff(got, local_reference(p, kind, period, steps, **outer))
            label = f"local SGD {kind} H={period} {'outer ' if outer else ''}p={p}"
            check(label, d < TOL and same_on_every_rank(comm, got),
                  f"max abs diff {d:.2e}, {opt.rounds} rounds, {opt.bytes_sent} B sent")
        # H = 1 is synchronous DP up to rounding (SGD with momentum is linear in the gradients)
        got, _ = local_train(comm, "sgd", 1, STEPS)
        d = max_diff(got, stale_reference("sgd", 0))
        check(f"local SGD H=1 equals synchronous DP p={p}",
              d < TOL and same_on_every_rank(comm, got), f"max abs diff {d:.2e}")
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {comm.rank}:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    if MPI.COMM_WORLD.allreduce(len(FAILURES)):
        sys.exit(1)


if __name__ == "__main__":
    main()
