"""PYTHONPATH=. python scripts/netsim_curves.py {curves,crossover,formulas,all} [options]

Predicted all-reduce times from the network simulator (ringcoll.netsim), which runs the real
algorithm functions against a model of the cluster (docs/simulator.md):

  curves     (a) predicted time vs message size for ring, recursive_doubling, rabenseifner and
                 hierarchical at 8x8 and 128x8 ranks -> docs/figures/netsim-curves.png
  crossover  (b) the message size below which hierarchical beats the flat ring, simulated and
                 by the closed forms -> docs/figures/netsim-crossover.png
  formulas   (c) the same curves with the closed-form cost model's beside them on the same
                 axes, and their ratio: where the formulas hold and where contention breaks
                 them -> docs/figures/netsim-formulas.png
  validate   the flat, contention-free check: simulated vs closed form for ring, recursive
             doubling, Rabenseifner and Bruck at p = 2, 3, 4, 8, 16 (a table; what
             tests/test_netsim.py asserts, within 5%)
  all        curves, formulas and crossover, sharing one simulator (each recorded schedule
             is replayed for every size it serves); 70-85 s on 2 cores

Tables go to stdout; `curves` also prints the wall time of the 1,024-rank ring run.
Options: --shapes 8x8,128x8 (nodes x devices per node), --nics-per-node 1 (8: a NIC per
device, "rails"), --inner ring|auto (hierarchical's cross-node algorithm), --out DIR,
--big-sizes N (how many sizes at >= 512 ranks; 6 by default, about a minute for `all`).
The cluster is ringcoll.netsim.Cluster's default: 300 GB/s and 2 us inside a node, one
25 GB/s NIC per node and 5 us between nodes, reductions at 1 TB/s; 4 MiB ring segments.
"""

import argparse
import math
import os
import sys
import time

from ringcoll.netsim import Cluster, Simulator, formula

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "hierarchical")
SHORT = {"ring": "ring", "recursive_doubling": "rd", "rabenseifner": "rab",
         "hierarchical": "hier"}
COLORS = {"ring": "C0", "recursive_doubling": "C1", "rabenseifner": "C2",
          "hierarchical": "C3"}


def size_label(b):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{b}B"


def us(seconds):
    return f"{seconds * 1e6:,.1f}"


class Runs:
    """Simulated and closed-form times, each computed once per (shape, algorithm, size)."""

    def __init__(self, args):
        # arrays above 4,096 elements are scaled (exact block fractions, see Simulator._shape):
        # every ring size from 16 KiB up replays one recorded 1,024-rank schedule
        self.sim = Simulator(max_elems=4096, cache_ops=12_000_000)
        self.args = args
        self.done = {}
        self.ring_wall = {}

    def cluster(self, shape):
        nodes, devices = shape
        return Cluster(nodes=nodes, devices_per_node=devices,
                       nics_per_node=min(self.args.nics_per_node, devices))

    def predict(self, shape, algorithm, nbytes):
        key = (shape, algorithm, nbytes)
        if key not in self.done:
            start = time.perf_counter()
            pred = self.sim.allreduce(self.cluster(shape), algorithm, nbytes,
                                      inner=self.args.inner)
            wall = time.perf_counter() - start
            best = self.ring_wall.get(shape)
            if algorithm == "ring" and pred.record_seconds and (
                    best is None or pred.messages > best[1].messages):
                self.ring_wall[shape] = (wall, pred)  # the first run with every message
            self.done[key] = pred.seconds
        return self.done[key]

    def formula(self, shape, algorithm, nbytes):
        return formula(self.cluster(shape), algorithm, nbytes, inner=self.args.inner)

    def sizes(self, shape):
        if shape[0] * shape[1] >= 512:  # a few sizes: each ring replay there takes ~2 s
            return [1 << k for k in (10, 14, 18, 22, 26, 30)][-self.args.big_sizes:]
        return [1 << k for k in range(10, 31, 2)]


def shape_label(shape):
    return f"{shape[0]}x{shape[1]} ({shape[0] * shape[1]} ranks)"


