"""Fixtures shared by the single-process tests, and the environment of every test."""

import os

import pytest

# Open MPI's libfabric transport probes for fabric hardware for a second in every
# MPI_Init on a machine without any (the PyPI wheel here); nothing here uses it, and the
# suite starts a few hundred MPI processes. Set before this process imports mpi4py, and
# inherited by every mpirun the tests start.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")

import pipesgd


@pytest.fixture(scope="module")
def engine():
    """A one-rank engine of the test module's own (p = 1 under plain pytest)."""
    e = pipesgd.Engine()
    yield e
    e.shutdown()
