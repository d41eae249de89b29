#!/usr/bin/env bash
# RINGCOLL_WHEELS=.whl bash scripts/gpu_check.sh OUTDIR
#
# The device check of ringcoll's GPU path (CuPy arrays), for a machine with an NVIDIA GPU and
# no internet. From the repository root; writes gpu_check.log, gpu_check.json (every step, its
# exit status and time), the pytest JUnit files and the benchmark JSON into OUTDIR. Steps:
#
#   1. nvidia-smi must list a GPU (else: exit 2 at once, saying so);
#   2. python3 (or $PYTHON; resolved to its absolute path, which every step and mpiexec then
#      use) must import numpy, ml_dtypes, pytest and CuPy; a missing CuPy is
#      installed from the wheels folder (cupy-cuda<major>x for the driver's CUDA major);
#      a missing MPI (mpi4py that cannot load an MPI library, or no mpiexec) is installed
#      from the wheels folder (mpich + mpi4py) into a venv that sees the system packages;
#   3. a preflight: the GPU, CuPy, the CUDA runtime, the MPI library and what
#      MPIX_Query_cuda_support says (so the log shows which path ringcoll takes);
#   4. tests/test_gpu.py in-process (kernels, every collective over threads at 1..4 ranks,
#      direct and staged, the node tier on device memory), then its mpiexec tier at -n 1, 2
#      and 4, all ranks sharing the GPU, where auto runs the node tier (CUDA IPC)
#      (RINGCOLL_REQUIRE_GPU=1: a skip for want of a GPU is a failure here);
#   4b. tests/mpi_dp_xp.py --xp cupy at -n 2 and 4: an MLP written once over the array
#      module, trained with DistributedOptimizer on CuPy parameters, against one process on
#      the global batch (float64 1e-10, float32 1e-5), replicas identical, a checkpoint
#      resumed on the GPU; scripts/train_digits.py --xp cupy at -n 2 where scikit-learn is;
#   4c. where torch sees the GPU: tests/mpi_torch.py --device cuda at -n 2 and 3 (every group
#      of the torch backend's suite on CUDA tensors against NumPy oracles, DDP against one
#      process and over gloo on the same tensors), and scripts/torch_ddp_digits.py and
#      torch_fsdp_digits.py --device cuda at -n 2 where scikit-learn is; bench/torch_ddp.py
#      --device cuda at -n 2 (the gate: a DDP step over ringcoll <= 0.5 x over gloo);
#   5. bench/gpu_allreduce.py at -n 2, 1 MiB to 256 MiB (the 70% staging gate at 64 MiB and
#      the node tier's targets: 1 MiB <= 150 us, 64 MiB >= 80 GB/s, 256 MiB >= 200 GB/s
#      busbw), -n 4 (node tier: 64 MiB >= 60 GB/s) and -n 1 (the only NCCL comparison one
#      GPU allows);
#   6. tests/test_kernel_source.py if a C++ compiler is there (the kernel source on the CPU).
#
# Everything runs under a deadline (RINGCOLL_GPU_CHECK_SECONDS, default 340 s: within 6
# minutes with the setup); a step that would pass it is cut off and counts as failed. Exit
# status: 0 every step passed, 1 a step failed, 2 no GPU or a setup problem (a message says
# which and how to fix it).
#
# The wheels folder (RINGCOLL_WHEELS, default .whl), made on a machine with internet, for the
# GPU machine's Python 3.12 on x86_64 (14 MiB; do not commit it):
#
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux_2_5_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2
#
# Optional, where the machine lacks them (large: they may not fit what a remote run can
# carry): cupy-cuda13x==14.2.0 (or cupy-cuda12x) and nvidia-nccl-cu13 (NCCL, for the -n 1
# NCCL row; CuPy 14 does not ship NCCL; without it that row is skipped with a note).
# Work files (the venv, a copy of ringcoll as an importable package) go to
# RINGCOLL_GPU_WORK (default: a fresh temporary directory), not to OUTDIR.

set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: RINGCOLL_WHEELS=.whl bash scripts/gpu_check.sh OUTDIR" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
LOG=$OUT/gpu_check.log
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

START=$(date +%s)
DEADLINE=$((START + ${RINGCOLL_GPU_CHECK_SECONDS:-340}))
WHEELS=${RINGCOLL_WHEELS:-.whl}
WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")
PY=${PYTHON:-python3}
STEPS=()   # "name|status|seconds"
FAILED=0

