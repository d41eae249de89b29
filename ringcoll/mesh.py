"""Process meshes: a communicator's ranks as a pp x dp x tp grid, one sub-communicator per axis.

    mesh = ringcoll.Mesh(comm, dp=2, tp=2)        # 4 ranks (pp=1)
    mesh.tp.allreduce(partial_sum)                # over the ranks holding the other shards
    mesh.dp.allreduce(grad, op="avg")             # over the replicas of this shard
    mesh.pp.send(activations, mesh.pp.rank + 1)   # to the next pipeline stage
    print(mesh)                                   # the layout, the groups, the nodes

The axes (Megatron-LM's names and order):
  tp  tensor parallel: each layer's weight matrices split over the group; an all-reduce (or
      all-gather / reduce-scatter) of activations in every layer, forward and backward. The
      most traffic, on the critical path: the innermost axis, consecutive ranks, one node.
  dp  data parallel: replicas on different shares of each batch; one all-reduce of the
      gradients per step, which can overlap the backward pass.
  pp  pipeline parallel: consecutive layers on different ranks; point-to-point activations
      forward and gradients backward, the least traffic: the outermost axis, across nodes.

Global rank = (pp_index * dp + dp_index) * tp + tp_index with the default order (outer to
inner) ("pp", "dp", "tp"); `order=` names another. In every sub-communicator the rank is the
coordinate on that axis: mesh.tp.rank is this rank's tensor-parallel index, mesh.pp.size the
number of stages.

Cost: three Communicator.split calls when built (one collective each); nothing afterwards.
"""

import numpy as np

from .communicator import Communicator
from .errors import InvalidArgumentError, where

AXES = ("pp", "dp", "tp")  # outer to inner
ROLES = {  # what each axis' groups carry, for describe()
    "tp": "layers split; all-reduce in every layer",
    "dp": "replicas; all-reduce gradients each step",
    "pp": "stages; activations and gradients point-to-point",
}


