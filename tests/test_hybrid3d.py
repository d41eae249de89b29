"""dp x tp x pp together: pipeline stages of tensor-parallel layers, gradients averaged over dp,
the dp all-reduce overlapped with the last micro-batch's backward.

- Thread tier: scripts/train_hybrid.py's train() at dp x tp x pp = 2 x 2 x 2 (8 thread ranks,
  1F1B and GPipe), 1 x 2 x 2, 1 x 3 x 2 (uneven tp splits; stage 0 holds layers 0-2 and
  ends on a gathered column layer) and 2 x 2 x 2 with m = 1: every rank's shards of its stage
  equal the same slices of the single-process run (float64, 1e-10), the accuracy and the
  loss history are the one-process run's. Checkpoints of tp-split stages: saved at 2 x 2 x 2,
  resumed there, at 1 x 2 x 2 and in one process, each ending on the single-process run.
- The hook: Pipeline.run(grad_ready=) hands over every parameter once, its final sum, during
  the stage's last backward action, layer by layer; with DistributedOptimizer.grad_ready a
  bucket's all-reduce has started before the stage's last backward action finished (the
  order of calls on each thread: deterministic).
- MPI tier: `mpiexec -n 8 python scripts/train_hybrid.py --dp 2 --tp 2 --pp 2` (2 epochs,
  small layers): PASS against one process, the same accuracy.
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import ringcoll
from ringcoll.parallel import Pipeline, micro_batches

import _mpirun as mpirun
from test_hybrid import synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_hybrid  # noqa: E402

TIMEOUT = 60


def run_mesh(dp, tp, pp, argv, data):
    """train() on dp * tp * pp thread ranks; returns [(diff, acc, history, names)] per rank
    and the single-process run's (params, accuracy)."""
    args = train_hybrid.parse(argv)
    ref_params, ref_acc = train_hybrid.reference(args, data, dp)

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=dp, tp=tp, pp=pp)
        params, acc, history = train_hybrid.train(mesh, args, data)
        diff = train_hybrid.compare(mesh, params, ref_params, "pp" if pp > 1 else "tp")
        return diff, acc, history, sorted(params)

    return ringcoll.run_threads(dp * tp * pp, body, timeout=TIMEOUT), ref_params, ref_acc


def flags(epochs=2, micro=3, schedule="1f1b", hidden=(24, 16)):
    return ["--epochs", str(epochs), "--batch", "24", "--dtype", "float64", "--micro-batches",
            str(micro), "--schedule", schedule, "--hidden", *map(str, hidden)]


@pytest.mark.parametrize("dp,tp,pp,schedule,micro,hidden", [
    (2, 2, 2, "1f1b", 3, (24, 16)),
    (2, 2, 2, "gpipe", 3, (24, 16)),
    (2, 2, 2, "1f1b", 1, (24, 16)),          # one micro-batch: its backward is the last
    (1, 2, 2, "1f1b", 4, (24, 16)),
    (1, 3, 2, "1f1b", 3, (25, 17, 11, 9)),   # uneven tp splits; stage 0 ends on a column layer
])
def test_three_axes_equal_one_process(dp, tp, pp, schedule, micro, hidden):
    data = synthetic()
    results, ref_params, ref_acc = run_mesh(dp, tp, pp, flags(2, micro, schedule, hidden), data)
    # the (loss, accuracy) history of train() on one rank: no split at all
    (one,), _, _ = run_mesh(1, 1, 1, flags(2, micro, schedule, hidden), data)
    for rank, (diff, acc, history, _) in enumerate(results):
        assert diff < 1e-10, f"rank {rank}: max abs diff {diff:.2e}"
        assert acc == ref_acc and len(history) == 2
        assert history == results[0][2]  # every rank reports the same losses
        assert np.allclose(history, one[2], rtol=0, atol=1e-12), (history, one[2])
    held = sorted({name for *_, names in results for name in names})
    assert held == sorted(ref_params)


def test_the_comparison_sees_one_wrong_shard():
    """compare() on a tp-split stage is not blind: one rank's shard nudged by 1e-6."""
    args = train_hybrid.parse(flags(1))
    data = synthetic()
    ref_params, _ = train_hybrid.reference(args, data, 2)

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=2, tp=2, pp=2)
        params, _, _ = train_hybrid.train(mesh, args, data)
        if comm.rank == 7:  # pp 1, dp 1, tp 1: a shard of W2
            params["W2"][0, 0] += 1e-6
        return train_hybrid.compare(mesh, params, ref_params, "pp")

    assert all(1e-7 < d < 2e-6 for d in ringcoll.run_threads(8, body, timeout=TIMEOUT))


