"""Move a known number of bytes between ranks and print how long it took (for test_netem.py).

Usage: netem_probe.py PATTERN NBYTES
    ring    every rank sends NBYTES to rank+1 and receives NBYTES from rank-1 (Sendrecv)
    fanout  rank 0 sends NBYTES to each of ranks 1 and 2 at once; they only receive
    fail    exit with status 3 after MPI_Init (a failing command)
    burst   measure the links' token-bucket burst as the timing model does (NBYTES: the
            link rate in bit/s); prints {"pattern", "burst_bytes"}

Rank 0 prints one JSON line: {"pattern", "nbytes", "seconds"}, where seconds is the
slowest rank's time between two barriers.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> int:
    pattern, nbytes = sys.argv[1], int(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if pattern == "fail":
        return 3
    if pattern == "burst":
        from pipesgd.timing.network import _measure_burst

        burst, _ = _measure_burst(comm, 8 / nbytes, probe_bytes=256 << 10, repeats=12)
        if rank == 0:
            print(json.dumps({"pattern": pattern, "burst_bytes": burst}), flush=True)
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
        raise SystemExit(f"unknown pattern {pattern!r}: use ring, fanout or fail")
    elapsed = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)
    comm.Barrier()
    if rank == 0:
        print(json.dumps({"pattern": pattern, "nbytes": nbytes, "seconds": elapsed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
