"""Node-local ranks under mpirun: every rank of this one machine is on one node, so the
local rank is the global one; on a sub-communicator it is the position within it.
A node without CUDA stops every rank alike, through the CLIs' `run_device` and through
`Pipeline(device="cuda")`. Usage: device_placement.py"""

import torch
from mpi4py import MPI

import pipesgd
from pipesgd.device import run_device
from pipesgd.pipeline import Pipeline, Plan, models

comm = MPI.COMM_WORLD
assert pipesgd.local_size() == comm.size, pipesgd.local_size()
assert pipesgd.local_rank() == comm.rank, pipesgd.local_rank()
odd = comm.Split(comm.rank % 2, comm.rank)
assert pipesgd.local_rank(odd) == odd.rank and pipesgd.local_size(odd) == odd.size
expected = (torch.device("cuda", comm.rank % torch.cuda.device_count())
            if torch.cuda.is_available() else torch.device("cpu"))
assert pipesgd.device() == expected, pipesgd.device()

# A node without CUDA (rank 1's here) stops every rank with its name, before any of them
# enters device()'s collective.
real_is_available = torch.cuda.is_available
torch.cuda.is_available = lambda: comm.rank != 1
model = models.mlp((6, 8, 3))
try:
    try:
        run_device("cuda", comm)
    except ValueError as err:
        assert str(err).startswith("rank 1: --device cuda, but CUDA is not available on "), err
    else:
        raise AssertionError("run_device('cuda') went on where rank 1 has no CUDA")
    # The library's pipeline too: ranks that have CUDA must not go on into its collectives.
    try:
        Pipeline(model, Plan.even(model.num_layers, comm.size, micro_batch=4), comm,
                 device="cuda")
    except ValueError as err:
        assert str(err).startswith("rank 1: device='cuda', but CUDA is not available on "), err
    else:
        raise AssertionError("Pipeline(device='cuda') went on where rank 1 has no CUDA")
finally:
    torch.cuda.is_available = real_is_available
assert run_device("cpu", comm) == torch.device("cpu")
if comm.rank == 0:
    print(f"device_placement: ok on {comm.size} ranks")
