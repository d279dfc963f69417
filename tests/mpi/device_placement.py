"""Node-local ranks under mpirun: every rank of this one machine is on one node, so the
local rank is the global one; on a sub-communicator it is the position within it.
Usage: device_placement.py"""

import torch
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
assert pipesgd.local_size() == comm.size, pipesgd.local_size()
assert pipesgd.local_rank() == comm.rank, pipesgd.local_rank()
odd = comm.Split(comm.rank % 2, comm.rank)
assert pipesgd.local_rank(odd) == odd.rank and pipesgd.local_size(odd) == odd.size
expected = (torch.device("cuda", comm.rank % torch.cuda.device_count())
            if torch.cuda.is_available() else torch.device("cpu"))
assert pipesgd.device() == expected, pipesgd.device()
if comm.rank == 0:
    print(f"device_placement: ok on {comm.size} ranks")
