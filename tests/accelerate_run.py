"""Hugging Face Accelerate on a backend, under mpiexec (tests/test_frameworks.py runs it).

    mpiexec -n 2 python tests/accelerate_run.py --backend ringcoll --out run.json

Accelerate initialises torch.distributed itself only with the backend names it knows (gloo,
nccl, mpi, ccl, ...); it leaves a process group that exists already as it is. So a ringcoll
user creates it first, then the Accelerator:

    import ringcoll.torch, torch.distributed as dist
    dist.init_process_group("ringcoll")
    accelerator = Accelerator(cpu=True)

The run: prepare() a model (wrapped in DDP), optimizer and data loader (sharded per rank),
train with accelerator.backward, and use accelerator.gather_for_metrics, accelerator.reduce
and accelerator.wait_for_everyone. Every rank checks that the group Accelerate uses is this
backend's, that the replicas hold the same parameters (gathered over MPI_COMM_WORLD, not the
backend) and that the gathered and reduced values are right; rank 0 writes the parameters to
--out. Exit 1 on a failed check.
"""

import argparse
import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("ringcoll", "gloo"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    failures = []
    if args.backend == "ringcoll":
        import ringcoll.torch  # noqa: F401  (registers the backend; fills RANK, WORLD_SIZE..)
        dist.init_process_group("ringcoll")
    else:  # gloo's env:// reads the same variables, filled from MPI the same way
        from ringcoll.torch.rendezvous import fill_env
        fill_env()
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    if dist.get_backend() != args.backend:
        failures.append(f"Accelerate runs on {dist.get_backend()!r}, not {args.backend!r}")
    if accelerator.num_processes != world.size or accelerator.process_index != world.rank:
        failures.append(f"Accelerate sees process {accelerator.process_index} of "
                        f"{accelerator.num_processes}, MPI {world.rank} of {world.size}")
    set_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.linspace(-1, 1, 8) + 0.1
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(args.epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
            accelerator.backward(loss)
            optimizer.step()
    accelerator.wait_for_everyone()
    # every sample once, in order, from the sharded loader
    seen = torch.cat([accelerator.gather_for_metrics(yb) for _, yb in loader])
    if not torch.equal(seen, y):
        failures.append("gather_for_metrics did not return every sample once, in order")
    total = accelerator.reduce(torch.tensor([float(world.rank + 1)]), reduction="sum")
    if total.item() != world.size * (world.size + 1) / 2:
        failures.append(f"accelerator.reduce sum gave {total.item()}")
    params = torch.cat([p.detach().reshape(-1)
                        for p in accelerator.unwrap_model(model).parameters()]).numpy()
    every = world.allgather(params)
    failures += [f"rank {r}'s parameters differ from rank 0's" for r in range(world.size)
                 if not np.array_equal(every[r], every[0])]
    for failure in failures:
        print(f"accelerate_run rank {world.rank}: FAIL {failure}", flush=True)
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"params": params.tolist(), "failures": failures}, f)
    accelerator.end_training()
    return 1 if world.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
