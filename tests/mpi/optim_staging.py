"""The host-staging path (pipesgd.staging), forced on the CPU, against the plain one:
bitwise the same weights for K = 1-3, with and without compression, warm-up, either
overlap, and through a save and resume in the middle. Usage: optim_staging.py
"""

from __future__ import annotations

import hashlib

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
STEPS = 7


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def optimizer(model: nn.Module, staging: bool, **config) -> DistributedOptimizer:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # small buckets: several per step, so the gated operations queue behind each other
    return DistributedOptimizer(inner, model.named_parameters(), bucket_mb=0.002,
                                staging=staging, **config)


def train(model: nn.Module, opt: DistributedOptimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(1000 * comm.rank + t)
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def run(staging: bool, resume_at: int | None = None, **config) -> str:
    model = make_model()
    opt = optimizer(model, staging, **config)
    if resume_at is None:
        train(model, opt, range(STEPS))
        return digest(model)
    train(model, opt, range(resume_at))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    model = make_model()
    model.load_state_dict(weights)
    opt = optimizer(model, staging, **config)
    opt.load_state_dict(saved)
    train(model, opt, range(resume_at, STEPS))
    return digest(model)


configs = [
    {"staleness": k, "compression": c, "overlap": o}
    for k in (1, 2, 3) for c in ("none", "quant8") for o in ("sequential", "backward")
] + [{"staleness": 2, "warmup_steps": 2, "compression": "trunc16"}]
for config in configs:
    plain = run(False, **config)
    assert run(True, **config) == plain, f"{config}: staging changed the weights"
    assert len(set(comm.allgather(plain))) == 1, f"{config}: ranks differ"
resumed = run(True, resume_at=3, staleness=3, compression="quant8")
assert resumed == run(False, staleness=3, compression="quant8"), "resume through staging"
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_staging: ok on {comm.size} ranks")
