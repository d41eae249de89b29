"""mpiexec -n 4 python tests/mpi_parallel.py: the model-parallel checks under real MPI.

The thread tier's assertions (tests/_parallel_cases.py) on 4 processes: meshes of several
shapes, the tensor-parallel layers at tp = 4 and tp = 2 inside a dp x tp mesh, and GPipe and
1F1B at pp = 4 and pp = 2 inside a dp x pp mesh. Prints 'OK <check>' per check on rank 0; a
failure on any rank prints 'FAIL' and ends the job with a non-zero exit code.
"""

import sys
import traceback
from pathlib import Path

from mpi4py import MPI

import ringcoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parallel_cases as C  # noqa: E402


def checks(comm):
    yield "mesh dp=2 tp=2", lambda: C.check_mesh(comm, 2, 2, 1)
    yield "mesh pp=2 dp=2", lambda: C.check_mesh(comm, 2, 1, 2)
    yield "mesh tp=4", lambda: C.check_mesh(comm, 1, 4, 1)
    yield "column tp=4", lambda: C.check_column(comm, gather_output=True)
    yield "row tp=4", lambda: C.check_row(comm, input_is_parallel=False)
    yield "mlp tp=4", lambda: C.check_mlp(comm)
    yield "mlp tp=4 sequence parallel", lambda: C.check_mlp(comm, sequence_parallel=True)
    mesh = ringcoll.Mesh(comm, dp=2, tp=2)
    yield "mlp tp=2 in dp=2 x tp=2", lambda: C.check_mlp(mesh.tp)
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 4, 8):
            yield f"{schedule} pp=4 m={m}", lambda: C.check_pipeline(comm, schedule, m)
    mesh = ringcoll.Mesh(comm, dp=2, pp=2)
    for schedule in ("gpipe", "1f1b"):
        yield f"{schedule} pp=2 m=4 in dp=2 x pp=2", lambda: C.check_pipeline(mesh.pp,
                                                                               schedule, 4)


def main():
    comm = ringcoll.Communicator()
    try:
        for label, check in checks(comm):
            check()
            comm.barrier()
            if comm.rank == 0:
                print(f"OK {label}", flush=True)
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {comm.rank}:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main()
