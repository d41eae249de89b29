"""Exscan: the exclusive prefix reduction, rank r > 0 gets op(x_0, ..., x_{r-1}), rank 0 None.

scan's plan with exclusive=True (scan.build; algorithms/scan.py). Rank 0 receives nothing
meaningful (MPI leaves its buffer undefined): it gets None and its out, if given, is left as
it was (still checked, as on every rank).
"""

from . import scan

NAME = "exscan"
ALGORITHMS = scan.ALGORITHMS
BUFFERS = scan.BUFFERS


def plan(g, ctx, x, op, out, algorithm):
    return scan.build(g, ctx, NAME, x, op, out, algorithm, exclusive=True)
