"""A rank that fails ends the whole `pipesgd` job at once, naming itself: the other ranks,
waiting for it in a collective, would otherwise wait until killed."""

import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

PIPESGD = Path(sys.executable).parent / "pipesgd"

# Builds on rank 0 and fails on rank 1, so rank 0 goes on to its first collective.
MODEL = '''
from mpi4py import MPI
from torch import nn


def build():
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("this model cannot be built on rank 1")
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


@pytest.mark.parametrize("argv", [
    ("train", "--quiet", "--data", "digits", "--steps", "2"),
    ("pipeline", "--input-shape", "64", "--steps", "2"),
])
def test_a_failing_rank_aborts_the_job(tmp_path: Path, argv: tuple[str, ...]) -> None:
    model = tmp_path / "one_rank_fails.py"
    model.write_text(MODEL)
    proc = run_mpi(2, PIPESGD, *argv, "--model", f"{model}:build", python=False,
                   timeout=90, expect_success=False)
    assert proc.returncode != 0, proc.stdout
    assert (f"pipesgd {argv[0]}: rank 1: RuntimeError: this model cannot be built on "
            "rank 1 (aborting the job") in proc.stdout, proc.stdout
