"""Build the C++ core with AddressSanitizer and UBSan and run its self-tests:
the compression kernels alone, and the engine's ring under mpirun."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, mpi_env, run_mpi

BUILD = ROOT / "build" / "sanitize"


@pytest.fixture(scope="module")
def sanitized_build() -> Path:
    env = mpi_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    cmake = shutil.which("cmake", path=env["PATH"])
    assert cmake, "cmake not found: run `make setup`"
    subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(BUILD),
            "-DPIPESGD_SANITIZE=ON",
            "-DPIPESGD_BUILD_PYTHON=OFF",
            "-DCMAKE_BUILD_TYPE=Debug",
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = subprocess.run(
        [cmake, "--build", str(BUILD), "-j", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return BUILD


SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1"}


def run_selftest(build: Path, name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the single-process self-test `name` of the sanitized build."""
    exe = build / name
    if not exe.exists():
        pytest.fail(f"{name} was not built")
    return subprocess.run(
        [str(exe)], env=mpi_env(SAN_ENV), capture_output=True, text=True, timeout=timeout
    )


def test_kernels_under_sanitizers(sanitized_build: Path) -> None:
    result = run_selftest(sanitized_build, "test_kernels", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_path_tuner_under_sanitizers(sanitized_build: Path) -> None:
    result = run_selftest(sanitized_build, "test_path_tuner", timeout=60)
    assert result.returncode == 0 and "0 failures" in result.stdout, result.stdout + result.stderr


def test_poller_under_sanitizers(sanitized_build: Path) -> None:
    result = run_selftest(sanitized_build, "test_poller", timeout=60)
    assert result.returncode == 0 and "0 failures" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_ring_under_sanitizers(sanitized_build: Path, np_: int) -> None:
    # MPI's own allocations are not ours to judge: leak detection is off.
    out = run_mpi(np_, sanitized_build / "test_ring", timeout=300, env=SAN_ENV, python=False)
    assert f"{np_} ranks, 0 failures" in out.stdout
