"""mpiexec -n 3 python tests/mpi_faults.py SCENARIO: rank 1 breaks the rules on purpose.

tests/test_faults.py launches every scenario, with and without RINGCOLL_DEBUG=1 and with a short
RINGCOLL_TIMEOUT, and asserts the job's exit status, the error text on the affected ranks and
that the job ended in bounded time. Ranks 0 and 2 always make the correct calls.

Scenarios (rank 1's fault):
  counts        allreduce of 5 elements where the others pass 4 (auto: a small message)
  counts_ring   the same with algorithm='ring' and 1-element segments, where every message has
                the same size and only the neighbour check can tell
  dtypes        float64 where the others pass float32 (a different item size)
  dtypes_same   int32 where the others pass float32 (same item size: only debug mode can tell)
  skip          skips the allreduce the others make first, then joins their broadcast
  invalid       op='avg' on integers, which the others pass as floats
  raise         raises in its own code instead of calling the allreduce
  raise_with    the same inside `with ringcoll.Communicator() as comm:`
  exit          exits (sys.exit(0)) instead of calling the allreduce
  declared_rows after every rank agreed on a declared allgather (counts= [2] * p,
                declared=True), passes 3 rows under the same counts
  declared_dtype the same, passing int64 rows where the others pass float64 (same item size)
  none          no fault (the control: every rank prints 'finished')
"""

import sys

import numpy as np

import ringcoll


def main(scenario):
    comm = ringcoll.Communicator()
    bad = comm.rank == 1
    x = np.ones(4, np.float32)
    if scenario == "counts":
        comm.allreduce(np.ones(5, np.float32) if bad else x)
    elif scenario == "counts_ring":
        n = 5 if bad else 4
        comm.allreduce(np.ones(n, np.float32), algorithm="ring")
    elif scenario == "dtypes":
        comm.allreduce(np.ones(4, np.float64) if bad else x)
    elif scenario == "dtypes_same":
        comm.allreduce(np.ones(4, np.int32) if bad else x)
    elif scenario == "skip":
        if not bad:
            comm.allreduce(x)
        comm.broadcast(x, root=0)
    elif scenario == "invalid":
        comm.allreduce(np.ones(4, np.int64) if bad else x, op="avg")
    elif scenario in ("raise", "raise_with"):
        with comm if scenario == "raise_with" else _nothing():
            if bad:
                raise RuntimeError("rank 1 failed in its own code")
            comm.allreduce(x)
    elif scenario == "exit":
        if bad:
            sys.exit(0)
        comm.allreduce(x)
    elif scenario in ("declared_rows", "declared_dtype"):
        counts = [2] * comm.size
        comm.allgather(np.ones(2), counts=counts, declared=True)  # agreed on every rank
        y = np.ones(3) if bad and scenario == "declared_rows" else \
            np.ones(2, np.int64) if bad else np.ones(2)
        comm.allgather(y, counts=counts, declared=True)
    elif scenario != "none":
        raise SystemExit(f"unknown scenario {scenario!r}")
    comm.barrier()
    print(f"rank {comm.rank}: finished", flush=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except ringcoll.RingcollError as exc:
        # One write per rank: a traceback is written in pieces, which mpiexec may interleave
        # with another rank's, splitting the text the tests look for.
        sys.stderr.write(f"{type(exc).__module__}.{type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        sys.exit(1)
