"""Replicas start from their stage's first replica: a 2-1 plan on 3 ranks where rank 1
builds stage 0 with other weights and batch-norm statistics (as a user's model that does
not seed would) trains exactly like a run where every rank built the same model.

Run: mpirun -n 3 python tests/mpi/pipeline_replica_broadcast.py
"""

import hashlib
import sys

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.models import LayerModel

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
N, MB = 9, 8
BUILDERS = (
    lambda: nn.Linear(10, 16),
    lambda: nn.BatchNorm1d(16),
    nn.ReLU,
    lambda: nn.Linear(16, 16),
    nn.ReLU,
    lambda: nn.Linear(16, 4),
)
PLAN = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 6, 1)), schedule="1f1b-rr",
            micro_batch=MB)


def perturbed(build):
    """`build`, then every tensor moved off what the seed gave (an unseeded model)."""
    def build_other() -> nn.Module:
        layer = build()
        noise = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for t in layer.state_dict().values():
                if t.is_floating_point():
                    t.add_(torch.rand(t.shape, generator=noise) + 0.5)
        return layer

    return build_other


def model(other_weights_on_rank_1: bool) -> LayerModel:
    builders = BUILDERS
    if other_weights_on_rank_1 and rank == 1:
        builders = tuple(perturbed(b) for b in BUILDERS)
    return LayerModel("bn-mlp", builders, (10,), 4)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stage0_digests(named) -> list[str]:
    """SHA-256 of each rank's tensors (rank 2 runs stage 1: its digest is not compared)."""
    return comm.allgather(digest(dict(named)))


def run(other_weights_on_rank_1: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    x, y = synthetic(N * MB, (10,), 4, seed=4)
    data = MicroBatches(x, y, MB, shuffle=False)
    built = model(other_weights_on_rank_1)
    before = stage0_digests(built.build(0, 3, seed=2).state_dict().items())
    assert (before[0] != before[1]) == other_weights_on_rank_1, before
    pipe = Pipeline(built, PLAN, lr=0.1, momentum=0.9, seed=2)
    start = stage0_digests(pipe.stage.module.state_dict().items())
    assert start[0] == start[1], f"replicas start apart: {start[:2]}"
    pipe.train_epoch(data)
    pipe.train_epoch(data)
    end = stage0_digests(pipe.stage.module.named_parameters())
    assert end[0] == end[1], f"replicas of stage 0 diverged: {end[:2]}"
    state = pipe.layer_state()  # per rank: the batch-norm statistics differ by replica
    pipe.close()
    return state, [start[0], end[0]]


def mismatched_layouts_raise_on_every_replica() -> None:
    """Replicas that built different tensors all raise (none waits in a broadcast)."""
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if pair == MPI.COMM_NULL:
        return
    width = 16 if rank == 0 else 17
    wrong = LayerModel("wrong", (lambda: nn.Linear(10, width), nn.ReLU,
                                 lambda: nn.Linear(width, 4)), (10,), 4)
    plan = Plan(stages=(StagePlan(0, 3, 2),), schedule="1f1b-rr", micro_batch=MB)
    try:
        Pipeline(wrong, plan, pair)
        raise AssertionError(f"rank {rank}: replicas of different models were accepted")
    except ValueError as exc:
        assert "every rank must build the same model" in str(exc), exc
        print(f"rank {rank} raised ValueError: {exc}", flush=True)
    pair.Free()


def main():
    same, same_digests = run(other_weights_on_rank_1=False)
    other, other_digests = run(other_weights_on_rank_1=True)
    assert same_digests == other_digests, (same_digests, other_digests)
    for k in same:
        assert torch.equal(same[k], other[k]), f"rank {rank}: layer {k} differs between runs"
    comm.Barrier()  # every rank compared its layers
    if rank == 0:
        print(f"stage 0 replicas bitwise identical (sha256 {other_digests[1][:16]}), "
              f"from start to end", flush=True)
        print("run with other weights on rank 1 == run with the same weights, bitwise",
              flush=True)
    comm.Barrier()
    mismatched_layouts_raise_on_every_replica()
    return 0


if __name__ == "__main__":
    sys.exit(main())
