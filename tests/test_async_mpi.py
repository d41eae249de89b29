"""One-sided windows and asynchronous SGD under real mpiexec: tests/mpi_async.py at 1..4 ranks.

Windows across processes (uneven parts, every rank into every rank, exact), the parameter
store's integer consistency under concurrent pushes, progress while an owner sleeps outside
MPI, AsyncSGD exact and bitwise-equal replicas, and learning with a 3x straggler. Thread-tier
units: test_async_sgd.py.
"""

import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi


def expected_checks(p):
    """'OK ...' lines tests/mpi_async.py prints when everything holds: 3 window checks, one
    store check per distinct N of {1, p - 1, p + 1, 4099}, 3 more."""
    return 3 + len({1, max(p - 1, 1), p + 1, 4099}) + 3


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_windows_and_async_sgd_under_mpiexec(p, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_async.py"], env={"RINGCOLL_TIMEOUT": "60"},
                                  timeout=120)
    mpi_timings[f"mpi_async -n {p}"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK ") == expected_checks(p), out[-4000:]
