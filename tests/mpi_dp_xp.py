"""mpiexec -n P python tests/mpi_dp_xp.py --xp numpy|cupy

Data-parallel training written once over the array module: a small MLP whose forward and
backward use only xp (NumPy on the host, CuPy on the GPU), trained with
ringcoll.DistributedOptimizer over P ranks, each rank on its 1/P share of every global batch,
and compared with the same optimizer on the whole global batch in this process, without
communication. The CPU suite runs it with --xp numpy (tests/test_dp_device.py); the GPU check
(scripts/gpu_check.sh) with --xp cupy, ranks sharing the GPU, where the buckets are the node
tier's registered device memory.

Checks, on every rank: float64 parameters within 1e-10 of the reference, float32 within 1e-5
(fp16 compression: 2e-2); every replica bitwise identical to rank 0's; parameters, buckets
and optimizer state arrays of xp; and a checkpoint of the training (save_checkpoint, written
from the host) loaded into fresh objects on xp resumes bit for bit. Prints 'OK <check> ...'
(rank 0) or 'FAIL rank r <check>'; exits non-zero if any check failed on any rank.
"""

import argparse
import hashlib
import shutil
import sys
import tempfile
import traceback

import numpy as np
from mpi4py import MPI

import ringcoll

WORLD = MPI.COMM_WORLD
SIZES = (16, 24, 8)  # inputs, hidden, classes
BATCH = 24  # divisible by 1, 2, 3, 4 and, in 2 micro-batches, by 1, 2, 3
STEPS = 5
FAILURES = []


def data(xp, dtype, n=BATCH * STEPS):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, SIZES[0])).astype(dtype)
    y = rng.integers(0, SIZES[-1], n)
    return xp.asarray(x), xp.asarray(y)


def init_params(xp, dtype, seed):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        w = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params[f"W{i}"] = xp.asarray(w.astype(dtype))
        params[f"b{i}"] = xp.zeros(fan_out, dtype)
    return params


def gradients(xp, params, x, y, scale):
    """Softmax cross-entropy of the MLP; gradients (of the loss times scale), last layer
    first, as a backward pass produces them."""
    h = xp.maximum(x @ params["W0"] + params["b0"], 0)
    z = h @ params["W1"] + params["b1"]
    z = z - z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[xp.arange(len(y)), y] -= 1
    dz = p * scale
    dh = (dz @ params["W1"].T) * (h > 0)
    return [("b1", dz.sum(axis=0)), ("W1", h.T @ dz), ("b0", dh.sum(axis=0)), ("W0", x.T @ dh)]


def make_opt(kind, params):
    if kind == "sgd":
        return ringcoll.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                  weight_decay=1e-3)
    return ringcoll.optim.Adam(params, lr=1e-2, weight_decay=1e-3, decoupled=True)


def reference(xp, kind, dtype):
    x, y = data(xp, dtype)
    params = init_params(xp, dtype, seed=1)
    opt = make_opt(kind, params)
    for s in range(STEPS):
        rows = slice(s * BATCH, (s + 1) * BATCH)
        opt.step(dict(gradients(xp, params, x[rows], y[rows], 1.0 / BATCH)))
    return params


def train(xp, comm, kind, dtype, passes=1, steps=range(STEPS), params=None, opt=None,
          **wrapper):
    p, r = comm.size, comm.rank
    x, y = data(xp, dtype)
    if params is None:
        params = init_params(xp, dtype, seed=1 + r)  # different on purpose: broadcast fixes it
        ringcoll.broadcast_parameters(params, comm=comm)
        opt = ringcoll.DistributedOptimizer(make_opt(kind, params), comm,
                                            backward_passes_per_step=passes, **wrapper)
    share = BATCH // p
    micro = share // passes
    for s in steps:
        for k in range(passes):
            start = s * BATCH + r * share + k * micro
            rows = slice(start, start + micro)
            for name, g in gradients(xp, params, x[rows], y[rows], p / BATCH):
                opt.grad_ready(name, g)
        opt.step()
    return params, opt


