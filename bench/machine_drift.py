"""Whether this machine changes speed under a running job: MPI's own Allreduce (and
pipesgd's beside it) timed for a while inside one launch, one median per second.

    mpirun -n 2 python bench/machine_drift.py --seconds 30 --size 1MiB

On a VM whose virtual CPUs the host moves, the medians step between levels within one
process, MPI's and pipesgd's together: a launch-to-launch spread then belongs to the
machine, not to the engine (docs/engine.md, "Counting launches"). Prints one line per
second; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--size", default="1MiB", help="buffer size (float32)")
    ap.add_argument("--no-pipesgd", action="store_true", help="time MPI's Allreduce alone")
    args = ap.parse_args(argv)

    from mpi4py import MPI

    import pipesgd

    comm = MPI.COMM_WORLD
    n = parse_size(args.size) // 4
    src, dst, mine = (np.ones(n, np.float32) for _ in range(3))
    if not args.no_pipesgd:
        pipesgd.init()
    if comm.rank == 0:
        print(f"per-second medians, {args.size}, p = {comm.size}: MPI ms"
              + ("" if args.no_pipesgd else " / pipesgd ms"))
    for second in range(args.seconds):
        mpi_times: list[float] = []
        our_times: list[float] = []
        # rank 0 decides when the second is over, so every rank runs the same operations
        deadline = time.perf_counter() + 1.0
        go = True
        while go:
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(src, dst)
            mpi_times.append(time.perf_counter() - t0)
            if not args.no_pipesgd:
                mine.fill(1.0)
                comm.Barrier()
                t0 = time.perf_counter()
                pipesgd.allreduce(mine, op="sum")
                our_times.append(time.perf_counter() - t0)
            go = comm.bcast(time.perf_counter() < deadline, root=0)
        if comm.rank == 0:
            line = f"{second + 1:3d} s  {statistics.median(mpi_times) * 1e3:8.3f}"
            if our_times:
                line += f" / {statistics.median(our_times) * 1e3:8.3f}"
            print(line, flush=True)
    if not args.no_pipesgd:
        pipesgd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
