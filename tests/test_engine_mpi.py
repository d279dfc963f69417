"""Multi-rank engine tests: real mpirun processes with hard time limits."""

import shutil
import subprocess
from pathlib import Path

import pytest
from mpirun import run_mpi


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_allreduce_matches_references(np_: int) -> None:
    run_mpi(np_, "engine_allreduce.py", timeout=240)


def test_allreduce_small_segments_and_nothing_left_in_dev_shm() -> None:
    # 4 KiB segments: many segments per chunk, chunks of unequal segment counts. The
    # shared-memory links' files are gone once the job ends.
    before = {f.name for f in Path("/dev/shm").glob("pipesgd-*")}
    run_mpi(3, "engine_allreduce.py", "4096", timeout=240)
    assert {f.name for f in Path("/dev/shm").glob("pipesgd-*")} == before


@pytest.mark.parametrize("np_", [3, 4])
def test_allreduce_on_the_ring_alone(np_: int) -> None:
    # Small operations too around the ring's links (the board turned off).
    out = run_mpi(np_, "engine_allreduce.py", "ring", timeout=240)
    assert "board=0 ok" in out.stdout


@pytest.mark.parametrize("np_", [2, 3])
def test_allreduce_over_mpi_messages(np_: int) -> None:
    # The path a ring takes across nodes (and when shared memory is refused): MPI messages.
    run_mpi(np_, "engine_allreduce.py", timeout=240, env={"PIPESGD_SHM_LINKS": "0"})


@pytest.mark.parametrize("np_", [2, 3])
def test_operations_on_the_callers_arrays_keep_the_fastest_path(np_: int) -> None:
    out = run_mpi(np_, "path_tuning.py", "tuned", timeout=240)
    assert "path_tuning tuned" in out.stdout


def test_shm_links_1_keeps_every_size_on_the_links() -> None:
    run_mpi(2, "path_tuning.py", "fixed", timeout=240, env={"PIPESGD_SHM_LINKS": "1"})


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_shared_buffers_reduce_in_place(np_: int) -> None:
    out = run_mpi(np_, "engine_shared_buffers.py", timeout=240)
    assert f"p={np_} shared={np_ > 1} leftover=[] ok" in out.stdout


def test_shared_buffers_are_ordinary_without_shared_memory() -> None:
    out = run_mpi(2, "engine_shared_buffers.py", timeout=240, env={"PIPESGD_SHM_LINKS": "0"})
    assert "p=2 shared=False leftover=[] ok" in out.stdout


@pytest.mark.parametrize(
    "scenario",
    ["mismatch-count", "mismatch-blocking", "mismatch-dtype", "mismatch-ring",
     "mismatch-board-ring", "mismatch-shared", "missing-peer", "drop-buffers", "shutdown-inflight",
     "blocking-order", "shutdown-aborts-blocking"],
)
@pytest.mark.parametrize("np_", [2, 3])
def test_faults(scenario: str, np_: int) -> None:
    run_mpi(np_, "engine_faults.py", scenario, timeout=90)


def test_stall_warning_names_the_operation_and_rank() -> None:
    out = run_mpi(
        2, "engine_faults.py", "missing-peer", timeout=90, env={"PIPESGD_STALL_SECONDS": "0.5"}
    ).stdout
    assert "allreduce #0" in out and "has waited" in out and "for rank" in out, out


def test_thread_level_below_multiple_is_refused() -> None:
    assert "ok" in run_mpi(1, "engine_thread_level.py", timeout=60).stdout


def with_dev_shm_of(size: str) -> list[str]:
    """A prefix that runs mpirun in a mount namespace of its own with a /dev/shm of
    `size` (tmpfs syntax); skips the test where that is not allowed."""
    if shutil.which("unshare") is None or subprocess.run(
        ["unshare", "-m", "true"], capture_output=True, check=False
    ).returncode != 0:
        pytest.skip("needs unshare -m (root) to give the ranks a small /dev/shm")
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh"]


def test_a_full_dev_shm_falls_back_to_mpi_messages() -> None:
    # /dev/shm of 900 KiB: the inboxes (1 MiB) do not fit.
    out = run_mpi(2, "shm_fallback.py", timeout=120, prefix=with_dev_shm_of("900k")).stdout
    assert "shm_fallback: ok" in out, out
    assert "no shared-memory links (posix_fallocate" in out, out


def test_a_shared_buffer_too_large_for_dev_shm_falls_back_to_an_ordinary_array() -> None:
    # /dev/shm of 6 MiB: the links fit, two parts of 4 MiB do not.
    out = run_mpi(2, "shared_buffer_fallback.py", timeout=120,
                  prefix=with_dev_shm_of("6m")).stdout
    assert "shared_buffer_fallback: ok" in out, out
    assert "no shared buffer of 4194304 bytes (posix_fallocate" in out, out


def test_a_rank_waiting_on_a_link_gives_its_cpu_away() -> None:
    out = run_mpi(2, "link_waiting.py", timeout=120).stdout
    assert "link_waiting: ok" in out, out


@pytest.mark.parametrize("scenario", ["order", "abort"])
def test_gated_operation_waits_for_its_buffer(scenario: str) -> None:
    out = run_mpi(3, "engine_gate.py", scenario, timeout=90).stdout
    assert f"engine_gate {scenario}: ok on 3 ranks" in out, out
