"""Launching real `mpiexec` jobs from tests, each with a deadline so a hang fails, never blocks.

    rc, output, seconds = launch(3, ["tests/mpi_faults.py", "counts"], env={...}, timeout=60)

rc is mpiexec's exit status, or None when the deadline killed the job's whole process group.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def find_mpiexec():
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH, else None."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to this Python or on "
                               "PATH: install an MPI (pip install -e '.[mpich]') to run it")


def launch(nprocs, argv, env=None, timeout=120, cwd=None):
    """mpiexec -n nprocs python *argv from the repo root; returns (rc or None, output, secs).

    The user's RINGCOLL_* variables are dropped (tests set theirs through env). The job runs in
    its own session; past the deadline its whole process group is killed. cwd: where it runs
    (default the repo root).
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOLL_")}
    full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    start = time.time()
    proc = subprocess.Popen([MPIEXEC, "-n", str(nprocs), sys.executable, *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, cwd=str(cwd or ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n*** killed after the {timeout} s deadline: a deadlock or a hang ***"
        rc = None
    return rc, out, time.time() - start
