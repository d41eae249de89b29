"""Shared setup for the two test tiers.

- test_threads.py: every rank a thread (ringcoll.run_threads), 1..16 ranks, in-process.
- test_mpi.py: real `mpiexec -n P python tests/mpi_checks.py` launches, P in 1, 2, 3, 4, 5, 8.

Both build their inputs and oracles with tests/_oracle.py.

The `mpiexec` mark (set here, at collection, never by hand): every test that carries
_mpirun.needs_mpi (on itself or its module), or whose code reaches _mpirun.launch (directly,
through a helper or fixture in tests/, or through a tests/ module such as torch_dist_suite),
i.e. every test that starts a real MPI job. `.ci/run`'s Open MPI lane runs
`pytest -m mpiexec` (scripts/openmpi_lane.sh); the rest are the thread tier and plain unit
tests, which do not touch an MPI library. A test that launched mpiexec without the mark is
named in pytest's summary ("launched mpiexec without the mpiexec mark").
"""

import os
import types
from pathlib import Path

import pytest

import _mpirun

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


TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "mpiexec: starts a real mpiexec job (set by "
                            "tests/conftest.py from the test's code; the Open MPI lane of "
                            ".ci/run runs -m mpiexec)")


def _in_tests(code):
    return Path(code.co_filename).resolve().parent == TESTS


def _reaches_launch(code, namespace, seen):
    """Whether code (or a function, fixture or nested code it names, all from tests/) calls
    _mpirun.launch: `mpirun.launch(...)`, `from _mpirun import launch`, a helper that does."""
    if code in seen:
        return False
    seen.add(code)
    names = set(code.co_names)
    if "launch" in names and ("_mpirun" in names
                              or any(namespace.get(n) is _mpirun for n in names)):
        return True
    for name in names:
        obj = namespace.get(name)
        if obj is _mpirun.launch:
            return True
        candidates = [obj]
        if isinstance(obj, types.ModuleType) and getattr(obj, "__file__", None) \
                and Path(obj.__file__).resolve().parent == TESTS:
            candidates = [getattr(obj, n, None) for n in names]  # suite.run_and_compare
        for fn in candidates:
            fn = getattr(fn, "__wrapped__", fn)
            sub = getattr(fn, "__code__", None)
            if sub is not None and _in_tests(sub) and _reaches_launch(sub, fn.__globals__, seen):
                return True
    return any(isinstance(const, types.CodeType) and _reaches_launch(const, namespace, seen)
               for const in code.co_consts)


def _starts_mpiexec(item):
    if any(mark == _mpirun.needs_mpi.mark for mark in item.iter_markers("skipif")):
        return True
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        funcs += [d.func for d in defs]
    seen = set()
    for fn in funcs:
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None and _in_tests(code) and _reaches_launch(code, fn.__globals__, seen):
            return True
    return False


_MARKED = pytest.StashKey()


#: tests that fail on Open MPI 5.0 for what Open MPI does, not ringcoll: xfail(strict=True)
#: there only (a pass then fails, so the entry is removed when it no longer applies). The
#: Open MPI lane also runs with OMPI_MCA_op=^avx (scripts/openmpi_lane.sh says why).
_COMPLEX_PROD = ("Open MPI 5.0's MPI_Scan/MPI_Exscan of complex128 prod is not bitwise "
                 "ringcoll's (nor NumPy's) product at 4, 5 and 8 ranks (mpi_checks' scan group "
                 "compares auto with MPI_Scan bitwise)")
OPEN_MPI_XFAIL = {
    "tests/test_mpi.py::test_mpi_group[4-scan]": _COMPLEX_PROD,
    "tests/test_mpi.py::test_mpi_group[5-scan]": _COMPLEX_PROD,
    "tests/test_mpi.py::test_mpi_group[8-scan]": _COMPLEX_PROD,
    "tests/test_mpi.py::test_mpi_checks[4]": _COMPLEX_PROD + ": the launch exits 1",
    "tests/test_mpi.py::test_mpi_checks[5]": _COMPLEX_PROD + ": the launch exits 1",
    "tests/test_mpi.py::test_mpi_checks[8]": _COMPLEX_PROD + ": the launch exits 1",
    "tests/test_faults.py::test_declared_call_with_another_dtype_is_left_to_mpis_size_check":
        "Open MPI reports the longer message as MPI_ERR_TRUNCATE, which ringcoll explains as "
        "its own CollectiveMismatchError (no 'truncated' in the text); MPICH's error text "
        "says 'Message truncated'",
}


def pytest_collection_modifyitems(config, items):
    marked = config.stash.setdefault(_MARKED, set())
    open_mpi = _mpirun.MPIEXEC is not None and _mpirun.library()[0] == "Open MPI"
    for item in items:
        if _starts_mpiexec(item):
            item.add_marker(pytest.mark.mpiexec)
            marked.add(item.nodeid)
        if open_mpi and item.nodeid in OPEN_MPI_XFAIL:
            item.add_marker(pytest.mark.xfail(reason=OPEN_MPI_XFAIL[item.nodeid], strict=True))


def pytest_terminal_summary(terminalreporter, config):
    unmarked = sorted(_mpirun.LAUNCHED_BY - config.stash.get(_MARKED, set()))
    if unmarked:
        terminalreporter.section("launched mpiexec without the mpiexec mark")
        terminalreporter.write_line("the Open MPI lane (pytest -m mpiexec) skips these: make "
                                    "their code reach _mpirun.launch or mark them needs_mpi")
        for nodeid in unmarked:
            terminalreporter.write_line(f"  {nodeid}")

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
