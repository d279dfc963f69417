"""Faults under mpirun: mismatched submissions, a missing peer, dropped
buffers and handles, shutdown with work in flight. Usage: engine_faults.py SCENARIO
"""

import gc
import sys
import time

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
scenario = sys.argv[1]


def expect_mismatch(engine: pipesgd.Engine, buf: np.ndarray, needles: list[str]) -> None:
    start = time.monotonic()
    try:
        engine.allreduce(buf, timeout=20)
    except pipesgd.CollectiveMismatchError as e:
        elapsed = time.monotonic() - start
        assert elapsed < 10, f"mismatch took {elapsed:.1f} s to surface"
        for needle in needles:
            assert needle in str(e), f"{needle!r} not in {e}"
    else:
        raise AssertionError(f"rank {r}: no CollectiveMismatchError")
    # The engine refuses further work with an error that names the cause.
    try:
        engine.allreduce(np.ones(4, np.float32), timeout=20)
    except pipesgd.PipesgdError as e:
        assert "earlier failure" in str(e), e
    else:
        raise AssertionError("engine ran an operation after a mismatch")
    engine.shutdown(timeout=2)


if scenario == "mismatch-count":
    engine = pipesgd.Engine(comm)
    engine.allreduce(np.ones(10, np.float32))  # sequence number 0 matches
    n = 1000 + (7 if r == p - 1 else 0)
    expect_mismatch(
        engine,
        np.ones(n, np.float32),
        ["allreduce #1", "1000 x float32", "1007 x float32", f"rank {p - 1}"],
    )
elif scenario == "mismatch-dtype":
    engine = pipesgd.Engine(comm)
    buf = np.ones(1000, np.float64 if r == 0 else np.float32)
    expect_mismatch(engine, buf, ["allreduce #0", "1000 x float64", "1000 x float32", "rank 0"])
elif scenario == "missing-peer":
    engine = pipesgd.Engine(comm)
    silent = p - 1
    if r != silent:
        start = time.monotonic()
        try:
            engine.allreduce(np.ones(1000, np.float32), timeout=1.5)
        except TimeoutError as e:
            assert time.monotonic() - start < 10
            assert "allreduce #0" in str(e) and "waiting for rank" in str(e), e
            assert f"on rank {r}" in str(e), e
        else:
            raise AssertionError("no TimeoutError")
    comm.Barrier()
    start = time.monotonic()
    engine.shutdown(timeout=1)  # fails the stuck operation instead of hanging
    assert time.monotonic() - start < 10
elif scenario == "drop-buffers":
    engine = pipesgd.Engine(comm)
    # Buffers and handles dropped while in flight: the engine keeps them alive.
    for _ in range(20):
        engine.allreduce_async(np.full(300001, float(r), np.float32))
    gc.collect()
    keep = np.full(1000, 1.0, np.float32)
    engine.allreduce(keep, op="sum", timeout=60)
    assert np.all(keep == p)
    engine.shutdown()
elif scenario == "shutdown-inflight":
    engine = pipesgd.Engine(comm)
    handles = [
        engine.allreduce_async(np.full(200000, 1.0, np.float32), op="sum") for _ in range(10)
    ]
    engine.shutdown()  # finishes what every rank submitted
    for h in handles:
        assert h.done()
        assert np.all(h.wait(timeout=0) == p)
    try:
        engine.allreduce_async(np.ones(4, np.float32))
    except RuntimeError as e:
        assert "shut down" in str(e), e
    else:
        raise AssertionError("submit after shutdown was accepted")
    # A default engine left running with work queued must not hang interpreter exit.
    pipesgd.init()
    pipesgd.allreduce_async(np.ones(1000, np.float32))
else:
    raise SystemExit(f"unknown scenario {scenario}")
if r == 0:
    print(f"engine_faults {scenario}: p={p} ok")
