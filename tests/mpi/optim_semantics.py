"""DistributedOptimizer against single-process references, under mpirun.

Usage: optim_semantics.py SCENARIO [SCENARIO ...]
  sync     K = 1 on p ranks == one process training on the concatenated batches.
  delayed  K = 2, 3 (with and without warm-up, both overlap modes, gradients lent from the
           buckets or made by model.zero_grad() + backward), SGD with momentum and
           weight decay, and Adam == an independent simulation of the delayed update.
  ramp     K = 2 with warm-up, a learning-rate ramp into the stale updates and Nesterov
           momentum (bench/train.py's CNN recipe) == the same simulation.
  bitwise  parameters identical across ranks for every compression.
"""

from __future__ import annotations

import hashlib
import sys

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
RANK, P = comm.rank, comm.size
BATCH = 6  # per rank
STEPS = 9
LR, MOMENTUM, WD = 0.05, 0.9, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8


def make_model(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def global_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(P * BATCH, 12, generator=g), torch.randint(0, 4, (P * BATCH,), generator=g)


def shard(t: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(t)
    return x[r * BATCH : (r + 1) * BATCH], y[r * BATCH : (r + 1) * BATCH]


def inner(kind: str, params) -> torch.optim.Optimizer:
    if kind == "nesterov":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    return torch.optim.Adam(params, lr=LR / 10, betas=BETAS, eps=EPS, weight_decay=WD)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def assert_identical_across_ranks(model: nn.Module, what: str) -> None:
    digests = comm.allgather(digest(model))
    assert len(set(digests)) == 1, f"{what}: parameters differ across ranks"


def train_distributed(kind: str, staleness: int, warmup: int, overlap: str,
                      compression: str = "none", steps: int = STEPS,
                      zero: str = "optimizer", ramp: int = 0) -> nn.Module:
    model = make_model()
    opt = DistributedOptimizer(inner(kind, model.parameters()), model.named_parameters(),
                               staleness=staleness, warmup_steps=warmup, overlap=overlap,
                               compression=compression, bucket_mb=0.0002, ramp_steps=ramp)
    assert opt.buckets.num_buckets > 1
    for t in range(steps):
        x, y = shard(t, RANK)
        (opt if zero == "optimizer" else model).zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.remove_hooks()
    opt.synchronize()
    return model


def simulate_delayed(kind: str, staleness: int, warmup: int, steps: int = STEPS,
                     ramp: int = 0) -> list:
    """Pipe-SGD by hand: gradient of iteration t (mean over the p shards, taken at the
    weights of iteration t) is applied at step t + K_t - 1 with hand-written SGD (heavy
    ball or Nesterov) / Adam. With a ramp, the learning rate that applies the gradient of
    a stale iteration t is scaled by min(1, (t - warmup + 1) / ramp)."""
    model = make_model()
    w = [p.detach().clone() for p in model.parameters()]
    due: dict[int, tuple[list[torch.Tensor], float]] = {}
    momentum: list[torch.Tensor] | None = None
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    updates = 0
    for t in range(steps):
        with torch.no_grad():
            for p, x in zip(model.parameters(), w, strict=True):
                p.copy_(x)
        total = [torch.zeros_like(x) for x in w]
        for r in range(P):
            model.zero_grad()
            x, y = shard(t, r)
            F.cross_entropy(model(x), y).backward()
            for acc, p in zip(total, model.parameters(), strict=True):
                acc += p.grad
        k = 1 if t < warmup else staleness
        scale = 1.0 if k == 1 or ramp == 0 else min(1.0, (t - warmup + 1) / ramp)
        due[t + k - 1] = ([acc / P for acc in total], scale)
        if t not in due:
            continue
        grad, scale = due.pop(t)
        g = [gi + WD * wi for gi, wi in zip(grad, w, strict=True)]
        updates += 1
        if kind in ("sgd", "nesterov"):
            momentum = g if momentum is None else [
                MOMENTUM * b + gi for b, gi in zip(momentum, g, strict=True)]
            direction = momentum if kind == "sgd" else [
                gi + MOMENTUM * b for gi, b in zip(g, momentum, strict=True)]
            w = [wi - LR * scale * d for wi, d in zip(w, direction, strict=True)]
        else:
            b1, b2 = BETAS
            m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g, strict=True)]
            v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g, strict=True)]
            w = [
                wi - (LR / 10) * (mi / (1 - b1**updates))
                / ((vi / (1 - b2**updates)).sqrt() + EPS)
                for wi, mi, vi in zip(w, m, v, strict=True)
            ]
    return w


def check_close(model: nn.Module, reference: list, what: str) -> None:
    for (name, p), ref in zip(model.named_parameters(), reference, strict=True):
        err = (p.detach() - ref).abs().max().item()
        assert torch.allclose(p.detach(), ref, rtol=1e-4, atol=2e-5), f"{what}: {name} off by {err}"


def scenario_sync() -> None:
    for kind in ("sgd", "adam"):
        for overlap in ("sequential", "backward"):
            model = train_distributed(kind, 1, 0, overlap)
            reference = make_model()
            opt = inner(kind, reference.parameters())
            for t in range(STEPS):
                x, y = global_batch(t)
                opt.zero_grad()
                F.cross_entropy(reference(x), y).backward()
                opt.step()
            check_close(model, [p.detach() for p in reference.parameters()],
                        f"K=1 {kind} {overlap}")
            assert_identical_across_ranks(model, f"K=1 {kind} {overlap}")


def scenario_delayed() -> None:
    for kind in ("sgd", "adam"):
        for staleness, warmup, overlap, zero in (
            (2, 0, "sequential", "optimizer"), (3, 0, "backward", "optimizer"),
            (2, 3, "backward", "optimizer"), (3, 4, "sequential", "optimizer"),
            (2, 1, "sequential", "model"),
        ):
            what = f"{kind} K={staleness} warmup={warmup} {overlap} {zero}.zero_grad"
            model = train_distributed(kind, staleness, warmup, overlap, zero=zero)
            check_close(model, simulate_delayed(kind, staleness, warmup), what)
            assert_identical_across_ranks(model, what)


def scenario_ramp() -> None:
    # Warm-up 2, ramp 4: stale gradients 2..5 are applied at 1/4 .. 4/4 of the rate.
    for kind, overlap in (("nesterov", "sequential"), ("sgd", "backward")):
        what = f"{kind} K=2 warmup=2 ramp=4 {overlap}"
        model = train_distributed(kind, 2, 2, overlap, ramp=4)
        check_close(model, simulate_delayed(kind, 2, 2, ramp=4), what)
        assert_identical_across_ranks(model, what)


def scenario_bitwise() -> None:
    for compression in ("none", "trunc16", "quant8"):
        for overlap in ("sequential", "backward"):
            model = train_distributed("sgd", 2, 0, overlap, compression, steps=12)
            assert_identical_across_ranks(model, f"{compression} {overlap}")


SCENARIOS = {"sync": scenario_sync, "delayed": scenario_delayed, "ramp": scenario_ramp,
             "bitwise": scenario_bitwise}
for name in sys.argv[1:]:  # several in one launch: each starts from its own fresh state
    SCENARIOS[name]()
    if RANK == 0:
        print(f"optim_semantics {name}: ok on {P} ranks", flush=True)
pipesgd.shutdown()
