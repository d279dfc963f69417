"""The pipeline runtime under real mpirun (scripts in tests/mpi/pipeline_*.py)."""

import json
import sys

import pytest
from mpirun import ROOT, mpi_env, mpirun_command, run_mpi


def engine_available() -> bool:
    try:
        import pipesgd

        return hasattr(pipesgd, "Engine")
    except ImportError:
        return False


def test_gpipe_and_1f1b_match_single_process_references():
    out = run_mpi(3, "pipeline_equivalence.py", timeout=120).stdout
    for name in ("gpipe", "1f1b weight stashing", "1f1b vertical sync"):
        assert f"{name}: max |pipeline - reference|" in out, out
    assert "stashed versions measured [3, 2, 1] implied [3, 2, 1]" in out, out
    assert "1f1b per-stage in flight [2, 2, 1]: max |pipeline - reference|" in out, out
    for name in ("gpipe", "1f1b"):
        assert f"{name} with recomputation: max |pipeline - reference|" in out, out
    assert "per-stage in flight [2, 2, 1]: stashed versions measured [2, 2, 1]" in out, out


@pytest.mark.skipif(not engine_available(), reason="pipesgd engine not built (make build)")
def test_replicated_stage_2_1_bitwise_identical():
    out = run_mpi(3, "pipeline_replicas.py", timeout=120).stdout
    assert "replicas bitwise identical" in out and "reference" in out, out


@pytest.mark.skipif(not engine_available(), reason="pipesgd engine not built (make build)")
def test_payloads_cut_into_pieces_train_bitwise_as_whole_messages():
    out = run_mpi(3, "pipeline_pieces.py", timeout=120).stdout
    for name in ("1f1b 1-1-1", "1f1b 1-1-1 staged", "1f1b-rr 1-2", "1f1b-rr 1-2 staged"):
        assert f"{name}: pieces [" in out and "cut == whole" in out, out
    assert "separate nodes, receiver pulls: whole messages" in out, out


@pytest.mark.skipif(not engine_available(), reason="pipesgd engine not built (make build)")
def test_host_staging_leaves_training_bitwise_unchanged_and_orders_sends():
    out = run_mpi(4, "pipeline_staging.py", timeout=120).stdout
    for name in ("1f1b 1-1-1-1", "gpipe 2-1-1", "1f1b-rr 2-2 K=2 quant8", "async 1-1-1-1"):
        assert f"{name}: staged == plain" in out, out
    assert "deferred sends: posted in order once copied" in out and "OK" in out, out


def test_shape_mismatch_raises_on_both_sides():
    out = run_mpi(2, "pipeline_mismatch.py", timeout=60).stdout
    assert "rank 0 raised StageMismatchError" in out, out
    assert "rank 1 raised StageMismatchError" in out, out


def test_resume_is_bitwise_and_checkpoints_repartition(tmp_path):
    out = run_mpi(2, "pipeline_resume.py", str(tmp_path), timeout=120).stdout
    assert "bitwise identical continuation" in out and "re-partitioned load" in out, out


