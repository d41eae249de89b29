"""mpiexec -n 4 python bench/alltoall.py -b 8 -e 64M -f 2

All-to-all: block j of rank i's buffer goes to rank j, where it lands as block i.

  bytes   S = the buffer each rank sends (= p blocks of S/p); count = elements per block
  busbw   algbw x (p-1)/p: each rank must send p-1 of its p blocks (nccl-tests)
  run     comm.alltoall(x, out=y, algorithm=a)  (out-of-place only: the API has no in-place
          form)
  check   rank i sends its own data; rank r compares block i of its result with block r of
          rank i's data, for every i
  -a      pairwise (ringcoll's pairwise exchange), native (MPI_Alltoall)
"""

import numpy as np

from harness import OUT, Spec, main


def make(c, inplace):
    return c.data(c.rank), c.empty()


def run(comm, x, y, algorithm, c):
    comm.alltoall(x, out=y, algorithm=algorithm)


def expect(c):
    return np.concatenate([c.data(i, c.block, start=c.rank * c.block) for i in range(c.size)])


SPEC = Spec(
    name="alltoall",
    busbw_factor=lambda p: (p - 1) / p,
    algorithms=("pairwise", "native"),
    default_algorithms=lambda comm: ["pairwise", "native"],
    make=make,
    run=run,
    expect=expect,
    result=lambda x, y, c: y,
    modes=(OUT,),
    blocked=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
