#!/usr/bin/env bash
# bash scripts/check_install.sh   (from a checkout, with a Python that has pip; .ci/run runs it)
# ringcoll as users install it, not as the checkout imports it:
#  1. python -m build makes an sdist and, from that sdist, a wheel;
#  2. scripts/check_dist.py holds both against the tree (every file of ringcoll/ and kernels/
#     in the wheel and nothing else, every tracked file in the sdist, the metadata);
#  3. the wheel goes into a fresh virtual environment with its extras, and a smoke subset of
#     the tests runs from a copy of the checkout without ringcoll/ and kernels/ in it, so that
#     nothing can import from the source tree: tests/test_installed.py (every module imports,
#     the `ringcoll` command, the README's one-liner at -n 2), the README's and docs' examples
#     under mpiexec, the MPI tier's checks at -n 2 and 3, the shipped tuning table;
#  4. the sdist, then a plain `pip install .` (non-editable) replace it in that environment,
#     and tests/test_installed.py runs on each.
# Any failure exits non-zero. PYTHON: the interpreter that builds (default: python3).
# About 2 minutes on 2 cores (1 min 45 s here, 2026-12-04), most of it installing the wheel's
# dependencies into the fresh venv from pip's cache.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say() { printf '\n== check_install: %s\n' "$*"; }
PIP=(--quiet --disable-pip-version-check)

say "building the sdist and, from it, the wheel"
"$PY" -m pip install "${PIP[@]}" build
"$PY" -m build --outdir "$tmp/dist" "$repo" > "$tmp/build.log" 2>&1 \
    || { tail -40 "$tmp/build.log"; exit 1; }
wheel=$(echo "$tmp"/dist/ringcoll-*.whl)
sdist=$(echo "$tmp"/dist/ringcoll-*.tar.gz)
"$PY" "$repo/scripts/check_dist.py" "$wheel" "$sdist"

say "installing $(basename "$wheel") with its mpich, test and torch extras into a fresh venv"
"$PY" -m venv "$tmp/venv"
venv_py=$tmp/venv/bin/python
"$venv_py" -m pip install "${PIP[@]}" "$wheel[mpich,test,torch]"

# The checkout without the package: tests, examples and docs, but nothing to import ringcoll from
mkdir "$tmp/smoke"
cp -r "$repo/tests" "$repo/bench" "$repo/scripts" "$repo/docs" "$repo/README.md" \
    "$repo/pytest.ini" "$tmp/smoke/"
cd "$tmp/smoke"
site=$("$venv_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
from=$("$venv_py" -c "import ringcoll; print(ringcoll.__file__)")
[ "$from" = "$site/ringcoll/__init__.py" ] \
    || { echo "check_install: ringcoll imports from $from, not from $site"; exit 1; }
echo "ringcoll imports from $from"

smoke() {  # pytest in the smoke copy with the fresh venv's Python; -p no:cacheprovider: no .pytest_cache
    "$venv_py" -m pytest -p no:cacheprovider -q "$@"
}
say "smoke tests on the installed wheel"
smoke tests/test_installed.py tests/test_readme.py tests/test_tuning.py \
    "tests/test_mpi.py::test_mpi_checks[2]" "tests/test_mpi.py::test_mpi_checks[3]" \
    "tests/test_torch.py::test_torch_launch[2-main]"

say "the sdist, built and installed in its place"
"$venv_py" -m pip install "${PIP[@]}" --no-deps --force-reinstall "$sdist"
smoke tests/test_installed.py

say "a plain (non-editable) pip install of the checkout in its place"
"$venv_py" -m pip install "${PIP[@]}" --no-deps --force-reinstall "$repo"
smoke tests/test_installed.py
say "passed: the wheel, the sdist and pip install . each import and run outside the checkout"
