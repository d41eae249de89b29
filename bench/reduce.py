"""mpiexec -n 4 python bench/reduce.py -b 8 -e 64M -f 2

Reduce: the element-wise reduction (-o, default sum) of all ranks' buffers, on the root only
(-r, default 0).

  bytes   S = the buffer on each rank; count = S / sizeof(type)
  busbw   algbw x 1: the root must take in S bytes' worth of every other rank's data (nccl-tests)
  run     comm.reduce(x, op, root, out=y, algorithm=a); in-place: out=x on the root
  check   rank r contributes its own integer-valued data; the root compares all S bytes with
          the exact reduction (the other ranks have nothing to check)
  -a      tree (ringcoll's binomial tree), native (MPI_Reduce)
"""

from harness import Spec, main


def make(c, inplace):
    x = c.data(c.rank)
    if c.rank != c.root:
        return x, None
    return x, (x if inplace else c.empty())


def run(comm, x, y, algorithm, c):
    comm.reduce(x, op=c.op, root=c.root, out=y, algorithm=algorithm)


SPEC = Spec(
    name="reduce",
    busbw_factor=lambda p: 1.0,
    algorithms=("tree", "native"),
    default_algorithms=lambda comm: ["tree", "native"],
    make=make,
    run=run,
    expect=lambda c: c.reduced() if c.rank == c.root else None,
    result=lambda x, y, c: y,
    reduces=True,
    rooted=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
