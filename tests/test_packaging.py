"""Packaging cannot forget a module: setup.py's package list covers the tree, and
scripts/check_dist.py (which .ci/run applies to the real wheel and sdist, through
scripts/check_install.sh) fails on a wheel or sdist that lacks a file, holds a stale one or
has the wrong metadata. Here it is fed archives made from the tree, one defect each.
"""

import io
import runpy
import sys
import tarfile
import zipfile

import pytest

from _mpirun import ROOT

pytest.importorskip("tomllib", reason="scripts/check_dist.py reads pyproject.toml with tomllib "
                    "(Python 3.11+)")
sys.path.insert(0, str(ROOT / "scripts"))
import check_dist  # noqa: E402

VERSION = check_dist.source_version(ROOT)
INFO = f"ringcoll-{VERSION}.dist-info"
METADATA = (f"Metadata-Version: 2.4\nName: ringcoll\nVersion: {VERSION}\n"
            "Requires-Dist: numpy>=1.23\nRequires-Dist: mpi4py>=4\n"
            + "".join(f"Provides-Extra: {e}\nRequires-Dist: x; extra == \"{e}\"\n"
                      for e in sorted(check_dist.declared(ROOT)[1])))
ENTRY_POINTS = "[console_scripts]\nringcoll = ringcoll.__main__:main\n"


def python_folders():
    """{folder as installed, e.g. ringcoll/kernels: its folder in the tree} of every folder
    holding a .py file."""
    return {wheel.rsplit("/", 1)[0]: tree.rsplit("/", 1)[0]
            for wheel, tree in check_dist.package_files(ROOT).items() if wheel.endswith(".py")}


def test_every_folder_with_python_in_it_is_a_package():
    """find_packages (setup.py) finds a folder only if it has an __init__.py."""
    bare = sorted(tree for tree in python_folders().values()
                  if not (ROOT / tree / "__init__.py").exists())
    assert not bare, f"setup.py would leave these out of the wheel: give each an __init__.py: {bare}"


def test_setup_py_lists_every_package_of_the_tree(monkeypatch):
    setuptools = pytest.importorskip("setuptools", reason="setup.py is run with setuptools")
    given = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    monkeypatch.chdir(ROOT)  # setup.py's find_packages calls are relative to the tree
    runpy.run_path(str(ROOT / "setup.py"))
    assert set(given["packages"]) == {folder.replace("/", ".") for folder in python_folders()}
    assert given["package_dir"] == {"ringcoll.kernels": "kernels"}


def wheel(tmp_path, drop=(), add=(), metadata=METADATA, entry_points=ENTRY_POINTS):
    path = tmp_path / f"ringcoll-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name in check_dist.package_files(ROOT):
            if name not in drop:
                z.writestr(name, "")
        for name in add:
            z.writestr(name, "")
        z.writestr(f"{INFO}/METADATA", metadata)
        z.writestr(f"{INFO}/entry_points.txt", entry_points)
    return path


def sdist(tmp_path, drop=()):
    path = tmp_path / f"ringcoll-{VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for name in sorted(check_dist.tracked_files(ROOT)):
            if name not in drop:
                info = tarfile.TarInfo(f"ringcoll-{VERSION}/{name}")
                t.addfile(info, io.BytesIO(b""))
    return path


@pytest.mark.skipif(check_dist.tracked_files(ROOT) is None, reason="not a git checkout")
def test_a_complete_wheel_and_sdist_pass(tmp_path):
    assert check_dist.main([str(wheel(tmp_path)), str(sdist(tmp_path))]) == 0


def problems_of(path):
    check = check_dist.check_wheel if path.suffix == ".whl" else check_dist.check_sdist
    return check(path, ROOT)


def test_a_wheel_without_a_module_fails(tmp_path, capsys):
    bad = wheel(tmp_path, drop={"ringcoll/checkpoint/layout.py"})
    assert check_dist.main([str(bad)]) == 1
    assert "lacks ringcoll/checkpoint/layout.py" in capsys.readouterr().err


def test_a_wheel_without_a_kernel_or_the_tuning_table_fails(tmp_path):
    bad = wheel(tmp_path, drop={"ringcoll/kernels/cuda.py", "ringcoll/tuning_default.json"})
    found = problems_of(bad)
    assert len(found) == 2 and "kernels/cuda.py" in found[0] + found[1], found


@pytest.mark.parametrize("stale", ["ringcoll/removed_long_ago.py", "kernels/__init__.py",
                                   "tests/conftest.py"])
def test_a_wheel_with_a_file_the_tree_lacks_fails(tmp_path, stale):
    (problem,) = problems_of(wheel(tmp_path, add={stale}))
    assert stale in problem and "no source" in problem


def test_a_wheel_with_other_metadata_fails(tmp_path):
    assert problems_of(wheel(tmp_path, entry_points="")) == [
        f"ringcoll-{VERSION}-py3-none-any.whl: no `ringcoll` console script in entry_points.txt"]
    old = problems_of(wheel(tmp_path, metadata=METADATA.replace(VERSION, "0.0.1")))
    assert any("version 0.0.1" in p for p in old), old
    no_torch = problems_of(wheel(tmp_path, metadata=METADATA.replace("Provides-Extra: torch\n",
                                                                     "")))
    assert any("extras" in p for p in no_torch), no_torch
    no_numpy = problems_of(wheel(tmp_path, metadata=METADATA.replace(
        "Requires-Dist: numpy>=1.23\n", "")))
    assert any("depends on ['mpi4py']" in p for p in no_numpy), no_numpy


@pytest.mark.skipif(check_dist.tracked_files(ROOT) is None, reason="not a git checkout")
def test_an_sdist_without_a_tracked_file_fails(tmp_path):
    bad = sdist(tmp_path, drop={"tests/conftest.py", "README.md", "kernels/cuda.py"})
    assert problems_of(bad) == [
        f"{bad.name} lacks README.md: add it to MANIFEST.in",
        f"{bad.name} lacks kernels/cuda.py: setup.py's package list or pyproject.toml's "
        "package-data does not reach it",
        f"{bad.name} lacks tests/conftest.py: add it to MANIFEST.in"]
