"""`choose_for_run` (`pipesgd train --config auto`) profiles on every rank at once, as the
ranks will train, and decides from rank 0's profile; a profile that fails on rank 0
raises its error on every rank. The network and the profile are stubs here.

Run: PYTHONPATH=tests mpirun -n 3 python tests/mpi/auto_profiles_every_rank.py
"""

import time

from fakes import KERNELS
from mpi4py import MPI

from pipesgd.timing import NetworkParams, Profile
from pipesgd.train import auto
from pipesgd.train.loop import TrainConfig

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
NET = NetworkParams(alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10, sync_s=2e-5,
                    kernels=KERNELS)


def measured(comm, repeats, device) -> NetworkParams:
    comm.Barrier()  # collective, as the real measurement is: the ranks leave it together
    return NET


auto.measure_network = measured
spans: list[tuple[float, float]] = []


def profiled(config, device) -> Profile:
    begin = time.monotonic()
    time.sleep(0.2)
    spans.append((begin, time.monotonic()))
    return Profile(forward_s=0.01 * (rank + 1), backward_s=0.02, update_s=0.005,
                   gradient_bytes=4e6)


auto.profile_run = profiled
choice = auto.choose_for_run(TrainConfig(model="mlp", data="synthetic"), comm)
every = comm.allgather(spans)
assert all(len(s) == 1 for s in every), every
# at once: every rank's profile overlaps every other's (CLOCK_MONOTONIC is one clock
# for every process of the host)
latest_begin = max(s[0][0] for s in every)
earliest_end = min(s[0][1] for s in every)
assert latest_begin < earliest_end, every
assert choice.profile.forward_s == 0.01, choice.profile  # rank 0's
assert comm.allgather(choice.best.config) == [choice.best.config] * comm.size


def fails_on_rank_0(config, device) -> Profile:
    if rank == 0:
        raise ValueError("no such data on rank 0")
    return profiled(config, device)


auto.profile_run = fails_on_rank_0
try:
    auto.choose_for_run(TrainConfig(model="mlp", data="synthetic"), comm)
except ValueError as e:
    assert "no such data on rank 0" in str(e), e
else:
    raise AssertionError("rank 0's error was not raised")
comm.Barrier()
if rank == 0:
    print(f"auto profiles on every rank: ok on {comm.size} ranks", flush=True)
