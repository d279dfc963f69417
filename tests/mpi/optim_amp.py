"""Mixed precision across ranks: an inf in one rank's gradient skips exactly the step
that applies that gradient, on every rank and no other step; every rank keeps the same
loss scale and bitwise the same weights. Compression carries the inf (or a NaN) through
the ring, so it is judged alike everywhere.

Usage: optim_amp.py  (K = 1 and 2, each compression, an inf and a NaN)
"""

from __future__ import annotations

import hashlib
import math

import torch
from amp_backward import scaled_backward
from mpi4py import MPI
from torch import nn

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
POISONED_RANK, POISONED_ITERATION, STEPS = comm.size - 1, 3, 9


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def run(staleness: int, compression: str, bad: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               model.named_parameters(), staleness=staleness,
                               compression=compression, grad_scaler=amp)
    skipped_step = POISONED_ITERATION + staleness - 1
    for t in range(STEPS):
        g = torch.Generator().manual_seed(100 * comm.rank + t)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        poisoned = t == POISONED_ITERATION and comm.rank == POISONED_RANK
        scaled_backward(amp, model, x, y, model[0].weight if poisoned else None, bad)
        before, scale_before = digest(model), float(amp.get_scale())
        opt.step()
        after, scale_after = digest(model), float(amp.get_scale())
        what = f"K={staleness} {compression} {bad} at step {t}"
        assert len(set(comm.allgather((after, scale_after)))) == 1, f"{what}: ranks differ"
        applied = t >= staleness - 1
        if t == skipped_step:
            assert after == before, f"{what}: the poisoned gradient was applied"
            assert scale_after == scale_before / 2, f"{what}: scale {scale_before} -> {scale_after}"
        elif applied:
            assert after != before, f"{what}: a finite gradient was not applied"
            assert scale_after >= scale_before, f"{what}: scale fell without an inf"
        assert all(torch.isfinite(p).all() for p in model.parameters()), what


for staleness in (1, 2):
    for compression in ("none", "trunc16", "quant8"):
        for bad in (math.inf, math.nan):
            run(staleness, compression, bad)
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_amp: ok on {comm.size} ranks")
