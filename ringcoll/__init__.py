"""ringcoll: collective communication from scratch, in Python over MPI point-to-point.

    import ringcoll, numpy as np
    comm = ringcoll.Communicator()            # MPI.COMM_WORLD, duplicated
    y = comm.allreduce(np.ones(1 << 20, np.float32))

See README.md to start, docs/algorithms.md for the algorithms and their costs,
docs/architecture.md for how the package is put together, bench/README.md for the benchmarks.
"""

from . import checkpoint, optim, parallel, straggler
from .algorithms import ALLREDUCE_NAMES, CostModel
from .checkpoint import load_checkpoint, save_checkpoint
from .communicator import ANY_SOURCE, Communicator, Request, Status
from .async_sgd import AsyncSGD, ParameterStore
from .compression import Compression, Compressor
from .distributed import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .errors import (ABORT_CODE, CheckpointError, CollectiveMismatchError, CollectiveTimeoutError,
                     CommunicatorClosedError, InvalidArgumentError, InvalidTypeError,
                     PeerFailedError, RingcollError)
from .inprocess import run_threads, simulate
from .local_sgd import LocalSGD
from .mesh import Mesh
from .repartition import Repartitioner
from .transport.trace import Message, Receive, Trace
from .tuning import Tuning, TuningFileError

__version__ = "0.1.0"


def wrap(mpi_comm=None, **options):
    """mpi4py-compatible communicator running ringcoll's collectives (see ringcoll.compat)."""
    from .compat import wrap as _wrap  # imports mpi4py only when asked

    return _wrap(mpi_comm, **options)


__all__ = [
    "ABORT_CODE",
    "ALLREDUCE_NAMES",
    "ANY_SOURCE",
    "AsyncSGD",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Communicator",
    "CommunicatorClosedError",
    "Compression",
    "Compressor",
    "CostModel",
    "DistributedOptimizer",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LocalSGD",
    "Mesh",
    "Message",
    "ParameterStore",
    "PeerFailedError",
    "Receive",
    "Repartitioner",
    "Request",
    "RingcollError",
    "Status",
    "Trace",
    "Tuning",
    "TuningFileError",
    "__version__",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "checkpoint",
    "load_checkpoint",
    "optim",
    "parallel",
    "run_threads",
    "save_checkpoint",
    "simulate",
    "straggler",
    "wrap",
]
