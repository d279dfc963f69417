"""Run a script under a real `mpirun` with a hard time limit, for multi-rank tests.

A deadlock fails the test after `timeout` seconds (the whole process group is
killed) instead of hanging the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "mpi"


def mpirun_command(np: int) -> list[str]:
    bindir = Path(sys.executable).parent
    launcher = shutil.which("mpirun", path=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    if launcher is None:
        raise RuntimeError("mpirun not found: run `make setup` first")
    return [launcher, "--oversubscribe", "-n", str(np)]


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # the scripts import the package, each other and the suite's shared fakes
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(SCRIPTS), str(SCRIPTS.parent), env.get("PYTHONPATH", ""))
        if p
    )
    # One thread per rank: ranks share two cores here.
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def run_mpi(
    np: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    expect_success: bool = True,
    python: bool = True,
    prefix: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `mpirun -n np python script args...` (or a program, with python=False);
    fail with its output if it fails or hangs. `prefix` runs mpirun through another
    command (e.g. one that sets up a mount namespace and then execs its arguments).

    A script expected to succeed runs under `python -m mpi4py`, which aborts the whole
    job when a rank raises: the others, maybe waiting for that rank, end at once with
    its traceback instead of at the time limit. One expected to fail runs plainly, so
    every rank reports its own error."""
    path = Path(script)
    if not path.is_absolute():
        path = SCRIPTS / path
    runner = [sys.executable, "-m", "mpi4py"] if expect_success else [sys.executable]
    program = [*runner, str(path)] if python else [str(path)]
    cmd = [*(prefix or []), *mpirun_command(np), *program, *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpi_env(env),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"mpirun -n {np} {path.name} {' '.join(args)} did not finish within {timeout} s "
            f"(deadlock?)\n--- output ---\n{out}"
        ) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if expect_success and proc.returncode != 0:
        raise AssertionError(
            f"mpirun -n {np} {path.name} {' '.join(args)} exited {proc.returncode}\n"
            f"--- output ---\n{out}"
        )
    return result
