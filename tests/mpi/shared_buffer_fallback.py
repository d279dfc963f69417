"""Run where /dev/shm holds the links but not a large shared buffer: that allocation
falls back to an ordinary array on every rank and says why on stderr, a small one still
shares, and both reduce to MPI's own result, bitwise equal on all ranks.
"""

import numpy as np
from fallback_checks import check_sum_matches_mpi
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
    check_sum_matches_mpi(comm, engine, x)
engine.shutdown()
if comm.rank == 0:
    print("shared_buffer_fallback: ok")
