"""Checkpoints under real mpiexec: tests/mpi_checkpoint.py at 1..4 ranks, and a crash test.

mpi_checkpoint.py checks every load and save failure (the same CheckpointError on every rank,
fast, nothing changed, the communicator working), a loop of bad checkpoints, a
DistributedOptimizer resumed bitwise, and resharding (tp = P -> tp = 1 -> one process and
back), printing one 'OK ...' line per check.

The crash test trains scripts/train_hybrid.py at -n 2 (--dp 2, and --tp 2) with --checkpoint,
through tests/ckpt_crash.py, which makes one rank SIGKILL itself in the middle of a save
(after writing its shard file, before the commit; or between the commit's two renames). The
job must fail, fast; the checkpoint directory must still hold the previous complete
checkpoint; relaunched with --resume the run must end with the parameters of a run that never
crashed, bitwise; and resumed at another mesh (--tp 2, --pp 2, one process), within the
script's float64 tolerance.
"""

import glob
import json
import os
import shutil

import numpy as np
import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi
CHECKS = 29  # 'OK ...' lines mpi_checkpoint.py prints when everything holds
ENV = {"RINGCOLL_TIMEOUT": "20"}  # a hang fails in 20 s, not 10 minutes
# 3 epochs of 14 steps; a save every 5 steps: at 5, 10, ..., 40. The 3rd save (step 15) dies.
TRAIN = ["--epochs", "3", "--hidden", "32", "16", "--dtype", "float64", "-q", "--save-every",
         "5"]
KILLED_SAVE, STEP_BEFORE, LAST_SAVE = 3, 10, 40


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_checkpoint_checks_under_mpiexec(p, tmp_path, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_checkpoint.py", "--tmpdir", tmp_path],
                                  env=ENV, timeout=120)
    mpi_timings[f"mpi_checkpoint -n {p}"] = secs
    assert rc == 0, out[-6000:]
    assert "FAIL" not in out and out.count("OK ") == CHECKS, out[-6000:]


# -- the crash test ------------------------------------------------------------------------------
def run(nprocs, flags, mpi_timings, what, driver=(), timeout=90):
    argv = ["tests/ckpt_crash.py", *map(str, driver), *TRAIN, *map(str, flags)]
    rc, out, secs = mpirun.launch(nprocs, argv, env=ENV, timeout=timeout)
    flags = list(map(str, flags))
    mesh = " ".join(f"{f} {flags[i + 1]}" for i, f in enumerate(flags)
                    if f in ("--dp", "--tp", "--pp"))
    mpi_timings[f"train_hybrid -n {nprocs} {mesh}: {what}"] = secs
    return rc, out


def trained(nprocs, flags, tmp_path, mpi_timings, what, driver=()):
    """Run to the end (PASS against the single-process run); the whole final parameters."""
    out_file = tmp_path / f"params-{len(list(tmp_path.glob('params-*')))}.npz"
    rc, out = run(nprocs, flags, mpi_timings, what, [*driver, "--params-out", out_file])
    assert rc == 0 and "tolerance 1e-10): PASS" in out, out[-4000:]
    with np.load(out_file) as f:
        return {k: f[k] for k in f.files}


def step_of(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)["extra"]["step"]


_UNINTERRUPTED = {}


def uninterrupted(mesh, tmp_path, mpi_timings):
    """The final parameters of a run at mesh ("--dp 2" ...) without checkpoints (once)."""
    if mesh not in _UNINTERRUPTED:
        _UNINTERRUPTED[mesh] = trained(2, mesh.split(), tmp_path, mpi_timings,
                                       "no checkpoint")
    return _UNINTERRUPTED[mesh]


def bitwise(a, b):
    return sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def crash(mesh, rank, where, ckpt, mpi_timings):
    """Train at mesh with --checkpoint ckpt; `rank` dies in the KILLED_SAVE-th save."""
    driver = ["--kill-rank", rank, "--kill-save", KILLED_SAVE, "--kill-in", where]
    rc, out = run(2, [*mesh.split(), "--checkpoint", ckpt], mpi_timings,
                  f"--checkpoint, rank {rank} killed in save {KILLED_SAVE} ({where})", driver,
                  timeout=60)
    assert rc is not None, out[-4000:]  # mpiexec ended the job: no hang
    assert rc != 0 and "PASS" not in out, out[-4000:]
    assert f"ckpt_crash: rank {rank} killed" in out, out[-4000:]
    return out


