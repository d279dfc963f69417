"""`bench/train.py --device cuda` on two ranks: DDP over NCCL beside pipesgd, whose runs
report their host staging time. Runs where CUDA is available; elsewhere skipped with
that reason."""

from __future__ import annotations

import json

import pytest
import torch
from mpirun import ROOT, run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")

PIPESGD = ["dsync", "pipesgd", "pipesgd+q"]


def test_the_bench_runs_on_the_gpus_and_reports_staging() -> None:
    # NCCL refuses two ranks on one GPU: ddp-nccl only where each rank has its own
    configs = (["ddp-nccl"] if torch.cuda.device_count() >= 2 else []) + PIPESGD
    tag = "pytest"
    out = run_mpi(2, ROOT / "bench" / "train.py", "--device", "cuda", "--models", "mlp",
                  "--configs", ",".join(configs), "--epochs", "1", "--tag", tag,
                  timeout=240).stdout
    path = ROOT / "bench" / "results" / f"train_p2_cuda_{tag}.json"
    try:
        payload = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
        path.with_suffix(".png").unlink(missing_ok=True)
    staging = {r["config"]["name"]: r["staging_ms"] for r in payload["runs"]}
    assert sorted(staging) == sorted(configs), out
    for name in PIPESGD:
        assert staging[name] > 0, (name, out)
    if "ddp-nccl" in staging:
        assert staging["ddp-nccl"] is None
    assert payload["device"] == "cuda"
