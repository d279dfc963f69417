"""`action_times_beside_others`: every rank runs the whole model at once; each gets the
mean over the ranks, None on every rank when the model does not fit one of them, and
the same error on every rank when one fails otherwise.

Run: mpirun -n 3 python tests/mpi/action_times_beside_others.py
"""

import torch
from mpi4py import MPI

from pipesgd.pipeline import models, runtime

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)

# the real runs: the same figures on every rank, all positive
times = runtime.action_times_beside_others(comm, models.mlp((8, 16, 4)), 4)
every = comm.allgather(times)
assert all(t == every[0] for t in every), every
assert times is not None and min(times.forward_s, times.backward_s, times.update_s) > 0

# the mean over the ranks, of what each measured
real = runtime.action_times
runtime.action_times = lambda model, micro_batch, device=None: runtime.ActionTimes(
    rank + 1.0, 2.0 * (rank + 1), 0.5)
mean = (size + 1) / 2
assert runtime.action_times_beside_others(comm, None, 4) == runtime.ActionTimes(
    mean, 2 * mean, 0.5)


def out_of_memory_on_rank_1(model, micro_batch, device=None):
    if rank == 1:
        raise RuntimeError("CUDA out of memory")
    return runtime.ActionTimes(1.0, 1.0, 1.0)


runtime.action_times = out_of_memory_on_rank_1
assert runtime.action_times_beside_others(comm, None, 4) is None


def broken_on_last_rank(model, micro_batch, device=None):
    if rank == size - 1:
        raise ValueError("no such layer\nmore")
    return runtime.ActionTimes(1.0, 1.0, 1.0)


runtime.action_times = broken_on_last_rank
try:
    runtime.action_times_beside_others(comm, None, 4)
    raise AssertionError("no error")
except RuntimeError as err:  # every rank hears of it, none waits forever
    assert str(err) == (f"rank {size - 1} could not run the whole model: "
                        "ValueError: no such layer"), err
runtime.action_times = real
if rank == 0:
    print(f"beside others on {size} ranks: {times}; mean and None OK", flush=True)
