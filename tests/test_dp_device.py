"""DistributedOptimizer, compression and the broadcasts on CuPy parameters, on the CPU: the
parameters, buckets, compression buffers and optimizer state live in tests/_fake_cupy.py's
"device" arrays (which refuse NumPy functions and mixing with NumPy arrays, as CuPy's do), and
the collectives run on thread ranks behind _fake_cupy.StagedComm, staged through the host.

Each run is compared with the same run on NumPy parameters over the plain Communicator: the
code path is one, so the results must agree bit for bit (gradients are small integers, so the
sums are exact). tests/mpi_dp_xp.py trains an MLP written once over the array module under
mpiexec, against one process on the global batch: here with NumPy, in scripts/gpu_check.sh
with CuPy through the real Communicator.
"""

import sys

import numpy as np
import pytest

import ringcoll
from ringcoll import InvalidArgumentError
from ringcoll.compression import Compression
from ringcoll.optim import SGD, Adam

import _fake_cupy
import _mpirun as mpirun

TIMEOUT = 20
MODEL = [("w1", (6, 5), np.float32), ("b1", (5,), np.float32), ("w2", (5, 3), np.float32),
         ("b2", (3,), np.float32)]
STEPS = 4


@pytest.fixture
def cp(monkeypatch):
    fake = _fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


def make_params(dtype=None):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(dtype or d) for n, s, d in MODEL}


def grads_for(params, rank, step):
    rng = np.random.default_rng([rank, step])
    return {n: rng.integers(-8, 9, p.shape).astype(p.dtype) for n, p in params.items()}


def train(p, device, opt_cls, hyper, wrapper, cp=None, dtype=None):
    """STEPS steps of data-parallel training on p thread ranks, gradients handed over last
    layer first; returns each rank's (parameters, optimizer state) on the host, and checks on
    the way that nothing left the device."""

    def fn(comm):
        params = make_params(dtype)
        if device:
            params = {n: cp.asarray(a) for n, a in params.items()}
            comm = _fake_cupy.StagedComm(comm)
        opt = ringcoll.DistributedOptimizer(opt_cls(params, **hyper), comm, **wrapper)
        passes = wrapper.get("backward_passes_per_step", 1)
        for step in range(STEPS):
            for k in range(passes):
                grads = grads_for(params, comm.rank, step * passes + k)
                for name in reversed(list(params)):
                    g = cp.asarray(grads[name]) if device else grads[name]
                    opt.grad_ready(name, g)
            opt.step()
        opt.flush()
        if device:
            kinds = {type(b.buf) for b in opt.buckets} | {type(v) for v in params.values()}
            kinds |= {type(v) for st in opt.optimizer.state.values() for k, v in st.items()
                      if k != "step"}
            kinds |= {type(a) for b in opt.buckets for a in b.state.values()}
            assert kinds == {cp.ndarray}, kinds
        host = {n: cp.asnumpy(a) if device else a for n, a in params.items()}
        state = {n: {k: v if k == "step" else (cp.asnumpy(v) if device else v)
                     for k, v in st.items()} for n, st in opt.optimizer.state.items()}
        return host, state

    return ringcoll.run_threads(p, fn, timeout=TIMEOUT)


CASES = [
    (SGD, dict(lr=0.05, momentum=0.9), {}),
    (Adam, dict(lr=0.01), dict(bucket_bytes=64)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True), dict(backward_passes_per_step=2)),
    (Adam, dict(lr=0.01, weight_decay=0.1, decoupled=True), dict(staleness=1)),
    (SGD, dict(lr=0.05), dict(compression=Compression.fp16, bucket_bytes=100)),
    (SGD, dict(lr=0.05, momentum=0.5), dict(compression=Compression.topk(0.3))),
    (SGD, dict(lr=0.05), dict(op="sum", staleness=2, bucket_bytes=64)),
]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("opt_cls,hyper,wrapper", CASES, ids=str)
def test_device_training_equals_the_numpy_run_bitwise(cp, p, opt_cls, hyper, wrapper):
    want = train(p, False, opt_cls, hyper, wrapper)
    got = train(p, True, opt_cls, hyper, wrapper, cp)
    for r in range(p):
        for name, a in want[r][0].items():
            assert got[r][0][name].tobytes() == a.tobytes(), (r, name)
        for name, st in want[r][1].items():
            for key, v in st.items():
                g = got[r][1][name][key]
                assert (g == v) if key == "step" else g.tobytes() == v.tobytes(), (r, name, key)
    assert all(got[r][0][n].tobytes() == got[0][0][n].tobytes() for r in range(p)
               for n in got[0][0])  # replicas identical


