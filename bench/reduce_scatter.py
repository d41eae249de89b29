"""mpiexec -n 4 python bench/reduce_scatter.py -b 8 -e 64M -f 2

Reduce-scatter: the element-wise reduction (-o, default sum) of all ranks' buffers, split in p
equal blocks; rank r keeps block r.

  bytes   S = the whole buffer each rank contributes (= p blocks); count = elements per block
  busbw   algbw x (p-1)/p: each rank must send (p-1) of its p blocks, as in nccl-tests
  run     comm.reduce_scatter(x, op, out=y, algorithm=a)  (out-of-place only: the API has no
          in-place form)
  check   rank r contributes its own integer-valued data; rank r compares its block with the
          same block of the exact reduction
  -a      ring (ringcoll), native (MPI_Reduce_scatter)
"""

from harness import OUT, Spec, main


def make(c, inplace):
    return c.data(c.rank), c.empty(c.block)


def run(comm, x, y, algorithm, c):
    comm.reduce_scatter(x, op=c.op, out=y, algorithm=algorithm)


SPEC = Spec(
    name="reduce_scatter",
    busbw_factor=lambda p: (p - 1) / p,
    algorithms=("ring", "node", "native"),  # node: -a only, auto runs it on GPUs alone
    default_algorithms=lambda comm: ["ring", "native"],
    make=make,
    run=run,
    expect=lambda c: c.reduced(c.block, start=c.rank * c.block),
    result=lambda x, y, c: y,
    modes=(OUT,),
    blocked=True,
    reduces=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
