"""ringcoll as a user gets it: every module imports, the `ringcoll` command runs, and the
README's one-line all-reduce prints the sum on every rank under mpiexec.

The suite runs these on the checkout's editable install; scripts/check_install.sh runs them
again on a wheel, an sdist and a plain `pip install .`, each installed into a fresh virtual
environment and tested from a copy of tests/ that has no ringcoll/ beside it, so nothing can
import from the source tree.
"""

import importlib.util
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import _mpirun as mpirun

import ringcoll

#: modules that need an optional dependency, by the dependency
OPTIONAL = {"torch": "ringcoll.torch"}


def modules():
    """Every module of the installed ringcoll package, found from its files without importing
    any (pkgutil.walk_packages would import ringcoll.torch here, which starts MPI).

    An editable install keeps kernels/ where it is and maps it in, so it is not under
    ringcoll/ there: its folder comes from the import system."""
    kernels = importlib.util.find_spec("ringcoll.kernels").submodule_search_locations
    found, todo = {"ringcoll"}, [("ringcoll", list(ringcoll.__path__)),
                                 ("ringcoll.kernels", list(kernels))]
    while todo:
        package, path = todo.pop()
        found.add(package)
        for info in pkgutil.iter_modules(path, package + "."):
            found.add(info.name)
            if info.ispkg:
                todo.append((info.name, [os.path.join(info.module_finder.path,
                                                      info.name.rsplit(".", 1)[1])]))
    return sorted(found)


def test_the_public_modules_are_found():
    assert {"ringcoll.torch", "ringcoll.checkpoint", "ringcoll.parallel", "ringcoll.kernels",
            "ringcoll.kernels.cuda", "ringcoll.__main__"} <= set(modules())


def test_every_module_imports(tmp_path):
    """All in one fresh interpreter, not this one (importing ringcoll.torch initialises MPI
    and registers a torch backend), from a folder with no ringcoll/ in it; ringcoll.torch's
    modules only where torch is installed."""
    wanted = [m for m in modules()
              if not any(m.startswith(prefix) and importlib.util.find_spec(dep) is None
                         for dep, prefix in OPTIONAL.items())]
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "import ringcoll, ringcoll.kernels\n"
            "print(ringcoll.__file__, ringcoll.kernels.__file__)\n")
    run = subprocess.run([sys.executable, "-c", code, *wanted], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert run.returncode == 0, f"importing {len(wanted)} modules failed:\n{run.stderr[-3000:]}"
    package, kernels = (Path(path).parent for path in run.stdout.split())
    installed, editable = package / "kernels", package.parent / "kernels"
    assert kernels in (installed, editable), (
        f"ringcoll.kernels comes from {kernels}, neither {installed} nor (an editable "
        f"install) {editable}")


def test_the_ringcoll_command_runs():
    command = Path(sys.executable).parent / "ringcoll"
    assert command.exists(), f"no `ringcoll` command beside {sys.executable}"
    usage = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "explain" in usage.stdout and "tune" in usage.stdout, usage
    # explain runs thread ranks; rank r's element i is 10 r + i
    shown = subprocess.run([str(command), "explain", "allreduce", "-p", "3", "-n", "3"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    sums = " ".join(str(sum(10 * r + i for r in range(3))) for i in range(3))
    assert f"Result on every rank: [{sums}]" in shown.stdout, shown.stdout


@mpirun.needs_mpi
def test_the_readme_one_liner_sums_on_both_ranks(mpi_timings):
    code = ("import ringcoll, numpy as np; c = ringcoll.Communicator(); "
            "print(c.allreduce(np.ones(3)))")
    rc, out, secs = mpirun.launch(2, ["-c", code], env={"RINGCOLL_TIMEOUT": "30"}, timeout=120)
    mpi_timings["the installed one-liner at -n 2"] = secs
    assert rc == 0, out[-3000:]
    # count, not lines: the two ranks' prints can interleave ('[2. 2. 2.][2. 2. 2.]\n\n')
    assert out.count("[2. 2. 2.]") == 2 and not out.replace("[2. 2. 2.]", "").strip(), out
