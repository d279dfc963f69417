"""Run where /dev/shm cannot hold the engine's inboxes: every rank keeps to MPI messages,
says why on stderr, and the allreduce still matches MPI's own, bitwise equal on all ranks.
"""

import numpy as np
from fallback_checks import check_sum_matches_mpi
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
engine = pipesgd.Engine(comm)
assert not engine.shm_links, "the inboxes should not fit"
rng = np.random.default_rng(comm.rank)
for n in (1, 1000, 2**20 + 3):
    check_sum_matches_mpi(comm, engine, rng.standard_normal(n).astype(np.float32))
engine.shutdown()
if comm.rank == 0:
    print("shm_fallback: ok")
