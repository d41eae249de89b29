"""ringcoll as a PyTorch distributed backend: ``import ringcoll.torch`` registers "ringcoll".

Under mpiexec this is all a PyTorch program needs::

    import torch.distributed as dist
    import ringcoll.torch
    dist.init_process_group("ringcoll")        # rank and world size come from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)

Every collective torch.distributed sends the group runs on ringcoll's algorithms, on NumPy views
of CPU tensors' memory and CuPy views of CUDA tensors' (process_group.py has the list and the
details). Importing this module
fills what torch's default ``env://`` rendezvous reads, where the environment leaves it unset:
RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from MPI, and MASTER_ADDR/MASTER_PORT for
torch's TCP store, chosen on rank 0 and broadcast over MPI (rendezvous.py). That broadcast makes
the import collective over MPI_COMM_WORLD when MASTER_ADDR or MASTER_PORT is unset: every rank
imports ringcoll.torch, as every rank initialises MPI.

Dynamic re-partitioning (repartition.py): RepartitionSampler, this rank's share of every global
batch under a ringcoll.Repartitioner's current split; allreduce_gradients (or the DDP comm hook
sum_hook), which sums the weighted gradients so the update is the global-batch mean; and
communicator(), the Communicator under a "ringcoll" group, for the Repartitioner.
"""

import torch.distributed as dist

from .process_group import ProcessGroup, create
from .rendezvous import fill_env
from .repartition import RepartitionSampler, allreduce_gradients, communicator, sum_hook

__all__ = ["ProcessGroup", "BACKEND", "RepartitionSampler", "allreduce_gradients",
           "communicator", "sum_hook"]

#: the name to pass to dist.init_process_group and dist.new_group(backend=...)
BACKEND = "ringcoll"

fill_env()
if getattr(dist.Backend, BACKEND.upper(), None) is None:  # a second import registers nothing
    # extended_api: the creator is told the group's global ranks, which it needs to build the
    # MPI sub-communicator of a dist.new_group (only the members call it).
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
