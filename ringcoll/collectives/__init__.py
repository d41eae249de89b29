"""The collectives: one module each, with its argument checks, algorithm choice and plan.

A module `m` here has NAME (the collective, as errors and debug mode name it), ALGORITHMS
(the algorithm names it accepts besides "auto"; the first is what "auto" runs where there is
no choice to make, and _args.pick_simple checks a call's algorithm= against them) and
plan(g, ctx, *args) -> runner.Plan, which checks the arguments of one call and builds the
steps it runs. The Communicator's method of the same name passes its arguments to the runner
with the module: runner.plan(m, *args), then runner.run(plan). Shared argument helpers are in
_args.py. The registry below lists every collective.
"""

from . import (allgather, allreduce, alltoall, alltoallv, barrier, broadcast, exscan, gather,
               reduce, reduce_scatter, scan, scatter)

#: name -> module, one line per collective
COLLECTIVES = {
    allreduce.NAME: allreduce,
    reduce_scatter.NAME: reduce_scatter,
    allgather.NAME: allgather,
    broadcast.NAME: broadcast,
    reduce.NAME: reduce,
    alltoall.NAME: alltoall,
    alltoallv.NAME: alltoallv,
    barrier.NAME: barrier,
    gather.NAME: gather,
    scan.NAME: scan,
    exscan.NAME: exscan,
    scatter.NAME: scatter,
}
