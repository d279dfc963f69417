"""Faults under mpirun: mismatched submissions, a missing peer, dropped
buffers and handles, shutdown with work in flight, blocking calls that run on the
caller's thread. Usage: engine_faults.py SCENARIO
"""

import gc
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
scenario = sys.argv[1]


def expect_mismatch(engine: pipesgd.Engine, buf: np.ndarray, needles: list[str],
                    timeout: float | None = 20) -> None:
    start = time.monotonic()
    try:
        engine.allreduce(buf, timeout=timeout)
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
elif scenario == "mismatch-blocking":
    # The same through a blocking call without a timeout (run on the caller's thread).
    engine = pipesgd.Engine(comm)
    n = 1000 + (7 if r == p - 1 else 0)
    expect_mismatch(engine, np.ones(n, np.float32), ["allreduce #0", f"rank {p - 1}"],
                    timeout=None)
elif scenario == "mismatch-dtype":
    engine = pipesgd.Engine(comm)
    buf = np.ones(1000, np.float64 if r == 0 else np.float32)
    expect_mismatch(engine, buf, ["allreduce #0", "1000 x float64", "1000 x float32", "rank 0"])
elif scenario == "mismatch-ring":
    # The same around the ring (the board turned off): caught from the ring's header.
    engine = pipesgd.Engine(comm, board_bytes=0)
    n = 1000 + (7 if r == p - 1 else 0)
    expect_mismatch(engine, np.ones(n, np.float32),
                    ["allreduce #0", "1000 x float32", "1007 x float32", f"rank {p - 1}"])
elif scenario == "mismatch-board-ring":
    # 4000 bytes fit the board, 4028 do not: the last rank runs the ring, the others the
    # board, and its announcement still tells them.
    engine = pipesgd.Engine(comm, board_bytes=4000)
    n = 1000 + (7 if r == p - 1 else 0)
    expect_mismatch(engine, np.ones(n, np.float32),
                    ["allreduce #0", "1000 x float32", "1007 x float32", f"rank {p - 1}"])
elif scenario == "mismatch-shared":
    # The last rank passes an ordinary array where the others pass the engine's shared
    # one: the others would reduce in place, it around the ring or through the board.
    engine = pipesgd.Engine(comm)
    buf = engine.zeros(1000, np.float32)  # collective
    buf = np.ones(1000, np.float32) if r == p - 1 else buf
    expect_mismatch(engine, buf, ["allreduce #0", "in shared buffer #0 at byte 0",
                                  f"rank {p - 1}"])
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
elif scenario == "blocking-order":
    # Blocking calls run on the caller's thread when nothing is queued, and queue behind
    # asynchronous ones otherwise: either way every rank runs them in submission order.
    engine = pipesgd.Engine(comm)
    rng = np.random.default_rng(r)
    bufs = [rng.standard_normal(n).astype(np.float32) for n in (300000, 5000, 70000, 3, 90000)]
    expected = [b.copy() for b in bufs]
    for e in expected:
        comm.Allreduce(MPI.IN_PLACE, e, op=MPI.SUM)
    first = engine.allreduce_async(bufs[0], op="sum")
    engine.allreduce(bufs[1], op="sum")  # queued behind `first`
    assert first.done(), "a blocking call overtook an earlier asynchronous one"
    engine.allreduce(bufs[2], op="sum")  # nothing queued: this thread runs it
    later = engine.allreduce_async(bufs[3], op="sum")
    engine.allreduce(bufs[4], op="sum")
    later.wait()
    for got, want in zip(bufs, expected, strict=True):
        # Summed in the ring's order, not MPI's: equal to rounding, and bitwise across ranks.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert len(set(comm.allgather(got.tobytes()))) == 1, "ranks differ"
    assert engine.allreduce(np.ones(4, np.float32), op="sum").tolist() == [p] * 4
    engine.shutdown()
elif scenario == "shutdown-aborts-blocking":
    # A blocking call without a timeout, stuck on a peer that never submits, fails when
    # another thread shuts the engine down instead of hanging.
    engine = pipesgd.Engine(comm)
    if r == 0:
        stopper = threading.Timer(0.5, lambda: engine.shutdown(timeout=0.5))
        stopper.start()
        try:
            engine.allreduce(np.ones(1000, np.float32))
        except pipesgd.PipesgdError as e:
            assert "aborted" in str(e) or "shut down" in str(e), e
        else:
            raise AssertionError("a stuck blocking allreduce returned")
        stopper.join()
    comm.Barrier()
    if r != 0:
        engine.shutdown(timeout=0.5)
else:
    raise SystemExit(f"unknown scenario {scenario}")
if r == 0:
    print(f"engine_faults {scenario}: p={p} ok")
