"""Multi-rank DistributedOptimizer tests: real mpirun processes with hard time limits."""

from pathlib import Path

import pytest
from mpirun import run_mpi


@pytest.mark.parametrize(
    ("scenario", "np_"), [("sync", 2), ("delayed", 3), ("ramp", 2), ("bitwise", 4)]
)
def test_matches_single_process_reference(scenario: str, np_: int) -> None:
    out = run_mpi(np_, "optim_semantics.py", scenario, timeout=120).stdout
    assert f"optim_semantics {scenario}: ok on {np_} ranks" in out, out


# Adam's round trip runs in-process in test_optim.py; here the SGD + quant8 + warm-up case.
@pytest.mark.parametrize("config", ["sgd-k3"])
def test_resume_is_bitwise_identical(config: str, tmp_path: Path) -> None:
    for phase in ("straight", "first", "second"):
        out = run_mpi(2, "optim_resume.py", config, phase, str(tmp_path), timeout=120).stdout
        assert f"optim_resume {config} {phase}: ok" in out, out


def test_errors_across_ranks() -> None:
    out = run_mpi(3, "optim_errors.py", timeout=120).stdout
    assert "optim_errors: ok on 3 ranks" in out, out


def test_broadcast_parameters_and_optimizer_state() -> None:
    out = run_mpi(3, "optim_broadcast.py", timeout=120).stdout
    assert "optim_broadcast: ok on 3 ranks" in out, out


def test_mixed_precision_skips_one_ranks_inf_everywhere() -> None:
    out = run_mpi(3, "optim_amp.py", timeout=120).stdout
    assert "optim_amp: ok on 3 ranks" in out, out


def test_host_staging_gives_the_same_weights() -> None:
    out = run_mpi(2, "optim_staging.py", timeout=120).stdout
    assert "optim_staging: ok on 2 ranks" in out, out
