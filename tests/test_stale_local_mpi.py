"""Bounded staleness and local SGD under real mpiexec: tests/mpi_stale_local.py at 1..4 ranks.

It trains the digits MLP (synthetic data) with DistributedOptimizer(staleness=0, 1, 2, 8 >
steps; fp16; a checkpoint with updates in flight) and LocalSGD (H = 1, 4, outer Nesterov
momentum; H = 1 against synchronous DP), against one-process references, bitwise identical
replicas. Thread-tier units: test_staleness.py, test_local_sgd.py.
"""

import re

import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi
CHECKS = 15  # 'OK ...' lines mpi_stale_local.py prints when everything holds


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_staleness_and_local_sgd_under_mpiexec(p, tmp_path, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_stale_local.py", "--tmpdir", tmp_path],
                                  env={"RINGCOLL_TIMEOUT": "60"}, timeout=300)
    mpi_timings[f"mpi_stale_local -n {p}"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == CHECKS, out[-4000:]


@pytest.mark.parametrize("mode,epochs", [(["--staleness", "1"], 10),  # 95.5% (20 epochs: 97.8%)
                                         (["--local-period", "4"], 3)])
def test_stale_digits_learns(mode, epochs, mpi_timings):
    """The digits MLP learns (one stale step with momentum 0.9 starts slower: 72% after 3
    epochs where synchronous DP has 97%; the runs are deterministic)."""
    pytest.importorskip("sklearn", reason="the example needs scikit-learn ([test] installs it)")
    rc, out, secs = mpirun.launch(2, ["scripts/stale_digits.py", "--epochs", epochs, *mode],
                                  timeout=300)
    mpi_timings[f"stale_digits -n 2 {' '.join(mode)} --epochs {epochs}"] = secs
    assert rc == 0, out[-4000:]
    accuracy = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert accuracy >= 93.0, out[-2000:]
    assert re.search(r"exposed wait [\d.]+ ms", out), out[-2000:]
