"""pipesgd.local_rank / local_size / device under mpirun (tests/mpi/device_placement.py),
and torch_threads."""

from mpirun import run_mpi


def test_node_local_rank_picks_the_device() -> None:
    out = run_mpi(3, "device_placement.py", timeout=60).stdout
    assert "device_placement: ok on 3 ranks" in out, out


def test_torch_threads_sets_the_count_for_the_block_and_gives_it_back() -> None:
    import pytest
    import torch

    from pipesgd.device import torch_threads

    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), torch_threads(other):
        raise KeyError("the block failed")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
