"""broadcast_parameters / broadcast_optimizer_state from a root, under mpirun.

Usage: optim_broadcast.py
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.broadcast import broadcast_optimizer_state, broadcast_parameters

comm = MPI.COMM_WORLD
root = comm.size - 1


def same_everywhere(tensors: list[torch.Tensor]) -> bool:
    digests = comm.allgather([t.detach().contiguous().view(-1).numpy().tobytes()
                              if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()
                              .tobytes() for t in tensors])
    return all(d == digests[0] for d in digests)


torch.manual_seed(comm.rank)  # every rank starts different
model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
model[1].running_mean.normal_()
half = nn.Linear(3, 3).to(torch.bfloat16)
assert not same_everywhere(list(model.state_dict().values()))

broadcast_parameters(model, root=root)
assert same_everywhere(list(model.state_dict().values())), "module state differs"
broadcast_parameters(half.named_parameters(), root=root)
assert same_everywhere(list(half.parameters())), "bfloat16 parameters differ"
broadcast_parameters({"t": model[0].weight.data.t()}, root=0)  # non-contiguous view
assert same_everywhere([model[0].weight]), "non-contiguous tensor differs"

opt = torch.optim.Adam(model.parameters(), lr=0.1)
for _ in range(comm.rank + 1):  # different step counts and moments per rank
    opt.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
broadcast_optimizer_state(opt, root=root)
states = comm.allgather({k: {n: v.tolist() if torch.is_tensor(v) else v for n, v in s.items()}
                         for k, s in opt.state_dict()["state"].items()})
assert all(s == states[0] for s in states), "optimizer state differs"

try:
    broadcast_parameters(model, root=comm.size)
    raise AssertionError("a bad root was accepted")
except ValueError as exc:
    assert "root must be a rank" in str(exc)

if comm.rank == 0:
    print(f"optim_broadcast: ok on {comm.size} ranks")
