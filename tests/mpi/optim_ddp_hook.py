"""DDP (gloo) with pipe_sgd_hook == DistributedOptimizer(warmup_steps=1), under mpirun,
also with a GradScaler (mixed precision).

Usage: optim_ddp_hook.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from amp_backward import scaled_backward
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

# Host staging (how buckets on a GPU are reduced), forced on the CPU: the same weights.
def ddp_run(staleness: int, compression: str, staging: bool) -> list[bytes]:
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = PipeSGDState(engine, staleness=staleness, compression=compression,
                         staging=staging)
    ddp.register_comm_hook(state, pipe_sgd_hook)
    opt = sgd(model)
    for t in range(STEPS):
        x, y = batch(t)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        if state.has_update:
            opt.step()
    state.synchronize()
    assert (state.stager is not None) == staging
    return [p.detach().numpy().tobytes() for p in model.parameters()]


for staleness, compression in ((1, "none"), (2, "quant8"), (3, "none")):
    assert ddp_run(staleness, compression, True) == ddp_run(staleness, compression, False), (
        f"K={staleness} {compression}: staging changed the weights")

# Mixed precision: one rank's inf at iteration 3 skips the same step everywhere, and the
# scale follows the same rule as DistributedOptimizer(grad_scaler=...).
POISONED = 3


def amp_backward(model: nn.Module, ddp_or_model: nn.Module, scaler, t: int) -> None:
    x, y = batch(t)
    poisoned = t == POISONED and comm.rank == comm.size - 1
    scaled_backward(scaler, ddp_or_model, x, y, model[0].weight if poisoned else None)


def amp_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)


for staleness in (1, 2, 3):
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    scaler = amp_scaler()
    state = PipeSGDState(engine, staleness=staleness, grad_scaler=scaler)
    ddp.register_comm_hook(state, pipe_sgd_hook)
    opt = sgd(model)
    ddp_scales = []
    for t in range(STEPS):
        opt.zero_grad()
        amp_backward(model, ddp, scaler, t)
        if state.has_update:
            scaler.step(opt)
            scaler.update()
        ddp_scales.append(float(scaler.get_scale()))
    state.synchronize()

    reference = make_model()
    ref_scaler = amp_scaler()
    wrapped = DistributedOptimizer(sgd(reference), reference.named_parameters(),
                                   staleness=staleness, warmup_steps=1, engine=engine,
                                   grad_scaler=ref_scaler)
    ref_scales = []
    for t in range(STEPS):
        wrapped.zero_grad()
        amp_backward(reference, reference, ref_scaler, t)
        wrapped.step()
        ref_scales.append(float(ref_scaler.get_scale()))
    wrapped.synchronize()
    assert ddp_scales == ref_scales, f"K={staleness}: {ddp_scales} against {ref_scales}"
    skipped = POISONED + staleness - 1  # the step that met the inf halved the scale
    assert ddp_scales[skipped] == ddp_scales[skipped - 1] / 2, f"K={staleness}: {ddp_scales}"
    assert len(set(comm.allgather(tuple(ddp_scales)))) == 1, "scales differ across ranks"
    digests = comm.allgather([p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(d == digests[0] for d in digests), "DDP parameters differ across ranks"
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.isfinite(a).all(), f"K={staleness} AMP: {name} took the inf"
        err = (a - b).abs().max().item()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"K={staleness} AMP: {name} off by {err}"

dist.destroy_process_group()
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_ddp_hook: ok on {comm.size} ranks")