def test_cli_writes_json_timeline_and_checkpoint(tmp_path):
    import subprocess

    cmd = [*mpirun_command(2), sys.executable, "-m", "pipesgd.cli", "pipeline",
           "--model", "mlp", "--schedule", "1f1b", "--epochs", "2", "--steps", "6",
           "--micro-batch", "8", "--batch-size", "16", "--json", str(tmp_path / "r.json"),
           "--timeline", str(tmp_path / "tl"), "--save", str(tmp_path / "ck"),
           "--momentum", "0.9", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["throughput_samples_per_s"] > 0
    assert len(report["stage_utilisation"]) == 2 and len(report["peak_rss_mb"]) == 2
    assert report["peak_versions"] == [2, 1]
    # the 64-500-500-10 MLP's parameters, split over the stages; SGD's momentum as large
    mlp_floats = 64 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10
    assert sum(report["weight_mb"]) == pytest.approx(4 * mlp_floats / 2**20)
    assert report["optimizer_state_mb"] == pytest.approx(report["weight_mb"])
    assert (tmp_path / "tl" / "timeline.png").stat().st_size > 0
    trace = json.loads((tmp_path / "tl" / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"0F0", "0B0", "1F0", "1B0", "0SF0", "1RF0"} <= names
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["epochs_done"] == 2
    assert "epoch 1: loss" in proc.stdout


def test_cli_pipelines_a_model_named_by_module_and_function(tmp_path):
    import subprocess

    (tmp_path / "user_models.py").write_text(
        "from torch import nn\n"
        "def mlp():\n"
        "    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(),\n"
        "                         nn.Linear(32, 10))\n")
    cmd = [*mpirun_command(2), sys.executable, "-m", "pipesgd.cli", "pipeline",
           "--model", f"{tmp_path / 'user_models.py'}:mlp", "--input-shape", "64",
           "--data", "digits", "--epochs", "1", "--steps", "6", "--micro-batch", "8",
           "--json", str(tmp_path / "r.json"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["throughput_samples_per_s"] > 0 and len(report["stage_utilisation"]) == 2
    missing = subprocess.run([*cmd[:cmd.index("--input-shape")], "--epochs", "1"],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                             timeout=120)
    assert missing.returncode != 0 and "needs --input-shape" in missing.stdout + missing.stderr
    # the digits fit 64 features or an image input, not this one
    wrong = subprocess.run([*cmd[:cmd.index("--input-shape")], "--input-shape", "32",
                            "--data", "digits", "--epochs", "1"],
                           capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                           timeout=120)
    assert wrong.returncode != 0
    assert "--data digits: 64 features or images" in wrong.stdout + wrong.stderr


def test_cli_stops_with_a_clear_error_when_the_loss_diverges(tmp_path):
    import subprocess

    # A learning rate far too large: the loss overflows within the epoch.
    cmd = [*mpirun_command(2), sys.executable, "-m", "pipesgd.cli", "pipeline",
           "--model", "mlp", "--epochs", "3", "--steps", "20", "--micro-batch", "8",
           "--lr", "1e4", "--save", str(tmp_path / "ck"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "diverged at --lr 10000" in out and "epoch 0" in out, out
    assert "epoch 1" not in out, "every rank stops after the first diverged epoch"
    assert not (tmp_path / "ck").exists(), "a diverged epoch is not checkpointed"


@pytest.mark.parametrize("plan_text,message", [
    ('{"stages": [{"layers": [0, 3]}, {"layers": [3, 4]}]}',
     "the plan covers layers [0, 4) but the model has 5 layers"),
    ('{"stages": [{"layers": [0, 5]}]}',
     "the plan places 1 stage replicas but 2 ranks run; run `mpirun -n 1 ...`"),
    ('{"stages": [', "not JSON"),
])
def test_cli_refuses_a_plan_that_does_not_fit_on_every_rank(tmp_path, plan_text, message):
    import subprocess

    path = tmp_path / "plan.json"
    path.write_text(plan_text)
    cmd = [*mpirun_command(2), sys.executable, "-m", "pipesgd.cli", "pipeline",
           "--model", "mlp", "--plan", str(path), "--steps", "2", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # one line per rank naming the problem, no traceback, no abort of the job
    assert out.count("pipesgd pipeline: ") == 2 and message in out, out
    assert "Traceback" not in out and "MPI_ABORT" not in out, out


def test_cli_learning_rate_defaults_per_model():
    import argparse

    from pipesgd.pipeline.cli import DEFAULT_LR, diverged, learning_rate

    assert learning_rate(argparse.Namespace(lr=None, model="mlp")) == DEFAULT_LR["mlp"]
    assert learning_rate(argparse.Namespace(lr=None, model="cnn")) == DEFAULT_LR["cnn"]
    assert learning_rate(argparse.Namespace(lr=None, model="m.py:f")) == DEFAULT_LR["cnn"]
    assert learning_rate(argparse.Namespace(lr=0.3, model="cnn")) == 0.3
    assert diverged(2.3, 0, 0.05) is None
    assert "lower it (say --lr 0.01)" in diverged(float("nan"), 4, 0.05)
    assert "became inf in epoch 2" in diverged(float("inf"), 2, 0.05)


def test_async_pipemare_diverges_where_lemma1_says_and_t1_rescues_it(tmp_path):
    out = run_mpi(4, "pipeline_async.py", str(tmp_path / "ck"), timeout=240).stdout
    assert "(async + T1)" in out and "weight sets held per stage" in out, out
    assert "bitwise equal to the uninterrupted run" in out, out


def test_cli_runs_async_with_t1_t2_and_a_synchronous_warmup(tmp_path):
    import subprocess

    base = [*mpirun_command(3), sys.executable, "-m", "pipesgd.cli", "pipeline",
            "--model", "mlp", "--steps", "12", "--micro-batch", "8", "--no-progress"]
    cmd = [*base, "--schedule", "async", "--t1", "100", "--t2", "0.1", "--recompute", "0",
           "--sync-warmup-epochs", "1", "--epochs", "2", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([*cmd, "--save", str(tmp_path / "ck")], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["plan"]["schedule"] == "async"
    assert report["delays"] == [[2, 0], [1, 0], [0, 0]]
    assert report["epochs"][0]["peak_versions"] == [3, 2, 1]  # the warm-up epoch stashes
    assert report["peak_versions"] == [1, 1, 1]  # then one copy of the weights
    # resumed after the warm-up, the run stays asynchronous
    resumed = subprocess.run([*cmd[:cmd.index("--epochs")], "--epochs", "1", "--resume",
                              str(tmp_path / "ck"), "--json", str(tmp_path / "r2.json")],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((tmp_path / "r2.json").read_text())["peak_versions"] == [1, 1, 1]


def _middle_stage_faults(env: dict[str, str] | None = None) -> tuple[float, str]:
    out = run_mpi(3, "pipeline_page_faults.py", timeout=180, env=env).stdout
    line = next(x for x in out.splitlines() if x.startswith("middle stage:"))
    return float(line.split()[2]), line.split("malloc: ")[1].rstrip(")")


def test_a_middle_stage_reuses_its_freed_memory():
    faults, malloc = _middle_stage_faults()
    if malloc == "not glibc":
        pytest.skip("this C library's malloc is not glibc's")
    assert malloc == "set"
    # Its activations, their gradients and saved tensors are hundreds of pages a
    # micro-batch: returned to the kernel, each would fault again on every step (below:
    # thousands). Kept, what faults is the rest of the process: 4-34 per micro-batch.
    assert faults < 150, faults
    # The same run with glibc's default thresholds fixed (the user's setting wins):
    # the tensors above 128 KiB are mapped anew at every step.
    faults, malloc = _middle_stage_faults({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert malloc == "user settings"
    assert faults > 300, faults


def test_the_whole_models_run_beside_the_other_ranks():
    out = run_mpi(3, "action_times_beside_others.py", timeout=120).stdout
    assert "beside others on 3 ranks" in out and "mean and None OK" in out, out


def test_a_replicated_round_and_a_data_parallel_iteration_cost_at_least_their_actions():
    out = run_mpi(2, "replicated_round.py", timeout=120).stdout
    assert "replicated round on 2 ranks" in out and "data-parallel iteration" in out \
        and "OK" in out, out
