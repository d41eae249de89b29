"""python scripts/bench_markdown.py /tmp/ringcoll-bench/*.json

Markdown tables from the --json files of bench/*.py: one table per file and mode, a row per
size, a column per algorithm holding "time in us (ratio to native)"; for auto, the algorithm
it ran too. Each file's exact command is in its environment.command field.
Quote ratios, not absolute times, from shared machines.
"""

import json
import sys


def fmt_us(us):
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def size(b):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale}{unit}"
    return str(b)


def table(doc, mode):
    rows = [r for r in doc["results"] if r["mode"] == mode]
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = ["size (B)"] + [f"{a} us (vs MPI)" for a in algs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for s in dict.fromkeys(r["size"] for r in rows):
        cells = [size(s)]
        for a in algs:
            r = next((x for x in rows if x["size"] == s and x["algorithm"] == a), None)
            if r is None:
                cells.append("")
                continue
            ratio = r["ratio_to_native"]
            cell = fmt_us(r["time_us"]) + ("" if ratio is None else f" ({ratio:.2f})")
            if r["picked"] and r["algorithm"] == "auto":
                cell = f"{r['picked']}: {cell}"
            if r["wrong"]:
                cell += f" **{r['wrong']} wrong**"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(paths):
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        env, par = doc["environment"], doc["parameters"]
        for mode in par["modes"]:
            print(f"**{doc['benchmark']}**, {env['processes']} ranks, {par['dtype']}"
                  + (f" {par['op']}" if par["op"] else "") + f", {mode} ({env['date'][:10]})\n")
            print("\n".join(table(doc, mode)))
            print()


if __name__ == "__main__":
    main(sys.argv[1:])
