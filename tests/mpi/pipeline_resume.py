"""Resume is bitwise: 2 epochs in one run == 1 epoch, save, a new pipeline loads, 1 epoch.
A checkpoint written by one partition loads into another (keyed by global layer index).

Run: mpirun -n 2 python tests/mpi/pipeline_resume.py DIR
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, checkpoint, models
from pipesgd.pipeline.data import synthetic

comm = MPI.COMM_WORLD
MODEL = models.mlp((10, 16, 16, 16, 4))  # 7 layers
KW = {"lr": 0.05, "momentum": 0.9, "seed": 7}


def main():
    root = Path(sys.argv[1])
    x, y = synthetic(96, (10,), 4, seed=9)
    data = MicroBatches(x, y, 8, seed=1)
    plan = Plan.even(MODEL.num_layers, comm.Get_size(), micro_batch=8)

    straight = Pipeline(MODEL, plan, **KW)
    straight.train_epoch(data)
    straight.train_epoch(data)
    want = straight.model_state()
    straight.close()

    first = Pipeline(MODEL, plan, **KW)
    first.train_epoch(data)
    checkpoint.save(first, root / "ck")
    saved = first.model_state()
    first.close()

    resumed = Pipeline(MODEL, plan, **KW)
    assert checkpoint.load(resumed, root / "ck") == 1
    resumed.train_epoch(data)
    got = resumed.model_state()
    resumed.close()
    if got is not None:
        for k in want:
            assert torch.equal(got[k], want[k]), f"resumed run differs in layer {k}"
        print("resume: bitwise identical continuation", flush=True)

    # Another partition: boundaries moved, same global layers.
    other = plan.replace(stages=(StagePlan(0, 2), StagePlan(2, 7)))
    moved = Pipeline(MODEL, other, **KW)
    checkpoint.load(moved, root / "ck")
    got = moved.model_state()
    if got is not None:
        for k in saved:
            assert torch.equal(got[k], saved[k]), f"re-partitioned load differs in {k}"
        print("re-partitioned load: identical layers", flush=True)
    moved.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
