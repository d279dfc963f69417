"""MadPipe's plan under a memory budget (as `choose` runs it), run for real: what each
rank holds (weights, stashed versions, optimizer state, what autograd saved for the
micro-batches in flight) stays within the budget and within the simulator's count for
its stage (the profile's saved bytes are an upper bound, exact at a stage's first layer).

Run: mpirun -n 3 python tests/mpi/planner_memory_run.py
"""

import torch
from mpi4py import MPI

from pipesgd.pipeline import MicroBatches, Pipeline, models
from pipesgd.pipeline.data import synthetic
from pipesgd.planner import choose, profile, smallest_budget

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
MB = 32
TOPOLOGY = "3x[10GB/s]"
torch.set_num_threads(1)
spec = models.mlp((64, 500, 500, 10))


def decide():
    """MadPipe's candidate as `choose` gives it: 1F1B*'s counts per stage, run at the
    deepest depth whose simulated memory (weight stashing included) fits the budget."""
    prof = profile(spec.build(seed=0).train(), torch.randn(MB, 64),
                   lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9))
    least, _ = smallest_budget(prof, comm.Get_size())
    budget = 2 * least
    choice = choose(prof, TOPOLOGY, budget, batch_size=MB)
    mad = next(c for c in choice.ranked if c.family == "madpipe")
    return mad.plan, budget, [s.memory_bytes for s in mad.simulation.stages]


plan, budget, simulated = comm.bcast(decide() if rank == 0 else None, root=0)
inside = rank < plan.world_size
sub = comm.Split(0 if inside else MPI.UNDEFINED, rank)
if inside:
    x, y = synthetic(2048, (64,), 10, seed=0)
    pipe = Pipeline(spec, plan, sub, lr=0.01, momentum=0.9)
    stats = pipe.train_epoch(MicroBatches(x, y, MB, seed=0), 0, max_micro_batches=24)
    stage = pipe.stage_id
    mib = 2**20
    held = (stats.weight_mb[sub.Get_rank()] + stats.peak_stash_mb[sub.Get_rank()]
            + stats.optimizer_state_mb[sub.Get_rank()] + stats.peak_saved_mb[sub.Get_rank()]
            ) * mib
    pipe.close()
    print(f"rank {rank} stage {stage}: held {held / 1e6:.3f} MB, simulated "
          f"{simulated[stage] / 1e6:.3f} MB, budget {budget / 1e6:.3f} MB, in flight "
          f"{plan.stage_in_flight}", flush=True)
    assert held <= budget * (1 + 1e-9), f"rank {rank} holds {held} bytes, over {budget}"
    assert held <= simulated[stage] * 1.001, (held, simulated[stage])
    assert held >= 0.5 * simulated[stage], (held, simulated[stage])
    print(f"rank {rank}: within the budget and the simulation", flush=True)
