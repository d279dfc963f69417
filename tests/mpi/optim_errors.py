"""Errors that need several ranks, under mpirun: every rank must raise the same clear error.

Usage: optim_errors.py  (runs every scenario in turn)
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

import pipesgd
from pipesgd.optim import DistributedOptimizer

comm = MPI.COMM_WORLD
LAST = comm.size - 1


def model(hidden: int = 8, name: str = "fc") -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("inp", nn.Linear(4, hidden))
    m.add_module(name, nn.Linear(hidden, 3))
    return m


def expect(make, *fragments: str) -> None:
    try:
        make()
    except pipesgd.PipesgdError as exc:
        text = str(exc)
        missing = [f for f in fragments if f not in text]
        assert not missing, f"message lacks {missing}: {text}"
        return
    raise AssertionError(f"no error raised, expected one mentioning {fragments}")


def wrap(m: nn.Module, **kwargs) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                **kwargs)


# Parameter shapes differ on the last rank.
expect(lambda: wrap(model(hidden=9 if comm.rank == LAST else 8)),
       "parameter #0 'inp.weight'", f"rank {LAST}", "(9, 4)")
# Parameter names differ.
expect(lambda: wrap(model(name="head" if comm.rank == LAST else "fc")),
       "parameter #2", f"rank {LAST}", "'head", "'fc")
# Configuration differs.
expect(lambda: wrap(model(), staleness=3 if comm.rank == LAST else 2),
       "staleness differs", f"rank {LAST} uses 3")
expect(lambda: wrap(model(), compression="quant8" if comm.rank == LAST else "none"),
       "compression differs")
# Memory layout differs (the strides order the bucket): channels_last on the last rank.
def conv(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3))
    return m.to(memory_format=torch.channels_last) if channels_last else m


expect(lambda: wrap(conv(comm.rank == LAST)),
       "parameter #0 '0.weight'", f"rank {LAST}", "strides (27, 1, 9, 3)", "(27, 9, 3, 1)")
# Bucket layout differs.
expect(lambda: wrap(model(), bucket_mb=1e-4 if comm.rank == LAST else 25),
       "bucket layout mismatch", "bucket_mb")

# A parameter without a gradient is named at step time, in both overlap modes.
for overlap in ("sequential", "backward"):
    m = model()
    opt = wrap(m, overlap=overlap, bucket_mb=1e-4)
    opt.zero_grad()
    m.inp(torch.randn(2, 4)).sum().backward()  # the head gets no gradient
    expect(opt.step, "'fc.weight'", "has no gradient", "named_parameters")
    opt.remove_hooks()

# Loading a checkpoint with another bucket layout.
m = model()
opt = wrap(m, bucket_mb=1e-4)
for _ in range(2):
    opt.zero_grad()
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
state = opt.state_dict()
other = wrap(model(), bucket_mb=25)
try:
    other.load_state_dict(state)
    raise AssertionError("loading with another layout succeeded")
except ValueError as exc:
    assert "bucket layout mismatch" in str(exc) and "bucket_mb" in str(exc), exc

pipesgd.shutdown()
if comm.rank == 0:
    print(f"optim_errors: ok on {comm.size} ranks")
