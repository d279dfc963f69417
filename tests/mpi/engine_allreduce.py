"""Allreduce correctness on every rank, under mpirun.

Checks, for counts {0, 1, p-1, 4, 1000, 10007, 2^20+3}, every dtype, sum and
average: the result against a float64 numpy reference of all ranks' inputs,
float32 against MPI's own Allreduce, bitwise equality across ranks, and many
operations in flight at once, over shared-memory links (the default on one node) or
MPI messages (PIPESGD_SHM_LINKS=0). On one node operations up to 256 KiB go through the
shared-memory board from p = 3, unless `ring` is given (every operation then takes the
ring).
Usage: engine_allreduce.py [segment_bytes] [ring]
"""

import hashlib
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
ring_only = "ring" in sys.argv[1:]
segment = next((int(a) for a in sys.argv[1:] if a.isdigit()), None)
engine = pipesgd.Engine(comm, segment_bytes=segment, board_bytes=0 if ring_only else None)
r, p = comm.rank, comm.size
# All ranks share this node's memory: the comm thread spins while the caller waits when
# every rank has a core, else it yields to the peer that shares its core.
expected_polling = "spin" if p <= (os.cpu_count() or 1) else "yield"
assert engine.polling_while_waited == expected_polling, engine.polling_while_waited
# Segments go through shared-memory inboxes between ranks of one node, unless told not to.
expected_links = p > 1 and os.environ.get("PIPESGD_SHM_LINKS", "1") != "0"
assert engine.shm_links == expected_links, (engine.shm_links, expected_links)
# Small operations skip the ring through a board in shared memory, where there are links
# and three ranks or more.
expected_board = 256 * 1024 if expected_links and p >= 3 and not ring_only else 0
assert engine.board_bytes == expected_board, (engine.board_bytes, expected_board)
# With a core per rank, each rank's comm thread is bound to a CPU of its own: the
# rank-th (all ranks are on this node) of those the process may run on.
allowed = sorted(os.sched_getaffinity(0))
expected_cpu = allowed[r] if p <= (os.cpu_count() or 1) and len(allowed) >= p else -1
assert engine.comm_cpu == expected_cpu, (engine.comm_cpu, expected_cpu)
assert len(set(comm.allgather(engine.comm_cpu))) == (p if expected_cpu >= 0 else 1)
COUNTS = [0, 1, max(p - 1, 1), 4, 1000, 10007, 2**20 + 3]
TOL = {"float32": 1e-6, "float64": 1e-13, "float16": 2e-3, "bfloat16": 1.6e-2}


def digest(t) -> str:
    raw = t.view(torch.int16).numpy() if isinstance(t, torch.Tensor) else t
    return hashlib.sha256(np.ascontiguousarray(raw).tobytes()).hexdigest()


def assert_identical_across_ranks(t, what: str) -> None:
    digests = comm.allgather(digest(t))
    assert len(set(digests)) == 1, f"{what}: ranks differ: {digests}"


def make_input(n: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n)
    if dtype == "bfloat16":
        t = torch.from_numpy(values).to(torch.bfloat16)
        return t, t.double().numpy()
    a = values.astype(dtype)
    return a, a.astype(np.float64)


def to_float64(t) -> np.ndarray:
    return t.double().numpy() if isinstance(t, torch.Tensor) else t.astype(np.float64)


for n in COUNTS:
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        for op in ("sum", "average"):
            x, mine = make_input(n, dtype, seed=1000 * r + n)
            reference = np.sum(comm.allgather(mine), axis=0) if n else np.zeros(0)
            if op == "average":
                reference = reference / p
            out = engine.allreduce(x, op=op, timeout=60)
            assert out is x
            # Every partial sum rounds once in the working precision: bound by p roundings.
            scale = np.maximum(np.abs(reference), 1.0)
            err = np.abs(to_float64(x) - reference) / scale
            assert n == 0 or err.max() <= p * TOL[dtype], (n, dtype, op, err.max())
            assert_identical_across_ranks(x, f"n={n} {dtype} {op}")

# Against MPI's own Allreduce (a different summation order: tolerance, not bits).
for n in (1000, 2**20 + 3):
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    expect = np.empty_like(x)
    comm.Allreduce(x, expect, op=MPI.SUM)
    engine.allreduce(x, op="sum")
    np.testing.assert_allclose(x, expect, rtol=1e-5, atol=1e-5 * p)

# Integer-valued data: every order is exact, so the result must equal MPI's bit for bit.
x = (np.arange(10007) % 17 + r).astype(np.float32)
expect = np.empty_like(x)
comm.Allreduce(x, expect, op=MPI.SUM)
engine.allreduce(x, op="sum")
assert np.array_equal(x, expect)

# Many operations in flight, submitted before any is waited on; on one node the board's
# (200 KB) and the ring's (280 KB) take turns.
buffers = [np.full((50000 if k % 2 else 70000) + k, float(r + k), np.float32) for k in range(32)]
handles = [engine.allreduce_async(b, op="sum") for b in buffers]
for k, (h, b) in enumerate(zip(handles, buffers, strict=True)):
    assert h.wait(timeout=60) is b
    assert np.all(b == sum(q + k for q in range(p))), k
assert all(h.done() for h in handles)

# A blocking allreduce counts its caller as waiting from submission until the operation
# finishes (the comm thread polls for it as for a waited one); an async one does not.
if p > 1:
    a, b = np.ones(4, np.float32), np.full(4, r + 1.0, np.float32)
    if r == 0:
        first = engine.allreduce_async(a)
        assert engine._engine.callers_waiting == 0
        # what engine.allreduce(b, op="sum") submits: the peers have not, so both wait
        second = engine._engine.allreduce(b.ctypes.data, 4, "float32", "sum", "none",
                                          caller_waits=True)
        assert engine._engine.callers_waiting == 1
        comm.bcast("submitted", root=0)
        assert second.wait(60.0) and first.wait(60) is a
    else:
        assert comm.bcast(None, root=0) == "submitted"
        engine.allreduce_async(a).wait(60)
        engine.allreduce(b, op="sum", timeout=60)
    assert engine._engine.callers_waiting == 0
    assert np.all(a == 1) and np.all(b == p * (p + 1) / 2), (a, b)

engine.shutdown()
if r == 0:
    print(f"engine_allreduce: p={p} segment={engine.segment_bytes} "
          f"board={engine.board_bytes} ok")