class Mesh:
    """A communicator's ranks as a grid of pipeline x data x tensor parallel groups.

    Args:
        comm: the ringcoll.Communicator over all ranks (default: a new one over
            MPI.COMM_WORLD).
        dp, tp, pp: the size of each axis; dp=None (default) takes whatever tp and pp leave:
            comm.size // (tp * pp). Their product must be comm.size.
        order: the axes from outermost to innermost (default ("pp", "dp", "tp")): the
            innermost has consecutive ranks.

    Attributes:
        tp, dp, pp: this rank's sub-communicator along each axis (a ringcoll.Communicator;
            its rank is this rank's coordinate, its size the axis' size).
        shape: {"pp": .., "dp": .., "tp": ..}.
        coords: this rank's {"pp": i, "dp": j, "tp": k}.

    Example::

        # mpiexec -n 4: ranks 0,1 and 2,3 split each layer; 0,2 and 1,3 are replicas
        mesh = ringcoll.Mesh(ringcoll.Communicator(), dp=2, tp=2)
        mesh.tp.rank, mesh.dp.rank     # rank 3: (1, 1)
    """

    def __init__(self, comm=None, *, dp=None, tp=1, pp=1, order=AXES):
        if comm is None:
            comm = Communicator()
        ctx = where(comm.rank, "Mesh")
        for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
            if value is None and name == "dp":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(f"{ctx}{name}={value!r} must be a positive integer")
        if sorted(order) != sorted(AXES):
            raise InvalidArgumentError(f"{ctx}order={order!r} must name each of {AXES} once "
                                       "(outermost first)")
        if dp is None:
            if comm.size % (tp * pp):
                raise InvalidArgumentError(
                    f"{ctx}tp={tp} x pp={pp} = {tp * pp} does not divide the communicator's "
                    f"{comm.size} ranks; choose tp and pp whose product divides {comm.size}")
            dp = comm.size // (tp * pp)
        if dp * tp * pp != comm.size:
            raise InvalidArgumentError(
                f"{ctx}dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the "
                f"communicator has {comm.size}; choose sizes whose product is {comm.size} "
                f"(or leave dp=None to take comm.size // (tp * pp))")
        self.comm = comm
        self.order = tuple(order)
        self.shape = {"pp": int(pp), "dp": int(dp), "tp": int(tp)}
        self.coords = self.coords_of(comm.rank)
        for axis in AXES:
            # the group: every rank that differs from this one only along `axis`; its color
            # is the group's first member, its key the coordinate along the axis
            color = self.rank_of(**{**self.coords, axis: 0})
            setattr(self, axis, comm.split(color, key=self.coords[axis]))

    @property
    def size(self):
        return self.comm.size

    def rank_of(self, **coords):
        """The global rank at these coordinates (pp=, dp=, tp=; a missing one is 0)."""
        rank = 0
        for axis in self.order:
            rank = rank * self.shape[axis] + int(coords.get(axis, 0))
        return rank

    def coords_of(self, rank):
        """{"pp": i, "dp": j, "tp": k} of a global rank."""
        coords = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, self.shape[axis])
        return {axis: coords[axis] for axis in AXES}

    def groups(self, axis):
        """Every group along `axis` as a list of global ranks in axis order, the groups
        ordered by their first rank. groups("tp") on dp=2, tp=2: [[0, 1], [2, 3]]."""
        if axis not in AXES:
            raise InvalidArgumentError(f"ringcoll Mesh.groups: axis must be one of {AXES}, "
                                       f"got {axis!r}")
        firsts = sorted({self.rank_of(**{**self.coords_of(r), axis: 0})
                         for r in range(self.size)})
        return [[self.rank_of(**{**self.coords_of(first), axis: i})
                 for i in range(self.shape[axis])] for first in firsts]

    def describe(self):
        """The layout as text (the same on every rank): the grid of global ranks, one row per
        outer coordinate and one column per innermost coordinate, the node of each row, and
        the groups of each axis with the traffic they carry."""
        outer, inner = self.order[:-1], self.order[-1]
        node_of = {r: i for i, members in enumerate(self.comm.nodes) for r in members}
        dims = " x ".join(f"{axis} {self.shape[axis]}" for axis in self.order)
        lines = [f"ringcoll.Mesh: {self.size} ranks = {dims} (outer to inner; {inner} ranks "
                 "are consecutive)", ""]
        width = max(4, len(str(self.size - 1)))
        label = " ".join(f"{axis} {{:<{len(str(self.shape[axis] - 1))}}}" for axis in outer)
        head = " " * len(label.format(*([0] * len(outer))))
        lines.append(head + "  " + " ".join(f"{inner} {i:<{width - 3}}".rjust(width + 2)
                                            for i in range(self.shape[inner])))
        for row in np.ndindex(*(self.shape[axis] for axis in outer)):
            ranks = [self.rank_of(**dict(zip(outer, row)), **{inner: i})
                     for i in range(self.shape[inner])]
            nodes = sorted({node_of[r] for r in ranks})
            lines.append(label.format(*row) + "  " + " ".join(f"{r:>{width + 2}}" for r in ranks)
                         + "    node " + ", ".join(map(str, nodes)))
        lines.append("")
        for axis in reversed(self.order):  # innermost first: the heaviest traffic
            groups = " ".join("[" + " ".join(map(str, g)) + "]" for g in self.groups(axis))
            lines.append(f"{axis} groups ({ROLES[axis]}): {groups}")
        split = [g for g in self.groups("tp") if len({node_of[r] for r in g}) > 1]
        if split:
            lines.append(f"note: tp group(s) {split} span nodes; tensor parallelism all-reduces "
                         "in every layer and belongs inside a node (make tp <= ranks per node)")
        return "\n".join(lines)

    __str__ = describe

    def __repr__(self):
        c = self.coords
        return (f"<ringcoll.Mesh pp={self.shape['pp']} dp={self.shape['dp']} "
                f"tp={self.shape['tp']}: rank {self.comm.rank} at pp {c['pp']}, dp {c['dp']}, "
                f"tp {c['tp']}>")

    def close(self):
        """Free the three sub-communicators (collective over the mesh); comm stays open."""
        for axis in AXES:
            getattr(self, axis).close()