say() { echo "gpu_check [$(( $(date +%s) - START )) s]: $*"; }

summary() {  # summary EXIT_STATUS: gpu_check.json and the table
    local status=$1 first=1
    {
        echo "{\"exit_status\": $status, \"seconds\": $(( $(date +%s) - START )),"
        echo " \"outdir\": \"$OUT\", \"python\": \"$PY\", \"steps\": ["
        for s in "${STEPS[@]}"; do
            IFS='|' read -r name rc secs <<< "$s"
            [ $first -eq 1 ] || echo ","
            first=0
            printf '  {"name": "%s", "exit_status": %s, "seconds": %s}' "$name" "$rc" "$secs"
        done
        echo; echo " ]}"
    } > "$OUT/gpu_check.json"
    echo
    echo "gpu_check summary (exit $status, $(( $(date +%s) - START )) s; $OUT):"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name rc secs <<< "$s"
        printf '  %-28s %s  (%s s)\n' "$name" "$([ "$rc" = 0 ] && echo PASS || echo "FAIL rc=$rc")" "$secs"
    done
}

die() {  # die MESSAGE: a setup problem
    say "ERROR: $*"
    STEPS+=("setup|2|$(( $(date +%s) - START ))")
    summary 2
    exit 2
}

step() {  # step NAME CAP_SECONDS COMMAND...: run it under min(cap, time left)
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    local limit=$(( cap < left ? cap : left ))
    if [ "$limit" -le 5 ]; then
        say "$name: not run, the deadline has passed"
        STEPS+=("$name|124|0")
        FAILED=1
        return
    fi
    say "$name (limit $limit s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    [ $rc -eq 124 ] && say "$name: cut off after $limit s"
    STEPS+=("$name|$rc|$(( $(date +%s) - t0 ))")
    [ $rc -eq 0 ] || FAILED=1
    say "$name: exit $rc"
}

# -- 1. a GPU? ------------------------------------------------------------------------------
if ! command -v nvidia-smi > /dev/null 2>&1; then
    die "no NVIDIA GPU here: nvidia-smi is not on PATH. This check needs a machine with an NVIDIA GPU and its driver; on a CPU-only machine run 'python -m pytest' instead (the GPU tests skip there, with the reason)."
fi
if ! nvidia-smi -L > "$OUT/nvidia-smi-L.txt" 2>&1 || ! grep -q "^GPU " "$OUT/nvidia-smi-L.txt"; then
    die "nvidia-smi finds no GPU: $(head -3 "$OUT/nvidia-smi-L.txt")"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
CUDA_MAJOR=$(grep -o "CUDA Version: *[0-9]*" "$OUT/nvidia-smi.txt" | grep -o "[0-9]*$" | head -1)
say "GPU(s): $(tr '\n' ';' < "$OUT/nvidia-smi-L.txt"); driver's CUDA major: ${CUDA_MAJOR:-unknown}"

# -- 2. Python, CuPy, MPI -------------------------------------------------------------------
command -v "$PY" > /dev/null 2>&1 || die "no $PY: set PYTHON=/path/to/python3 (3.10 or newer)"
# The interpreter's own absolute path, from here on: under Open MPI's mpiexec a bare name such
# as python3 can resolve to another interpreter (on the H200 run, one without numpy).
PY=$("$PY" -c 'import sys; print(sys.executable)') && [ -x "$PY" ] \
    || die "${PYTHON:-python3} does not say where it is (sys.executable): set PYTHON=/path/to/python3"
say "python: $PY $("$PY" -c 'import sys; print(sys.version.split()[0])')"
WORK=${RINGCOLL_GPU_WORK:-$(mktemp -d -t ringcoll-gpu-XXXXXX)}
mkdir -p "$WORK" || die "cannot create the work directory $WORK"

venv() {  # a venv over the system's packages, once; PY becomes its python
    [ -x "$WORK/venv/bin/python" ] && { PY=$WORK/venv/bin/python; return 0; }
    "$PY" -m venv --system-site-packages "$WORK/venv" > "$WORK/venv.log" 2>&1 \
        || "$PY" -m venv --without-pip --system-site-packages "$WORK/venv" >> "$WORK/venv.log" 2>&1 \
        || die "cannot create a venv with $PY (see $WORK/venv.log): install python3-venv"
    BASE_PY=$PY
    PY=$WORK/venv/bin/python
    export PATH=$WORK/venv/bin:$PATH
}