@pytest.mark.parametrize("mesh,rank", [("--dp 2", 0), ("--tp 2", 1)])
def test_rank_killed_mid_save_resumes_bitwise(mesh, rank, tmp_path, mpi_timings):
    """The killed rank had written its shard file: the save was half done (in a pure dp run
    only rank 0 writes, the replica's blocks are the same)."""
    ckpt = str(tmp_path / "ckpt")
    crash(mesh, rank, "shard", ckpt, mpi_timings)
    assert step_of(ckpt) == STEP_BEFORE  # the previous checkpoint, whole
    half = glob.glob(ckpt + ".tmp-*")  # what the killed save left: its shard, no manifest
    assert len(half) == 1, os.listdir(tmp_path)
    left = os.listdir(half[0])
    assert f"shard-{rank:05d}.bin" in left and "manifest.json" not in left, left

    resumed = trained(2, [*mesh.split(), "--checkpoint", ckpt, "--resume"], tmp_path,
                      mpi_timings, "--checkpoint --resume")
    assert bitwise(resumed, uninterrupted(mesh, tmp_path, mpi_timings))
    assert step_of(ckpt) == LAST_SAVE and not glob.glob(ckpt + ".*")  # leftovers cleaned


def test_rank_killed_between_the_commit_renames_resumes_bitwise(tmp_path, mpi_timings):
    """Killed after the old checkpoint was renamed aside, before the new one took its place:
    no DIR, a complete DIR.old-*, which --resume loads."""
    ckpt = str(tmp_path / "ckpt")
    crash("--dp 2", 0, "commit", ckpt, mpi_timings)
    aside = glob.glob(ckpt + ".old-*")
    assert not os.path.exists(ckpt) and len(aside) == 1, os.listdir(tmp_path)
    assert step_of(aside[0]) == STEP_BEFORE

    resumed = trained(2, ["--dp", "2", "--checkpoint", ckpt, "--resume"], tmp_path,
                      mpi_timings, "--checkpoint --resume (from DIR.old-*)")
    assert bitwise(resumed, uninterrupted("--dp 2", tmp_path, mpi_timings))
    assert step_of(ckpt) == LAST_SAVE and not glob.glob(ckpt + ".*")


@pytest.fixture(scope="module")
def crashed_dp2(tmp_path_factory):
    """A checkpoint directory that a --dp 2 run killed in its 3rd save left behind."""
    ckpt = str(tmp_path_factory.mktemp("crashed") / "ckpt")
    timings = {}
    crash("--dp 2", 0, "shard", ckpt, timings)
    assert step_of(ckpt) == STEP_BEFORE
    return ckpt, timings


@pytest.mark.parametrize("nprocs,mesh", [(2, "--tp 2"), (2, "--pp 2"), (1, "--dp 1")])
def test_killed_dp_run_resumes_at_another_mesh(nprocs, mesh, crashed_dp2, tmp_path,
                                               mpi_timings):
    """Saved at --dp 2, resumed (resharded) at tp 2, pp 2 or on one process: the script's
    PASS (within 1e-10 of the single-process run), and within 1e-10 of the dp 2 run."""
    saved, timings = crashed_dp2
    mpi_timings.update({f"{k} (for the resumes at other meshes)": v
                        for k, v in timings.items()})
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    resumed = trained(nprocs, [*mesh.split(), "--checkpoint", ckpt, "--resume"], tmp_path,
                      mpi_timings, "--resume from the --dp 2 crash")
    expected = uninterrupted("--dp 2", tmp_path, mpi_timings)
    assert sorted(resumed) == sorted(expected)
    diff = max(float(np.abs(resumed[k] - expected[k]).max()) for k in expected)
    assert diff < 1e-10, diff
    assert step_of(ckpt) == LAST_SAVE