@pytest.mark.parametrize("wrapper", [{}, {"compression": Compression.fp16},
                                     {"staleness": 1}], ids=["plain", "fp16", "staleness"])
def test_bucket_allreduces_run_on_a_stream_of_their_own(cp, wrapper):
    """On a GPU every bucket's all-reduce is called on the buckets' own stream, which first
    waits for the compute stream (the gradients written), and the compute stream waits for
    it before the update: the backward's kernels are never queued behind a collective.
    Checked on the fake's stream log, over a 2-rank run whose results stay those of the
    NumPy run."""

    def fn(comm):
        params = {n: cp.asarray(a) for n, a in make_params().items()}
        staged = _fake_cupy.StagedComm(comm, cuda=cp.cuda)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), staged, bucket_bytes=64,
                                            **wrapper)
        for step in range(STEPS):
            grads = grads_for(params, comm.rank, step)
            for name in reversed(list(params)):
                opt.grad_ready(name, cp.asarray(grads[name]))
            opt.step()
        opt.flush()
        return {n: cp.asnumpy(a) for n, a in params.items()}, len(opt.buckets)

    results = ringcoll.run_threads(2, fn, timeout=TIMEOUT)
    log = cp.cuda.log  # both ranks' entries, interleaved: checked per stream name
    calls = [e for e in log if e[0] == "call"]
    buckets = results[0][1]
    assert buckets > 1 and len(calls) >= 2 * STEPS * buckets  # one call per bucket and step
    streams = {stream for _, _, stream in calls}
    assert "null" not in streams and len(streams) == 2, calls  # one stream per rank's buckets
    for s in streams:
        mine = [e for e in log if s in e[1:]]
        # before each call its stream waited for the compute (null) stream ...
        for i, e in enumerate(mine):
            if e[0] == "call":
                assert ("wait", s, "null") in mine[:i], mine[:i + 1]
        # ... and the compute stream waited for it as often as a bucket finished
        assert mine.count(("wait", "null", s)) == \
            sum(1 for e in mine if e[0] == "call"), mine
    reference = train(2, False, SGD, {"lr": 0.1}, {"bucket_bytes": 64, **wrapper})
    for (got, _), (want, _) in zip(results, reference):
        for n in want:
            np.testing.assert_array_equal(got[n], want[n])


def test_float16_parameters_on_the_device(cp):
    want = train(2, False, Adam, dict(lr=0.01), {}, dtype=np.float16)
    got = train(2, True, Adam, dict(lr=0.01), {}, cp, dtype=np.float16)
    for name, a in want[0][0].items():
        assert got[0][0][name].dtype == np.float16
        assert got[0][0][name].tobytes() == a.tobytes(), name


