"""What every fallback test checks of the engine's result (imported by the scripts)."""

import numpy as np


def check_sum_matches_mpi(comm, engine, x: np.ndarray) -> None:
    """Sum `x` over the ranks with `engine`, in place: MPI's own result, to rounding, and
    bitwise equal on every rank."""
    reference = np.empty_like(x)
    comm.Allreduce(x, reference)
    engine.allreduce(x, op="sum", timeout=60)
    np.testing.assert_allclose(x, reference, rtol=1e-5, atol=1e-5)
    assert len(set(comm.allgather(x.tobytes()))) == 1, "ranks differ"
