"""Multi-rank DistributedOptimizer tests: real mpirun processes with hard time limits."""

from pathlib import Path

import pytest
from mpirun import run_mpi


@pytest.mark.parametrize(
    ("scenarios", "np_"), [("sync ramp", 2), ("delayed", 3), ("bitwise", 4)]
)
def test_matches_single_process_reference(scenarios: str, np_: int) -> None:
    out = run_mpi(np_, "optim_semantics.py", *scenarios.split(), timeout=120).stdout
    for scenario in scenarios.split():
        assert f"optim_semantics {scenario}: ok on {np_} ranks" in out, out


# Adam's round trip runs in-process in test_optim.py; here the SGD + quant8 + warm-up case.
@pytest.mark.parametrize("config", ["sgd-k3"])
def test_resume_is_bitwise_identical(config: str, tmp_path: Path) -> None:
    for phase in ("straight", "first", "second"):
        out = run_mpi(2, "optim_resume.py", config, phase, str(tmp_path), timeout=120).stdout
        assert f"optim_resume {config} {phase}: ok" in out, out


# Scripts that check everything themselves and end with "<script>: ok on <np> ranks":
# errors raised alike on every rank; parameters and optimizer state broadcast; one rank's
# inf under mixed precision skipping the same step everywhere; host staging giving the
# plain path's weights.
@pytest.mark.parametrize(("script", "np_"), [("optim_errors", 3), ("optim_broadcast", 3),
                                             ("optim_amp", 3), ("optim_staging", 2)])
def test_script_passes_on_every_rank(script: str, np_: int) -> None:
    out = run_mpi(np_, f"{script}.py", timeout=120).stdout
    assert f"{script}: ok on {np_} ranks" in out, out
