"""The planner on a GPU: the profile is taken there, the copy rate to the host (δ)
measured, and plans then count staging. Runs where CUDA is available; elsewhere skipped
with that reason. The staging arithmetic is checked on the CPU in
tests/test_planner_simulate.py."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipesgd.pipeline import models
from pipesgd.pipeline.auto_plan import measured_topology
from pipesgd.planner import choose, profile_layer_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


def test_plans_for_gpu_workers_are_profiled_and_staged_on_the_gpu() -> None:
    spec = models.MODELS["mlp"]()
    prof = profile_layer_model(spec, "mlp", 32, device="cuda")
    assert "profiled on cuda" in prof.source
    assert all(lp.forward_s > 0 and lp.backward_s > 0 for lp in prof.layers)

    topo, _, net = measured_topology(MPI.COMM_WORLD, torch.device("cuda"))
    assert net.device_copy_s_per_byte > 0
    assert topo.device_copy_s_per_byte == net.device_copy_s_per_byte
    choice = choose(prof, topo, batch_size=32)
    assert choice.best.samples_per_s > 0
