"""`pipesgd train` end to end under a real mpirun."""

import json
import sys
from pathlib import Path

from mpirun import run_mpi

PIPESGD = Path(sys.executable).parent / "pipesgd"


def train(np_: int, *args: str) -> str:
    return run_mpi(np_, PIPESGD, "train", "--quiet", *args, python=False, timeout=150).stdout


def test_compare_prints_table_and_json(tmp_path: Path) -> None:
    summary = tmp_path / "run.json"
    out = train(2, "--steps", "30", "--compare", "--json", str(summary))
    assert "dsync" in out and "pipesgd+q" in out and "comm wait ms" in out, out
    runs = json.loads(summary.read_text())["runs"]
    assert [r["config"]["name"] for r in runs] == ["dsync", "pipesgd+q"]
    for run in runs:
        for key in ("iteration_time_s", "compute_s", "update_s", "comm_wait_s",
                    "compute_update_s"):
            assert run[key] >= 0, (key, run)
        # compute + update <= the iteration in every iteration, so in the medians too
        assert run["compute_update_s"] <= run["iteration_time_s"], run
        assert 0.5 < run["final_accuracy"] <= 1.0, run
        assert run["history"] and run["history"][-1]["wall_s"] > 0


def test_cnn_backward_overlap_runs(tmp_path: Path) -> None:
    summary = tmp_path / "cnn.json"
    train(2, "--model", "cnn", "--steps", "3", "--batch-size", "8", "--overlap", "backward",
          "--bucket-mb", "4", "--compression", "trunc16", "--json", str(summary))
    result = json.loads(summary.read_text())
    assert result["config"]["model"] == "cnn" and result["iterations"] == 3


def test_resume_from_checkpoint_is_bitwise_identical(tmp_path: Path) -> None:
    common = ("--steps", "20", "--staleness", "3", "--warmup-steps", "8", "--compression",
              "quant8", "--overlap", "backward", "--optimizer", "adam", "--lr", "0.001")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(2, *common, "--checkpoint", str(straight))
    train(2, *common[2:], "--steps", "10", "--checkpoint", str(split))
    summary = tmp_path / "resumed.json"
    train(2, *common, "--checkpoint", str(split), "--resume", "--json", str(summary))
    assert json.loads(summary.read_text())["iterations"] == 10  # continued, not restarted
    run_mpi(1, "train_resume_check.py", str(straight), str(split), timeout=60)


def test_cnn_channels_last_trains_like_nchw(tmp_path: Path) -> None:
    # same data, weights and updates, another memory layout: oneDNN's NHWC convolutions
    # sum in another order, so parameters agree to float32 rounding, not bitwise
    common = ("--model", "cnn", "--steps", "4", "--batch-size", "8", "--lr", "0.01")
    nchw, nhwc = tmp_path / "nchw", tmp_path / "nhwc"
    train(2, *common, "--checkpoint", str(nchw))
    train(2, *common, "--channels-last", "--checkpoint", str(nhwc))
    run_mpi(1, "train_resume_check.py", str(nchw), str(nhwc), "1e-4", timeout=60)


def test_channels_last_needs_image_inputs() -> None:
    out = run_mpi(1, PIPESGD, "train", "--quiet", "--model", "mlp", "--channels-last",
                  "--steps", "1", python=False, timeout=60, expect_success=False).stdout
    assert "channels_last needs image inputs" in out, out
