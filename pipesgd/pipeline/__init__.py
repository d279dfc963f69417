"""Pipeline-parallel training over MPI: 1F1B (PipeDream) with weight stashing, 1F1B-RR
with replicated stages synchronized by the engine, and GPipe as the synchronous baseline.

    from pipesgd.pipeline import MicroBatches, Pipeline, Plan, models
    pipe = Pipeline(models.mlp(), Plan.even(5, 2, micro_batch=8), lr=0.05)  # mpirun -n 2
    stats = pipe.train_epoch(MicroBatches(x, y, micro_batch=8))

Modules: plan (the planner's format), schedule (actions, generators, deadlock check),
stash (weight-version policies), p2p (tensor messages), stage (a stage's compute),
replicas (gradient all-reduce of replicated stages), runtime (the executor),
evaluate (held-out loss and accuracy), checkpoint, timeline, models, data, cli.
"""

from . import models
from .data import MicroBatches
from .evaluate import Evaluation, evaluate
from .plan import Plan, PlanError, StagePlan
from .runtime import EpochStats, Pipeline
from .schedule import Action, DeadlockError, ScheduleError
from .stash import LatestWeights, VerticalSync, WeightPolicy, WeightStash

__all__ = [
    "Action",
    "DeadlockError",
    "EpochStats",
    "Evaluation",
    "LatestWeights",
    "MicroBatches",
    "Pipeline",
    "Plan",
    "PlanError",
    "ScheduleError",
    "StagePlan",
    "VerticalSync",
    "WeightPolicy",
    "WeightStash",
    "evaluate",
    "models",
]
