"""DDP (gloo) with pipe_sgd_hook == DistributedOptimizer(warmup_steps=1), under mpirun.

Usage: optim_ddp_hook.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import pipesgd
from pipesgd.hooks import PipeSGDState, pipe_sgd_hook
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
STEPS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = str(comm.bcast(free_port() if comm.rank == 0 else None))
dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
engine = pipesgd.init()


def make_model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 5))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + comm.rank)
    return torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


# Compressed results depend on where bucket boundaries fall (quant8 scales per block), and
# DDP buckets differently than DistributedOptimizer: compare those across ranks only.
for staleness, compression in ((2, "none"), (3, "none"), (2, "quant8")):
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = PipeSGDState(engine, staleness=staleness, compression=compression)
    ddp.register_comm_hook(state, pipe_sgd_hook)
    opt = sgd(model)
    updates = []
    for t in range(STEPS):
        x, y = batch(t)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        updates.append(state.has_update)
        if state.has_update:
            opt.step()
    state.synchronize()
    assert len(state.buffers) > 1, "the test needs several DDP buckets"
    assert updates == [True] + [False] * (staleness - 1) + [True] * (STEPS - staleness), updates

    digests = comm.allgather([p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(d == digests[0] for d in digests), "DDP parameters differ across ranks"
    if compression != "none":
        continue
    reference = make_model()
    wrapped = DistributedOptimizer(sgd(reference), reference.named_parameters(),
                                   staleness=staleness, compression=compression,
                                   warmup_steps=1, engine=engine)
    for t in range(STEPS):
        x, y = batch(t)
        wrapped.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        wrapped.step()
    wrapped.synchronize()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        err = (a - b).abs().max().item()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"K={staleness}: {name} off by {err}"

dist.destroy_process_group()
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_ddp_hook: ok on {comm.size} ranks")
