"""What torch's env:// rendezvous reads, filled from MPI where the environment leaves it unset.

torch.distributed always builds a key-value store (a TCPStore served by rank 0) before it
creates a process group, and reads its address from MASTER_ADDR and MASTER_PORT. ringcoll's
collectives never use that store, but torch does (its init barrier, new_group, object
collectives' bookkeeping), so a real one is set up:

- RANK and WORLD_SIZE: MPI_COMM_WORLD's rank and size;
- LOCAL_RANK and LOCAL_WORLD_SIZE: this rank's place among the ranks on its host;
- MASTER_ADDR: 127.0.0.1 when every rank runs on one host, else rank 0's hostname (on a
  cluster whose hostnames do not resolve between nodes, set MASTER_ADDR yourself);
- MASTER_PORT: a port that was free on rank 0 when asked (the kernel's pick).

The hostnames and the address travel in one MPI allgather and one broadcast, done only when
MASTER_ADDR or MASTER_PORT is unset (mpiexec passes one environment to every rank, so every
rank decides alike). Variables already set are left as they are; if RANK or WORLD_SIZE then
disagree with MPI, creating the group says so (process_group.create).
"""

import os
import socket


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def fill_env(environ=None):
    """Set the unset ones of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in environ (default os.environ) from MPI_COMM_WORLD. Collective over it when
    MASTER_ADDR or MASTER_PORT is unset."""
    from mpi4py import MPI

    env = os.environ if environ is None else environ
    world = MPI.COMM_WORLD
    env.setdefault("RANK", str(world.rank))
    env.setdefault("WORLD_SIZE", str(world.size))
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return
    hosts = world.allgather(socket.gethostname())
    env.setdefault("LOCAL_RANK", str(hosts[:world.rank].count(hosts[world.rank])))
    env.setdefault("LOCAL_WORLD_SIZE", str(hosts.count(hosts[world.rank])))
    if world.rank == 0:
        addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        address = (env.get("MASTER_ADDR", addr), env.get("MASTER_PORT") or str(_free_port()))
    else:
        address = None
    addr, port = world.bcast(address, root=0)
    env.setdefault("MASTER_ADDR", addr)
    env.setdefault("MASTER_PORT", port)
