"""A rank that fails ends the whole `pipesgd` job at once, naming itself: the other ranks,
waiting for it in a collective, would otherwise wait until killed. A check of the options
that fails on one rank only stops every rank, with that rank's message."""

import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

from pipesgd.agreement import failure_anywhere

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


# Fails to import on rank 1 only (a package missing on one node): caught by the option
# checks, which every rank makes before any of them goes on.
IMPORT_FAILS = '''
from mpi4py import MPI
from torch import nn

if MPI.COMM_WORLD.Get_rank() == 1:
    raise ImportError("a package this model needs is missing on rank 1's node")


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


def test_a_model_one_rank_cannot_import_stops_every_rank_with_its_message(
        tmp_path: Path) -> None:
    model = tmp_path / "import_fails.py"
    model.write_text(IMPORT_FAILS)
    proc = run_mpi(2, PIPESGD, "train", "--quiet", "--data", "digits", "--steps", "2",
                   "--model", f"{model}:build", python=False, timeout=60,
                   expect_success=False)
    assert proc.returncode == 2, proc.stdout
    assert "pipesgd train: rank 1: " in proc.stdout and "missing on rank 1's node" \
        in proc.stdout, proc.stdout


class Ranks:
    """Rank 0 of a communicator whose other ranks' checks failed with `values` (None:
    passed), this rank's own outcome in place of the first."""

    def __init__(self, values: list[str | None]) -> None:
        self.values = values

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return len(self.values)

    def allgather(self, mine: tuple) -> list[tuple]:
        others = [(None if v is None else ("ValueError", v), None) for v in self.values[1:]]
        return [mine, *others]


def test_failure_anywhere_names_the_first_rank_unless_all_failed_alike() -> None:
    def fails() -> None:
        raise ValueError("no such file")

    assert failure_anywhere(Ranks([None, None]), lambda: None) is None
    assert failure_anywhere(Ranks([None, "no such file", "other"]), lambda: None) == \
        "rank 1: no such file"
    assert failure_anywhere(Ranks(["no such file"] * 3), fails) == "no such file"
    with pytest.raises(KeyError):  # not one of the errors it agrees on: raised here
        failure_anywhere(Ranks([None]), lambda: {}["x"])


def test_data_that_cannot_be_read_stops_every_rank_before_training(tmp_path: Path) -> None:
    """A folder without MNIST's files is refused with the check of the options, so no
    rank trains or prints a traceback."""
    proc = run_mpi(2, PIPESGD, "train", "--quiet", "--data", str(tmp_path), python=False,
                   timeout=90, expect_success=False)
    assert proc.returncode == 2, proc.stdout
    assert f"pipesgd train: {tmp_path} lacks train-images-idx3-ubyte" in proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
