"""`pipesgd pipeline --plan auto --device cuda` on two ranks: the network and the copy
rate to the host (δ) measured, the profile taken on the GPU, and the plan rank 0 chose run
by every rank on its GPU. Runs where CUDA is available; elsewhere skipped with that reason.
The same command on the CPU: tests/test_pipeline_auto_plan.py."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from mpirun import run_mpi

from pipesgd.planner import HierarchicalTopology, ModelProfile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


def test_auto_plan_on_the_gpu_is_profiled_there_and_counts_staging(tmp_path) -> None:
    report_path = tmp_path / "r.json"
    out = run_mpi(2, sys.executable, "-m", "pipesgd.cli", "pipeline", "--model", "mlp",
                  "--data", "digits", "--plan", "auto", "--device", "cuda", "--epochs", "1",
                  "--steps", "10", "--no-progress", "--json", str(report_path),
                  python=False, timeout=180).stdout
    ran = dict(re.findall(r"^rank (\d+): (\w+ plan: .*)$", out, re.M))
    assert sorted(ran) == ["0", "1"] and ran["0"] == ran["1"], out
    report = json.loads(report_path.read_text())
    auto = report["auto_plan"]
    assert auto["network"].startswith("measured on 2 ranks"), auto["network"]
    assert "profiled on cuda" in ModelProfile.from_dict(auto["profile"]).source
    assert HierarchicalTopology.from_dict(auto["topology"]).device_copy_s_per_byte > 0
    assert auto["measured_samples_per_s"] == report["throughput_samples_per_s"] > 0
