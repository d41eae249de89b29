#!/usr/bin/env bash
# scripts/bench_all.sh 4 /tmp/ringcoll-bench -b 8 -e 64M -f 4
#
# Run every bench/<collective>.py under `mpiexec -n NP` (default 2), print each table, and write
# OUTDIR/<collective>-pNP.json and .csv (default OUTDIR: $TMPDIR/ringcoll-bench). Arguments after
# OUTDIR go to every script. MPIEXEC and PYTHON override the commands used. Exits non-zero if
# any benchmark did (wrong results, a missed --target-ratio, bad arguments).
# Then: python scripts/bench_markdown.py OUTDIR/*.json   (markdown tables for a README)
set -u
np=${1:-2}
out=${2:-${TMPDIR:-/tmp}/ringcoll-bench}
shift $(( $# < 2 ? $# : 2 ))
mpiexec=${MPIEXEC:-mpiexec}
python=${PYTHON:-python}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out" || exit 2
status=0
for c in allreduce reduce_scatter allgather broadcast reduce alltoall; do
    echo "== $mpiexec -n $np $python bench/$c.py $*"
    "$mpiexec" -n "$np" "$python" "bench/$c.py" "$@" \
        --json "$out/$c-p$np.json" --csv "$out/$c-p$np.csv" \
        || { echo "== $c failed ($?)"; status=1; }
    echo
done
exit $status
