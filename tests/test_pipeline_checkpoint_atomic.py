"""Checkpoints replace each other atomically: a save that crashes at any point leaves the
previous checkpoint loadable, and a save that succeeds leaves nothing else behind.

One-stage pipelines run in this process (a singleton MPI world); the multi-rank case runs
under mpirun (tests/mpi/pipeline_checkpoint_crash.py).
"""

import os
import subprocess
import sys

import pytest
import torch
from mpirun import ROOT, mpi_env, run_mpi

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, checkpoint, models
from pipesgd.pipeline.data import synthetic

MODEL = models.mlp((6, 8, 3))  # 3 layers


def make_pipe():
    return Pipeline(MODEL, Plan.even(MODEL.num_layers, 1, micro_batch=4), lr=0.1,
                    momentum=0.9, seed=3)


def data():
    x, y = synthetic(32, (6,), 3, seed=1)
    return MicroBatches(x, y, 4, seed=0)


def loaded(directory):
    """(epochs done, layer state) of a fresh pipeline loaded from `directory`."""
    pipe = make_pipe()
    try:
        return checkpoint.load(pipe, directory), pipe.layer_state()
    finally:
        pipe.close()


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"layer {k} differs"


def leftovers(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture
def saved_once(tmp_path):
    """A pipeline one epoch in, saved to tmp_path/ck, then trained one epoch more."""
    pipe = make_pipe()
    stream = data()
    pipe.train_epoch(stream)
    checkpoint.save(pipe, tmp_path / "ck")
    first = pipe.layer_state()
    pipe.train_epoch(stream)
    yield pipe, first
    pipe.close()


def test_a_save_replaces_the_old_checkpoint_and_leaves_no_temporary_files(tmp_path, saved_once):
    pipe, first = saved_once
    assert loaded(tmp_path / "ck")[0] == 1
    checkpoint.save(pipe, tmp_path / "ck")
    epochs, state = loaded(tmp_path / "ck")
    assert epochs == 2
    assert_same(state, pipe.layer_state())
    assert not torch.equal(state["0.weight"], first["0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["layer_0000.pt", "layer_0001.pt", "layer_0002.pt", "manifest.json",
                     "optimizer_0000.pt", "optimizer_0001.pt", "optimizer_0002.pt"]


def test_a_write_failing_after_the_first_file_keeps_the_previous_checkpoint(
        tmp_path, saved_once, monkeypatch):
    pipe, first = saved_once
    written = []
    real = checkpoint._write_file

    def fail_after_first(path, obj):
        if written:
            raise OSError("No space left on device (simulated)")
        written.append(path)
        real(path, obj)

    monkeypatch.setattr(checkpoint, "_write_file", fail_after_first)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(pipe, tmp_path / "ck")
    monkeypatch.undo()
    assert len(written) == 1 and written[0].parent.name.startswith(".ck.tmp-")
    epochs, state = loaded(tmp_path / "ck")
    assert epochs == 1
    assert_same(state, first)
    assert leftovers(tmp_path) == []  # the failed save removed its temporary directory


def test_a_crash_between_the_two_renames_loads_the_copy_set_aside(
        tmp_path, saved_once, monkeypatch):
    pipe, first = saved_once
    real = os.rename
    renames = []

    def crash_on_second(src, dst):
        if renames:
            raise OSError("killed (simulated)")
        renames.append((src, dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(pipe, tmp_path / "ck")
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists()
    assert [n[:8] for n in leftovers(tmp_path)] == [".ck.old-"]
    epochs, state = loaded(tmp_path / "ck")
    assert epochs == 1
    assert_same(state, first)
    checkpoint.save(pipe, tmp_path / "ck")  # the next save cleans up
    assert loaded(tmp_path / "ck")[0] == 2 and leftovers(tmp_path) == []


# Killed mid-write (no cleanup runs): saves epoch 1, then dies after the first file of
# the epoch-2 save; what it had saved first is kept beside the checkpoint for comparison.
KILLED = """
import os, torch
import test_pipeline_checkpoint_atomic as t
from pipesgd.pipeline import checkpoint
root = {root!r}
pipe = t.make_pipe()
stream = t.data()
pipe.train_epoch(stream)
checkpoint.save(pipe, root + "/ck")
torch.save(pipe.layer_state(), root + "/want.pt")
pipe.train_epoch(stream)
real = checkpoint._write_file
def die_after_first(path, obj):
    real(path, obj)
    os._exit(9)
checkpoint._write_file = die_after_first
checkpoint.save(pipe, root + "/ck")
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    env = mpi_env()
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests")
    proc = subprocess.run([sys.executable, "-c", KILLED.format(root=str(tmp_path))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    stale = leftovers(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".ck.tmp-")
    assert len(list((tmp_path / stale[0]).iterdir())) == 1  # half written
    epochs, state = loaded(tmp_path / "ck")
    assert epochs == 1
    assert_same(state, torch.load(tmp_path / "want.pt", weights_only=True))
    pipe = make_pipe()
    try:
        checkpoint.load(pipe, tmp_path / "ck")
        pipe.train_epoch(data())
        checkpoint.save(pipe, tmp_path / "ck")
    finally:
        pipe.close()
    assert loaded(tmp_path / "ck")[0] == 2 and leftovers(tmp_path) == []


def test_a_save_refuses_to_replace_a_directory_holding_other_files(tmp_path, saved_once):
    pipe, _ = saved_once
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint's"):
        checkpoint.save(pipe, tmp_path / "results")
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"
    assert leftovers(tmp_path) == []


def test_ranks_agree_when_one_fails_mid_write(tmp_path):
    out = run_mpi(2, "pipeline_checkpoint_crash.py", str(tmp_path), timeout=60).stdout
    assert "rank 0 raised CheckpointError: checkpoint not saved: rank 1" in out, out
    assert "rank 1 raised OSError" in out, out
    assert "previous checkpoint loads: epochs 1, identical layers" in out, out
    assert "replaced: epochs 2, identical layers, no temporary files" in out, out
