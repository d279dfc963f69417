"""End-to-end compressed allreduce under mpirun, p = 1..4 (bounds in the script)."""

import pytest
from mpirun import run_mpi


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_compressed_allreduce_within_bounds(np_: int) -> None:
    run_mpi(np_, "compressed_allreduce.py", "4096", timeout=240)


def test_compressed_allreduce_default_segments() -> None:
    run_mpi(3, "compressed_allreduce.py", "262144", timeout=240)