def test_wrong_memories_are_refused_naming_the_fix(cp):
    def fn(comm):
        comm = _fake_cupy.StagedComm(comm)
        mixed = {"w": cp.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
        with pytest.raises(InvalidArgumentError, match=r"\['b'\] are not where the first one "
                                                       r"is \(on the GPU"):
            ringcoll.DistributedOptimizer(SGD(mixed, lr=0.1), comm)
        opt = ringcoll.DistributedOptimizer(SGD({"w": cp.zeros(3, np.float32)}, lr=0.1), comm)
        with pytest.raises(InvalidArgumentError, match="gradient of 'w' is on the host"):
            opt.grad_ready("w", np.ones(3, np.float32))
        if Compression.bf16 is not None:
            with pytest.raises(InvalidArgumentError, match="bf16 has no GPU form"):
                ringcoll.DistributedOptimizer(SGD({"w": cp.zeros(3, np.float32)}, lr=0.1),
                                              comm, compression=Compression.bf16)

    ringcoll.run_threads(2, fn, timeout=TIMEOUT)


def test_wrapper_checkpoint_from_the_device_resumes_bitwise(cp):
    """Save mid-accumulation with top-k's residual and a step in flight (staleness needs no
    residual compressor, so two wrappers), through host arrays as a checkpoint file holds
    them, into fresh device wrappers: the resumed run is the uninterrupted one."""

    def fn(comm):
        comm = _fake_cupy.StagedComm(comm)
        results = []
        for wrapper in (dict(compression=Compression.topk(0.3), backward_passes_per_step=2),
                        dict(staleness=1)):
            runs = []
            for resume in (False, True):
                params = {n: cp.asarray(a) for n, a in make_params().items()}
                opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.05, momentum=0.9), comm,
                                                    **wrapper)
                passes = wrapper.get("backward_passes_per_step", 1)
                for i in range(3 * passes + 1):  # three steps and one pass of the fourth
                    grads = grads_for(make_params(), comm.rank, i)
                    for name in reversed(list(params)):
                        opt.grad_ready(name, cp.asarray(grads[name]))
                    if (i + 1) % passes == 0:
                        opt.step()
                    if resume and i == 3 * passes:  # checkpoint: host arrays, new objects
                        wsd = opt.wrapper_state_dict()
                        kinds = {k.split("/")[1].rstrip("0123456789") for k in wsd["arrays"]}
                        assert kinds == ({"grads", "residual"} if passes == 2 else {"pending"})
                        assert all(type(a) is cp.ndarray for a in wsd["arrays"].values())
                        wsd["arrays"] = {k: cp.asnumpy(a) for k, a in wsd["arrays"].items()}
                        sd = opt.optimizer.state_dict()
                        held = {n: cp.asnumpy(a) for n, a in params.items()}
                        params = {n: cp.asarray(a) for n, a in held.items()}
                        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.05, momentum=0.9),
                                                            comm, **wrapper)
                        opt.optimizer.load_state_dict(sd)
                        opt.load_wrapper_state_dict(wsd)
                if passes == 2:  # the fourth step's second pass
                    grads = grads_for(make_params(), comm.rank, 99)
                    for name in reversed(list(params)):
                        opt.grad_ready(name, cp.asarray(grads[name]))
                    opt.step()
                opt.flush()
                runs.append({n: cp.asnumpy(a) for n, a in params.items()})
            results.append(all(runs[0][n].tobytes() == runs[1][n].tobytes() for n in runs[0]))
        return results

    assert ringcoll.run_threads(2, fn, timeout=TIMEOUT) == [[True, True]] * 2


def test_broadcasts_of_device_parameters_and_optimizer_state(cp):
    def fn(comm):
        comm = _fake_cupy.StagedComm(comm)
        params = {n: cp.asarray(a * (comm.rank + 1)) for n, a in make_params().items()}
        ringcoll.broadcast_parameters(params, root=1, comm=comm)
        assert all(type(a) is cp.ndarray for a in params.values())
        after = {n: cp.asnumpy(a) for n, a in params.items()}
        opt = Adam(params, lr=0.01)
        if comm.rank == 1:  # only the root has state: the others get it, on their device
            opt.step({n: cp.asarray(g) for n, g in grads_for(make_params(), 1, 0).items()})
        ringcoll.broadcast_optimizer_state(opt, root=1, comm=comm)
        state = opt.state["w1"]
        assert type(state["exp_avg"]) is cp.ndarray and state["step"] == 1
        return after, cp.asnumpy(state["exp_avg"]), cp.asnumpy(state["exp_avg_sq"])

    out = ringcoll.run_threads(3, fn, timeout=TIMEOUT)
    want = {n: a * 2 for n, a in make_params().items()}  # root 1's parameters
    for r, (params, m, v) in enumerate(out):
        assert all(params[n].tobytes() == want[n].tobytes() for n in want), r
        assert m.tobytes() == out[1][1].tobytes() and v.tobytes() == out[1][2].tobytes(), r
        assert m.any() and v.any()


