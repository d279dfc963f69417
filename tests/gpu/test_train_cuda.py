"""`pipesgd train --device cuda` for a few steps, one process. Runs where CUDA is
available; elsewhere skipped with that reason."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipesgd.train import loop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


# The CNN with K = 2 needs its warm-up and ramp to learn under momentum 0.9 (bench/train.py's
# recipe). Without momentum it leaves its loss plateau after about 150 steps; before 250 its
# accuracy swings by tens of points between runs of one device (the GPU's sums are not
# deterministic), so it is compared after 400 (97-98 % on an H200 and on the CPU).
@pytest.mark.parametrize(("model", "steps", "momentum"), [("mlp", 30, 0.9), ("cnn", 400, 0.0)])
def test_a_short_run_on_the_gpu_learns_like_the_cpu(model: str, steps: int,
                                                     momentum: float) -> None:
    results = {}
    for device in ("cuda", "cpu"):
        config = loop.TrainConfig(model=model, data="digits", steps=steps, batch_size=32,
                                  lr=0.05, momentum=momentum, staleness=2, device=device)
        results[device] = loop.run(config, MPI.COMM_SELF, progress=False, log=lambda _: None)
    assert results["cuda"].final_accuracy > 0.3
    assert abs(results["cuda"].final_accuracy - results["cpu"].final_accuracy) < 0.1
