"""mpiexec -n P python tests/mpi_p2p.py [SCENARIO]: point-to-point messages under real MPI.

Without a scenario it runs every case of tests/_p2p_cases.py (the thread tier's assertions)
and prints 'OK p2p <case> p=P' per case on rank 0; any failure prints 'FAIL' and ends the job
non-zero. A scenario makes rank 1 break the rules instead (tests/test_p2p.py asserts that the
job ends at once with the error text, never hangs):
  long      rank 0 sends 3 float64 where rank 1's recv has room for 2 (blocking recv)
  short     rank 0 sends 1 float64 where rank 1's irecv expects 2 (found at wait)
  never     rank 1 waits in recv for a message rank 0 never sends (the watchdog ends it;
            rank 0 sleeps meanwhile, so rank 1's watchdog is the one that fires)
  polled    the same with irecv(...).wait(poll=1e-3): the polling wait is watched too
  any       the same with recv(out, ringcoll.ANY_SOURCE): no rank sends
  any_long  rank 0 sends 3 float64 to a wildcard recv with room for 2 (named in the error)
The scenario `wildcards` is not a failure: it runs the wildcard cases alone (any -n),
printing 'OK p2p <case> p=P' as the full run does.
"""

import sys
import time
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringcoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _p2p_cases  # noqa: E402


def main(scenario=None):
    comm = ringcoll.Communicator()
    if scenario in (None, "wildcards"):
        cases = _p2p_cases.CASES if scenario is None else _p2p_cases.WILDCARD_CASES
        try:
            for case in cases:
                case(comm)
                comm.barrier()
                if comm.rank == 0:
                    print(f"OK p2p {case.__name__} p={comm.size}", flush=True)
        except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
            print(f"FAIL rank {comm.rank}:\n{traceback.format_exc()}", flush=True)
            MPI.COMM_WORLD.Abort(1)
        return
    if scenario == "long":
        if comm.rank == 0:
            comm.send(np.ones(3), 1)
        elif comm.rank == 1:
            comm.recv(np.empty(2), 0)
    elif scenario == "short":
        if comm.rank == 0:
            comm.send(np.ones(1), 1)
        elif comm.rank == 1:
            comm.irecv(np.empty(2), 0).wait()
    elif scenario == "any_long":
        if comm.rank == 0:
            comm.send(np.ones(3), 1)
        elif comm.rank == 1:
            comm.recv(np.empty(2), ringcoll.ANY_SOURCE)
    elif scenario == "any":
        if comm.rank == 0:
            time.sleep(60)
        elif comm.rank == 1:
            comm.recv(np.empty(2), ringcoll.ANY_SOURCE)
    elif scenario in ("never", "polled"):
        if comm.rank == 0:
            time.sleep(60)
        elif scenario == "never":
            comm.recv(np.empty(2), 0)
        else:
            comm.irecv(np.empty(2), 0).wait(poll=1e-3)
    comm.barrier()
    print(f"rank {comm.rank}: finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
