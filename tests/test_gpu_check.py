"""scripts/gpu_check.sh and bench/gpu_allreduce.py where there is no GPU: both must stop at
once with a message that says so (and the script must leave its JSON), never half-run.
What they do on a GPU is the device check itself (see docs/gpu.md)."""

import json
import os
import shutil
import subprocess

import pytest

import _mpirun as mpirun

ROOT = mpirun.ROOT
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash")


def run_script(tmp_path, path, **env):
    env.update(PATH=path, HOME=os.environ.get("HOME", "/tmp"))
    out = tmp_path / "out"
    proc = subprocess.run([BASH, str(SCRIPT), str(out)], capture_output=True, text=True,
                          env=env, timeout=60, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr, out


def test_the_script_parses():
    assert subprocess.run([BASH, "-n", str(SCRIPT)]).returncode == 0


def test_no_nvidia_smi_exits_2_with_the_reason(tmp_path):
    rc, text, out = run_script(tmp_path, "/usr/bin:/bin")
    assert rc == 2, text
    assert "no NVIDIA GPU here: nvidia-smi is not on PATH" in text
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["exit_status"] == 2 and data["steps"][0]["name"] == "setup"
    assert "no NVIDIA GPU here" in (out / "gpu_check.log").read_text()


def test_nvidia_smi_without_a_gpu_exits_2(tmp_path):
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (stub / "nvidia-smi").chmod(0o755)
    rc, text, _ = run_script(tmp_path, f"{stub}:/usr/bin:/bin")
    assert rc == 2 and "nvidia-smi finds no GPU: No devices were found" in text, text


def test_usage(tmp_path):
    proc = subprocess.run([BASH, str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@mpirun.needs_mpi
def test_gpu_bench_without_a_gpu_says_so(tmp_path):
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        pytest.skip("there is a GPU here: the device check runs this benchmark")
    except Exception:  # noqa: BLE001 - no CuPy, or no device: the case under test
        pass
    rc, out, _ = mpirun.launch(1, ["bench/gpu_allreduce.py", "-b", "1K", "-e", "1K"], timeout=60)
    assert rc == 2 and "needs CuPy and an NVIDIA GPU" in out, out


def test_a_bare_python_name_is_resolved_to_the_interpreter(tmp_path):
    """PYTHON=python3 (the default) becomes the interpreter's absolute path before any step
    uses it, so every later call, mpiexec's included, starts that interpreter and not whatever
    the name finds there (the H200 run's benchmark steps got a python3 without numpy).

    Here the name `python3` is a shim that runs this interpreter with -S (no site-packages, so
    no numpy); the interpreter itself has numpy. A fake nvidia-smi lists a GPU. Resolved, the
    script passes the numpy check and stops at the missing CuPy (no wheels folder to install
    it from); had it kept the name, it would stop at numpy."""
    import sys

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text("#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: Fake GPU'\n"
                                     "echo 'CUDA Version: 13.0'\n")
    (stub / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    for tool in stub.iterdir():
        tool.chmod(0o755)
    rc, text, out = run_script(tmp_path, f"{stub}:/usr/bin:/bin",
                               RINGCOLL_GPU_WORK=str(tmp_path / "work"))
    assert rc == 2, text
    assert f"python: {sys.executable} " in text, text
    assert "cannot import numpy" not in text and "CuPy is missing" in text, text
    # by then the script's own venv (made to install CuPy into) has replaced it
    assert json.loads((out / "gpu_check.json").read_text())["python"] == str(
        tmp_path / "work" / "venv" / "bin" / "python")
