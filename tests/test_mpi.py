"""MPI tier: real `mpiexec -n P python tests/mpi_checks.py` launches, P in 1, 2, 3, 4, 5, 8.

One launch per P runs every group of checks in tests/mpi_checks.py (each rank checks against MPI's
own collectives and NumPy, and that all ranks agree bitwise). test_mpi_checks asserts mpiexec's
exit status; test_mpi_group reports each group's failures separately, so one broken collective
does not hide the others. Every launch has a deadline: a deadlock kills the process group and
fails the test instead of hanging. The wall time of each launch is printed in pytest's summary.
"""

import ast
import json
import os
import time
from pathlib import Path

import pytest

import _mpirun as mpirun

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mpi_checks.py"
PS = [1, 2, 3, 4, 5, 8]
LIGHT = {8}  # 8 busy-polling ranks on a small machine: fewer sizes and roots
LAUNCH_TIMEOUT = 120  # seconds per mpiexec launch
GROUPS = ["allreduce", "allreduce_floats", "reduce_scatter", "allgather", "gather", "scatter",
          "broadcast", "reduce", "alltoall", "barrier", "iallreduce", "split", "layouts",
          "fortran_out", "errors", "compat", "compat_buffers", "compat_collectives", "trace",
          "alltoallv", "scan", "dtypes", "compat_repeat", "declared", "allgather_in_place"]


MPIEXEC = mpirun.MPIEXEC
pytestmark = mpirun.needs_mpi


def launch(nprocs, args, timeout=LAUNCH_TIMEOUT, script=WORKER):
    """mpiexec -n nprocs python script args: (returncode, or None after the deadline; output;
    seconds)."""
    return mpirun.launch(nprocs, [script, *args], timeout=timeout)


_RUNS = {}


@pytest.fixture
def checks_run(tmp_path_factory, mpi_timings):
    """The (cached) full mpi_checks.py launch at P ranks."""

    def get(nprocs):
        if nprocs not in _RUNS:
            d = tmp_path_factory.mktemp(f"mpi{nprocs}")
            report = d / "report.json"
            args = ["--report", str(report), "--tmpdir", str(d)]
            if nprocs in LIGHT:
                args.append("--light")
            rc, out, secs = launch(nprocs, args)
            mpi_timings[f"mpi_checks -n {nprocs}{' --light' if nprocs in LIGHT else ''}"] = secs
            data = json.loads(report.read_text()) if report.exists() else None
            _RUNS[nprocs] = (rc, out, secs, data)
        return _RUNS[nprocs]

    return get


def tail(text, n=150):
    lines = text.splitlines()
    return "\n".join(lines[-n:])


@pytest.mark.parametrize("nprocs", PS)
def test_mpi_checks(nprocs, checks_run):
    rc, out, secs, _ = checks_run(nprocs)
    assert rc == 0, (f"mpiexec -n {nprocs} {WORKER.name} exited with {rc} after {secs:.1f} s; "
                     f"output:\n{tail(out)}")


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("nprocs", PS)
def test_mpi_group(nprocs, group, checks_run):
    rc, out, secs, report = checks_run(nprocs)
    assert report is not None, f"no report from mpiexec -n {nprocs} (rc {rc}):\n{tail(out)}"
    assert group in report, f"group {group} did not run:\n{tail(out)}"
    rep = report[group]
    assert rep["checks"] > 0, f"group {group} checked nothing"
    assert not rep["failures"], (f"{len(rep['failures'])} failure(s) in {group} at P={nprocs}:\n"
                                 + "\n".join(rep["failures"][:30]))


def test_worker_groups_match():
    """The groups listed here are exactly the ones mpi_checks.py runs."""
    tree = ast.parse(WORKER.read_text())
    worker_groups = next(ast.literal_eval(node.value) for node in tree.body
                         if isinstance(node, ast.Assign)
                         and getattr(node.targets[0], "id", None) == "GROUPS")
    assert worker_groups == GROUPS


# ---------------------------------------------------------------------------------------------
# failures must reach mpiexec's exit status, and quickly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["check", "raise", "stuck"])
def test_failing_rank_fails_the_launch(mode, mpi_timings):
    """A failed check, an exception, or a rank stuck while another raised: non-zero exit."""
    rc, out, secs = launch(3, ["--inject", mode, "--sync-timeout", "5"], timeout=60)
    mpi_timings[f"mpi_checks -n 3 --inject {mode}"] = secs
    assert rc is not None, f"--inject {mode} hung:\n{tail(out)}"
    assert rc != 0, f"--inject {mode}: mpiexec exited 0 although rank 1 failed:\n{tail(out)}"
    if mode == "check":  # the others die by MPI_Abort: their last output may be lost
        assert "injected failure" in out and "1 failures" in out, tail(out)
    assert secs < 40


def test_plain_script_rank_exit_code_propagates(tmp_path, mpi_timings):
    """mpiexec itself reports a non-zero exit of a single rank (rank 1 raises)."""
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "comm = MPI.COMM_WORLD\n"
        "comm.Barrier()\n"
        "if comm.Get_rank() == 1:\n"
        "    raise SystemExit('rank 1 fails on purpose')\n"
    )
    rc, out, secs = launch(2, [], timeout=60, script=script)
    mpi_timings["plain script -n 2, rank 1 fails"] = secs
    assert rc is not None and rc != 0, f"rc={rc}:\n{out}"


def _alive(pid):
    """True if pid is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_deadline_kills_a_hung_launch(tmp_path, mpi_timings):
    """The per-launch deadline turns a hang into a failure and kills every rank."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        "from mpi4py import MPI\n"
        f"open(os.path.join({str(tmp_path)!r}, f'pid.{{MPI.COMM_WORLD.Get_rank()}}'), 'w')"
        ".write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    rc, out, secs = launch(2, [], timeout=5, script=script)
    mpi_timings["hanging script -n 2 (deadline 5 s)"] = secs
    assert rc is None and "killed after the 5 s deadline" in out
    assert secs < 30
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)
            if (tmp_path / f"pid.{r}").exists()]
    assert pids, f"the ranks never started:\n{out}"
    deadline = time.time() + 10
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "ranks survived the deadline kill"
