"""mpiexec -n 4 python scripts/torch_fsdp_digits.py [--epochs 6] [--backend ringcoll] [--device cuda]

Fully sharded data parallelism (PyTorch's FSDP2, torch.distributed.fsdp.fully_shard) on CPU
tensors over ringcoll's torch.distributed backend: scripts/torch_ddp_digits.py's CNN and data,
but every rank keeps only its 1/p of each parameter, of its gradient and of AdamW's state.

fully_shard() is applied to every Conv2d and Linear layer, then to the whole model. In each
forward and backward pass, each layer all-gathers its full parameters just before it runs and
frees them after (all_gather_single); backward reduce-scatters each layer's gradients, averaged
over the ranks, so each rank receives the gradient of its own shard (reduce_scatter_single);
AdamW then updates each rank's shards. Rank 0 shows a progress bar on stderr, then per epoch the
training loss (averaged over every rank's samples with dist.all_reduce), the test accuracy (the
test set split over the ranks) and the time.

At the end it checks the unsharded state and exits 1 if any check fails:
- get_model_state_dict(full_state_dict=True) gathers every parameter on every rank; the hashes
  of those full state dicts are all-gathered and must be the same on every rank;
- each rank's shard (DTensor.to_local()) must be its torch.chunk of the full parameter
  (DTensor.full_tensor());
- the full state dict, loaded into an unsharded copy of the model, must predict the test
  images as the sharded model does.

At -n 4 it passes 95% test accuracy at epoch 3, as the DDP example does (their losses agree
to 3-4 digits: the same model, data and seed); the 6 epochs took 6-16 s on the 2-core
development VM (the more other jobs ran, the longer), the whole command 20-40 s.

--backend gloo runs the same script on torch's own gloo backend. --device cuda shards and
trains on the GPU (see scripts/torch_ddp_digits.py; not yet run on one).
Needs torch and scikit-learn: pip install -e ".[mpich,examples,torch]" (docs/torch.md).
"""

import hashlib
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: the ranks fill the cores

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_model_state_dict)
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ringcoll.torch  # noqa: E402,F401  registers backend "ringcoll"; rank and size from MPI
from torch_ddp_digits import (  # noqa: E402  (this directory)
    DigitsCNN, parse_args, pick_device, rank_data, train_epochs)


def state_hash(state, device):
    """The first 8 bytes of a SHA-256 of a state dict's names and bytes, as an int64 tensor."""
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return torch.tensor([int.from_bytes(h.digest()[:8], "little", signed=True)],
                        device=device)


def main(argv=None):
    args = parse_args(argv, __doc__.splitlines()[0])
    torch.set_num_threads(1)
    device = pick_device(args)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler, loader, x_test, y_test = rank_data(args, rank, world, device)

    torch.manual_seed(args.seed)  # the same full weights on every rank before sharding
    model = DigitsCNN().to(device)
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            fully_shard(layer)  # its own all-gather / reduce-scatter group
    fully_shard(model)  # the root: what is left, and the schedule of the whole
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    n_full = sum(p.numel() for p in model.parameters())
    n_local = sum(p.to_local().numel() for p in model.parameters())
    if rank == 0:
        print(f"{world} rank(s), backend {dist.get_backend()}, {n_full} parameters, "
              f"{n_local} of them on rank 0; {len(loader)} steps of {args.batch} per rank "
              f"per epoch", flush=True)

    accuracy, predicted, seconds = train_epochs(model, opt, sampler, loader, x_test, y_test,
                                                args, rank)

    failures = []
    # 1. the full (unsharded) state dict, gathered on every rank, is the same everywhere
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    hashes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(hashes, state_hash(full, device))
    if not all(torch.equal(h, hashes[0]) for h in hashes):
        failures.append("full state dicts differ: hashes by rank "
                        + ", ".join(f"{h.item() & (2**64 - 1):016x}" for h in hashes))
    # 2. every shard is its rank's piece of the full parameter
    for name, p in model.named_parameters():
        whole = p.full_tensor()
        pieces = torch.chunk(whole, world, dim=0)
        mine = pieces[rank] if rank < len(pieces) else whole[:0]
        if not (torch.equal(whole, full[name]) and torch.equal(p.to_local(), mine)):
            failures.append(f"rank {rank}: the shard of {name} is not its piece of the full one")
    # 3. the gathered state dict is a working unsharded model: the same test predictions
    plain = DigitsCNN().to(device)
    plain.load_state_dict(full)
    plain.eval()
    with torch.no_grad():
        differ = (plain(x_test).argmax(dim=1) != predicted).sum().item()
    if differ:
        failures.append(f"rank {rank}: unsharded, the model predicts {differ} of its "
                        f"{len(y_test)} test images differently")
    failed = torch.tensor([len(failures)], device=device)
    dist.all_reduce(failed)
    for line in failures:
        print(line, file=sys.stderr, flush=True)
    if rank == 0:
        verdict = ("the full state dict is the same on every rank, every shard is its piece of "
                   "it, and unsharded it predicts the same" if not failed.item()
                   else f"{failed.item()} check(s) FAILED")
        print(f"final test accuracy {100 * accuracy:.2f}% after {args.epochs} epochs "
              f"({seconds:.1f} s) on {world} rank(s); {verdict} (state hash "
              f"{hashes[0].item() & (2**64 - 1):016x})", flush=True)
    dist.destroy_process_group()
    return 0 if not failed.item() else 1


if __name__ == "__main__":
    sys.exit(main())
