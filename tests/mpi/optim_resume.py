"""Resume: 20 steps straight vs 10 steps, checkpoint, new processes, load, 10 steps.

Usage: optim_resume.py CONFIG PHASE DIR
  CONFIG  sgd-k3 (SGD + momentum, K = 3, warm-up 8, quant8, backward overlap) or
          adam-k2 (Adam, K = 2, sequential)
  PHASE   straight: 20 steps, write DIR/straight_<rank>.pt
          first: 10 steps, write the checkpoint DIR/ckpt.pt
          second: load DIR/ckpt.pt, 10 more steps, compare bitwise with straight
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
config, phase, directory = sys.argv[1], sys.argv[2], Path(sys.argv[3])
CONFIGS = {
    "sgd-k3": dict(staleness=3, warmup_steps=8, compression="quant8", overlap="backward"),
    "adam-k2": dict(staleness=2, warmup_steps=0, compression="none", overlap="sequential"),
}


def build() -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    if config.startswith("sgd"):
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = DistributedOptimizer(inner, model.named_parameters(), bucket_mb=0.001,
                               **CONFIGS[config])
    return model, opt


def train(model: nn.Module, opt: DistributedOptimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(50 + t * comm.size + comm.rank)
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


model, opt = build()
mine = directory / f"straight_{comm.rank}.pt"
if phase == "straight":
    train(model, opt, range(20))
    torch.save(model.state_dict(), mine)
elif phase == "first":
    train(model, opt, range(10))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    assert len(state["optimizer"]["pipesgd"]["inflight"]) == CONFIGS[config]["staleness"] - 1
    if comm.rank == 0:
        torch.save(state, directory / "ckpt.pt")
    comm.Barrier()
else:
    state = torch.load(directory / "ckpt.pt", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert opt.iteration == 10
    train(model, opt, range(10, 20))
    reference = torch.load(mine, weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), f"{config}: {name} differs after resume"
opt.synchronize()
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_resume {config} {phase}: ok")
