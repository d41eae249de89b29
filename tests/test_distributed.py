"""Data-parallel training under real mpiexec: tests/mpi_dp.py at 1..4 ranks, and the example.

mpi_dp.py checks that p ranks, each on 1/p of every global batch, end with the parameters one
rank gets on the whole batch (SGD and Adam; overlapped, serial, clipped, accumulated and
no_sync steps; several bucket sizes), bitwise identical on every rank; that a checkpoint
resumes the run exactly; and fp16/bf16 compression's accuracy and bytes. Unit tests of the
pieces are in test_dp_units.py and test_optim.py.
"""

import re

import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi
CHECKS = 15  # 'OK ...' lines mpi_dp.py prints when everything holds


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_data_parallel_equals_one_rank_on_the_global_batch(p, tmp_path, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_dp.py", "--tmpdir", tmp_path],
                                  env={"RINGCOLL_TIMEOUT": "60"}, timeout=300)
    mpi_timings[f"mpi_dp -n {p}"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == CHECKS, out[-4000:]


def test_digits_example_learns(mpi_timings):
    pytest.importorskip("sklearn", reason="the example needs scikit-learn ([test] installs it)")
    rc, out, secs = mpirun.launch(2, ["scripts/train_digits.py", "--epochs", "3", "-q"],
                                  timeout=300)
    mpi_timings["train_digits -n 2 --epochs 3"] = secs
    assert rc == 0, out[-4000:]
    accuracy = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert accuracy >= 93.0, out[-2000:]