def print_table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def plain_log_y(ax):
    """Log y axis with ticks written 0.5, 1, 2 (not 5x10^-1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def save(fig, args, name):
    os.makedirs(args.out, exist_ok=True)
    if args.nics_per_node != 1:  # keep the default figures: netsim-curves-nics8.png, ...
        name = name.replace(".png", f"-nics{args.nics_per_node}.png")
    path = os.path.join(args.out, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"\nwrote {path}")


def curves(runs, args, with_formulas=False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = args.shapes
    rows_n = 2 if with_formulas else 1
    fig, axes = plt.subplots(rows_n, len(shapes), figsize=(6.5 * len(shapes), 4.5 * rows_n),
                             squeeze=False)
    for col, shape in enumerate(shapes):
        sizes = runs.sizes(shape)
        table = []
        for nbytes in sizes:
            sim = {a: runs.predict(shape, a, nbytes) for a in ALGORITHMS}
            row = [size_label(nbytes)]
            if with_formulas:
                for a in ALGORITHMS:
                    f = runs.formula(shape, a, nbytes)
                    row += [us(sim[a]), us(f), f"{sim[a] / f:.2f}"]
            else:
                row += [us(sim[a]) for a in ALGORITHMS] + [SHORT[min(sim, key=sim.get)]]
            table.append(row)
        if with_formulas:
            header = ["size"] + [f"{SHORT[a]} {x}" for a in ALGORITHMS
                                 for x in ("sim", "formula", "ratio")]
            print_table(f"{shape_label(shape)}: simulated vs closed-form time (us), "
                        f"NICs per node {runs.cluster(shape).nics_per_node}", header, table)
        else:
            header = ["size"] + [SHORT[a] for a in ALGORITHMS] + ["fastest"]
            print_table(f"{shape_label(shape)}: predicted all-reduce time (us), NICs per "
                        f"node {runs.cluster(shape).nics_per_node}", header, table)
        if shape in runs.ring_wall and shape[0] * shape[1] >= 512:
            wall, pred = runs.ring_wall[shape]
            print(f"  wall time of the {shape[0] * shape[1]}-rank ring's first run: {wall:.1f} s"
                  f" (record {pred.record_seconds:.1f} s, replay {pred.replay_seconds:.1f} s,"
                  f" {pred.messages:,} messages); sizes from 16K on replay that same log")
        ax = axes[0][col]
        for a in ALGORITHMS:
            ax.loglog(sizes, [runs.predict(shape, a, s) for s in sizes], "o-", ms=3,
                      color=COLORS[a], label=f"{a} (simulated)")
            if with_formulas:
                ax.loglog(sizes, [runs.formula(shape, a, s) for s in sizes], "--",
                          color=COLORS[a], alpha=0.8, label=f"{a} (closed form)")
        ax.set_title(shape_label(shape))
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        if with_formulas:
            ax = axes[1][col]
            for a in ALGORITHMS:
                ax.semilogx(sizes, [runs.predict(shape, a, s) / runs.formula(shape, a, s)
                                    for s in sizes], "o-", ms=3, color=COLORS[a], label=a)
            ax.axhspan(0.95, 1.05, color="grey", alpha=0.2, label="within 5%")
            plain_log_y(ax)
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("simulated / closed form")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    nics = runs.cluster(shapes[0]).nics_per_node
    fig.suptitle(("Simulated (solid) vs closed-form (dashed) all-reduce time" if with_formulas
                  else "Predicted all-reduce time") + f", {nics} NIC(s) per node")
    save(fig, args, "netsim-formulas.png" if with_formulas else "netsim-curves.png")
    plt.close(fig)


def _crossings(sizes, ratio):
    """Indices i where hier/ring crosses 1 between sizes[i] and sizes[i + 1]."""
    return [i for i in range(len(sizes) - 1) if (ratio[i] < 1) != (ratio[i + 1] < 1)]


def _refine(f, lo, hi, steps):
    """Bisect log2(size) between lo and hi for the sign change of log f(size)."""
    below = f(lo) < 1
    for _ in range(steps):
        mid = 4 * round(2 ** ((math.log2(lo) + math.log2(hi)) / 2) / 4)
        if mid in (lo, hi):
            break
        if (f(mid) < 1) == below:
            lo = mid
        else:
            hi = mid
    return lo, hi


def crossover(runs, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    rows = []
    for shape in args.shapes:
        sizes = sorted(set(runs.sizes(shape)) | {4 << 30})  # the curves' sizes, and 4 GiB

        def sim(n, shape=shape):
            return runs.predict(shape, "hierarchical", n) / runs.predict(shape, "ring", n)

        def closed(n, shape=shape):
            return runs.formula(shape, "hierarchical", n) / runs.formula(shape, "ring", n)

        for name, f, steps in (("simulated", sim, args.refine), ("closed form", closed, 30)):
            ratio = [f(n) for n in sizes]
            found = [_refine(f, sizes[i], sizes[i + 1], steps)
                     for i in _crossings(sizes, ratio)]
            where = "; ".join(
                f"{size_label(lo)}..{size_label(hi)} (hier {'faster' if f(lo) < 1 else 'slower'}"
                f" below)" for lo, hi in found) or (
                f"none in {size_label(sizes[0])}..{size_label(sizes[-1])} (hier always "
                f"{'faster' if ratio[0] < 1 else 'slower'})")
            rows.append([shape_label(shape), name, where])
            style = "o-" if name == "simulated" else "--"
            line, = ax.semilogx(sizes, ratio, style, ms=3,
                                label=f"{shape_label(shape)} {name}")
            for lo, hi in found:
                ax.axvline(math.sqrt(lo * hi), color=line.get_color(), ls=":", lw=1)
    nics = runs.cluster(args.shapes[0]).nics_per_node
    print_table(f"Where hierarchical and the flat ring cross (NICs per node {nics}, "
                f"hierarchical inner: {args.inner})", ["ranks", "model", "crossover"], rows)
    ax.axhline(1, color="black", lw=0.8)
    plain_log_y(ax)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("hierarchical time / ring time  (< 1: hierarchical wins)")
    ax.set_title(f"Hierarchical vs flat ring, {nics} NIC(s) per node")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, args, "netsim-crossover.png")
    plt.close(fig)


def validate(args):
    from ringcoll.netsim import NO_SEGMENTS

    alpha, bandwidth, gamma = 5e-6, 10e9, 1e-10
    sim = Simulator(segment_bytes=NO_SEGMENTS)
    sizes = (8, 64 << 10, 1 << 20, 16 << 20)
    rows, worst = [], 0.0
    for algorithm in ("ring", "recursive_doubling", "rabenseifner", "bruck"):
        for p in (2, 3, 4, 8, 16):
            cluster = Cluster.flat(p, alpha, bandwidth, gamma)
            row = [SHORT.get(algorithm, algorithm), p]
            for nbytes in sizes:
                got = sim.allreduce(cluster, algorithm, nbytes).seconds
                want = formula(cluster, algorithm, nbytes)
                err = got / want - 1
                row.append(f"{us(got)} / {us(want)} ({err:+.1%})")
                if not (algorithm == "recursive_doubling" and p == 3 and nbytes < 1 << 20):
                    worst = max(worst, abs(err))
            rows.append(row)
    print_table(f"Flat full-bisection network (alpha {alpha * 1e6:.0f} us, {bandwidth / 1e9:.0f} "
                f"GB/s, gamma {gamma * 1e9:.1f} ns/B), unsegmented: simulated / closed form, us",
                ["alg", "p", *(size_label(s) for s in sizes)], rows)
    print(f"\nlargest deviation {worst:.2%} (leaving out recursive doubling at p = 3 below "
          "1 MiB: its fold overlaps the first exchange, one alpha less than the formula)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command",
                        choices=("curves", "crossover", "formulas", "validate", "all"))
    parser.add_argument("--shapes", default="8x8,128x8",
                        help="nodes x devices per node, comma-separated (default 8x8,128x8)")
    parser.add_argument("--nics-per-node", type=int, default=1)
    parser.add_argument("--inner", default="ring", help="hierarchical's cross-node algorithm")
    parser.add_argument("--out", default=os.path.join("docs", "figures"))
    parser.add_argument("--big-sizes", type=int, default=6,
                        help="sizes (of 1K, 16K, 256K, 4M, 64M, 1G) at >= 512 ranks")
    parser.add_argument("--refine", type=int, default=4,
                        help="bisection steps (on log size) for each simulated crossover")
    args = parser.parse_args(argv)
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    runs = Runs(args)
    start = time.perf_counter()
    if args.command == "validate":
        validate(args)
    if args.command in ("curves", "all"):
        curves(runs, args)
    if args.command in ("formulas", "all"):
        curves(runs, args, with_formulas=True)
    if args.command in ("crossover", "all"):
        crossover(runs, args)
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
