"""Replicas of a stage start from its first replica's parameters and buffers, however
each rank built them (tests/mpi/pipeline_replica_broadcast.py, under mpirun)."""

import pytest
from mpirun import run_mpi


def engine_available() -> bool:
    try:
        import pipesgd

        return hasattr(pipesgd, "Engine")
    except ImportError:
        return False


@pytest.mark.skipif(not engine_available(), reason="pipesgd engine not built (make build)")
def test_replicas_built_differently_train_like_replicas_built_alike():
    out = run_mpi(3, "pipeline_replica_broadcast.py", timeout=60).stdout
    assert "stage 0 replicas bitwise identical" in out, out
    assert "run with other weights on rank 1 == run with the same weights, bitwise" in out, out
    assert "rank 0 raised ValueError" in out and "rank 1 raised ValueError" in out, out
