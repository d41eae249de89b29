"""mpiexec -n 4 python bench/allreduce.py -b 8 -e 64M -f 2

All-reduce: every rank ends with the element-wise reduction (-o, default sum) of all buffers.

  bytes   S = the buffer on each rank; count = S / sizeof(type)
  busbw   algbw x 2(p-1)/p: what each rank must send (and receive) at the least, a ring's
  run     comm.allreduce(x, op, algorithm=a, out=y); in-place: out=x
  check   rank r contributes its own integer-valued data; every rank compares all S bytes
          with the exact reduction
  -a      auto, ring, recursive_doubling, rabenseifner, bruck, hierarchical, node, native
          (default all but bruck, hierarchical and node, plus bruck when p is not a power of
          two, hierarchical when ranks span > 1 node and node, the node tier, when every
          rank shares one node: what auto may pick there, so "auto vs best" sees it)
  extra   --gloo: torch.distributed all_reduce over Gloo too (row 'gloo'), if torch is
          installed (else a one-line note): in-place all_reduce(x) on a torch.from_numpy view;
          out-of-place out.copy_(x) then all_reduce(out); one host only; no avg, no int16 or
          unsigned > 8 bits (skipped with a note);
          --target-ratio R --target-min-bytes B: exit 3 if the best ringcoll algorithm is
          slower than R x native at any size >= B
"""

from harness import Spec, main

ALGORITHMS = ("auto", "ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical",
              "node", "native")


def defaults(comm):
    algs = ["auto", "ring", "recursive_doubling", "rabenseifner", "native"]
    if comm.size & (comm.size - 1):  # Bruck only differs from recursive doubling off 2^k
        algs.insert(-1, "bruck")
    if len(comm.nodes) > 1:
        algs.insert(-1, "hierarchical")
    elif comm.size > 1:
        algs.insert(-1, "node")
    return algs


def make(c, inplace):
    x = c.data(c.rank)
    return x, (x if inplace else c.empty())


def run(comm, x, y, algorithm, c):
    comm.allreduce(x, op=c.op, algorithm=algorithm, out=y)


SPEC = Spec(
    name="allreduce",
    busbw_factor=lambda p: 2 * (p - 1) / p,
    algorithms=ALGORITHMS,
    default_algorithms=defaults,
    make=make,
    run=run,
    expect=lambda c: c.reduced(),
    result=lambda x, y, c: y,
    reduces=True,
    picked=lambda comm, nbytes, inplace=False: comm.auto_algorithm(nbytes, inplace),
    gloo=True,
)

if __name__ == "__main__":
    raise SystemExit(main(SPEC))
