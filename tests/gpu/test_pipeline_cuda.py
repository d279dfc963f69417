"""The pipeline with every stage on the GPU (tests/mpi/pipeline_staging.py cuda): trains
as on the CPU, replicas bitwise equal, and a send returns while the GPU is busy. Runs
where CUDA is available; elsewhere skipped with that reason. The same staging path runs
on the CPU in tests/test_pipeline_mpi.py."""

from __future__ import annotations

import pytest
import torch
from mpirun import run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")


def test_stages_on_the_gpu_train_as_on_the_cpu_and_sends_do_not_wait() -> None:
    out = run_mpi(4, "pipeline_staging.py", "cuda", timeout=240).stdout
    for name in ("1f1b 1-1-1-1", "gpipe 2-1-1", "1f1b-rr 2-2 K=2 quant8", "async 1-1-1-1"):
        assert f"{name}: cuda == cpu" in out, out
    assert "with the GPU busy" in out and "OK" in out, out
