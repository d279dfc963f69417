"""The DDP hook on CUDA buckets (host staging). Runs where CUDA is available, as a
one-process DDP over gloo; elsewhere skipped with that reason. The same path runs on the
CPU across ranks in tests/mpi/optim_ddp_hook.py."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from pipesgd.hooks import PipeSGDState, pipe_sgd_hook

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
