"""mpiexec -n P python tests/mpi_repartition.py: re-partitioned training under real MPI.

The loop of tests/_repartition_train.py (the digits MLP in float64 on synthetic data, rank 1
recorded as computing 2x slower, an exchange every 3 steps, 4 steps per epoch) on P processes
must end with the parameters of one-process synchronous training on the same global batches
(within 1e-10; the max abs difference is printed), bitwise identical on every rank, every rank
having used the same split at every step, and (P > 1) the split moved in the middle of an epoch.
A second run uses real measured times (timed()) with a real 2x Slowdown on rank 1: the
splits then depend on the clock, the parameters still may not.
Prints 'OK <check> ...' per check; exits non-zero if any check fails on any rank.
"""

import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repartition_train as tr  # noqa: E402

import ringcoll  # noqa: E402
from ringcoll.straggler import Slowdown  # noqa: E402

FAILURES = []
TOL = 1e-10


def check(label, ok, detail=""):
    rank = MPI.COMM_WORLD.rank
    if ok:
        if rank == 0:
            print(f"OK {label} {detail}", flush=True)
    else:
        FAILURES.append(label)
        print(f"FAIL rank {rank} {label} {detail}", flush=True)


def same_on_every_rank(comm, value):
    everyone = MPI.COMM_WORLD.allgather(value)
    return all(v == everyone[0] for v in everyone)


def digest(params):
    return b"".join(np.ascontiguousarray(params[k]).tobytes() for k in sorted(params))


def train_measured(comm, every=3):
    """tr.train's loop with real timed() compute and a real 2x Slowdown on rank 1."""
    x, y = tr.data()
    params = tr.params64(seed=1 + comm.rank)
    ringcoll.broadcast_parameters(params, comm=comm)
    rp = ringcoll.Repartitioner(comm, tr.BATCH, every=every, hysteresis=0.1)
    opt = rp.distributed_optimizer(tr.make_sgd(params), bucket_bytes=512)
    slow = Slowdown.for_rank("1:2", comm.rank)
    used = []
    for batch in tr.batches():
        rows = rp.shard(batch)
        used.append(rp.counts)
        with rp.timed(), slow:
            acts = tr.forward(params, x[rows])
            _, dlogits = tr.loss_and_grad_logits(acts[-1], y[rows], rp.grad_scale)
            tr.backward(params, acts, dlogits, opt.grad_ready)
        opt.step()
        rp.step()
    return params, rp, used


def main():
    # ringcoll's own algorithms: the trace below counts their messages (MPI's own
    # collectives, which a measured table may pick, are opaque to it)
    comm = ringcoll.Communicator(tuning=False)
    p = comm.size
    try:
        ref = tr.reference()
        slow = [1.0] * p
        slow[min(1, p - 1)] = 2.0
        params, rp, used = tr.train(comm, slow)
        d = tr.max_diff(params, ref)
        mid = [s for s in range(1, len(used)) if used[s] != used[s - 1]
               and s % tr.STEPS_PER_EPOCH != 0]
        moved = (not mid and set(used) == {(tr.BATCH,)}) if p == 1 else bool(mid)
        check(f"recorded straggler p={p}",
              d < TOL and moved and same_on_every_rank(comm, digest(params))
              and same_on_every_rank(comm, used),
              f"max abs diff {d:.2e}, splits {rp.resplits}")

        params, rp, used = train_measured(comm)
        d = tr.max_diff(params, ref)
        check(f"measured 2x Slowdown p={p}",
              d < TOL and same_on_every_rank(comm, digest(params))
              and same_on_every_rank(comm, used) and all(sum(c) == tr.BATCH for c in used),
              f"max abs diff {d:.2e}, final split {rp.counts}")

        # the exchange is one all-gather of p floats every `every` steps, nothing else
        rp = ringcoll.Repartitioner(comm, tr.BATCH, every=2)
        with comm.trace() as trace:
            for _ in range(4):
                rp.record(1e-3 * rp.count)
                rp.step()
        calls = sorted({(m.collective, m.seq) for m in trace.messages})
        biggest = max((m.nbytes for m in trace.messages), default=0)
        expected = 2 if p > 1 else 0  # one process sends nothing
        check(f"two exchanges in four steps p={p}",
              len(calls) == expected and {c for c, _ in calls} <= {"allgather"}
              and biggest <= 8 * p + 64, f"collectives {calls}, largest message {biggest} B")
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {comm.rank}:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    if MPI.COMM_WORLD.allreduce(len(FAILURES)):
        sys.exit(1)


if __name__ == "__main__":
    main()
