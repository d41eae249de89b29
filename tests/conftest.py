"""Shared setup for the two test tiers.

- test_threads.py: every rank a thread (ringcoll.run_threads), 1..16 ranks, in-process.
- test_mpi.py: real `mpiexec -n P python tests/mpi_checks.py` launches, P in 1, 2, 3, 4, 5, 8.

Both build their inputs and oracles with tests/_oracle.py.
"""

import os

import pytest

# The thread tier only needs mpi4py's MPI.SUM... handles (to test op=MPI.SUM), not a running MPI:
# do not initialise MPI inside the pytest process (the MPI tier starts its own processes).
try:
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
except ImportError:  # pragma: no cover - mpi4py is a dependency of ringcoll
    pass


@pytest.fixture(autouse=True)
def _clean_ringcoll_env(monkeypatch):
    """Tests set their options explicitly: a user's RINGCOLL_* variables must not leak in."""
    for name in list(os.environ):
        if name.startswith("RINGCOLL_"):
            monkeypatch.delenv(name)


_TIMINGS = pytest.StashKey()


@pytest.fixture
def mpi_timings(request):
    """{launch description: wall seconds} of the mpiexec launches, printed after the run."""
    return request.config.stash.setdefault(_TIMINGS, {})


_NOTES = pytest.StashKey()


@pytest.fixture
def mpi_notes(request):
    """[lines] measured by the launches (e.g. DDP's distance to its reference), printed after
    the run even when the tests pass."""
    return request.config.stash.setdefault(_NOTES, [])


def pytest_terminal_summary(terminalreporter, config):
    timings = config.stash.get(_TIMINGS, None)
    if timings:
        terminalreporter.section("mpiexec launches (wall time)")
        for what, secs in timings.items():
            terminalreporter.write_line(f"{secs:7.1f} s  {what}")
        terminalreporter.write_line(f"{sum(timings.values()):7.1f} s  total")
    notes = config.stash.get(_NOTES, None)
    if notes:
        terminalreporter.section("mpiexec launches (measured)")
        for line in notes:
            terminalreporter.write_line(line)
