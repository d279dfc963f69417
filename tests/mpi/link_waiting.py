"""A rank that waits on a shared-memory link gives its CPU away (docs/engine.md).

Rank 1 joins each operation late (it sleeps first); rank 0 has submitted and waits.
On shared-memory links data moves only while the sending rank runs, so a waiting
rank that spins takes the CPU time the late rank needs whenever the two do not run
at once. Checks, on rank 0, that its process used at most a fifth of the wall time
while it waited, late in the header and late in the middle of the data (rank 1 is
stopped with SIGSTOP halfway through a large operation), and that the results still
match MPI's own Allreduce bitwise.
"""

import os
import signal
import time

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
assert p == 2, "run with 2 ranks"
engine = pipesgd.Engine(comm)
assert engine.shm_links, "this test is about the shared-memory links"
LATE_S = 0.8


def waited_cpu_share(n: int, late_in_data: bool) -> float:
    """Rank 0's CPU time / wall time while it waited for rank 1 in one allreduce."""
    data = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    expected = data.copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
    pids = comm.allgather(os.getpid())
    comm.Barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    if r == 1 and not late_in_data:
        time.sleep(LATE_S)
    if r == 0 and late_in_data:
        # Stop rank 1 once the ring is under way, then let it go on.
        handle = engine.allreduce_async(data, op="sum")
        time.sleep(0.0005)
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(LATE_S)
        os.kill(pids[1], signal.SIGCONT)
        handle.wait()
    else:
        engine.allreduce(data, op="sum")
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    assert np.array_equal(data, expected), "result differs from MPI's Allreduce"
    return cpu / wall if wall >= 0.9 * LATE_S else float("nan")


for late_in_data in (False, True):
    n = (64 << 20) // 4 if late_in_data else 1 << 16
    share = waited_cpu_share(n, late_in_data)
    if r == 0:
        where = "in the data" if late_in_data else "before the header"
        print(f"rank 0, peer late {where}: CPU {share:.2f} of wall", flush=True)
        assert share <= 0.2, (
            f"rank 0 used {share:.0%} of a CPU while its peer was late {where}: a waiting "
            "rank must sleep on its link, not spin")
engine.shutdown()
if r == 0:
    print("link_waiting: ok", flush=True)
