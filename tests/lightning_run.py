"""PyTorch Lightning's DDP on a backend, under mpiexec (tests/test_frameworks.py runs it).

    mpiexec -n 2 python tests/lightning_run.py --backend ringcoll --out run.json

What a Lightning user writes to train on ringcoll: DDPStrategy(process_group_backend=
"ringcoll", cluster_environment=MPIEnvironment()), nothing else changed. The model logs with
sync_dist=True (a float loss, and an int64 count, which Lightning reduces with ReduceOp.AVG on
any backend but gloo), validates every epoch, and ModelCheckpoint keeps the best and the last
checkpoint by the synced val_loss. Afterwards every rank checks that all replicas hold the
same parameters (gathered over MPI_COMM_WORLD, not the backend), loads the last checkpoint
into a new model and checks it against the trained one; rank 0 writes the parameters and the
logged metrics to --out. Exit 1 on a failed check.
"""

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("ringcoll", "gloo"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    if args.backend == "ringcoll":
        import ringcoll.torch  # noqa: F401  (registers the backend, on every rank)
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.environments import MPIEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 3))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            logits = self(x)
            self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
            # an int64 metric: Lightning syncs it with ReduceOp.AVG (NCCL's integer mean)
            self.log("val_correct", (logits.argmax(1) == y).sum(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    data = torch.utils.data.TensorDataset(x, y)
    loader = lambda: torch.utils.data.DataLoader(data, batch_size=8)  # noqa: E731
    model = Model()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = world.bcast(tmp)  # rank 0's directory: checkpoints are written there
        checkpoint = ModelCheckpoint(dirpath=tmp, monitor="val_loss", save_last=True)
        trainer = L.Trainer(
            accelerator="cpu", devices=world.size, max_epochs=args.epochs, logger=False,
            strategy=DDPStrategy(process_group_backend=args.backend,
                                 cluster_environment=MPIEnvironment()),
            callbacks=[checkpoint], enable_progress_bar=False, enable_model_summary=False,
            deterministic=True)
        trainer.fit(model, loader(), loader())
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        every = world.allgather(params)
        failures = [f"rank {r}'s parameters differ from rank 0's by "
                    f"{np.abs(every[r] - every[0]).max():.3g}"
                    for r in range(world.size) if not np.array_equal(every[r], every[0])]
        trainer.strategy.barrier()
        loaded = Model.load_from_checkpoint(checkpoint.last_model_path)
        back = torch.cat([p.detach().reshape(-1) for p in loaded.parameters()]).numpy()
        if not np.array_equal(back, params):
            failures.append("the last checkpoint holds other parameters than the model's")
        if not checkpoint.best_model_path:
            failures.append("ModelCheckpoint kept no best checkpoint by val_loss")
        trainer.strategy.barrier()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for failure in failures:
        print(f"lightning_run rank {world.rank}: FAIL {failure}", flush=True)
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"params": params.tolist(), "metrics": metrics, "failures": failures,
                       "backend": torch.distributed.get_backend()
                       if torch.distributed.is_initialized() else None}, f)
    return 1 if world.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
