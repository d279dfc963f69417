"""`replicated_round_s`: every rank a replica of the whole model; each gets the same
seconds per update round, which cover at least the round's forward, backward and step;
None on a single rank; fewer rounds where they would exceed the budget. The same of
`data_parallel_iteration_s` (the whole model under `DistributedOptimizer`) and of
`pipeline_micro_batch_s` (one stage per rank), and of the three sampled in turn
(`medians_in_turn`).

Run: mpirun -n 2 python tests/mpi/replicated_round.py
"""

import dataclasses
import itertools
import time

import torch
from mpi4py import MPI

from pipesgd.optim import DistributedOptimizer
from pipesgd.pipeline import Plan, PlanError, StagePlan, models, runtime

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
model = models.mlp((64, 256, 256, 10))

alone = runtime.action_times(model, 32)  # this rank's F + B + U, the model unreplicated
round_s = runtime.replicated_round_s(comm, model, 32, rounds=16)
every = comm.allgather(round_s)
assert all(r == every[0] for r in every), every
# a round is a micro-batch's forward and backward, the ring and the step
assert round_s is not None and 0.8 * alone.total_s < round_s < 50 * alone.total_s, \
    (round_s, alone)
assert runtime.replicated_round_s(MPI.COMM_SELF, model, 32) is None

# a budget no round fits: the two warm-up rounds, then the least: four epochs of one
epochs = []
train_epoch = runtime.Pipeline.train_epoch


def counted(self, data, *args, **kwargs):
    epochs.append(len(data))
    return train_epoch(self, data, *args, **kwargs)


runtime.Pipeline.train_epoch = counted
assert runtime.replicated_round_s(comm, model, 32, budget_s=0.0) > 0
assert epochs == [2 * size] + [size] * 4, epochs

# the median epoch: one the machine spent elsewhere (ten times slower) does not count
slow_epochs = iter([0.5, 3.0, 20.0, 2.0, 4.0])  # warm-up, then four timed epochs


def timed(self, data, *args, **kwargs):
    return dataclasses.replace(train_epoch(self, data, *args, **kwargs),
                               seconds=next(slow_epochs))


runtime.Pipeline.train_epoch = timed
each = runtime.replicated_round_s(comm, model, 32, rounds=16, budget_s=1e9)
assert each == (3.0 + 4.0) / 2 / 4, each  # 16 rounds in 4 epochs of 4
runtime.Pipeline.train_epoch = train_epoch

# a pipeline of one stage per rank: the same seconds per micro-batch on every rank, at
# least its slowest stage's share of the model's work and less than the model's work on
# one rank times the ranks that share the cores
layers = model.num_layers
cut = [round(i * layers / size) for i in range(size + 1)]
straight = Plan(tuple(StagePlan(a, b) for a, b in itertools.pairwise(cut)),
                        micro_batch=32)
micro_s = runtime.pipeline_micro_batch_s(comm, model, straight)
every = comm.allgather(micro_s)
assert all(m == every[0] for m in every), every
assert micro_s is not None and alone.total_s / size / 2 < micro_s < 50 * alone.total_s, \
    (micro_s, alone)
assert runtime.pipeline_micro_batch_s(MPI.COMM_SELF, model, straight) is None
epochs.clear()
runtime.Pipeline.train_epoch = counted
assert runtime.pipeline_micro_batch_s(comm, model, straight, budget_s=0.0) > 0
assert epochs == [4 * size] * 5, epochs  # warm-up, then the least: four of 4 per rank
epochs.clear()
assert runtime.pipeline_micro_batch_s(comm, model, straight, budget_s=1e9, per_rank=6) > 0
assert epochs == [4 * size] + [6 * size] * 4, epochs  # the most: `per_rank` each
runtime.Pipeline.train_epoch = train_epoch
too_many = Plan((StagePlan(0, layers, size + 1),), schedule="1f1b-rr", micro_batch=32)
try:
    runtime.pipeline_micro_batch_s(comm, model, too_many)
except PlanError as err:
    assert "ranks" in str(err), err
else:
    raise AssertionError("a plan for another number of ranks ran")

# data parallelism: the same iteration on every rank, at least the plain loop's
net = model.build(seed=0)
sgd = torch.optim.SGD(net.parameters(), lr=1e-4)
x, y = torch.randn(32, *model.input_shape), torch.randint(model.num_classes, (32,))


def plain_loop(count=20):
    """Seconds per iteration of forward, backward and step on this rank, no pipesgd."""
    begin = time.perf_counter()
    for _ in range(count):
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        sgd.step()
    return (time.perf_counter() - begin) / count


plain_loop(5)
plain = min(plain_loop() for _ in range(3))
dp_s = runtime.data_parallel_iteration_s(comm, model, 32, compression="quant8", steps=8)
every = comm.allgather(dp_s)
assert all(d == every[0] for d in every), every
assert dp_s is not None and 0.8 * plain < dp_s < 50 * plain, (dp_s, plain)
assert runtime.data_parallel_iteration_s(MPI.COMM_SELF, model, 32) is None
steps = []
step = DistributedOptimizer.step


def counted_step(self, *args, **kwargs):
    steps.append(self.iteration)
    return step(self, *args, **kwargs)


DistributedOptimizer.step = counted_step
assert runtime.data_parallel_iteration_s(comm, model, 32, budget_s=0.0) > 0
# three of warm-up, then the least: 4 runs of one, each after one that refills the
# allreduces in flight
assert len(steps) == 3 + 4 * 2, steps
DistributedOptimizer.step = step

# the three in turn, as `--plan auto` calibrates: each the median of its own samples,
# the same on every rank, each within the bounds it keeps alone
in_turn = runtime.medians_in_turn([
    runtime.pipeline_micro_batch_runs(comm, model, straight),
    runtime.replicated_round_runs(comm, model, 32),
    runtime.data_parallel_iteration_runs(comm, model, 32, compression="quant8", steps=8)])
every = comm.allgather(in_turn)
assert all(t == every[0] for t in every), every
assert alone.total_s / size / 2 < in_turn[0] < 50 * alone.total_s, (in_turn, alone)
assert 0.8 * alone.total_s < in_turn[1] < 50 * alone.total_s, (in_turn, alone)
assert 0.8 * plain < in_turn[2] < 50 * plain, (in_turn, plain)
assert torch.get_num_threads() == 1, torch.get_num_threads()
if rank == 0:
    print(f"replicated round on {size} ranks: {round_s * 1e3:.3f} ms, data-parallel "
          f"iteration {dp_s * 1e3:.3f} ms, a micro-batch of {size} stages "
          f"{micro_s * 1e3:.3f} ms (F + B + U alone {alone.total_s * 1e3:.3f} ms "
          f"of CPU, the plain loop {plain * 1e3:.3f} ms); OK", flush=True)
