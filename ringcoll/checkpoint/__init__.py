"""Checkpoints of data-, tensor- and pipeline-parallel training: sharded, atomic, pickle-free,
loadable at any mesh.

    ringcoll.save_checkpoint("ckpt", params, opt, comm=comm, extra={"step": 100})
    extra = ringcoll.load_checkpoint("ckpt", params, opt, comm=comm)

    # model parallel: each rank passes its blocks, and where they sit in the whole tensors
    ringcoll.save_checkpoint("ckpt", model.params, opt, mesh=mesh, shards=model.shards())
    ringcoll.load_checkpoint("ckpt", other.params, opt2, mesh=other_mesh,
                             shards=other.shards())          # another mesh: resharded

Every rank calls both with what it holds: `params` (its parameters, or its blocks of them),
the optimizer over them (a ringcoll.optim optimizer or the DistributedOptimizer wrapping
one), and for each parameter that is a block of a bigger tensor its Shard (the global shape
and the block's first index). A checkpoint is a directory (files.py): one raw shard file per
rank that wrote something, and a JSON manifest naming, for every tensor, its global shape and
the blocks each shard holds, with checksums.

    layout.py    Shard, regions, chunks, the dtypes a checkpoint may hold
    files.py     the directory on disk: shard files, the manifest, the atomic rename
    agree.py     the protocol: after every step every rank knows every rank's outcome
    holdings.py  what one rank holds (parameters, optimizer state, wrapper state)
    save.py      plan, write, commit
    load.py      read (resharding as it goes), apply

Guarantees (docs/checkpoints.md): a failure on any rank raises the same CheckpointError on
every rank, within the time of the slowest rank's I/O, leaving the model, the optimizer, the
previous checkpoint and the communicator as they were; the checkpoint at a path is always the
previous or the new one, whole; nothing in a checkpoint can run code when loaded.
"""

from .layout import Shard, shard
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["Shard", "load_checkpoint", "save_checkpoint", "shard"]
