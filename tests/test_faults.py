"""Fault tests under real mpiexec: one rank breaks the rules, the job must end, fast and loud.

Each case launches tests/mpi_faults.py (rank 1 makes the fault; see its docstring) with
RINGCOLL_TIMEOUT=3 and asserts the exit status, the error text on the affected ranks, and that
the job ended in bounded time. Two behaviours are checked:
- without debug mode, a fault ringcoll can see (a size check, the ring's neighbour check, an
  exception escaping `with Communicator()`) aborts the job at once with exit code 70; a fault
  it cannot see (a rank that raised, exited or skipped) ends with the watchdog's
  CollectiveTimeoutError after RINGCOLL_TIMEOUT, naming the collective and the rank waited for;
- with RINGCOLL_DEBUG=1, every rank raises the same error before any data moves (exit code 1,
  every rank prints it), except for faults outside a collective (raise, exit).
"""

import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi
WORKER = "tests/mpi_faults.py"
TIMEOUT = 3  # RINGCOLL_TIMEOUT in these jobs: seconds
PROMPT = 15  # seconds a job that fails at once may take on a busy 2-core machine
BOUNDED = TIMEOUT + PROMPT  # ... and one that waits for the watchdog
ABORTED = 70  # ringcoll.errors.ABORT_CODE
# mpiexec exits with the code of the first rank that aborted; when two ranks abort at the same
# moment, MPICH's hydra may kill one mid-abort and report its SIGKILL (9) instead.
ABORT_STATUSES = (ABORTED, 9)


def run(scenario, debug, nprocs=3, mpi_timings=None):
    env = {"RINGCOLL_TIMEOUT": str(TIMEOUT), "RINGCOLL_DEBUG": "1" if debug else "0"}
    rc, out, secs = mpirun.launch(nprocs, [WORKER, scenario], env=env, timeout=60)
    if mpi_timings is not None:
        mpi_timings[f"mpi_faults -n {nprocs} {scenario}{' debug' if debug else ''}"] = secs
    assert rc is not None, f"{scenario}: the job hung past the 60 s deadline:\n{out[-3000:]}"
    return rc, out, secs


def expect(out, *texts):
    for text in texts:
        assert text in out, f"{text!r} not in the job's output:\n{out[-4000:]}"


def test_control_no_fault_finishes_on_every_rank(mpi_timings):
    for debug in (False, True):
        rc, out, _ = run("none", debug, mpi_timings=mpi_timings)
        assert rc == 0, out
        expect(out, *(f"rank {r}: finished" for r in range(3)))


# -- faults ringcoll sees at once, without debug mode: exit 70 ----------------------------------
@pytest.mark.parametrize("scenario,nprocs,texts", [
    ("counts", 2, ["CollectiveMismatchError", "allreduce #1", "disagree on the element count"]),
    ("counts", 3, ["CollectiveMismatchError", "allreduce #1", "disagree on the element count"]),
    ("counts", 5, ["CollectiveMismatchError", "allreduce #1", "disagree on the element count"]),
    ("counts_ring", 3, ["CollectiveMismatchError", "allreduce #1 (ring)",
                        "allreduce of 5 elements of float32", "allreduce of 4 elements"]),
    ("dtypes", 3, ["CollectiveMismatchError", "allreduce #1", "disagree on the element count"]),
    ("raise_with", 3, ["RuntimeError: rank 1 failed in its own code",
                       "ringcoll rank 1: aborting the job",
                       "an exception escaped `with Communicator()` on this rank"]),
    ("declared_rows", 3, ["InvalidArgumentError: ringcoll rank 1, allgather: x has 3 rows, "
                          "but counts[1] = 2", "allgather #2"]),
])
def test_visible_fault_aborts_the_job_at_once(scenario, nprocs, texts, mpi_timings):
    rc, out, secs = run(scenario, False, nprocs, mpi_timings)
    assert rc in ABORT_STATUSES, f"exit status {rc}, not {ABORTED}:\n{out[-4000:]}"
    expect(out, *texts, f"aborting the job (MPI_Abort, exit code {ABORTED})")
    assert "CollectiveTimeoutError" not in out, f"only the watchdog caught it:\n{out[-4000:]}"
    assert "finished" not in out, f"a rank went on after the fault:\n{out[-4000:]}"
    assert secs < PROMPT, f"took {secs:.1f} s"


