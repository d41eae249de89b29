#!/usr/bin/env bash
# bash scripts/fresh_clone_check.sh
# Do what CI and a new user do: clone the committed HEAD into a temporary folder, run
# .ci/run there, then the README's benchmark quick start. Nothing from this checkout's venv
# is used, so a missing install step shows up here.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet "$repo" "$tmp/ringcoll"
cd "$tmp/ringcoll"
time bash .ci/run
. .venv/bin/activate
mpiexec -n 2 python bench/allreduce.py -b 8 -e 1M -f 16
echo "fresh clone check passed"
