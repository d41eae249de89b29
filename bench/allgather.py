"""mpiexec -n 4 python bench/allgather.py -b 8 -e 64M -f 2

All-gather: every rank ends with all ranks' blocks, rank 0's first.

  bytes   S = the gathered buffer (= p blocks of S/p, one from each rank); count = per block
  busbw   algbw x (p-1)/p: each rank must receive the p-1 blocks it does not have
  run     comm.allgather(x, out=y, algorithm=a)  (out-of-place only: the API has no in-place
          form)
  check   rank r contributes its own data; every rank compares all S bytes with every rank's
          block in rank order
  -a      ring (ringcoll), native (MPI_Allgatherv)
"""

import numpy as np

from harness import OUT, Spec, main


def make(c, inplace):
    return c.data(c.rank, c.block), c.empty()


def run(comm, x, y, algorithm, c):
    comm.allgather(x, out=y, algorithm=algorithm)


SPEC = Spec(
    name="allgather",
    busbw_factor=lambda p: (p - 1) / p,
    algorithms=("ring", "node", "native"),  # node: -a only, auto runs it on GPUs alone
    default_algorithms=lambda comm: ["ring", "native"],
    make=make,
    run=run,
    expect=lambda c: np.concatenate([c.data(r, c.block) for r in range(c.size)]),
    result=lambda x, y, c: y,
    modes=(OUT,),
    blocked=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
