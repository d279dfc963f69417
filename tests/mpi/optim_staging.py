"""The host-staging path (pipesgd.staging), forced on the CPU, against the plain one:
bitwise the same weights for K = 1-3, with and without compression, warm-up, either
overlap, and through a save and resume in the middle. With `cuda` (tests/gpu): the model
on each rank's GPU, staged by default, keeps the ranks bitwise equal, resumes bitwise, and
trains as the CPU does (to rounding). Either way, the host buckets lie in the engine's
memory and are reduced in place. Usage: optim_staging.py [cuda]
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
STEPS = 7
ON_GPU = sys.argv[1:] == ["cuda"]


def make_model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(device)


def optimizer(model: nn.Module, staging: bool, **config) -> DistributedOptimizer:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # small buckets: several per step, so the gated operations queue behind each other
    return DistributedOptimizer(inner, model.named_parameters(), bucket_mb=0.002,
                                staging=staging, **config)


def train(model: nn.Module, opt: DistributedOptimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(1000 * comm.rank + t)
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def run(staging: bool, resume_at: int | None = None, device: str = "cpu",
        weights_out: list | None = None, **config) -> str:
    model = make_model(device)
    opt = optimizer(model, staging, **config)
    if resume_at is None:
        train(model, opt, range(STEPS))
        if weights_out is not None:
            weights_out.extend(p.detach().cpu() for p in model.parameters())
        return digest(model)
    train(model, opt, range(resume_at))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    model = make_model(device)
    model.load_state_dict(weights)
    opt = optimizer(model, staging, **config)
    opt.load_state_dict(saved)
    train(model, opt, range(resume_at, STEPS))
    return digest(model)


configs = [
    {"staleness": k, "compression": c, "overlap": o}
    for k in (1, 2, 3) for c in ("none", "quant8") for o in ("sequential", "backward")
] + [{"staleness": 2, "warmup_steps": 2, "compression": "trunc16"}]


def reduced_in_place(device: str) -> None:
    """Ranks sharing a node: the staged buckets lie in the engine's memory (pinned where it
    lies beside a GPU: no warning that CUDA refused) and are summed in place, as the plain
    ones are, so none takes the caller's-array paths, whose choice `operation_paths` lists
    once made (from 4 MiB at p = 2: the links or MPI's messages)."""
    engine = pipesgd.init()
    assert engine.shares_memory and not engine.operation_paths, engine.operation_paths
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(10, 1024), nn.ReLU(), nn.Linear(1024, 1100), nn.ReLU(),
                          nn.Linear(1100, 4)).to(device)  # 4.4 MiB of float32: one bucket
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   model.named_parameters(), bucket_mb=8, staging=True)
    train(model, opt, range(12))  # the first choice times each path on three operations
    assert not engine.operation_paths, f"{device}: reduced as the caller's arrays: " \
        f"{engine.operation_paths}"


def on_the_gpu() -> None:
    for config in configs:
        gpu: list[torch.Tensor] = []
        cpu: list[torch.Tensor] = []
        on_gpu = run(True, device="cuda", weights_out=gpu, **config)
        assert len(set(comm.allgather(on_gpu))) == 1, f"{config}: ranks differ on the GPU"
        run(False, weights_out=cpu, **config)
        if config["compression"] == "none":  # quantizing amplifies rounding
            for a, b in zip(gpu, cpu, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=str(config))
    resumed = run(True, resume_at=3, device="cuda", staleness=3, compression="quant8")
    assert resumed == run(True, device="cuda", staleness=3, compression="quant8"), \
        "resume on the GPU"
    pipesgd.shutdown()
    if comm.rank == 0:
        print(f"optim_staging cuda: ok on {comm.size} ranks")


reduced_in_place("cuda" if ON_GPU else "cpu")
if ON_GPU:
    on_the_gpu()
    sys.exit(0)
for config in configs:
    plain = run(False, **config)
    assert run(True, **config) == plain, f"{config}: staging changed the weights"
    assert len(set(comm.allgather(plain))) == 1, f"{config}: ranks differ"
resumed = run(True, resume_at=3, staleness=3, compression="quant8")
assert resumed == run(False, staleness=3, compression="quant8"), "resume through staging"
pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_staging: ok on {comm.size} ranks")
