"""Run where /dev/shm cannot hold the engine's inboxes: every rank keeps to MPI messages,
says why on stderr, and the allreduce still matches MPI's own, bitwise equal on all ranks.
"""

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
engine = pipesgd.Engine(comm)
assert not engine.shm_links, "the inboxes should not fit"
rng = np.random.default_rng(comm.rank)
for n in (1, 1000, 2**20 + 3):
    x = rng.standard_normal(n).astype(np.float32)
    reference = np.empty_like(x)
    comm.Allreduce(x, reference)
    engine.allreduce(x, op="sum", timeout=60)
    np.testing.assert_allclose(x, reference, rtol=1e-5, atol=1e-5)
    assert len(set(comm.allgather(x.tobytes()))) == 1, "ranks differ"
engine.shutdown()
if comm.rank == 0:
    print("shm_fallback: ok")