def test_checkpoints_of_tensor_parallel_stages_resume_and_reshard(tmp_path, monkeypatch):
    """Saved at 2 x 2 x 2 (each rank its stage's shards), resumed at 2 x 2 x 2, 1 x 2 x 2 and in
    one process: each run ends on the single-process parameters of its epochs, and each
    resume really loaded the checkpoint (the step it returned)."""
    data = synthetic()
    folder = str(tmp_path / "ck")
    loaded = []
    real_load = ringcoll.load_checkpoint

    def load(*a, **k):
        extra = real_load(*a, **k)
        loaded.append(extra["step"])
        return extra

    monkeypatch.setattr(ringcoll, "load_checkpoint", load)
    ck = ["--checkpoint", folder, "--save-every", "3"]  # 10 steps an epoch: saves every 3rd
    for dp, tp, pp, epochs, resume, step in [(2, 2, 2, 1, False, None), (2, 2, 2, 2, True, 9),
                                             (1, 2, 2, 3, True, 18), (1, 1, 1, 4, True, 30)]:
        loaded.clear()
        argv = flags(epochs) + ck + (["--resume"] if resume else [])
        results, _, ref_acc = run_mesh(dp, tp, pp, argv, data)
        for rank, (diff, acc, _, _) in enumerate(results):
            assert diff < 1e-10, f"{dp}x{tp}x{pp} rank {rank}: max abs diff {diff:.2e}"
            assert acc == ref_acc
        assert loaded == ([step] * dp * tp * pp if resume else [])


# -- the overlap hook ---------------------------------------------------------------------------
def logged_stage(mesh, params, events):
    """This rank's stage of train_hybrid's model, each layer's backward logged in events."""
    stage = train_hybrid.pipeline_stage(mesh.pp, params, mesh.tp)
    for k, layer in enumerate(stage.layers):
        def backward(dy, cache, input_grad=True, _real=layer.backward, _k=k):
            events.append(("backward", _k))
            return _real(dy, cache, input_grad=input_grad)
        layer.backward = backward
    return stage


