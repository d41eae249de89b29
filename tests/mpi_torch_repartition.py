"""mpiexec -n P python tests/mpi_torch_repartition.py: re-partitioned torch training under MPI.

A small torch MLP in float64 trains on the "ringcoll" backend with a RepartitionSampler
(DataLoader(batch_sampler=...)) over a ringcoll.Repartitioner whose first split is forced uneven
(speeds=) and whose compute times are recorded, not measured (rank 1 "2x slower"), so that the
exchange every 3 steps re-splits deterministically, in the middle of an epoch (4 steps per
epoch). Three ways to weight the gradients, each a fresh run:

- "scaled loss": loss = sum of the rows' losses x rp.grad_scale; allreduce_gradients(model, 1.0)
- "sum loss": loss = sum of the rows' losses; allreduce_gradients(model, rp)
- "ddp sum_hook": DistributedDataParallel with sum_hook, loss as in "scaled loss"

Each must end with the parameters of one process training on the whole global batches in the
same order (the mean loss; within 1e-10, the max abs difference printed), bitwise identical on
every rank; every step the ranks' rows, in rank order, must be exactly that step's global batch;
and at P > 1 the split must have moved in the middle of an epoch. Then "errors": bad arguments
to allreduce_gradients and communicator() raise on the rank, before any collective.
Prints 'OK <check> ...' per check (4); exits non-zero if any check fails on any rank.
"""

import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

import ringcoll
import ringcoll.torch
from ringcoll import InvalidArgumentError, InvalidTypeError
from ringcoll.torch import RepartitionSampler, allreduce_gradients, sum_hook

N, BATCH, STEPS_PER_EPOCH, EPOCHS = 120, 30, 4, 3  # 30 rows: uneven shares at 4 ranks
EVERY, SEED, TOL = 3, 17, 1e-10
FORCED = [1.0, 3.0, 2.0, 1.5]  # the first split, before anything is measured
VARIANTS = ["scaled loss", "sum loss", "ddp sum_hook"]
FAILURES = []
WORLD = MPI.COMM_WORLD


def check(label, ok, detail=""):
    if ok:
        if WORLD.rank == 0:
            print(f"OK {label} {detail}", flush=True)
    else:
        FAILURES.append(label)
        print(f"FAIL rank {WORLD.rank} {label} {detail}", flush=True)


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 12, generator=g, dtype=torch.float64)
    y = (x[:, :5].argmax(dim=1) + (x[:, -1] > 0.5).long()) % 5
    return x, y


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 5)).double()


def make_opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def epoch_order(epoch):
    """The oracle's order: DistributedSampler's permutation (seed + epoch), drawn here."""
    g = torch.Generator()
    g.manual_seed(SEED + epoch)
    return torch.randperm(N, generator=g)


def reference():
    """One process, whole global batches, the mean loss: the synchronous trajectory."""
    x, y = data()
    model = make_model(1)
    opt = make_opt(model)
    for epoch in range(EPOCHS):
        order = epoch_order(epoch)
        for b in range(STEPS_PER_EPOCH):
            rows = order[b * BATCH:(b + 1) * BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
    return flat(model)


def train(variant, comm):
    """Returns (parameters, rp, [counts per step], [this rank's indices per step])."""
    x, y = data()
    model = make_model(1 + comm.rank)  # different on purpose: a broadcast (or DDP) fixes it
    if variant == "ddp sum_hook":
        net = torch.nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(None, sum_hook)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = make_opt(model)
    rp = ringcoll.Repartitioner(comm, BATCH, every=EVERY, hysteresis=0.1,
                                speeds=FORCED[:comm.size])
    sampler = RepartitionSampler(rp, N, shuffle=True, seed=SEED)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y, torch.arange(N)), batch_sampler=sampler)
    factor = 2.0 if comm.rank == 1 else 1.0
    used, mine = [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb, ib in loader:
            used.append(rp.counts)
            mine.append(ib.tolist())
            opt.zero_grad()
            loss = F.cross_entropy(net(xb), yb, reduction="sum")
            if variant != "sum loss":
                loss = loss * rp.grad_scale
            loss.backward()
            rp.record(factor * 1e-3 * len(ib))  # deterministic: recorded, not measured
            if variant == "scaled loss":
                allreduce_gradients(model, 1.0)
            elif variant == "sum loss":
                allreduce_gradients(model, rp)
            opt.step()
            rp.step()
    return flat(model), rp, used, mine


def raises(fn, cls, words):
    try:
        fn()
    except cls as exc:
        return str(exc).startswith(f"ringcoll rank {WORLD.rank}, ") and words in str(exc)
    return False


def check_errors():
    """Local checks: each raises at the call on this rank, and no collective has started."""
    model = make_model(1)
    emb = torch.nn.Embedding(4, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    gloo = dist.new_group(backend="gloo")
    cases = {
        "nan scale": raises(lambda: allreduce_gradients(model, float("nan")),
                            InvalidArgumentError, "rp_or_scale must be a Repartitioner"),
        "one tensor": raises(lambda: allreduce_gradients(torch.zeros(3), 1.0), InvalidTypeError,
                             "not one tensor"),
        "sparse gradient": raises(lambda: allreduce_gradients(emb, 1.0), InvalidTypeError,
                                  "only dense gradients"),
        "gloo group": raises(lambda: ringcoll.torch.communicator(gloo), InvalidArgumentError,
                             "runs on 'gloo', not ringcoll"),
    }
    bad = [k for k, ok in cases.items() if not ok]
    check(f"errors p={WORLD.size}", not bad, f"{len(cases)} cases, failed: {bad}")


def main():
    dist.init_process_group("ringcoll")
    comm = ringcoll.torch.communicator()
    p = comm.size
    try:
        ref = reference()
        for variant in VARIANTS:
            params, rp, used, mine = train(variant, comm)
            d = float((params - ref).abs().max())
            everyone = WORLD.allgather((params.numpy().tobytes(), used, mine))
            bitwise = all(e[0] == everyone[0][0] for e in everyone)
            same_split = all(e[1] == used for e in everyone)
            partition = len(used) == EPOCHS * STEPS_PER_EPOCH and all(
                sum((e[2][s] for e in everyone), [])
                == epoch_order(s // STEPS_PER_EPOCH)[
                    (s % STEPS_PER_EPOCH) * BATCH:(s % STEPS_PER_EPOCH + 1) * BATCH].tolist()
                and [len(e[2][s]) for e in everyone] == list(used[s])
                for s in range(len(used)))
            mid = [s for s in range(1, len(used)) if used[s] != used[s - 1]
                   and s % STEPS_PER_EPOCH != 0]
            moved = bool(mid) if p > 1 else set(used) == {(BATCH,)}
            check(f"{variant} p={p}", d <= TOL and bitwise and same_split and partition and moved,
                  f"max abs diff {d:.3e} (bound {TOL:g}); bitwise {bitwise}, same split "
                  f"{same_split}, rows partition every batch {partition}, first split "
                  f"{used[0]}, re-splits {rp.resplits} (mid-epoch at steps {mid})")
        check_errors()
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {WORLD.rank}:\n{traceback.format_exc()}", flush=True)
        WORLD.Abort(1)
    failed = WORLD.allreduce(len(FAILURES))
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