# -- the same training under mpiexec, written once over xp (the GPU check runs it on CuPy) ---
@mpirun.needs_mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_mpi_dp_xp_numpy(nprocs, mpi_timings):
    rc, out, secs = mpirun.launch(nprocs, ["tests/mpi_dp_xp.py", "--xp", "numpy"], timeout=120)
    mpi_timings[f"mpi_dp_xp numpy -n {nprocs}"] = secs
    assert rc == 0, f"mpiexec -n {nprocs} tests/mpi_dp_xp.py --xp numpy: rc {rc}\n{out[-4000:]}"
    assert f"mpi_dp_xp numpy p={nprocs}: 6 cases, 0 failures" in out, out[-3000:]
    assert out.count("OK numpy") == 6, out[-3000:]


def test_checkpoint_of_device_training_resumes_bitwise_on_either_memory(cp, tmp_path):
    """save_checkpoint from CuPy parameters, Adam state and top-k residuals (written from the
    host); load_checkpoint into fresh device objects and into host objects: both continue as
    the uninterrupted run, bit for bit."""
    wrapper = dict(compression=Compression.topk(0.3))

    def fn(comm):
        comm = _fake_cupy.StagedComm(comm)
        path = str(tmp_path / "ckpt")

        def build(device):
            params = make_params()
            params = {n: cp.asarray(a) for n, a in params.items()} if device else params
            return params, ringcoll.DistributedOptimizer(Adam(params, lr=0.01), comm, **wrapper)

        def steps(params, opt, first, last, device):
            for i in range(first, last):
                grads = grads_for(make_params(), comm.rank, i)
                for name in reversed(list(params)):
                    opt.grad_ready(name, cp.asarray(grads[name]) if device else grads[name])
                opt.step()

        params, opt = build(True)
        steps(params, opt, 0, 3, True)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, extra={"step": 3})
        steps(params, opt, 3, 6, True)
        out = [{n: cp.asnumpy(a) for n, a in params.items()}]
        for device in (True, False):
            fresh, fresh_opt = build(device)
            assert ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm) == {"step": 3}
            assert all((type(a) is cp.ndarray) == device for a in fresh.values())
            steps(fresh, fresh_opt, 3, 6, device)
            out.append({n: cp.asnumpy(a) if device else a for n, a in fresh.items()})
        return [all(o[n].tobytes() == out[0][n].tobytes() for n in o) for o in out[1:]]

    assert ringcoll.run_threads(2, fn, timeout=TIMEOUT) == [[True, True]] * 2


@pytest.mark.parametrize("options", [dict(period=2), dict(period=3, average_state=True),
                                     dict(period=2, outer_lr=0.7, outer_momentum=0.5,
                                          nesterov=True)], ids=str)
def test_local_sgd_on_the_device_equals_the_numpy_run(cp, options):
    def fn(comm, device):
        params = make_params()
        if device:
            params = {n: cp.asarray(a) for n, a in params.items()}
            comm = _fake_cupy.StagedComm(comm)
        opt = ringcoll.LocalSGD(Adam(params, lr=0.01), comm, **options)
        for step in range(6):
            grads = grads_for(make_params(), comm.rank, step)
            opt.step({n: cp.asarray(g) if device else g for n, g in grads.items()})
        if device:
            assert all(type(a) is cp.ndarray for a in params.values())
            assert all(type(v) is cp.ndarray for st in opt.optimizer.state.values()
                       for k, v in st.items() if k != "step")
        return {n: cp.asnumpy(a) if device else a for n, a in params.items()}

    want = ringcoll.run_threads(3, lambda c: fn(c, False), timeout=TIMEOUT)
    got = ringcoll.run_threads(3, lambda c: fn(c, True), timeout=TIMEOUT)
    for r in range(3):
        assert all(got[r][n].tobytes() == want[r][n].tobytes() for n in want[r]), r
