"""Gated operations under mpirun: an operation queued before its buffer is filled keeps
its place in the order and starts only when the submitter opens its gate (the staging
path's device-to-host copy). Usage: engine_gate.py SCENARIO

  order  rank 0 fills its buffer 0.3 s after submitting, from another thread; the
         operation queued behind it waits; both results match MPI's Allreduce
  abort  rank 0 never opens its gate; shutdown() fails the wait, naming it
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r = comm.rank
scenario = sys.argv[1]
engine = pipesgd.Engine(comm)
n = 100_000

if scenario == "order":
    # whole numbers: every summation order gives the same float32 sum
    values = np.random.default_rng(r).integers(-50, 50, n).astype(np.float32)
    later = np.full(n, float(r + 1), np.float32)
    expect_first, expect_later = np.empty_like(values), np.empty_like(later)
    comm.Allreduce(values, expect_first)
    comm.Allreduce(later, expect_later)
    comm.Barrier()
    gated = r == 0
    buf = np.zeros(n, np.float32) if gated else values.copy()
    first = engine.allreduce_async(buf, op="sum", gated=gated)
    second = engine.allreduce_async(later, op="sum")
    if gated:
        def fill() -> None:
            time.sleep(0.3)
            buf[:] = values
            first.open_gate()

        filler = threading.Thread(target=fill)
        filler.start()
        time.sleep(0.1)
        assert not first.done() and not second.done(), "ran before its gate opened"
        filler.join()
    first.wait(timeout=30)
    second.wait(timeout=30)
    assert np.array_equal(buf, expect_first), "gated operation: differs from MPI"
    assert np.array_equal(later, expect_later), "operation behind it: differs from MPI"
    engine.shutdown(timeout=5)
elif scenario == "abort":
    buf = np.ones(n, np.float32)
    handle = engine.allreduce_async(buf, gated=r == 0)
    time.sleep(0.2)
    engine.shutdown(timeout=0.5)
    try:
        handle.wait(timeout=30)
    except pipesgd.PipesgdError as e:
        if r == 0:
            assert "open_gate" in str(e) and "aborted" in str(e), e
    else:
        raise AssertionError(f"rank {r}: a gate never opened, yet the operation finished")
else:
    raise SystemExit(f"unknown scenario {scenario}")
if r == 0:
    print(f"engine_gate {scenario}: ok on {comm.size} ranks")
