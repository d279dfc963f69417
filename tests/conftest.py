"""Fixtures shared by the single-process tests."""

import pytest

import pipesgd


@pytest.fixture(scope="module")
def engine():
    """A one-rank engine of the test module's own (p = 1 under plain pytest)."""
    e = pipesgd.Engine()
    yield e
    e.shutdown()
