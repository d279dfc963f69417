"""The DDP hook on CUDA buckets (host staging), and with float16 autocast and a
GradScaler. Runs where CUDA is available, as a one-process DDP over gloo; elsewhere
skipped with that reason. The same paths run on the CPU across ranks in
tests/mpi/optim_ddp_hook.py (bfloat16)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from amp_backward import scaled_backward
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from pipesgd.hooks import PipeSGDState, pipe_sgd_hook
from pipesgd.optim import DistributedOptimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


@pytest.fixture(scope="module")
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run(engine, device: str, staleness: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = PipeSGDState(engine, staleness=staleness)
    ddp.register_comm_hook(state, pipe_sgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(6):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        if state.has_update:
            opt.step()
    state.synchronize()
    assert (state.stager is not None) == (device == "cuda")
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("staleness", [1, 2])
def test_cuda_buckets_reduce_through_the_host(engine, process_group, staleness: int) -> None:
    for a, b in zip(run(engine, "cuda", staleness), run(engine, "cpu", staleness),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


POISONED = 3  # the iteration whose gradient holds an inf


def amp_run(engine, device: str, staleness: int, hook: bool
            ) -> tuple[list[torch.Tensor], list[float]]:
    """Eight mixed-precision iterations, iteration 3's gradient poisoned; through the DDP
    hook (scaler given to the state) or through DistributedOptimizer(grad_scaler=...)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if hook:
        forward: nn.Module = DistributedDataParallel(model, bucket_cap_mb=0.001)
        state = PipeSGDState(engine, staleness=staleness, grad_scaler=scaler)
        forward.register_comm_hook(state, pipe_sgd_hook)
    else:
        forward = model
        opt = DistributedOptimizer(sgd, model.named_parameters(), staleness=staleness,
                                   warmup_steps=1, engine=engine, grad_scaler=scaler)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    scales = []
    for t in range(8):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        sgd.zero_grad()
        scaled_backward(scaler, forward, x.to(device), y.to(device),
                        model[0].weight if t == POISONED else None, device=device, dtype=dtype)
        if not hook:
            opt.step()
        elif state.has_update:
            scaler.step(sgd)
            scaler.update()
        scales.append(float(scaler.get_scale()))
    if hook:
        state.synchronize()
    else:
        opt.synchronize()
    return [p.detach().cpu() for p in model.parameters()], scales


@pytest.mark.parametrize("staleness", [1, 2])
def test_mixed_precision_through_the_hook_skips_the_poisoned_step_as_the_optimizer(
        engine, process_group, staleness: int) -> None:
    weights, scales = amp_run(engine, "cuda", staleness, hook=True)
    ref_weights, ref_scales = amp_run(engine, "cuda", staleness, hook=False)
    assert scales == ref_scales
    skipped = POISONED + staleness - 1  # the step that met the inf halved the scale
    assert scales[skipped] == scales[skipped - 1] / 2, scales
    for a, b in zip(weights, ref_weights, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
