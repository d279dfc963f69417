"""A pipeline's held-out evaluation equals the whole model's, evaluated in one process.

On 3 ranks, a model with batch norm and dropout trains an epoch under two plans (stage 0
replicated 2-1, and three single stages); then `Pipeline.evaluate` on held-out samples
is set against the model rebuilt in one process from the first replica of every stage,
in evaluation mode: the accuracy equal, the loss within float32 rounding of a float64
reference. The stages are back in training mode after it, and a second evaluation
gives the same result (nothing it ran changed a statistic).

Run: mpirun -n 3 python tests/mpi/pipeline_evaluate.py
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.models import LayerModel

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
MB = 8
MODEL = LayerModel("bn-dropout-mlp", (
    lambda: nn.Linear(10, 32),
    lambda: nn.BatchNorm1d(32),
    nn.ReLU,
    lambda: nn.Dropout(0.5),
    lambda: nn.Linear(32, 32),
    nn.ReLU,
    lambda: nn.Linear(32, 4),
), (10,), 4)
PLANS = {
    "2-1": Plan(stages=(StagePlan(0, 4, 2), StagePlan(4, 7, 1)), schedule="1f1b-rr",
                micro_batch=MB),
    "1-1-1": Plan(stages=(StagePlan(0, 2, 1), StagePlan(2, 5, 1), StagePlan(5, 7, 1)),
                  schedule="1f1b", micro_batch=MB),
}


def reference(plan: Plan, states: list[dict[str, torch.Tensor]], x: torch.Tensor,
              y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of the whole model from each stage's first replica, in float64."""
    merged = {k: v for s in range(plan.num_stages) for k, v in
              states[plan.rank_of(s, 0)].items()}
    whole = MODEL.build(0, MODEL.num_layers, seed=0)
    whole.load_state_dict(merged)
    whole = whole.double().eval()
    with torch.no_grad():
        out = whole(x.double())
    loss = float(nn.functional.cross_entropy(out, y))
    return loss, float((out.argmax(dim=1) == y).double().mean())


def check(name: str, plan: Plan) -> None:
    x, y = synthetic(12 * MB, (10,), 4, seed=3)
    held_x, held_y = synthetic(100, (10,), 4, seed=4)
    pipe = Pipeline(MODEL, plan, lr=0.1, momentum=0.9, seed=1)
    pipe.train_epoch(MicroBatches(x, y, MB))
    first = pipe.evaluate(held_x, held_y, batch_size=16)
    assert pipe.stage.module.training, f"rank {rank}: the stage stayed in evaluation mode"
    again = pipe.evaluate(held_x, held_y, batch_size=16)
    assert again == first, f"rank {rank}: a second evaluation gave {again}, not {first}"
    try:
        pipe.evaluate(held_x, held_y[:-1])
        raise AssertionError("inputs and labels of different lengths were accepted")
    except ValueError as exc:
        assert "as many labels as inputs" in str(exc), exc
    states = pipe.gather_state(root=0)
    pipe.close()
    if rank == 0:
        loss, accuracy = reference(plan, states, held_x, held_y)
        assert first.samples == 100, first
        assert first.accuracy == accuracy, (name, first.accuracy, accuracy)
        assert abs(first.loss - loss) <= 1e-5 * max(1.0, loss), (name, first.loss, loss)
        print(f"{name}: held-out loss {first.loss:.6f} accuracy {first.accuracy:.2f} == "
              f"one-process float64 {loss:.6f} {accuracy:.2f}", flush=True)
    outcome = comm.allgather((first.loss, first.accuracy))
    assert len(set(outcome)) == 1, f"ranks disagree: {outcome}"


def main() -> int:
    for name, plan in PLANS.items():
        check(name, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
