"""MadPipe's plans keep to their memory budget in a real run, not only in the simulation
(tests/mpi/planner_memory_run.py, under mpirun)."""

import re

from mpirun import run_mpi


def test_madpipe_plan_holds_no_more_than_its_budget_when_run():
    out = run_mpi(3, "planner_memory_run.py", timeout=120).stdout
    ran = re.findall(r"^rank (\d) stage (\d): held ([\d.]+) MB, simulated ([\d.]+) MB", out,
                     re.M)
    assert len(ran) >= 2, out  # a pipeline, not one worker
    assert len(re.findall(r"within the budget and the simulation", out)) == len(ran), out
