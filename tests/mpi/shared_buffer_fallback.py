"""Run where /dev/shm holds the links but not a large shared buffer: that allocation
falls back to an ordinary array on every rank and says why on stderr, a small one still
shares, and both reduce to MPI's own result, bitwise equal on all ranks.
"""

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
engine = pipesgd.Engine(comm)
assert engine.shm_links and engine.shares_memory, "the links should fit"
small = engine.zeros(1000, np.float32)     # p parts of a page each: fits
large = engine.zeros(2**20, np.float32)    # p parts of 4 MiB: does not
assert small.base is not None, "the small buffer should be shared"
assert large.base is None and large.flags.owndata, "the large one should be ordinary"
rng = np.random.default_rng(comm.rank)
for x in (small, large):
    x[:] = rng.standard_normal(x.size).astype(np.float32)
    reference = np.empty_like(x)
    comm.Allreduce(x, reference)
    engine.allreduce(x, op="sum", timeout=60)
    np.testing.assert_allclose(x, reference, rtol=1e-5, atol=1e-5)
    assert len(set(comm.allgather(x.tobytes()))) == 1, "ranks differ"
engine.shutdown()
if comm.rank == 0:
    print("shared_buffer_fallback: ok")
