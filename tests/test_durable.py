"""pipesgd.durable: a replaced file is the old one or the new one, whole, and no
temporary file is left behind."""

import threading

import pytest
import torch

from pipesgd.durable import replace_file


def test_replace_file_swaps_whole_files_and_a_failed_write_keeps_the_old(tmp_path):
    path = tmp_path / "ckpt.pt"
    replace_file(path, {"step": 1, "w": torch.ones(3)})
    replace_file(path, {"step": 2, "w": torch.zeros(3)})
    assert torch.load(path)["step"] == 2
    with pytest.raises(TypeError):
        replace_file(path, {"step": 3, "lock": threading.Lock()})  # cannot be pickled
    assert torch.load(path)["step"] == 2
    replace_file(path, "text\n")
    assert path.read_text() == "text\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
