"""The engine's own buffers (Engine.zeros) under mpirun: shared across the node's ranks
where they have shared-memory links, reduced in place, checked against float64 numpy
and the same operation on an ordinary buffer; slices leave the rest alone; many in
flight beside ordinary operations; bitwise equal across ranks; different sizes refused
on every rank; the array outlives the engine. Usage: engine_shared_buffers.py
"""

import gc
import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
engine = pipesgd.Engine(comm)
shared = p > 1 and os.environ.get("PIPESGD_SHM_LINKS", "1") != "0"
TOL = {"float32": 1e-6, "float64": 1e-13, "float16": 2e-3}


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def assert_identical_across_ranks(a: np.ndarray, what: str) -> None:
    digests = comm.allgather(digest(a))
    assert len(set(digests)) == 1, f"{what}: ranks differ"


def in_shared_region(address: int) -> bool:
    """Whether `address` lies in a mapping of one of the engine's shared buffers (named
    /pipesgd-<token>-buffer<k>, unlinked once every rank has mapped it)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return len(rest) == 5 and "/pipesgd-" in rest[4] and "-buffer" in rest[4]
    return False


# Where the ranks share memory the array lies in the engine's mapping; elsewhere it is
# an ordinary zero-filled array.
probe = engine.zeros((3, 5), np.float64)
assert probe.shape == (3, 5) and probe.dtype == np.float64 and not probe.any()
assert in_shared_region(probe.ctypes.data) == shared, shared

for n in (1, max(p - 1, 1), 1000, 10007, 2**20 + 3):
    for dtype in ("float32", "float64", "float16"):
        for op in ("sum", "average"):
            values = np.random.default_rng(1000 * r + n).standard_normal(n).astype(dtype)
            reference = np.sum(comm.allgather(values.astype(np.float64)), axis=0)
            if op == "average":
                reference = reference / p
            mine = engine.zeros(n, dtype)
            mine[:] = values
            assert engine.allreduce(mine, op=op, timeout=60) is mine
            scale = np.maximum(np.abs(reference), 1.0)
            err = np.abs(mine.astype(np.float64) - reference) / scale
            assert err.max() <= p * TOL[dtype], (n, dtype, op, err.max())
            assert_identical_across_ranks(mine, f"n={n} {dtype} {op}")

# Integer-valued data: every summation order is exact, so MPI's result bit for bit.
x = engine.zeros(10007, np.float32)
x[:] = np.arange(10007) % 17 + r
expect = np.empty_like(x)
comm.Allreduce(np.ascontiguousarray(x), expect, op=MPI.SUM)
engine.allreduce(x, op="sum")
assert np.array_equal(x, expect)

# A slice: the same one on every rank. Only it is reduced; around it each rank keeps
# its own values.
whole = engine.zeros(5000, np.float32)
whole[:] = r + 1
engine.allreduce(whole[1000:3001], op="sum")
total = p * (p + 1) / 2
assert np.all(whole[1000:3001] == total) and np.all(whole[:1000] == r + 1) \
    and np.all(whole[3001:] == r + 1), "a slice's reduction reached outside it"

# Many in flight, shared and ordinary buffers alternating, with compression on some
# shared ones (those take the ring: compression is not done in place).
buffers = [engine.zeros(30000 + k, np.float32) if k % 2 else np.zeros(30000 + k, np.float32)
           for k in range(16)]
for k, b in enumerate(buffers):
    b[:] = r + k
handles = [engine.allreduce_async(b, op="sum", compression="trunc16" if k % 4 == 1 else "none")
           for k, b in enumerate(buffers)]
for k, (h, b) in enumerate(zip(handles, buffers, strict=True)):
    assert h.wait(timeout=60) is b
    assert np.all(b == sum(q + k for q in range(p))), k

# torch tensors on the engine's memory, as the optimizer's buckets are made.
raw = engine.zeros(4 * 1000, np.uint8)
grad = torch.from_numpy(raw).view(torch.float32)
grad.fill_(float(r))
engine.allreduce(grad, op="average")
assert torch.all(grad == (p - 1) / 2) and np.all(raw.view(np.float32) == (p - 1) / 2)

# The optimizer's gradient buckets are such buffers, and training keeps the replicas
# bitwise identical.
model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))
torch.manual_seed(0)
for param in model.parameters():
    torch.nn.init.normal_(param)
opt = pipesgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   model.named_parameters(), engine=engine)
assert all(in_shared_region(b.data_ptr()) == shared for s in opt.buckets.buffers for b in s)
data = torch.from_numpy(np.random.default_rng(r).standard_normal((8, 20)).astype(np.float32))
for _ in range(4):
    opt.zero_grad()
    model(data).square().mean().backward()
    opt.step()
opt.synchronize()
for param in model.parameters():
    assert_identical_across_ranks(param.detach().numpy(), "a parameter after training")
del opt

# Ranks asking for different sizes: refused on every rank, and the engine goes on.
try:
    engine.zeros(100 + (r == p - 1), np.float32)
except ValueError as e:
    assert "different sizes" in str(e), e
    assert p > 1
else:
    assert p == 1 or not shared, "different sizes were not refused"
after = engine.zeros(64, np.float32)
after[:] = 1
engine.allreduce(after, op="sum")
assert np.all(after == p)

engine.shutdown()
# The array stays valid after the engine is gone.
after[:] = 2
assert np.all(after == 2)
del probe, mine, x, whole, buffers, raw, grad, after
gc.collect()
comm.Barrier()
if r == 0:
    leftover = sorted(f.name for f in Path("/dev/shm").glob("pipesgd-*-buffer*"))
    print(f"engine_shared_buffers: p={p} shared={shared} leftover={leftover} ok")
