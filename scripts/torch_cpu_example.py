"""mpiexec -n 2 python scripts/torch_cpu_example.py   (needs torch; CPU tensors)

PyTorch on the CPU with ringcoll averaging the gradients. p.grad.numpy() and p.detach().numpy()
are NumPy views of the tensors' memory, so nothing is copied between torch and ringcoll:
- a post-accumulate-grad hook hands each gradient to DistributedOptimizer.grad_ready as soon
  as autograd has it (last layer first), so its bucket's all-reduce overlaps the rest of
  backward();
- ringcoll.optim.SGD updates the parameters through their NumPy views, in place.
Prints the loss every 20 steps on rank 0 and checks that every rank ends bitwise identical.
"""

import numpy as np
import torch

import ringcoll

torch.manual_seed(0)  # the same initial model on every rank (broadcast_parameters checks it)
comm = ringcoll.Communicator()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
params = {name: p.detach().numpy() for name, p in model.named_parameters()}  # views
ringcoll.broadcast_parameters(params, comm=comm)
opt = ringcoll.DistributedOptimizer(ringcoll.optim.SGD(params, lr=0.05, momentum=0.9), comm)
for name, p in model.named_parameters():
    p.register_post_accumulate_grad_hook(
        lambda p, name=name: opt.grad_ready(name, p.grad.numpy()))

rng = np.random.default_rng(comm.rank)  # each rank its own shard of the data
x = torch.from_numpy(rng.standard_normal((512, 32)).astype(np.float32))
y = torch.from_numpy((x[:, :4].numpy() > 0).argmax(axis=1))
for step in range(100):
    batch = slice(32 * (step % 16), 32 * (step % 16 + 1))
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
    loss.backward()  # the hooks start the all-reduces while autograd goes on
    opt.step()
    if step % 20 == 0 and comm.rank == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

flat = np.concatenate([v.ravel() for v in params.values()])
root = flat.copy()
comm.broadcast(root, root=0)
assert np.array_equal(flat, root), f"rank {comm.rank}: parameters differ from rank 0's"
if comm.rank == 0:
    print(f"every rank holds the same {flat.size} parameters", flush=True)
