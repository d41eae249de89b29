"""Torch tier: real `mpiexec -n P python tests/mpi_torch.py` launches of ringcoll's
torch.distributed backend ("ringcoll", ringcoll/torch), P in 1, 2, 3, 4.

One launch per P runs every group of checks of tests/mpi_torch.py (every rank checks against
NumPy on inputs gathered with mpi4py, against a gloo group of the same job where simpler, and that
all ranks agree bitwise); a second launch at P = 3 runs the "errors" group with
RINGCOLL_DEBUG=1 (mismatched calls across ranks must raise, not hang). test_torch_launch asserts
each launch's exit status, test_torch_group reports each group's failures on its own, so one broken
collective does not hide the others. A third kind of launch, at P = 1, 2, 3, runs the same
groups with --fake-device: every tensor through the backend's GPU path (CuPy-like views,
bfloat16 widened, host-staged sends, streams handed to each call and settled), on
tests/_fake_torch_cuda.py's fake device arrays. Every launch has a deadline: a hang kills its
process group and fails the test. The launches' wall times, and what they measured (DDP's
distance to its one-process reference), are printed in pytest's summary.

The launches inherit no MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE: init_process_group("ringcoll")
must work without them. To check the oracles themselves, run the worker on gloo:
    mpiexec -n 3 python tests/mpi_torch.py --backend gloo
(what gloo cannot do is skipped there and counted on stdout).
"""

import ast
import json
import re
from pathlib import Path

import pytest

import _mpirun as mpirun

pytest.importorskip("torch", reason="the torch tier needs PyTorch (pip install torch, CPU "
                    "wheel: --index-url https://download.pytorch.org/whl/cpu); ringcoll itself "
                    "does not")
pytest.importorskip("torch.distributed", reason="this PyTorch build has no torch.distributed")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mpi_torch.py"
PS = [1, 2, 3, 4]
LIGHT = {3, 4}  # more ranks than the 2 cores: fewer cases (every size, root, mode still)
ERROR_PS = [3]
FAKE_DEVICE_PS = [1, 2, 3]  # the GPU path's code on CPU tensors (tests/_fake_torch_cuda.py)
LAUNCH_TIMEOUT = 150  # seconds per launch: a hang fails instead of blocking
GROUPS = ["init", "all_reduce", "all_reduce_floats", "all_reduce_complex", "coalesced",
          "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "all_to_all", "gather_scatter", "barrier", "p2p", "objects", "noncontig", "unsupported",
          "subgroups", "device_mesh", "functional", "ddp", "avg_integers", "sparse"]
ERROR_GROUPS = ["errors"]
NOTHING_AT_1 = {"p2p"}  # no peer to send to at P=1
TORCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

pytestmark = mpirun.needs_mpi
_RUNS = {}


@pytest.fixture
def torch_run(tmp_path_factory, mpi_timings, mpi_notes):
    """The (cached) launch of mpi_torch.py at P ranks: kind "main" (GROUPS), "fake-device"
    (GROUPS, every tensor through the backend's GPU path on fake device arrays) or
    "errors"."""

    def get(nprocs, kind="main"):
        key = (nprocs, kind)
        if key not in _RUNS:
            d = tmp_path_factory.mktemp(f"torch{nprocs}{kind}")
            report = d / "report.json"
            extra, env = [], {}
            if kind == "errors":
                extra += ["--groups", ",".join(ERROR_GROUPS)]
                env["RINGCOLL_DEBUG"] = "1"
            else:
                if kind == "fake-device":
                    extra.append("--fake-device")
                if nprocs in LIGHT:
                    extra.append("--light")
            args = [WORKER, "--report", report, "--sync-timeout", "60", *extra]
            with pytest.MonkeyPatch.context() as mp:
                for var in TORCH_ENV:
                    mp.delenv(var, raising=False)
                rc, out, secs = mpirun.launch(nprocs, args, env=env, timeout=LAUNCH_TIMEOUT)
            what = " ".join([f"{k}={v}" for k, v in env.items()] + [f"mpiexec -n {nprocs}",
                                                                    WORKER.name, *extra])
            mpi_timings[what] = secs
            data = json.loads(report.read_text()) if report.exists() else None
            for group, rep in (data or {}).items():
                mpi_notes.extend(f"P={nprocs} [{group}] {n}" for n in rep.get("notes", []))
            _RUNS[key] = (rc, out, secs, data)
        return _RUNS[key]

    return get


def tail(text, n=120):
    return "\n".join(text.splitlines()[-n:])


LAUNCHES = ([(p, "main") for p in PS] + [(p, "fake-device") for p in FAKE_DEVICE_PS]
            + [(p, "errors") for p in ERROR_PS])


@pytest.mark.parametrize("nprocs,kind", LAUNCHES)
def test_torch_launch(nprocs, kind, torch_run):
    rc, out, secs, _ = torch_run(nprocs, kind)
    assert rc == 0, (f"mpiexec -n {nprocs} {WORKER.name} ({kind}) exited with {rc} after "
                     f"{secs:.1f} s; output:\n{tail(out)}")


CASES = ([(p, g, "main") for p in PS for g in GROUPS]
         + [(p, g, "fake-device") for p in FAKE_DEVICE_PS for g in GROUPS]
         + [(p, g, "errors") for p in ERROR_PS for g in ERROR_GROUPS])


@pytest.mark.parametrize("nprocs,group,kind", CASES)
def test_torch_group(nprocs, group, kind, torch_run):
    if nprocs == 1 and group in NOTHING_AT_1:
        pytest.skip(f"{group}: nothing to check with one rank")
    rc, out, secs, report = torch_run(nprocs, kind)
    assert report is not None, f"no report from mpiexec -n {nprocs} (rc {rc}):\n{tail(out)}"
    assert group in report, (f"group {group} did not run (an earlier group hung or the job "
                             f"aborted; rc {rc}):\n{tail(out)}")
    rep = report[group]
    assert rep["checks"] > 0, f"group {group} checked nothing"
    assert not rep["failures"], (f"{len(rep['failures'])} failure(s) in {group} at P={nprocs} "
                                 f"({rep['checks']} checks):\n" + "\n".join(rep["failures"][:30]))


def _worker_list(name):
    tree = ast.parse(WORKER.read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", None) == name)


def test_worker_groups_match():
    """The groups listed here are exactly the ones mpi_torch.py runs."""
    assert _worker_list("GROUPS") == GROUPS
    assert _worker_list("ERROR_GROUPS") == ERROR_GROUPS


@pytest.mark.parametrize("script, nprocs", [("scripts/torch_ddp_digits.py", 3),
                                            ("scripts/torch_fsdp_digits.py", 2)])
def test_torch_example_scripts_run(script, nprocs, mpi_timings):
    """The PyTorch examples train and end with their own replica checks (exit 1 if replicas or
    shards differ): two epochs here, with the accuracy they print rising above chance."""
    pytest.importorskip("sklearn", reason="the examples load scikit-learn's digits")
    rc, out, secs = mpirun.launch(nprocs, [script, "-q", "--epochs", "2"],
                                  env={"RINGCOLL_TIMEOUT": "60"}, timeout=240)
    mpi_timings[f"{script} -n {nprocs}"] = secs
    assert rc == 0, out[-4000:]
    accuracies = [float(a) for a in re.findall(r"^epoch .* test accuracy\s+([\d.]+)%", out, re.M)]
    assert len(accuracies) == 2 and accuracies[-1] > 50, out[-4000:]
