"""The algorithm registry, and the cost model `auto` falls back on.

Every all-reduce algorithm has the signature fn(t, src, dst, combine, ws) (hierarchical also
takes `nodes`). `auto` first looks the size up in a measured tuning table (ringcoll.tuning,
made by `python -m ringcoll.tune`); where there is none it picks the cheapest algorithm by
this model. The model is the alpha-beta-gamma one from each module's docstring:
alpha = per-message latency (s), beta = s per byte moved, gamma = s per byte reduced.
The defaults were fitted to all-reduce timings of ring, recursive doubling and Rabenseifner at
p = 2, 3, 4 and 256 B .. 16 MiB on a 2-core machine with the embedded MPICH (shared memory):
they minimise the summed slowdown of auto's pick against the best measured algorithm. They
are effective values, not link properties: beta is small because on shared memory the copy
overlaps the reduction. `CostModel(alpha=..., beta=..., gamma=...)` overrides them.
"""

import math
from dataclasses import dataclass

from . import (alltoall, barrier, bruck, hierarchical, native, node, rabenseifner,
               recursive_doubling, ring, tree)

ALLREDUCE = {
    "ring": ring.allreduce,
    "recursive_doubling": recursive_doubling.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "hierarchical": hierarchical.allreduce,
    "bruck": bruck.allreduce,
    "node": node.allreduce,
}
#: the algorithms that do not look at the node structure (node, the node tier, runs only where
#: every rank shares one node: CostModel.choose_allreduce's `tier`)
FLAT = ("ring", "recursive_doubling", "rabenseifner", "bruck")
#: every name `algorithm=` accepts for allreduce
ALLREDUCE_NAMES = ("auto", *ALLREDUCE, "native")
#: the other collectives' algorithms (besides "auto"), ringcoll's own first: what auto runs
#: where no tuning table measured the collective (ringcoll.tuning); each collective's module
#: takes its ALGORITHMS from here, so that the tuning file can be checked below that layer
COLLECTIVE_ALGORITHMS = {
    "reduce_scatter": ("ring", "node", "native"), "allgather": ("ring", "node", "native"),
    "broadcast": ("tree", "node", "native"), "reduce": ("tree", "native"),
    "scan": ("recursive_doubling", "native"), "exscan": ("recursive_doubling", "native"),
    "alltoall": ("pairwise", "native"), "alltoallv": ("pairwise", "native"),
    "gather": ("tree", "native"), "scatter": ("tree", "native"),
    "barrier": ("dissemination", "native"),
}


@dataclass(frozen=True)
class CostModel:
    alpha: float = 8e-6  # one step: Python + MPI latency of a message
    beta: float = 0.02e-9  # s per byte through shared memory
    gamma: float = 0.05e-9  # s per byte reduced by a NumPy ufunc
    inter_alpha: float | None = None  # between nodes; None = same as inside a node
    inter_beta: float | None = None
    # the node tier's own terms (fitted by ringcoll.tune where it measured the tier):
    # node_alpha per counter handoff, node_beta per byte one copy moves; None = derived from
    # alpha and beta as the docstring of the node term says
    node_alpha: float | None = None
    node_beta: float | None = None

    def allreduce(self, name, nbytes, p, nodes=None):
        """Predicted seconds of all-reduce `name` on nbytes at p ranks.

        A flat algorithm on several nodes is paced by its slowest link, so it pays the
        inter-node alpha and beta; hierarchical pays them only for its cross-node step.
        """
        if p == 1:
            return 0.0
        n, g = nbytes, self.gamma
        multi_node = nodes is not None and len(nodes) > 1
        ag = self.inter_alpha if self.inter_alpha is not None else self.alpha
        bg = self.inter_beta if self.inter_beta is not None else self.beta
        a, b = (ag, bg) if multi_node else (self.alpha, self.beta)
        if name == "ring":
            return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
        core = 1 << (p.bit_length() - 1)
        fold = 0.0 if core == p else 2 * a + 2 * n * b + n * g
        steps = int(math.log2(core))
        if name == "recursive_doubling":
            return steps * (a + n * b + n * g) + fold
        if name == "bruck":  # a candidate only for small messages (its p x n scratch)
            if nbytes > bruck.MAX_BYTES:
                return math.inf
            return math.ceil(math.log2(p)) * a + (p - 1) * n * (b + g)
        if name == "rabenseifner":
            return 2 * steps * a + 2 * (core - 1) / core * n * b + (core - 1) / core * n * g + fold
        if name == "node":  # 3 handoffs a chunk, each waiting on p-1 peers; without fitted
            # terms a handoff costs about a message's latency (on 2 cores: 3.3 us at p = 2,
            # alpha fitted 2.9 us) and a byte half of beta, which prices a byte through MPI's
            # shared memory, copied twice (into its cells and out): the tier copies each byte
            # once, by the rank that needs it. Large messages break that: MPICH moves them
            # with one kernel copy (CMA), and the tier's 2(p-1)/p + 1/p copies then cost more
            # than the ring's 2(p-1)/p, which node_beta, fitted, shows (docs/node_tier.md)
            chunks = max(1, math.ceil(nbytes / node.HOST_CHUNK))
            na = self.node_alpha if self.node_alpha is not None else a
            nb = self.node_beta if self.node_beta is not None else self.beta / 2
            return (3 * chunks * (p - 1) * na
                    + (2 * (p - 1) / p + 1 / p) * n * nb + (p - 1) / p * n * g)
        if name == "hierarchical":
            k, a, b = max(len(m) for m in nodes), self.alpha, self.beta
            local = 2 * (k - 1) * a + 2 * (k - 1) / k * n * b + (k - 1) / k * n * g
            return local + self.cross_node(nbytes, nodes)[1]
        raise ValueError(f"no cost model for {name!r}")

    def cross_node(self, nbytes, nodes):
        """(algorithm, seconds) of hierarchical's step 2: the cheapest flat all-reduce of one
        shard (nbytes / ranks per node) among one rank of each node."""
        shard = nbytes // max(len(m) for m in nodes)
        spread = [[i] for i in range(len(nodes))]
        return min(((name, self.allreduce(name, shard, len(nodes), spread)) for name in FLAT),
                   key=lambda pair: pair[1])

    def choose_allreduce(self, nbytes, p, nodes, tier=False):
        """The algorithm with the smallest predicted time; hierarchical only across nodes,
        node only where `tier` (every rank on one node, a transport with shared memory)."""
        names = list(FLAT)
        if 1 < len(nodes) < p:
            names.append("hierarchical")
        if tier and len(nodes) == 1 and p > 1:
            names.append("node")
        return min(names, key=lambda name: self.allreduce(name, nbytes, p, nodes))


__all__ = ["ALLREDUCE", "ALLREDUCE_NAMES", "CostModel", "alltoall", "barrier", "bruck",
           "hierarchical", "native", "node", "rabenseifner", "recursive_doubling", "ring", "tree"]
