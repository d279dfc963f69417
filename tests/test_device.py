"""pipesgd.local_rank / local_size / device under mpirun (tests/mpi/device_placement.py)."""

from mpirun import run_mpi


def test_node_local_rank_picks_the_device() -> None:
    out = run_mpi(3, "device_placement.py", timeout=60).stdout
    assert "device_placement: ok on 3 ranks" in out, out
