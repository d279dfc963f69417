"""DistributedOptimizer on CUDA parameters (host staging, mixed precision). Runs where
CUDA is available; elsewhere every test is skipped with that reason. The same paths run
on the CPU in tests/mpi/optim_staging.py and tests/test_optim_amp.py."""

from __future__ import annotations

import math
import time

import pytest
import torch
from mpirun import run_mpi
from torch import nn
from torch.nn import functional as F

from pipesgd.optim import DistributedOptimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


def make_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)


def train(engine, device: str, staleness: int, poison_at: int | None = None,
          amp: bool = False) -> tuple[nn.Module, list[float]]:
    model = make_model(device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3) if amp \
        else None
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               model.named_parameters(), staleness=staleness,
                               bucket_mb=0.005, engine=engine, grad_scaler=scaler)
    scales = []
    for t in range(8):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16 if device == "cuda" else
                            torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if t == poison_at:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = math.inf
        opt.step()
        if scaler:
            scales.append(float(scaler.get_scale()))
    opt.synchronize()
    torch.cuda.synchronize()
    return model, scales


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_cuda_parameters_train_as_on_the_cpu(engine, staleness: int) -> None:
    on_gpu, _ = train(engine, "cuda", staleness)
    on_cpu, _ = train(engine, "cpu", staleness)
    assert all(p.is_cuda for p in on_gpu.parameters())
    for a, b in zip(on_gpu.parameters(), on_cpu.parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def test_staging_is_the_default_on_cuda(engine) -> None:
    model = make_model("cuda")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), engine=engine)
    assert opt._staging is not None
    assert all(h.is_pinned() for hosts in opt._host for h in hosts)
    assert all(b.is_cuda for bs in opt.buckets.buffers for b in bs)


def test_mixed_precision_skips_the_poisoned_gradient_on_cuda(engine) -> None:
    model, scales = train(engine, "cuda", staleness=2, poison_at=3, amp=True)
    assert scales[4] == scales[3] / 2  # the step that applied iteration 3's gradient
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_returns_while_the_gpu_is_still_busy(engine) -> None:
    """K = 2: step() queues its buckets behind events and applies last iteration's
    aggregate without waiting for the device (no synchronize on the compute thread)."""
    model = make_model("cuda")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               model.named_parameters(), staleness=2, engine=engine)
    x, y = torch.randn(16, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()
    torch.cuda.synchronize()
    opt.zero_grad()
    torch.cuda._sleep(500_000_000)  # the backward below queues behind a long kernel
    F.cross_entropy(model(x), y).backward()
    begin = time.perf_counter()
    opt.step()
    took = time.perf_counter() - begin
    busy = not torch.cuda.current_stream().query()
    opt.synchronize()
    torch.cuda.synchronize()
    assert busy and took < 0.05, (busy, took)
    assert opt.staging_seconds > 0


def test_ranks_stay_bitwise_equal_on_their_gpus() -> None:
    out = run_mpi(2, "optim_staging.py", "cuda", timeout=240).stdout
    assert "optim_staging cuda: ok on 2 ranks" in out, out