pip_offline() {  # pip_offline PACKAGE...: from the wheels folder only, into the venv
    [ -d "$WHEELS" ] || die "need $* but the wheels folder '$WHEELS' does not exist; make it with the pip download command in this script's header and set RINGCOLL_WHEELS"
    if "$PY" -m pip --version > /dev/null 2>&1; then
        "$PY" -m pip install --no-index --find-links "$WHEELS" --ignore-installed --no-deps "$@"
    else  # a venv made --without-pip: the base python's pip installs into it
        "$BASE_PY" -m pip --python "$PY" install --no-index --find-links "$WHEELS" --ignore-installed --no-deps "$@"
    fi || die "could not install $* from $WHEELS (ls: $(ls "$WHEELS" | tr '\n' ' '))"
}

for module in numpy ml_dtypes pytest; do
    "$PY" -c "import $module" 2> /dev/null || die "$PY cannot import $module: install it (pip install $module)"
done
"$PY" -c "import pytest_timeout" 2> /dev/null || say "note: pytest-timeout is missing: the step deadlines still apply"
if ! "$PY" -c "import cupy" 2> /dev/null; then
    [ -n "$CUDA_MAJOR" ] || die "CuPy is missing and the CUDA version is unknown"
    say "CuPy is missing: installing cupy-cuda${CUDA_MAJOR}x from $WHEELS"
    venv
    pip_offline "cupy-cuda${CUDA_MAJOR}x" cuda-pathfinder
fi
mpi_ok() {
    "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" > /dev/null 2>&1 || return 1
    MPIEXEC=$(dirname "$(command -v "$PY")")/mpiexec
    [ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec) || return 1
}
if ! mpi_ok; then
    say "no usable MPI for $PY (mpi4py without an MPI library, or no mpiexec): installing mpich + mpi4py from $WHEELS"
    venv
    pip_offline mpich mpi4py
    mpi_ok || die "mpich and mpi4py installed, but '$PY -c \"from mpi4py import MPI\"' still fails"
fi
say "mpiexec: $MPIEXEC"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # harmless for MPICH

# ringcoll as an importable package (setup.py maps kernels/ to ringcoll.kernels; no install)
rm -rf "$WORK/site" && mkdir -p "$WORK/site"
cp -r "$ROOT/ringcoll" "$WORK/site/ringcoll" && rm -rf "$WORK/site/ringcoll/kernels" \
    && cp -r "$ROOT/kernels" "$WORK/site/ringcoll/kernels" || die "cannot copy ringcoll to $WORK/site"
export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
STEPS+=("setup|0|$(( $(date +%s) - START ))")

# -- 3. preflight ---------------------------------------------------------------------------
PYFLAGS=()  # -P: import the copy above, not the repository's ringcoll/ (it has no kernels/)
"$PY" -P -c "" 2> /dev/null && PYFLAGS=(-P)
cat > "$WORK/preflight.py" <<'PREFLIGHT'
import sys
import numpy, cupy, ml_dtypes, mpi4py
from mpi4py import MPI
import ringcoll
from ringcoll.transport.mpi import MPITransport
rt = cupy.cuda.runtime
name = rt.getDeviceProperties(0)["name"]
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, cupy {cupy.__version__}, "
      f"ml_dtypes {ml_dtypes.__version__}, mpi4py {mpi4py.__version__}; ringcoll from "
      f"{ringcoll.__file__}")
