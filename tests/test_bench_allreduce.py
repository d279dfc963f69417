"""bench/allreduce.py runs end to end under mpirun (a small size, pipesgd against MPI),
and refuses to judge a single rank."""

from __future__ import annotations

import json
import subprocess
import sys

from mpirun import ROOT, run_mpi

BENCH = ROOT / "bench" / "allreduce.py"


def test_one_rank_is_refused_with_what_to_run_instead() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--sizes", "64KiB"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mpirun -n 2" in proc.stderr


def test_two_ranks_time_pipesgd_and_mpi_and_write_their_json() -> None:
    out = run_mpi(2, BENCH, "--sizes", "64KiB", "--repeat", "3", "--warmup", "1",
                  "--impl", "pipesgd,mpi", "--tag", "test", timeout=120).stdout
    assert "pipesgd" in out and "mpi" in out, out
    written = json.loads((ROOT / "bench" / "results" / "allreduce_p2_test.json").read_text())
    rows = written["records"]
    assert written["p"] == 2 and {r["impl"] for r in rows} == {"pipesgd", "mpi"}, written
    assert all(r["time_s"] > 0 and r["bytes"] == 64 << 10 for r in rows)
