"""mpiexec -n P python tests/mpi_dp.py [--tmpdir DIR]: data-parallel training checks.

Each check trains a small MLP (scripts/train_digits.py's model) on synthetic data with
ringcoll.DistributedOptimizer over P ranks, each rank on its 1/P share of every global batch,
and compares the parameters with a reference that this rank computes alone: the same
optimizer on the whole global batch, no communication. They must agree within float32
rounding (the max abs difference is printed), and be bitwise identical on every rank.
Prints 'OK <check> ...' per check; exits non-zero if any check fails on any rank.
"""

import argparse
import os
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringcoll

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from train_digits import backward, forward, init_params, loss_and_grad_logits  # noqa: E402

SIZES = [20, 24, 16, 5]  # 4 weight matrices + 4 biases: several buckets when they are small
STEPS = 6
TOL = 2e-5


def data(n=240, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], n)
    return x, y


def grads_of(params, x, y, scale):
    acts = forward(params, x)
    _, dlogits = loss_and_grad_logits(acts[-1], y, scale)
    out = {}
    backward(params, acts, dlogits, out.__setitem__)
    return out


def make_opt(kind, params):
    if kind == "sgd":
        return ringcoll.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                  weight_decay=1e-3)
    return ringcoll.optim.Adam(params, lr=1e-2, weight_decay=1e-3, decoupled=True)


def reference(kind, batch, steps=STEPS):
    """One rank, whole global batches, no communication."""
    x, y = data()
    params = init_params(SIZES, seed=1)
    opt = make_opt(kind, params)
    for s in range(steps):
        rows = slice(s * batch, (s + 1) * batch)
        opt.step(grads_of(params, x[rows], y[rows], 1.0 / batch))
    return params


def train(comm, kind, batch, mode="overlap", bucket_bytes=256, passes=1, steps=STEPS,
          compression=None, params=None, opt=None, start=0):
    x, y = data()
    p, r = comm.size, comm.rank
    share = batch // p
    if params is None:
        params = init_params(SIZES, seed=1 + r)  # different on purpose: broadcast fixes it
        ringcoll.broadcast_parameters(params, comm=comm)
    if opt is None:
        opt = ringcoll.DistributedOptimizer(make_opt(kind, params), comm,
                                            bucket_bytes=bucket_bytes, compression=compression,
                                            backward_passes_per_step=passes)
    for s in range(start, start + steps):
        base = s * batch + r * share
        if passes == 1:
            rows = slice(base, base + share)
            g = grads_of(params, x[rows], y[rows], p / batch)
            if mode == "overlap":
                for name in reversed(list(g)):  # backward order: last layer first
                    opt.grad_ready(name, g[name])
                opt.step()
            elif mode == "clip":  # Horovod's clipping pattern, with a clip that never bites
                for name in reversed(list(g)):
                    opt.grad_ready(name, g[name])
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step(g)
        else:  # the share split into `passes` micro-batches that accumulate
            micro = share // passes
            for k in range(passes):
                rows = slice(base + k * micro, base + (k + 1) * micro)
                g = grads_of(params, x[rows], y[rows], p / batch)
                if k < passes - 1 and mode == "no_sync":
                    with opt.no_sync():
                        for name in reversed(list(g)):
                            opt.grad_ready(name, g[name])
                else:
                    for name in reversed(list(g)):
                        opt.grad_ready(name, g[name])
            opt.step()
    return params, opt


def same_on_every_rank(comm, params):
    """True when every rank's parameters are bitwise identical to rank 0's."""
    flat = np.concatenate([v.reshape(-1) for v in params.values()])
    root = flat.copy()
    comm.broadcast(root, root=0)
    return bool(np.array_equal(flat.view(np.uint8), root.view(np.uint8)))


def max_diff(a, b):
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


FAILURES = []


def check(label, ok, detail=""):
    rank = MPI.COMM_WORLD.rank
    if ok:
        if rank == 0:
            print(f"OK {label} {detail}", flush=True)
    else:
        FAILURES.append(label)
        print(f"FAIL rank {rank} {label} {detail}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmpdir", default=".")
    args = ap.parse_args()
    comm = ringcoll.Communicator()
    p = comm.size
    batch = 24  # divisible by 1, 2, 3, 4 (and by 2 micro-batches per share up to p = 4: 24/4/2)
    try:
        for kind in ("sgd", "adam"):
            ref = reference(kind, batch)
            for mode, bucket in (("overlap", 256), ("overlap", 1 << 20), ("step", 256),
                                 ("clip", 512)):
                got, _ = train(comm, kind, batch, mode, bucket)
                d = max_diff(got, ref)
                check(f"{kind} {mode} bucket_bytes={bucket} p={p}",
                      d < TOL and same_on_every_rank(comm, got), f"max abs diff {d:.2e}")
            for mode in ("accumulate", "no_sync"):
                got, _ = train(comm, kind, batch, mode, 256, passes=2)
                d = max_diff(got, ref)
                check(f"{kind} {mode} 2 passes p={p}",
                      d < TOL and same_on_every_rank(comm, got), f"max abs diff {d:.2e}")

        # checkpoint: 3 steps, save, 3 more  ==  load into fresh objects, the same 3 more
        path = os.path.join(args.tmpdir, "ckpt")
        params, opt = train(comm, "adam", batch, steps=3)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, extra={"step": 3})
        straight, _ = train(comm, "adam", batch, steps=3, params=params, opt=opt, start=3)
        fresh = init_params(SIZES, seed=99)
        fresh_opt = ringcoll.DistributedOptimizer(make_opt("adam", fresh), comm, bucket_bytes=256)
        extra = ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm)
        resumed, _ = train(comm, "adam", batch, steps=3, params=fresh, opt=fresh_opt, start=3)
        same = all(np.array_equal(straight[k], resumed[k]) for k in straight)
        check(f"checkpoint resume p={p}", same and extra == {"step": 3},
              f"bitwise {same}, extra {extra}")

        # compression keeps training close; the bytes on the wire are what is claimed
        for name, comp, tol in (("fp16", ringcoll.Compression.fp16, 2e-2),
                                ("bf16", ringcoll.Compression.bf16, 1e-1)):
            got, opt = train(comm, "sgd", batch, compression=comp, bucket_bytes=1 << 20)
            ref = reference("sgd", batch)
            d = max_diff(got, ref)
            n_bytes = sum(v.nbytes for v in got.values())
            check(f"{name} compression p={p}",
                  d < tol and same_on_every_rank(comm, got) and
                  opt.bytes_sent == STEPS * n_bytes // 2,
                  f"max abs diff {d:.2e}, sent {opt.bytes_sent} B for {STEPS} x {n_bytes} B")
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {comm.rank}:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    if MPI.COMM_WORLD.allreduce(len(FAILURES)):
        sys.exit(1)


if __name__ == "__main__":
    main()