def stage_inputs(pipe, m, rows=12, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 20))
    y = rng.integers(0, 10, rows)
    slices = micro_batches(rows, m)
    inputs = [x[sl] for sl in slices] if pipe.first else None
    loss = (lambda j, logits: train_hybrid.digits.loss_and_grad_logits(
        logits, y[slices[j]], 1.0 / rows)) if pipe.last else None
    return [sl.stop - sl.start for sl in slices], inputs, loss


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gradients_are_handed_over_once_final_layer_by_layer(schedule):
    """grad_ready gets every parameter once, as res.grads[name] (the sum over micro-batches),
    all during the stage's last backward action, the last layer's before the first layer's
    backward runs; a stage that is not a Sequential hands over after its whole backward."""
    m = 3

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=1, tp=2, pp=2)
        params = train_hybrid.initial_params(train_hybrid.parse(flags(1, hidden=(24, 16, 12))),
                                             synthetic())
        events = []
        stage = logged_stage(mesh, {k: v.astype(np.float64) for k, v in params.items()}, events)
        pipe = Pipeline(mesh.pp, stage, schedule)
        rows, inputs, loss = stage_inputs(pipe, m)
        handed = []

        def ready(name, grad):
            events.append(("ready", name))
            handed.append((name, grad))

        res = pipe.run(rows, inputs, loss, grad_ready=ready)
        assert sorted(n for n, _ in handed) == sorted(stage.params)
        assert all(g is res.grads[n] for n, g in handed)
        top = max(k for k, layer in enumerate(stage.layers) if layer.params)
        calls = [i for i, e in enumerate(events) if e == ("backward", top)]
        assert len(calls) == m
        last = events[calls[-1]:]  # the stage's last backward action
        assert all(e[0] == "backward" for e in events[:calls[-1]])  # nothing handed before
        assert [e[1] for e in last if e[0] == "ready"] == [
            n for layer in reversed(stage.layers) for n in layer.params]
        first_ready = last.index(("ready", next(iter(stage.layers[top].params))))
        assert ("backward", 0) in last[first_ready:]  # handed over before layer 0's backward
        t0 = res.timeline[-1][2]
        assert all(t0 <= res.final_at[n] <= res.timeline[-1][3] for n in stage.params)

        # without a Sequential: all at once, after the module's backward, still in the action
        class Opaque:
            def __init__(self, inner):
                self.inner, self.params = inner, inner.params
                self.in_features, self.out_features = inner.in_features, inner.out_features
                self.dtype = inner.dtype
                self.forward = inner.forward

            def backward(self, dy, cache, input_grad=True):
                return self.inner.backward(dy, cache, input_grad=input_grad)

        events.clear()
        handed.clear()
        res2 = Pipeline(mesh.pp, Opaque(stage), schedule).run(rows, inputs, loss,
                                                              grad_ready=ready)
        assert sorted(n for n, _ in handed) == sorted(stage.params)
        assert events[-len(handed):] == [("ready", n) for n, _ in handed]
        for n in stage.params:
            assert np.array_equal(res2.grads[n], res.grads[n])
        return True

    assert ringcoll.run_threads(4, body, timeout=TIMEOUT) == [True] * 4


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_dp_allreduce_starts_before_the_last_backward_finishes(schedule):
    """2 x 2 x 2, one bucket per parameter: right after the stage's last layer hands over its
    gradients, that layer's buckets' all-reduce (over mesh.dp) has started, and the backward
    of the stage's first layer comes after it in the same (the last) backward action. Then
    step() averages: both replicas end bitwise equal, and equal to a plain step(grads) on the
    dp-averaged gradients."""
    m = 3

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=2, tp=2, pp=2)
        full = {k: v.astype(np.float64) for k, v in train_hybrid.initial_params(
            train_hybrid.parse(flags(1, hidden=(24, 16, 12))), synthetic()).items()}
        events = []
        stage = logged_stage(mesh, full, events)
        opt = ringcoll.DistributedOptimizer(ringcoll.optim.SGD(stage.params, lr=0.1),
                                            mesh.dp, bucket_bytes=1)
        assert len(opt.buckets) == len(stage.params)  # one bucket per parameter
        pipe = Pipeline(mesh.pp, stage, schedule)
        rows, inputs, loss = stage_inputs(pipe, m, seed=5 + mesh.dp.rank)  # replicas differ

        def ready(name, grad):
            opt.grad_ready(name, grad)
            events.append(("ready", name, [b.index for b in opt.buckets
                                           if b.handle is not None]))

        res = pipe.run(rows, inputs, loss, grad_ready=ready)
        top = max(k for k, layer in enumerate(stage.layers) if layer.params)
        readies = [i for i, e in enumerate(events) if e[0] == "ready"]
        started = next(i for i in readies if events[i][2])  # a bucket's all-reduce started
        assert events[started][1] in stage.layers[top].params
        assert events[started][2] == [0, 1]  # the last layer's bias and weight, in order
        assert ("backward", 0) in events[started:]  # the stage's backward was still running
        grads = {n: g.copy() for n, g in res.grads.items()}
        before = {n: p.copy() for n, p in stage.params.items()}
        opt.step()
        mean = {n: mesh.dp.allreduce(g, op="avg") for n, g in grads.items()}
        for n, p in stage.params.items():
            assert np.allclose(p, before[n] - 0.1 * mean[n], rtol=0, atol=1e-14), n
        everyone = mesh.dp.allgather(np.concatenate([p.ravel() for p in stage.params.values()]))
        half = everyone.size // 2
        assert everyone[:half].tobytes() == everyone[half:].tobytes()  # replicas bitwise equal
        return True

    assert ringcoll.run_threads(8, body, timeout=TIMEOUT) == [True] * 8


# -- MPI tier -----------------------------------------------------------------------------------
@mpirun.needs_mpi
def test_three_axes_under_mpiexec_equal_one_process(mpi_timings):
    pytest.importorskip("sklearn", reason="the example needs scikit-learn ([test] installs it)")
    argv = ["scripts/train_hybrid.py", "--dp", "2", "--tp", "2", "--pp", "2", "--epochs", "2",
            "--hidden", "32", "16", "--dtype", "float64", "-q"]
    rc, out, secs = mpirun.launch(8, argv, env={"RINGCOLL_TIMEOUT": "60"}, timeout=180)
    mpi_timings["train_hybrid -n 8 --dp 2 --tp 2 --pp 2"] = secs
    assert rc == 0, out[-4000:]
    line = re.search(r"hybrid dp=2 x tp=2 x pp=2.*final test accuracy ([\d.]+)%.*single "
                     r"process: ([\d.]+)%\).*max abs diff (\S+) \(float64, tolerance 1e-10\): "
                     r"PASS", out)
    assert line, out[-4000:]
    accuracy, single, diff = (float(v) for v in line.groups())
    assert diff < 1e-10 and accuracy == single, out[-2000:]