print(f"{rt.getDeviceCount()} GPU(s), GPU 0: {name.decode() if isinstance(name, bytes) else name}"
      f"; CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
x = cupy.arange(10, dtype=cupy.float32)
assert float(x.sum()) == 45.0, "a CuPy kernel gave a wrong sum"
print("MPI:", MPI.Get_library_version().splitlines()[0])
t = MPITransport(MPI.COMM_WORLD, timeout=0)
print("MPIX_Query_cuda_support: CUDA-aware = %s (%s)" % t.cuda_support())
t.close()
try:
    cupy.asarray(numpy.ones(2, ml_dtypes.bfloat16))
    print("CuPy bfloat16 arrays: yes")
except Exception as exc:
    print(f"CuPy bfloat16 arrays: no ({type(exc).__name__}: {exc})")
try:
    from cupy.cuda import nccl
    print(f"NCCL available: {nccl.available}")
except Exception as exc:
    print(f"NCCL: {type(exc).__name__}: {exc}")
PREFLIGHT
step preflight 60 "$PY" "${PYFLAGS[@]}" "$WORK/preflight.py"
if [ "$(echo "${STEPS[-1]}" | cut -d'|' -f2)" != 0 ]; then
    say "the preflight failed: CuPy or MPI cannot work here, the remaining steps would only fail"
    summary 1
    exit 1
fi

# -- 4. the GPU tests -----------------------------------------------------------------------
PYTEST=("$PY" "${PYFLAGS[@]}" -m pytest -q -rs -p no:cacheprovider)
step "pytest gpu in-process" 150 env RINGCOLL_REQUIRE_GPU=1 "${PYTEST[@]}" tests/test_gpu.py \
    -k "not mpiexec" --junitxml="$OUT/pytest_gpu_inprocess.xml"
step "pytest gpu mpiexec 1,2,4" 150 env RINGCOLL_REQUIRE_GPU=1 "${PYTEST[@]}" tests/test_gpu.py \
    -k "mpiexec" --junitxml="$OUT/pytest_gpu_mpiexec.xml"

# -- 4b. data-parallel training on CuPy: DistributedOptimizer against one process ------------
step "cupy training -n 2,4" 60 bash -c '"$0" -n 2 "$1" tests/mpi_dp_xp.py --xp cupy &&
    "$0" -n 4 "$1" tests/mpi_dp_xp.py --xp cupy' "$MPIEXEC" "$PY"
if "$PY" -c "import sklearn" 2> /dev/null; then  # the README's digits example, on the GPU
    step "cupy digits example -n 2" 40 "$MPIEXEC" -n 2 "$PY" scripts/train_digits.py --xp cupy \
        --epochs 3 -q
else
    say "note: scikit-learn is missing: the CuPy digits example (scripts/train_digits.py --xp cupy) is not run"
fi

# -- 4c. the PyTorch backend on CUDA tensors: every group of the torch suite, DDP vs gloo ------
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
    step "torch backend on cuda -n 2,3" 120 bash -c '"$0" -n 2 "$1" tests/mpi_torch.py --device cuda \
        --light --sync-timeout 60 --stall-timeout 30 --report "$2/torch_cuda_p2.json" &&
        "$0" -n 3 "$1" tests/mpi_torch.py --device cuda --light --sync-timeout 60 \
        --stall-timeout 30 --report "$2/torch_cuda_p3.json"' "$MPIEXEC" "$PY" "$OUT"
    if "$PY" -c "import sklearn" 2> /dev/null; then
        step "torch DDP digits on cuda -n 2" 60 "$MPIEXEC" -n 2 "$PY" scripts/torch_ddp_digits.py \
            --device cuda --epochs 3 -q
        step "torch FSDP2 digits on cuda -n 2" 60 "$MPIEXEC" -n 2 "$PY" \
            scripts/torch_fsdp_digits.py --device cuda --epochs 2 -q
    fi
    # the issue's step-time target: DDP on CUDA tensors over ringcoll <= 0.5 x over gloo at -n 2
    # on one GPU (2.1M-parameter MLP); every launch also checks the gradients and replicas
    step "torch DDP step time on cuda -n 2 (gate)" 100 "$PY" bench/torch_ddp.py --device cuda \
        --nprocs 2 --width 1024 --repeats 2 --steps 50 --warmup 5 --launch-timeout 40 \
        --mpiexec "$MPIEXEC" --json "$OUT/bench_torch_ddp_cuda.json"
else
    say "note: torch with CUDA is missing: the torch backend's CUDA path (tests/mpi_torch.py --device cuda) is not run"
fi

# -- 5. the benchmark on device buffers -----------------------------------------------------
BENCH=(bench/gpu_allreduce.py -b 1M -e 64M -f 4)
step "bench -n 2 (gates)" 120 "$MPIEXEC" -n 2 "$PY" "${BENCH[@]}" -e 256M \
    --staging-bytes 256K,4M --json "$OUT/bench_gpu_p2.json"
step "bench -n 4" 70 "$MPIEXEC" -n 4 "$PY" "${BENCH[@]}" --json "$OUT/bench_gpu_p4.json"
step "bench -n 1 (NCCL)" 40 "$MPIEXEC" -n 1 "$PY" "${BENCH[@]}" --json "$OUT/bench_gpu_p1.json"

# -- 6. the kernel source on the CPU (cheap; needs a C++ compiler) --------------------------
if command -v g++ > /dev/null 2>&1 || command -v c++ > /dev/null 2>&1; then
    step "kernel source on CPU" 30 "${PYTEST[@]}" tests/test_kernel_source.py
fi

summary $FAILED
exit $FAILED
