"""bench/planner.py's scenarios: which command each name runs, and a clear error for a
name it cannot read (before any launch)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from mpirun import ROOT

sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("bench_planner", ROOT / "bench" / "planner.py")
planner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(planner)

INNER = ["python", "worker.py"]


def test_shared_memory_runs_under_mpirun() -> None:
    cmd = planner.scenario_command("shm-p4", INNER)
    assert cmd[1:4] == ["--oversubscribe", "-n", "4"] and cmd[-2:] == INNER


@pytest.mark.parametrize(("scenario", "netem"), [
    ("1gbit-p3", ["--np", "3", "--rate", "1gbit", "--"]),
    ("500mbit-b256KiB-p3", ["--np", "3", "--rate", "500mbit", "--burst", "256KiB", "--"]),
    ("2gbit-b0-p4", ["--np", "4", "--rate", "2gbit", "--burst", "0", "--"]),
])
def test_links_run_under_the_emulator_with_their_bucket(scenario, netem) -> None:
    cmd = planner.scenario_command(scenario, INNER)
    assert cmd[1].endswith("netem.py") and cmd[2:-2] == netem and cmd[-2:] == INNER


@pytest.mark.parametrize("scenario", ["1gbit", "shm-p", "shm-p1", "-p3", "1gbit-px"])
def test_a_bad_scenario_says_how_to_write_one(scenario) -> None:
    with pytest.raises(ValueError, match="LINK-pRANKS"):
        planner.scenario_command(scenario, INNER)
