"""Check a built wheel and sdist against the source tree: nothing left out, nothing stale.

    python -m build --outdir dist . && python scripts/check_dist.py dist/ringcoll-*.whl dist/ringcoll-*.tar.gz

The wheel must hold every file of ringcoll/ (kernels/ as ringcoll/kernels/), .py or data,
and nothing else besides its .dist-info: no top-level package other than ringcoll, no module
the tree no longer has (setuptools' build/ folder can keep a deleted one alive). Its metadata
must carry the version in ringcoll/__init__.py, the dependencies and extras pyproject.toml
declares, and the `ringcoll` command. The sdist must hold every file git tracks (but .ci/ and .gitignore) so a
packager can build and test from it; outside a git checkout, the package files at least.
Exits 1, listing every problem, if any check fails.
"""

import argparse
import ast
import email.parser
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> where its files go in the wheel
PACKAGE_DIRS = {"ringcoll": "ringcoll", "kernels": "ringcoll/kernels"}
NOT_IN_SDIST = (".ci/", ".gitignore")


def package_files(root):
    """{path inside the wheel: path in the tree} of every file the package must install."""
    files = {}
    for source, target in PACKAGE_DIRS.items():
        for path in (root / source).rglob("*"):
            rel = path.relative_to(root / source)
            if path.is_dir() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
                continue
            files[f"{target}/{rel.as_posix()}"] = f"{source}/{rel.as_posix()}"
    return files


def tracked_files(root):
    """Every file git tracks under root, or None outside a git checkout (an unpacked sdist)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {name for name in out.split("\0") if name and (root / name).is_file()}


def project_name(requirement):
    """'numpy>=1.23' -> 'numpy' (PEP 508: the name comes first)."""
    return re.match(r"[A-Za-z0-9._-]+", requirement).group()


def declared(root):
    """(dependency names, extra names) as pyproject.toml declares them."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return ({project_name(r) for r in project["dependencies"]},
            set(project["optional-dependencies"]))


def source_version(root):
    tree = ast.parse((root / "ringcoll" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "__version__"]:
            return ast.literal_eval(node.value)
    raise SystemExit("check_dist: ringcoll/__init__.py sets no __version__")


def check_wheel(path, root):
    problems = []
    expected = package_files(root)
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
        if len(info) != 1:
            return [f"{path.name}: expected one .dist-info folder, found {info}"]
        meta = email.parser.Parser().parsestr(wheel.read(f"{info[0]}/METADATA").decode())
        entry_points = (wheel.read(f"{info[0]}/entry_points.txt").decode()
                        if f"{info[0]}/entry_points.txt" in names else "")
    for name in sorted(set(expected) - names):
        problems.append(f"{path.name} lacks {name} (from {expected[name]}): setup.py's package "
                        "list or pyproject.toml's package-data does not reach it (a folder "
                        "without __init__.py, or a data file of a new kind)")
    for name in sorted(names - set(expected)):
        if name.split("/")[0] != info[0]:
            problems.append(f"{path.name} holds {name}, which the tree has no source for (a "
                            "stale build/ folder, or a package outside ringcoll/)")
    version = source_version(root)
    if meta["Version"] != version:
        problems.append(f"{path.name}: version {meta['Version']}, ringcoll/__init__.py says "
                        f"{version}")
    dependencies, extras = declared(root)
    given = set(meta.get_all("Provides-Extra") or [])
    if given != extras:
        problems.append(f"{path.name}: extras {sorted(given)}, pyproject.toml declares "
                        f"{sorted(extras)}")
    requires = {project_name(r) for r in meta.get_all("Requires-Dist") or []
                if "extra ==" not in r}
    if requires != dependencies:
        problems.append(f"{path.name}: depends on {sorted(requires)}, pyproject.toml declares "
                        f"{sorted(dependencies)}")
    if "ringcoll = ringcoll.__main__:main" not in entry_points:
        problems.append(f"{path.name}: no `ringcoll` console script in entry_points.txt")
    return problems


def check_sdist(path, root):
    with tarfile.open(path) as sdist:
        members = [m.name for m in sdist.getmembers() if m.isfile()]
    top = {name.split("/")[0] for name in members}
    if len(top) != 1:
        return [f"{path.name}: expected one top folder, found {sorted(top)}"]
    prefix = top.pop() + "/"
    names = {name[len(prefix):] for name in members}
    package = set(package_files(root).values())
    tracked = tracked_files(root)
    if tracked is None:  # not a git checkout: the package and the build files at least
        expected = package | {"pyproject.toml", "setup.py", "README.md", "LICENSE"}
    else:
        expected = {name for name in tracked if not name.startswith(NOT_IN_SDIST)}
    return [f"{path.name} lacks {name}: " + ("setup.py's package list or pyproject.toml's "
                                             "package-data does not reach it" if name in package
                                             else "add it to MANIFEST.in")
            for name in sorted(expected - names)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dists", nargs="+", type=Path, help="wheels (.whl) and sdists (.tar.gz)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: "
                        "the one this script is in)")
    args = parser.parse_args(argv)
    problems = []
    for path in args.dists:
        if path.name.endswith(".whl"):
            problems += check_wheel(path, args.root)
        elif path.name.endswith(".tar.gz"):
            problems += check_sdist(path, args.root)
        else:
            problems.append(f"{path}: neither a wheel (.whl) nor an sdist (.tar.gz)")
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_dist: {', '.join(p.name for p in args.dists)}: every file of the tree, "
          f"nothing else, metadata as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
