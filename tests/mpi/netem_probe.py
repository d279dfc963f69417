"""Move a known number of bytes between ranks and print how long it took (for test_netem.py).

Usage: netem_probe.py PATTERN NBYTES
    ring    every rank sends NBYTES to rank+1 and receives NBYTES from rank-1 (Sendrecv)
    fanout  rank 0 sends NBYTES to each of ranks 1 and 2 at once; they only receive
    fail    exit with status 3 after MPI_Init (a failing command)
    burst   measure the links' β and token-bucket burst as the timing model does (NBYTES
            unused); prints {"pattern", "burst_bytes", "beta", "flow_beta"}
    eager   the largest message rank 0 sends to rank 1 before rank 1 posts its receive,
            as the timing model measures it (NBYTES unused); prints
            {"pattern", "eager_bytes"}
    pieces  the piece size the pipeline agrees between ranks 0 and 1 (NBYTES unused);
            prints {"pattern", "piece_bytes"}
    wakes   an engine allreduce of NBYTES of float32, once with the comm thread's poll
            sleep fixed at PIPESGD_POLL_US (poll_max_us=0) and once doubling (the
            default); prints
            {"pattern", "fixed", "doubling"}: the comm threads' wake-ups (voluntary
            context switches), summed over ranks and three allreduces of each

Rank 0 prints one JSON line: {"pattern", "nbytes", "seconds"}, where seconds is the
slowest rank's time between two barriers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

WAKE_ROUNDS = 3


def _comm_thread_wakes() -> int:
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "pipesgd-comm":
            status = (task / "status").read_text().splitlines()
            total += next(int(ln.split()[1]) for ln in status
                          if ln.startswith("voluntary_ctxt_switches"))
    return total


def _engine_wakes(comm, nbytes: int, poll_max_us: int | None) -> int:
    """Wake-ups of this rank's comm thread during one allreduce, checked against MPI's.
    Nothing waits on it meanwhile (as when Pipe-SGD computes): a thread in `wait` would
    make the comm thread test and yield instead of napping."""
    import pipesgd
    from pipesgd.polling import wait_unwatched

    options = {} if poll_max_us is None else {"poll_max_us": poll_max_us}
    engine = pipesgd.Engine(comm, **options)
    x = np.arange(nbytes // 4, dtype=np.float32) % 97 + comm.Get_rank()
    expect = np.empty_like(x)
    comm.Allreduce(x, expect, op=MPI.SUM)
    engine.allreduce(np.zeros(4, np.float32), timeout=60)  # the thread is up and tuned
    before = _comm_thread_wakes()
    wait_unwatched(engine.allreduce_async(x, op="sum"))
    wakes = _comm_thread_wakes() - before
    engine.shutdown()
    if not np.array_equal(x, expect):  # small integers: every order is exact
        raise AssertionError("the engine's sum differs from MPI's")
    return wakes


def main() -> int:
    pattern, nbytes = sys.argv[1], int(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if pattern == "fail":
        return 3
    if pattern == "burst":
        import pipesgd
        from pipesgd.timing.link_probes import measure_ring_beta
        from pipesgd.timing.token_bucket import measure_burst

        # as measure_network runs it across nodes: β from the engine's ring (its
        # reductions, γ, are negligible beside these links), then the burst in the
        # engine's segments, polite waits on shared cores
        engine = pipesgd.Engine(comm)
        segment, polite = engine.segment_bytes, size > (os.cpu_count() or 1)
        beta, _ = measure_ring_beta(comm, engine, (4 << 20, 16 << 20), 5, gamma=0.0)
        burst, flow_beta, _ = measure_burst(comm, beta, repeats=6, segment=segment,
                                            polite=polite)
        engine.shutdown()
        if rank == 0:
            print(json.dumps({"pattern": pattern, "burst_bytes": burst, "beta": beta,
                              "flow_beta": flow_beta}),
                  flush=True)
        return 0
    if pattern == "eager":
        from pipesgd.timing.link_probes import measure_eager

        eager = measure_eager(comm, peer=1)
        if rank == 0:
            print(json.dumps({"pattern": pattern, "eager_bytes": eager}), flush=True)
        return 0
    if pattern == "pieces":
        from pipesgd.pipeline.pieces import piece_bytes
        from pipesgd.timing.link_probes import node_key

        keys = comm.allgather(node_key())
        piece = piece_bytes(comm, keys, 1 - rank, sender=rank == 0) if rank < 2 else 0
        if rank == 0:
            print(json.dumps({"pattern": pattern, "piece_bytes": piece}), flush=True)
        return 0
    if pattern == "wakes":
        # three of each, taking turns, so that a spell of the machine's load falls on both
        fixed = doubling = 0
        for _ in range(WAKE_ROUNDS):
            fixed += comm.reduce(_engine_wakes(comm, nbytes, 0)) or 0  # no growth
            doubling += comm.reduce(_engine_wakes(comm, nbytes, None)) or 0
        if rank == 0:
            print(json.dumps({"pattern": pattern, "fixed": fixed, "doubling": doubling}),
                  flush=True)
        return 0
    send = np.full(nbytes, rank, dtype=np.uint8)
    recv = np.empty(nbytes, dtype=np.uint8)
    comm.Barrier()
    start = time.perf_counter()
    if pattern == "ring":
        comm.Sendrecv(send, dest=(rank + 1) % size, recvbuf=recv, source=(rank - 1) % size)
        if recv[0] != (rank - 1) % size or recv[-1] != (rank - 1) % size:
            raise AssertionError(f"rank {rank}: ring received wrong data")
    elif pattern == "fanout":
        if size < 3:
            raise SystemExit("fanout needs 3 ranks")
        if rank == 0:
            MPI.Request.Waitall([comm.Isend(send, dest=1), comm.Isend(send, dest=2)])
        elif rank in (1, 2):
            comm.Recv(recv, source=0)
    else:
        raise SystemExit(f"unknown pattern {pattern!r}: use ring, fanout, burst, wakes or fail")
    elapsed = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)
    comm.Barrier()
    if rank == 0:
        print(json.dumps({"pattern": pattern, "nbytes": nbytes, "seconds": elapsed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