def check(label, ok, detail=""):
    if not ok:
        FAILURES.append(label)
        print(f"FAIL rank {WORLD.rank} {label} {detail}", flush=True)
    elif WORLD.rank == 0:
        print(f"OK {label} {detail}", flush=True)


def host(xp, a):
    return xp.asnumpy(a) if xp is not np else a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xp", choices=("numpy", "cupy"), default="numpy")
    args = ap.parse_args()
    if args.xp == "cupy":
        import cupy as xp
    else:
        xp = np
    comm = ringcoll.Communicator()
    p = comm.size
    cases = [("sgd", np.float64, {}, 1e-10), ("adam", np.float64, {"bucket_bytes": 512}, 1e-10),
             ("sgd", np.float32, {"passes": 2}, 1e-5), ("adam", np.float32, {}, 1e-5),
             ("sgd", np.float32, {"compression": ringcoll.Compression.fp16}, 2e-2)]
    try:
        for kind, dtype, wrapper, tol in cases:
            options = " ".join(f"{k}={getattr(v, 'name', v)}" for k, v in wrapper.items())
            label = f"{args.xp} {kind} {np.dtype(dtype).name} {options} p={p}"
            ref = reference(xp, kind, dtype)
            got, opt = train(xp, comm, kind, dtype, **wrapper)
            diff = max(float(np.abs(host(xp, got[n]).astype(np.float64) - host(xp, ref[n])).max())
                       for n in ref)
            digest = hashlib.sha256(b"".join(host(xp, got[n]).tobytes() for n in sorted(got)))
            digests = WORLD.allgather(digest.hexdigest())
            arrays = list(got.values()) + [b.buf for b in opt.buckets] + [
                v for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"]
            kinds = sorted({type(a).__module__.split(".")[0] for a in arrays})
            check(label, diff <= tol and len(set(digests)) == 1 and kinds == [args.xp],
                  f"max |diff| {diff:.1e} (<= {tol:g}), replicas identical "
                  f"{len(set(digests)) == 1}, arrays of {kinds}, buckets shared "
                  f"{[comm.is_shared(b.buf) for b in opt.buckets]}")
        # a checkpoint of device training (written from the host, read back onto the GPU)
        # resumes bitwise: 2 steps, save, 3 more == load into fresh objects, the same 3 more
        folder = WORLD.bcast(tempfile.mkdtemp(prefix="rc_dp_xp_") if WORLD.rank == 0 else None)
        wrapper = {"compression": ringcoll.Compression.topk(0.5)}
        params, opt = train(xp, comm, "adam", np.float32, steps=range(2), **wrapper)
        ringcoll.save_checkpoint(f"{folder}/ckpt", params, opt, comm=comm)
        straight, _ = train(xp, comm, "adam", np.float32, steps=range(2, 5), params=params,
                            opt=opt)
        fresh = init_params(xp, np.float32, seed=99)
        fresh_opt = ringcoll.DistributedOptimizer(make_opt("adam", fresh), comm, **wrapper)
        ringcoll.load_checkpoint(f"{folder}/ckpt", fresh, fresh_opt, comm=comm)
        resumed, _ = train(xp, comm, "adam", np.float32, steps=range(2, 5), params=fresh,
                           opt=fresh_opt)
        same = all(host(xp, straight[n]).tobytes() == host(xp, resumed[n]).tobytes()
                   for n in straight)
        check(f"{args.xp} checkpoint resume p={p}", same, f"bitwise {same}")
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {WORLD.rank}:\n{traceback.format_exc()}", flush=True)
        WORLD.Abort(1)
    comm.close()
    failed = WORLD.allreduce(len(FAILURES))
    if WORLD.rank == 0:
        print(f"mpi_dp_xp {args.xp} p={p}: {len(cases) + 1} cases, {failed} failures",
              flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
