"""A plan whose stage 1 cannot take stage 0's activation raises on both ranks, naming both.

Run: mpirun -n 2 python tests/mpi/pipeline_mismatch.py
"""

import sys

from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.models import LayerModel
from pipesgd.pipeline.p2p import StageMismatchError

BROKEN = LayerModel(
    "broken",
    (lambda: nn.Linear(10, 16), nn.ReLU, lambda: nn.Linear(12, 4)),  # 16 out, 12 in
    (10,),
    4,
)


def main():
    rank = MPI.COMM_WORLD.Get_rank()
    x, y = synthetic(64, (10,), 4)
    pipe = Pipeline(BROKEN, Plan.even(3, 2, micro_batch=8))
    try:
        pipe.train_epoch(MicroBatches(x, y, 8))
    except StageMismatchError as exc:
        text = str(exc)
        assert "stage 0 (rank 0)" in text and "stage 1 (rank 1)" in text, text
        print(f"rank {rank} raised StageMismatchError: {text}", flush=True)
        return 0
    print(f"rank {rank} did not raise", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
