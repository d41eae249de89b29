"""Hierarchical (node-aware) all-reduce: reduce-scatter in the node, all-reduce across nodes,
all-gather in the node.

Intra-node links are fast and inter-node links are slow, so only 1/k of the buffer (k ranks per
node) should cross the network from each rank:

  1. inside each node, a reduce-scatter leaves local rank i with its shard of the node's sum:
     through the node tier's shared memory (algorithms/node.py) where the node's ranks can
     share it, else the ring;
  2. the ranks holding the same shard on different nodes all-reduce it with the `inner`
     algorithm (ring by default; the Communicator passes the cost model's pick for n/k bytes
     on N ranks) - N nodes, n/k bytes each;
  3. inside each node, an all-gather (node tier, else ring) puts the shards back together.

Uneven nodes (the last may be smaller): the buffer is cut into L blocks, L the largest node
size; in a node of k ranks local rank i owns the contiguous blocks [i*L//k, (i+1)*L//k). Step 2
runs once per block b, in increasing b, among the owners of b on every node; every rank takes
its blocks in the same global order, so the groups can never wait on each other in a cycle.

Cost with N nodes of k ranks (intra-node a_l, b_l; inter-node a_g, b_g):
    2(k-1) a_l + 2(k-1)/k n b_l + (k-1)/k n g          (steps 1 and 3 by the ring; the node
                                                        tier's: 3 handoffs a chunk instead
                                                        of 2(k-1) a_l, see node.py)
  + 2(N-1) a_g + 2(N-1)/N (n/k) b_g + (N-1)/N (n/k) g  (step 2 with a ring inner; another
                                                        inner: its own cost on n/k bytes)
Every shard is finished by one cross-node all-reduce (itself bitwise identical) and copied, so
all ranks end with bitwise identical results.
"""

from ..arrays import Partition
from . import node as tier, ring


def owned_blocks(local_rank, node_size, blocks):
    """The blocks [first, last) local_rank of a node of node_size ranks owns, of `blocks`."""
    return local_rank * blocks // node_size, (local_rank + 1) * blocks // node_size


def owner(block, node_size, blocks):
    """The local rank of a node of node_size ranks that owns `block`."""
    for i in range(node_size):
        first, last = owned_blocks(i, node_size, blocks)
        if first <= block < last:
            return i
    raise ValueError(f"block {block} is not among the {blocks} blocks")


def plan(t, nodes, n, ws):
    """This rank's schedule for n elements: its node's view, the node-local partition into
    shards, and one (block slice, cross-node view) per block it owns. Cached per n."""

    def build():
        node = next(m for m in nodes if t.rank in m)
        k, blocks = len(node), max(len(m) for m in nodes)
        part = ws.partition(n, blocks)
        shards = Partition([part.starts[last] - part.starts[first]  # local rank i's blocks
                            for first, last in (owned_blocks(i, k, blocks) for i in range(k))])
        local = t.view(node, tag_offset=1)
        first, last = owned_blocks(local.rank, k, blocks)
        cross = [(part.slices[b], t.view([m[owner(b, len(m), blocks)] for m in nodes],
                                         tag_offset=2 + b))
                 for b in range(first, last)]
        return local, shards, cross

    return ws.cached(("hierarchical", n), build)


def allreduce(t, src, dst, combine, ws, nodes, inner=ring.allreduce):
    """dst = reduction of every rank's src; `nodes` lists each node's ranks (of t), in order."""
    local, shards, cross = plan(t, nodes, dst.size, ws)
    shared = local.size > 1 and tier.tier_of(local, ws) is not None
    if shared:  # 1. my shard of the node's sum
        tier.reduce_scatter(local, src, dst[shards.slices[local.rank]], shards, combine, ws)
    else:
        ring.reduce_scatter(local, src, dst, shards, combine, ws)
    for block, group in cross:  # 2. each block I own, with its owners on the other nodes
        shard = dst[block]
        inner(group, shard, shard, combine, ws)
    if shared:  # 3. every shard back to every rank of the node
        tier.allgather(local, dst, shards, ws)
    else:
        ring.allgather(local, dst, shards, ws)
