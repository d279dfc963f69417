"""Pipeline.use_schedule keeps the weight policy the pipeline was built with, or takes the
new schedule's default when none was named; PipeMare's schedule refuses a named one; a
GPU asked for where there is none is a clear error. One-stage pipelines in this process
(a singleton MPI world)."""

import pytest
import torch

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, PlanError, models
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.pipemare import AsyncWeights
from pipesgd.pipeline.stash import LatestWeights, VerticalSync, WeightStash

MODEL = models.mlp((6, 8, 3))  # 3 layers


def make_pipe(**options) -> Pipeline:
    return Pipeline(MODEL, Plan.even(MODEL.num_layers, 1, micro_batch=4), lr=0.1, seed=3,
                    **options)


def train(pipe: Pipeline) -> None:
    x, y = synthetic(16, (6,), 3, seed=1)
    pipe.train_epoch(MicroBatches(x, y, 4, seed=0))


def test_a_named_policy_survives_a_switch_and_a_default_follows_the_schedule():
    vertical = make_pipe(vertical_sync=True)
    vertical.use_schedule("gpipe")
    assert type(vertical.stage.policy) is VerticalSync
    train(vertical)
    with pytest.raises(PlanError, match="built with weight policy 'vertical'"):
        vertical.use_schedule("async")
    vertical.close()

    default = make_pipe()
    assert type(default.stage.policy) is WeightStash
    default.use_schedule("gpipe")
    assert type(default.stage.policy) is LatestWeights
    default.use_schedule("async")
    assert type(default.stage.policy) is AsyncWeights
    train(default)
    before = {k: v.clone() for k, v in default.layer_state().items()}
    default.use_schedule("1f1b")
    assert type(default.stage.policy) is WeightStash
    assert all(torch.equal(v, default.layer_state()[k]) for k, v in before.items())
    default.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_a_gpu_asked_for_where_there_is_none_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        make_pipe(device="cuda")
