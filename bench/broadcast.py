"""mpiexec -n 4 python bench/broadcast.py -b 8 -e 64M -f 2

Broadcast: the root's buffer (-r, default 0) copied into the same buffer on every rank.

  bytes   S = the buffer; count = S / sizeof(type)
  busbw   algbw x 1: every rank must receive all S bytes (nccl-tests)
  run     comm.broadcast(x, root, algorithm=a)  (in place: the API has only that form)
  check   the root holds its data, the others a sentinel; every rank compares all S bytes
          with the root's data
  -a      tree (ringcoll's binomial tree), node (the node tier: shared memory, one node
          only), native (MPI_Bcast)
"""

from harness import IN, Spec, main


def make(c, inplace):
    x = c.data(c.root) if c.rank == c.root else c.empty()
    return x, x


def run(comm, x, y, algorithm, c):
    comm.broadcast(x, root=c.root, algorithm=algorithm)


SPEC = Spec(
    name="broadcast",
    busbw_factor=lambda p: 1.0,
    algorithms=("tree", "node", "native"),
    default_algorithms=lambda comm: ["tree", "node", "native"],
    make=make,
    run=run,
    expect=lambda c: c.data(c.root),
    result=lambda x, y, c: x,
    modes=(IN,),
    rooted=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
