"""Model parallelism under real mpiexec.

- tests/mpi_parallel.py at -n 4: the thread tier's tensor-parallel, pipeline and mesh checks
  (tests/_parallel_cases.py) on 4 MPI processes.
"""


import _mpirun as mpirun

pytestmark = mpirun.needs_mpi
PARALLEL_CHECKS = 16  # 'OK ...' lines of tests/mpi_parallel.py


def test_model_parallel_checks_under_mpiexec(mpi_timings):
    rc, out, secs = mpirun.launch(4, ["tests/mpi_parallel.py"], env={"RINGCOLL_TIMEOUT": "60"},
                                  timeout=120)
    mpi_timings["mpi_parallel -n 4"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == PARALLEL_CHECKS, out[-4000:]
