"""Hybrid (data x tensor, data x pipeline) training, in both tiers.

- Thread tier: scripts/train_hybrid.py's train() on 4 thread ranks, on synthetic data, at
  dp x tp = 2 x 2 and 1 x 4, dp x pp = 2 x 2 (1F1B and GPipe) and 1 x 4, dp = 4, and
  tp x pp = 2 x 2 (tensor-parallel stages; all three axes: tests/test_hybrid3d.py): every
  rank's parameters (its shards or its stage's layers) equal the same slices of a
  single-process run of the same loop and seed (float64, 1e-10), and so does the accuracy.
- MPI tier: tests/mpi_parallel.py at -n 4 (the tensor-parallel, pipeline and mesh checks of
  tests/_parallel_cases.py on 4 processes), and the example itself,
  `mpiexec -n 4 python scripts/train_hybrid.py --dp 2 --tp 2` (and `--dp 2 --pp 2`) on the
  digits, 20 epochs: PASS against the single-process run, and the data-parallel example's
  accuracy (scripts/train_digits.py at -n 4: 98.05%).
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import ringcoll

import _mpirun as mpirun

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_hybrid  # noqa: E402

PARALLEL_CHECKS = 16  # 'OK ...' lines of tests/mpi_parallel.py
TIMEOUT = 60


def synthetic(n=240, n_test=60, features=20, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + n_test, features)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1) + (x[:, 10] > 1)) % 10  # learnable, 10 classes
    return x[:n], y[:n], x[n:], y[n:]


@pytest.mark.parametrize("dp,tp,pp,schedule,hidden", [
    (2, 2, 1, "1f1b", [24, 16]), (1, 4, 1, "1f1b", [24, 16]), (4, 1, 1, "1f1b", [24, 16]),
    (2, 1, 2, "1f1b", [24, 16]), (2, 1, 2, "gpipe", [24, 16]), (1, 1, 4, "1f1b", [24, 16, 12]),
    (1, 2, 2, "1f1b", [24, 16]), (1, 2, 2, "gpipe", [24, 16, 12]),
])
def test_hybrid_training_equals_one_process(dp, tp, pp, schedule, hidden):
    args = train_hybrid.parse(["--epochs", "2", "--batch", "24", "--dtype", "float64",
                               "--micro-batches", "3", "--schedule", schedule,
                               "--hidden", *map(str, hidden)])
    data = synthetic()
    ref_params, ref_acc = train_hybrid.reference(args, data, dp)

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=dp, tp=tp, pp=pp)
        params, acc, history = train_hybrid.train(mesh, args, data)
        diff = train_hybrid.compare(mesh, params, ref_params, "pp" if pp > 1 else "tp")
        return diff, acc, len(history), sorted(params)

    results = ringcoll.run_threads(4, body, timeout=TIMEOUT)
    for rank, (diff, acc, epochs, names) in enumerate(results):
        assert diff < 1e-10, f"rank {rank}: max abs diff {diff:.2e}"
        assert acc == ref_acc and epochs == 2
    held = sorted({name for *_, names in results for name in names})
    assert held == sorted(ref_params)  # together the ranks hold every parameter


def test_the_comparison_sees_a_wrong_run():
    """compare() is not blind: one rank's parameter nudged by 1e-6 shows up on every rank."""
    args = train_hybrid.parse(["--epochs", "1", "--batch", "24", "--dtype", "float64",
                               "--hidden", "24", "16"])
    data = synthetic()
    ref_params, _ = train_hybrid.reference(args, data, 2)

    def body(comm):
        mesh = ringcoll.Mesh(comm, dp=2, tp=2)
        params, _, _ = train_hybrid.train(mesh, args, data)
        if comm.rank == 3:
            params["W1"][0, 0] += 1e-6
        return train_hybrid.compare(mesh, params, ref_params, "tp")

    assert all(1e-7 < d < 2e-6 for d in ringcoll.run_threads(4, body, timeout=TIMEOUT))


# -- MPI tier -----------------------------------------------------------------------------------
@mpirun.needs_mpi
def test_model_parallel_checks_under_mpiexec(mpi_timings):
    rc, out, secs = mpirun.launch(4, ["tests/mpi_parallel.py"], env={"RINGCOLL_TIMEOUT": "60"},
                                  timeout=120)
    mpi_timings["mpi_parallel -n 4"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == PARALLEL_CHECKS, out[-4000:]


@mpirun.needs_mpi
@pytest.mark.parametrize("flags", [["--dp", "2", "--tp", "2"], ["--dp", "2", "--pp", "2"]])
def test_hybrid_example_matches_one_process_and_learns(flags, mpi_timings):
    pytest.importorskip("sklearn", reason="the example needs scikit-learn ([test] installs it)")
    argv = ["scripts/train_hybrid.py", *flags, "--dtype", "float64", "-q"]
    rc, out, secs = mpirun.launch(4, argv, env={"RINGCOLL_TIMEOUT": "120"}, timeout=300)
    mpi_timings[f"train_hybrid -n 4 {' '.join(flags)}"] = secs
    assert rc == 0, out[-4000:]
    line = re.search(r"final test accuracy ([\d.]+)%.*single process: ([\d.]+)%\).*"
                     r"max abs diff (\S+) \(float64, tolerance 1e-10\): PASS", out)
    assert line, out[-4000:]
    accuracy, single, diff = (float(v) for v in line.groups())
    assert diff < 1e-10 and accuracy == single, out[-2000:]
    assert accuracy >= 98.0, out[-2000:]  # the data-parallel example's 98.05% at -n 4
