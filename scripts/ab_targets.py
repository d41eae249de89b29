"""python scripts/ab_targets.py OLD_TREE NEW_TREE [-n 2] [--pairs 4] [--only T4] [--limit 1.05]

A/B speed check of two ringcoll source trees with bench/targets.py: did a change make ringcoll
slower? Runs `mpiexec -n N python bench/targets.py --only T --json F` with PYTHONPATH set to
each tree in turn, --pairs times in ABBA order (A B B A A B ...), so drift on a shared machine
hits both alike, then pools every repeat's time of all-reduce `auto` per size and mode.

Per (size, mode) it prints the median auto time of each tree, new/old, and new/old of the
ratio of auto to the bare mpi4py Sendrecv unit timed in the same rounds (targets.py's
"sendrecv/..." calls: T4's latency floor, T2's ring bound). That unit runs no ringcoll code, so
the ratio cancels what the machine did meanwhile and keeps all of ringcoll's own cost (native
would not do: algorithm="native" runs through ringcoll's plan and replay too). Exit 3 if a
size's new/old of that ratio exceeds --limit (default 1.05: within 5%), else 0.

Example (the refactor of issue 14, old = a worktree of the commit before it):
    git worktree add --detach /tmp/old a5cedce
    python scripts/ab_targets.py /tmp/old . --only T4            # 8 B .. 1 KiB, replayed
    python scripts/ab_targets.py /tmp/old . --only T1,T2         # 16 and 64 MiB
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(tree, args, out):
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.n), sys.executable,
           str(ROOT / "bench" / "targets.py"), "--only", args.only, "--json", out, "-q"]
    subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
    with open(out) as f:
        data = json.load(f)
    if any(check["wrong"] for check in data["wrong"]):
        raise SystemExit(f"{tree}: wrong results in bench/targets.py; fix that first")
    return data["repeats"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--only", default="T4")
    ap.add_argument("--limit", type=float, default=1.05)
    args = ap.parse_args()
    times = {"old": {}, "new": {}}  # tree -> (size, mode) -> {"auto": [...], "ratio": [...]}
    order = [("old", "new"), ("new", "old")]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            for which in order[k % 2]:
                out = os.path.join(tmp, f"{which}{k}.json")
                for rep in run(getattr(args, which), args, out):
                    for size, calls in rep["times_s"].items():
                        for mode in ("out-of-place", "in-place"):
                            auto = calls.get(f"allreduce/auto/{mode}")
                            bare = [v for k, v in calls.items() if k.startswith("sendrecv/")]
                            if auto is None:
                                continue
                            cell = times[which].setdefault((int(size), mode),
                                                           {"auto": [], "ratio": []})
                            cell["auto"].append(auto)
                            if bare:
                                cell["ratio"].append(auto / bare[0])
                print(f"# pair {k + 1}/{args.pairs}: {which} done", file=sys.stderr)
    print(f"# A/B of bench/targets.py --only {args.only} at -n {args.n}: {args.pairs} runs of "
          f"each tree, ABBA order; medians over every repeat")
    print(f"# old = {args.old}, new = {args.new}")
    print(f"{'size':>10} {'mode':>12} {'old auto us':>12} {'new auto us':>12} {'new/old':>8} "
          f"{'new/old of auto/Sendrecv':>25}")
    worst = 0.0
    for key in sorted(times["old"]):
        old, new = times["old"][key], times["new"].get(key)
        if new is None:
            continue
        a, b = statistics.median(old["auto"]), statistics.median(new["auto"])
        ratio = statistics.median(new["ratio"]) / statistics.median(old["ratio"])
        worst = max(worst, ratio)
        size, mode = key
        print(f"{size:>10} {mode:>12} {a * 1e6:12.1f} {b * 1e6:12.1f} {b / a:8.3f} {ratio:25.3f}")
    verdict = "PASS" if worst <= args.limit else "MISS"
    print(f"worst new/old of auto/Sendrecv: {worst:.3f} (limit {args.limit}) -> {verdict}")
    return 0 if verdict == "PASS" else 3


if __name__ == "__main__":
    sys.exit(main())
