"""Bad command-line input is refused before anything runs, with a message naming it."""

from __future__ import annotations

import json

import pytest
from cli_in_process import pipesgd

from pipesgd.cli import main
from pipesgd.pipeline.plan import Plan, StagePlan


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--batch-size", "-3"], "argument --batch-size: expected an integer >= 1, got '-3'"),
    (["train", "--batch-size", "x"], "argument --batch-size: expected an integer >= 1, got 'x'"),
    (["pipeline", "--micro-batch", "0"], "argument --micro-batch: expected an integer >= 1"),
    (["pipeline", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
    (["pipeline", "--plan", "no/such/plan.json"], "no plan file 'no/such/plan.json'"),
    (["train", "--staleness", "0"], "argument --staleness: expected an integer >= 1, got '0'"),
    (["train", "--steps", "0"], "argument --steps: expected an integer >= 1"),
    (["pipeline", "--epochs", "0"], "argument --epochs: expected an integer >= 1"),
    (["pipeline", "--schedule", "async", "--t1", "0"], "argument --t1: expected an integer >= 1"),
    (["plan", "--batch-size", "8", "--threads", "-1"], "argument --threads: expected an integer"),
    (["plan", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got '0'"),
    (["plan", "--batch-size", "8", "--workers", "0"], "argument --workers: expected an integer"),
    (["timing", "predict", "--batch-size", "0"], "argument --batch-size: expected an integer"),
    (["timing", "measure", "--repeats", "0"], "argument --repeats: expected an integer >= 1"),
])
def test_bad_arguments_stop_the_command(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_pipemares_options_need_its_schedule():
    res = pipesgd("pipeline", "--model", "mlp", "--steps", "2", "--t1", "100", "--epochs", "1",
                  "--no-progress")
    assert res.returncode != 0 and "use them with --schedule async" in res.stderr


def test_a_plan_file_that_holds_no_plan_names_itself(tmp_path):
    plan = Plan((StagePlan(0, 2), StagePlan(2, 5, 2)), schedule="1f1b-rr", micro_batch=16)
    good = tmp_path / "plan.json"
    plan.save(good)
    assert Plan.load(good) == plan
    not_json = tmp_path / "notes.json"
    not_json.write_text("stages: 0-2, 2-5")
    with pytest.raises(ValueError, match=r"notes\.json: not JSON \(Expecting value at line 1"):
        Plan.load(not_json)
    no_stages = tmp_path / "profile.json"
    no_stages.write_text(json.dumps({"layers": 3}))
    with pytest.raises(ValueError, match=r"profile\.json: not a plan: expected \{\"stages\""):
        Plan.load(no_stages)
    bad_stage = tmp_path / "bad.json"
    bad_stage.write_text(json.dumps({"stages": [{"layers": [0]}]}))
    with pytest.raises(ValueError, match=r"bad\.json: not a plan.*IndexError"):
        Plan.load(bad_stage)
