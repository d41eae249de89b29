"""mpiexec -n 4 python scripts/train_hybrid.py --dp 2 --tp 2     (or: --dp 2 --pp 2)
   mpiexec -n 8 python scripts/train_hybrid.py --dp 2 --tp 2 --pp 2

Hybrid-parallel training of the digits MLP of scripts/train_digits.py (its data, model,
initialisation, loss, batch order and SGD with momentum) on a ringcoll.Mesh of the ranks:

  --tp T  tensor parallel (Megatron): the 3 layers alternate column- and row-parallel over
          mesh.tp. 64 -> 256 split by columns, ReLU on each rank's columns, 256 -> 128 split
          by rows (one all-reduce), ReLU, 128 -> 10 split by columns and all-gathered: per
          step one all-reduce and one all-gather forward, one all-reduce backward.
  --pp P  pipeline parallel: consecutive layers per stage (ringcoll.parallel.partition),
          --micro-batches M per step through the --schedule (1f1b or gpipe) over mesh.pp.
  --dp D  data parallel: each replica takes 1/D of every global batch; the gradients are
          averaged over mesh.dp only (DistributedOptimizer), never over tp or pp.

D defaults to what T and P leave of the ranks.

All three together (--tp T --pp P, any D): each pipeline stage is its own Megatron sequence of
its layers over mesh.tp: its first layer column-parallel, then alternating, and its last
layer, when column-parallel, gathers its output. The rule at a stage boundary: the activation
that crosses it (and its gradient coming back) is whole, the same on every tp rank of the
stage, so stage s's tp rank i simply sends it to stage s+1's tp rank i (the pp groups are the
ranks sharing (dp, tp) coordinates). It costs one all-gather per stage that ends on a column
layer; with the digits' 3 layers at P = 2 (layers 0-1 | 2) no stage does: the boundary falls
after a row layer. The last stage's tp ranks all compute the loss (on the gathered logits);
its tp rank 0 reports it.

Overlap (with --pp): the stage hands each layer's gradient to the DistributedOptimizer
(grad_ready) as soon as the backward of the last micro-batch has gone through that layer
(Pipeline.run's grad_ready hook), so the dp all-reduce of the later layers' buckets runs in the
background while the earlier layers' backward still runs; --bucket-kb sets the bucket size
(default with --pp: 64 KiB, about a layer of the digits model; else DDP's 25 MiB).

  --checkpoint DIR  every --save-every N steps, save the model and the optimizer state to DIR
          (a sharded ringcoll checkpoint, each rank its blocks, replacing the previous one
          atomically). With --resume, DIR (if there) is loaded first and the run continues
          from its step as if it had never stopped (the batch order is deterministic), also
          at another --dp/--tp/--pp or number of ranks (loading reshards; keep --batch a
          multiple of both dp sizes so that the steps are the same).

At the end, every rank compares the parameters it holds (its shards or its stage's layers)
with a single-process run of the same loop and seed (train_digits' forward and backward on
whole global batches), and rank 0 prints the largest difference over all ranks with PASS or
FAIL (exit code 1) against --tolerance, and both runs' test accuracy. Run on 1 process (no
flags) it is that single-process run.

Needs scikit-learn: pip install -e ".[examples]".
"""

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per rank (see train_digits)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits as digits  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.parallel import (Activation, ColumnParallelLinear, Pipeline,  # noqa: E402
                               RowParallelLinear, Sequential, default_poll, micro_batches, mlp,
                               partition)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=None, help="default: ranks / (tp * pp)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4, help="per step, with --pp")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--poll-us", type=float, default=None,
                    help="pipeline receives poll every N us instead of blocking (default: 50 "
                         "when the ranks outnumber the cores, else block; 0: block)")
    ap.add_argument("--bucket-kb", type=float, default=None,
                    help="DistributedOptimizer bucket size in KiB (default: 64 with --pp, "
                         "so the dp all-reduce overlaps the last backward; else 25600)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=96, help="global batch (split over dp)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest allowed parameter difference (default 1e-4 for float32, "
                         "1e-10 for float64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", metavar="DIR", default=None,
                    help="save a checkpoint to DIR every --save-every steps")
    ap.add_argument("--save-every", type=int, default=10, metavar="N")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the checkpoint in --checkpoint DIR, if there is one")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint:
        ap.error("--resume needs --checkpoint DIR")
    if args.save_every < 1:
        ap.error("--save-every must be at least 1")
    if args.tolerance is None:
        args.tolerance = 1e-4 if args.dtype == "float32" else 1e-10
    return args


def initial_params(args, data):
    x_train = data[0]
    params = digits.init_params([x_train.shape[1], *args.hidden, 10], args.seed)
    return {k: v.astype(args.dtype) for k, v in params.items()}


def batches(args, n_train, dp):
    """Per epoch, per step: the global batch's row indices (train_digits' order)."""
    batch = (args.batch // dp) * dp  # every replica the same share
    rng = np.random.default_rng(args.seed + 1)  # the same order on every rank
    for _ in range(args.epochs):
        order = rng.permutation(n_train)
        yield [order[s * batch:(s + 1) * batch] for s in range(n_train // batch)]


# -- the single-process run ------------------------------------------------------------------
def reference(args, data, dp=1):
    """train_digits' model and loop on one process, whole global batches (of the size a run
    with dp replicas uses): the parameters a hybrid run must end with, and their accuracy."""
    x_train, y_train, x_test, y_test = (a.astype(args.dtype) if a.dtype.kind == "f" else a
                                        for a in data)
    params = initial_params(args, data)
    opt = ringcoll.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    for epoch in batches(args, len(x_train), dp):
        for rows in epoch:
            acts = digits.forward(params, x_train[rows])
            _, dlogits = digits.loss_and_grad_logits(acts[-1], y_train[rows], 1.0 / len(rows))
            grads = {}
            digits.backward(params, acts, dlogits, grads.__setitem__)
            opt.step(grads)
    return params, digits.accuracy(params, x_test, y_test)


# -- the models ---------------------------------------------------------------------------------
def tensor_parallel_model(tp, params, first=0, last=None):
    """Layers first..last-1 of the MLP, alternately column- and row-parallel over tp
    (Megatron's pairing), starting with a column layer: a column layer's output columns are
    the next row layer's input rows, so only the row layer communicates; the last of these
    layers, if column-parallel, gathers its output, so what comes out is whole on every tp
    rank (the logits, or a pipeline stage's output). Copies of this rank's shards of params
    (from_full): the model owns them."""
    n = len(params) // 2
    last = n if last is None else last
    layers = []
    for i in range(first, last):
        w, b, names = params[f"W{i}"], params[f"b{i}"], (f"W{i}", f"b{i}")
        if (i - first) % 2 == 0:
            layers.append(ColumnParallelLinear.from_full(tp, w, b, gather_output=i == last - 1,
                                                         names=names))
        else:
            layers.append(RowParallelLinear.from_full(tp, w, b, names=names))
        if i < n - 1:  # every layer but the model's last is followed by its ReLU
            layers.append(Activation("relu"))
    return Sequential(layers)


def pipeline_stage(pp, params, tp=None):
    """This stage's consecutive layers of the MLP: views of params, or with tp (size > 1) a
    tensor-parallel model of them over tp (tensor_parallel_model: whole activations in and
    out, so stage boundaries carry whole arrays between equal tp ranks)."""
    n = len(params) // 2
    if n < pp.size:
        raise ringcoll.InvalidArgumentError(
            f"ringcoll rank {pp.rank}, train_hybrid: {n} layers cannot fill {pp.size} pipeline "
            f"stages; use --pp <= {n} or more --hidden layers")
    layers = partition(n, pp.size)[pp.rank]
    if tp is not None and tp.size > 1:
        return tensor_parallel_model(tp, params, layers.start, layers.stop)
    return mlp(params, "relu", layers.start, layers.stop)


def build_model(mesh, params):
    """This rank's model on the mesh: its pipeline stage (tensor-parallel over mesh.tp when
    tp > 1) with pp > 1, else the tensor-parallel MLP (whole, at tp = 1)."""
    if mesh.pp.size > 1:
        return pipeline_stage(mesh.pp, params, mesh.tp)
    return tensor_parallel_model(mesh.tp, params)


# -- checkpoints ------------------------------------------------------------------------------
def resume(args, mesh, model, opt):
    """With --resume, load --checkpoint DIR into the model and the optimizer (each rank its
    blocks, whatever mesh saved them); returns the saved extra: the steps done, and the loss
    summed so far in their epoch. A fresh start when DIR does not exist yet."""
    fresh = {"step": 0, "loss_sum": 0.0}
    if not args.resume:
        return fresh
    try:
        return ringcoll.load_checkpoint(args.checkpoint, model.params, opt, mesh=mesh,
                                        shards=model.shards())
    except ringcoll.CheckpointError as exc:
        if exc.problem == "missing":  # nothing saved yet (a damaged one is "corrupt")
            return fresh
        raise


def save(args, mesh, model, opt, step, loss_sum):
    """Save the model and the optimizer to --checkpoint DIR after `step` steps."""
    total = float(mesh.comm.allreduce(np.array([loss_sum]))[0])  # every rank's share of it
    ringcoll.save_checkpoint(args.checkpoint, model.params, opt, mesh=mesh,
                             shards=model.shards(), extra={"step": step, "loss_sum": total})


# -- hybrid training ---------------------------------------------------------------------------
def train(mesh, args, data, log=None):
    """Train on the mesh; returns (this rank's parameters, the model's test accuracy, the
    per-epoch (loss, accuracy) history). Every rank of the mesh calls it."""
    x_train, y_train, x_test, y_test = (a.astype(args.dtype) if a.dtype.kind == "f" else a
                                        for a in data)
    dp, d = mesh.dp.size, mesh.dp.rank
    full = initial_params(args, data)  # the same on every rank (one seed)
    model = build_model(mesh, full)
    if mesh.pp.size > 1:
        poll = (default_poll(mesh.comm) if args.poll_us is None
                else args.poll_us / 1e6 or None)
        pipe = Pipeline(mesh.pp, model, args.schedule, poll=poll)
        args.poll = poll  # reported by main()
        first, last = pipe.first, pipe.last
    else:
        pipe, first, last = None, True, True
    reports = last and mesh.tp.rank == 0  # one rank per replica adds up the loss
    params = model.params  # this rank's shards or stage: what it updates
    bucket_kb = args.bucket_kb if args.bucket_kb is not None else (
        64 if pipe is not None else 25 * 1024)
    opt = ringcoll.DistributedOptimizer(
        ringcoll.optim.SGD(params, lr=args.lr, momentum=args.momentum), mesh.dp,
        bucket_bytes=max(1, int(bucket_kb * 1024)))
    done = resume(args, mesh, model, opt)  # the steps a checkpoint holds: skipped below
    history, step = [], 0
    for epoch, epoch_rows in enumerate(batches(args, len(x_train), dp), 1):
        if step + len(epoch_rows) <= done["step"]:
            step += len(epoch_rows)
            continue
        loss_sum = done["loss_sum"] if step < done["step"] and mesh.comm.rank == 0 else 0.0
        start = time.perf_counter()
        for rows in epoch_rows:
            step += 1
            if step <= done["step"]:
                continue
            share = len(rows) // dp
            mine = rows[d * share:(d + 1) * share]  # this replica's share of the batch
            scale = dp / len(rows)  # sum over the share * dp / batch, then averaged over dp
            if pipe is None:
                logits, cache = model.forward(x_train[mine])
                loss, dlogits = digits.loss_and_grad_logits(logits, y_train[mine], scale)
                _, grads = model.backward(dlogits, cache, input_grad=False)
            else:
                micro = [mine[sl] for sl in micro_batches(share, args.micro_batches)]
                # each layer's gradient goes to the optimizer when final (grad_ready): its
                # bucket's dp all-reduce overlaps the last micro-batch's remaining backward
                res = pipe.run([len(m) for m in micro],
                               inputs=[x_train[m] for m in micro] if first else None,
                               loss=(lambda j, y: digits.loss_and_grad_logits(
                                   y, y_train[micro[j]], scale)) if last else None,
                               grad_ready=opt.grad_ready)
                loss, grads = sum(res.losses), None  # handed over already
            opt.step(grads)  # averaged over mesh.dp
            loss_sum += loss / dp if reports else 0.0
            if args.checkpoint and step % args.save_every == 0:
                save(args, mesh, model, opt, step, loss_sum)
        # one reporting rank per replica adds its share: the mean loss of the global batches
        loss = float(mesh.comm.allreduce(np.array([loss_sum / len(epoch_rows)]))[0])
        acc = evaluate(mesh, model, pipe, x_test, y_test)
        history.append((loss, acc))
        if log is not None:
            log(f"epoch {epoch:3d}  {time.perf_counter() - start:5.2f} s  loss "
                f"{loss:.4f}  test accuracy {100 * acc:5.1f}%")
    acc = history[-1][1] if history else evaluate(mesh, model, pipe, x_test, y_test)
    return params, acc, history


def evaluate(mesh, model, pipe, x, y):
    """Test accuracy of the parallel model itself (the same on every rank)."""
    if pipe is None:
        logits, _ = model.forward(x)  # tensor parallel: every tp rank gets the logits
        return float((logits.argmax(axis=1) == y).mean())
    out = pipe.forward_only([len(x)], inputs=[x] if pipe.first else None)
    acc = np.array([float((out.outputs[0].argmax(axis=1) == y).mean()) if pipe.last else 0.0])
    mesh.pp.broadcast(acc, root=mesh.pp.size - 1)
    return float(acc[0])


def compare(mesh, params, ref_params, model_kind):
    """The largest |this run - the single-process run| over every parameter of every rank."""
    if model_kind == "pp":
        expected = pipeline_stage(mesh.pp, ref_params, mesh.tp).params  # the same shards
    else:
        expected = tensor_parallel_model(mesh.tp, ref_params).params
    mine = max(float(np.abs(params[k].astype(np.float64) - expected[k]).max()) for k in params)
    return float(mesh.comm.allreduce(np.array([mine]), op="max")[0])


def main(argv=None):
    args = parse(argv)
    comm = ringcoll.Communicator()
    mesh = ringcoll.Mesh(comm, dp=args.dp, tp=args.tp, pp=args.pp)
    show = comm.rank == 0
    if show and not args.quiet:
        print(mesh, flush=True)
    data = digits.load_data(args.seed)
    log = (lambda line: print(line, flush=True)) if show and not args.quiet else None
    start = time.perf_counter()
    params, acc, _ = train(mesh, args, data, log)
    elapsed = time.perf_counter() - start
    ref_params, ref_acc = reference(args, data, mesh.dp.size)
    diff = compare(mesh, params, ref_params, "pp" if mesh.pp.size > 1 else "tp")
    ok = diff <= args.tolerance
    if show:
        shape = " x ".join(f"{a}={mesh.shape[a]}" for a in ("dp", "tp", "pp")
                           if mesh.shape[a] > 1) or "1 process"
        wait = f"receives polled every {1e6 * args.poll:g} us" if getattr(args, "poll", None) \
            else "blocking receives"
        extra = (f", {args.schedule}, {args.micro_batches} micro-batches, {wait}"
                 if mesh.pp.size > 1 else "")
        print(f"hybrid {shape}{extra}: final test accuracy {100 * acc:.2f}% after "
              f"{args.epochs} epochs ({elapsed:.1f} s; single process: {100 * ref_acc:.2f}%); "
              f"parameters vs the single-process run: max abs diff {diff:.2e} "
              f"({args.dtype}, tolerance {args.tolerance:.0e}): {'PASS' if ok else 'FAIL'}",
              flush=True)
    mesh.close()
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