# -- faults only the watchdog sees, without debug mode: exit 70 after RINGCOLL_TIMEOUT ----------
@pytest.mark.parametrize("scenario,first", [
    ("skip", None),  # rank 1 waits in broadcast #1 for rank 0, which waits in allreduce #1
    ("raise", "RuntimeError: rank 1 failed in its own code"),
    ("exit", None),
    ("invalid", "InvalidTypeError: ringcoll rank 1, allreduce: op 'avg' on integer dtype int64"),
])
def test_silent_fault_ends_with_the_watchdog_naming_the_rank(scenario, first, mpi_timings):
    rc, out, secs = run(scenario, False, mpi_timings=mpi_timings)
    assert rc in ABORT_STATUSES, f"exit status {rc}, not {ABORTED}:\n{out[-4000:]}"
    if first:
        expect(out, first)
    # ranks 0 and 2 wait in allreduce #1 and name rank 1 (or each other, when one of them
    # waits for the other: then the other's own message names rank 1)
    expect(out, "CollectiveTimeoutError: ringcoll rank", "allreduce #1",
           f"no progress for {TIMEOUT}", ": rank 1 (", "Aborting the job (MPI_Abort, exit code 70)")
    assert "finished" not in out, f"a rank went on after the fault:\n{out[-4000:]}"
    assert TIMEOUT <= secs < BOUNDED, f"took {secs:.1f} s"


# -- debug mode: every rank raises the same error before any data moves --------------------------
@pytest.mark.parametrize("scenario,differ", [
    ("counts", "shape"), ("counts_ring", "shape"), ("dtypes", "dtype"), ("dtypes_same", "dtype"),
    ("skip", "collective"),
])
def test_debug_mode_names_the_disagreement_on_every_rank(scenario, differ, mpi_timings):
    rc, out, secs = run(scenario, True, mpi_timings=mpi_timings)
    assert rc == 1, f"exit status {rc}: every rank should raise (exit 1):\n{out[-4000:]}"
    for r in range(3):
        expect(out, f"CollectiveMismatchError: ringcoll rank {r}, ")
    expect(out, f"the ranks disagree on this call ({differ} differ)", "rank(s) [0, 2]: ",
           "rank(s) [1]: ")
    assert "MPI_Abort" not in out and "CollectiveTimeoutError" not in out, out[-4000:]
    assert secs < PROMPT, f"took {secs:.1f} s"


def test_debug_mode_tells_the_others_when_one_rank_has_a_bad_argument(mpi_timings):
    rc, out, secs = run("invalid", True, mpi_timings=mpi_timings)
    assert rc == 1, out[-4000:]
    expect(out, "InvalidTypeError: ringcoll rank 1, allreduce: op 'avg' on integer dtype int64",
           *(f"PeerFailedError: ringcoll rank {r}, allreduce #1 (recursive_doubling): rank(s) "
             "[1] could not start this collective" for r in (0, 2)))
    assert "MPI_Abort" not in out, out[-4000:]
    assert secs < PROMPT, f"took {secs:.1f} s"


# -- declared counts (allgather/gather/scatter with declared=True), once agreed ------------------
def test_declared_call_with_another_dtype_is_left_to_mpis_size_check(mpi_timings):
    """Rank 1 passes int64 rows where the others pass float64, under counts the ranks agreed
    on before: no exchange tells them (docs/errors.md: not caught by ringcoll). Here the
    message sizes differ (rank 1 agrees anew, the others send data), so MPI's own check ends
    the job at once; it must never finish or hang."""
    rc, out, secs = run("declared_dtype", False, mpi_timings=mpi_timings)
    assert rc != 0 and "finished" not in out, f"exit status {rc}:\n{out[-4000:]}"
    assert "truncated" in out.lower(), out[-4000:]
    assert secs < PROMPT, f"took {secs:.1f} s"


@pytest.mark.parametrize("scenario,first,others", [
    ("declared_rows", "InvalidArgumentError: ringcoll rank 1, allgather #2", "InvalidArgumentError"),
    ("declared_dtype", "CollectiveMismatchError: ringcoll rank 1, ", "CollectiveMismatchError"),
])
def test_debug_mode_agrees_on_every_declared_call(scenario, first, others, mpi_timings):
    """Debug mode never skips a declared call's agreement: every rank raises, none aborts."""
    rc, out, secs = run(scenario, True, mpi_timings=mpi_timings)
    assert rc == 1, f"exit status {rc}: every rank should raise (exit 1):\n{out[-4000:]}"
    expect(out, first, *(f"{others}: ringcoll rank {r}, " for r in (0, 2)))
    assert "MPI_Abort" not in out and "CollectiveTimeoutError" not in out, out[-4000:]
    assert secs < PROMPT, f"took {secs:.1f} s"
