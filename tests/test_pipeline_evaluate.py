"""Held-out evaluation through the stages equals the whole model's in one process
(tests/mpi/pipeline_evaluate.py, under mpirun)."""

from mpirun import run_mpi


def test_pipeline_evaluation_equals_the_whole_model_in_one_process():
    out = run_mpi(3, "pipeline_evaluate.py", timeout=90).stdout
    for plan in ("2-1", "1-1-1"):
        assert f"{plan}: held-out loss" in out, out
