"""Runs one benchmark as N separate `mpirun` jobs and gathers each job's records.

A process can be fast or slow for its whole life (thread placement, how the host
schedules the virtual CPUs, where its pages landed), so a median over repetitions
inside one process hides a bimodal result: only a count over launches shows it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from common import PYTHON_UNDER_MPI, mpi_env, mpirun


def run_launches(script: Path, np_: int, launches: int, script_args: list[str],
                 timeout_s: float = 600) -> list[list[dict[str, Any]]]:
    """Runs `mpirun -n np_ python script script_args --record FILE` `launches` times,
    one after the other, and returns each launch's records (the list the script wrote).

    Raises SystemExit naming the launch when one fails or outlives `timeout_s`.
    """
    env = mpi_env()
    out: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="pipesgd-launches-") as tmp:
        for k in range(launches):
            record = Path(tmp) / f"launch{k}.json"
            cmd = [mpirun(), "--oversubscribe", "-n", str(np_), *PYTHON_UNDER_MPI, str(script),
                   *script_args, "--record", str(record)]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired as exc:
                raise SystemExit(f"launch {k + 1} of {launches} (p = {np_}) ran past "
                                 f"{timeout_s:.0f} s: {' '.join(cmd)}") from exc
            if proc.returncode != 0 or not record.exists():
                raise SystemExit(f"launch {k + 1} of {launches} (p = {np_}) failed "
                                 f"(exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            out.append(json.loads(record.read_text()))
            print(f"  launch {k + 1}/{launches} (p = {np_}) done", flush=True)
    return out
