"""`pipesgd pipeline --plan auto` under real mpirun: rank 0 chooses, every rank runs it."""

import dataclasses
import json
import re
import sys

import pytest
from mpirun import run_mpi

from pipesgd.pipeline.plan import Plan
from pipesgd.planner import (
    HierarchicalTopology,
    ModelProfile,
    choose,
    fit_pipeline_overhead,
    fit_replica_overhead,
)
from pipesgd.planner.profile import scaled_compute

RUN = ("-m", "pipesgd.cli", "pipeline", "--model", "mlp", "--data", "digits", "--plan", "auto",
       "--epochs", "1", "--steps", "10", "--no-progress")


def pipeline(*args: str, expect_success: bool = True):
    return run_mpi(2, sys.executable, *RUN, *args, python=False, timeout=60,
                   expect_success=expect_success)


def plans_run(out: str) -> dict[int, str]:
    """rank -> the plan line it printed before running."""
    return {int(r): plan for r, plan in re.findall(r"^rank (\d+): (\w+ plan: .*)$", out, re.M)}


def test_auto_plan_with_bandwidth_runs_the_plan_choose_gives(tmp_path):
    out = pipeline("--bandwidth", "1Gbit", "--json", str(tmp_path / "r.json")).stdout
    assert " #  candidate" in out and "choice: " in out, out
    ran = plans_run(out)
    assert sorted(ran) == [0, 1] and ran[0] == ran[1], out
    report = json.loads((tmp_path / "r.json").read_text())
    auto = report["auto_plan"]
    assert auto["predicted_samples_per_s"] > 0 and auto["measured_samples_per_s"] > 0
    assert auto["measured_samples_per_s"] == report["throughput_samples_per_s"]
    assert auto["network"].startswith("--bandwidth 1Gbit")
    recorded = Plan.from_dict(auto["plan"])
    assert Plan.from_dict(report["plan"]) == recorded
    assert ran[0].startswith(auto["planner"])
    again = choose(ModelProfile.from_dict(auto["profile"]),
                   HierarchicalTopology.from_dict(auto["topology"]), auto["memory_per_worker"],
                   batch_size=auto["batch_size"], micro_batch=auto["micro_batch"],
                   staleness=auto["staleness"])
    assert again.best_pipeline.plan == recorded
    assert again.best_pipeline.family == auto["planner"]
    assert f"predicted {auto['predicted_samples_per_s']:.0f} samples/s" in out


def test_auto_plan_measures_the_network_without_bandwidth(tmp_path):
    out = pipeline("--json", str(tmp_path / "r.json")).stdout
    ran = plans_run(out)
    assert sorted(ran) == [0, 1] and ran[0] == ran[1], out
    auto = json.loads((tmp_path / "r.json").read_text())["auto_plan"]
    assert auto["network"].startswith("measured on 2 ranks"), auto["network"]
    level, = auto["topology"]["levels"]
    assert level["count"] == 2 and level["bandwidth"] > 0
    assert auto["measured_samples_per_s"] > 0
    # the profile carries a real run of the pipeline of one stage per rank the chooser
    # offers, and the charge per micro-batch fitted to it on this topology (first: the
    # replicated round below is simulated with it)
    prof = ModelProfile.from_dict(auto["profile"])
    topo = HierarchicalTopology.from_dict(auto["topology"])
    straight = prof.extra["pipeline_run"]
    plan = Plan.from_dict(straight["plan"])
    assert [s.replicas for s in plan.stages] == [1, 1] and straight["measured_s"] > 0
    # (or, where the run was faster than simulated, the factor its layers were scaled by)
    factor = straight["compute_factor"]
    unfitted = dataclasses.replace(scaled_compute(prof, 1 / factor), stage_excess_s=0.0,
                                   replica_s_per_byte=0.0)
    refit = fit_pipeline_overhead(unfitted, topo, plan, straight["measured_s"])
    assert refit.stage_excess_s == pytest.approx(prof.stage_excess_s, rel=1e-6, abs=1e-12)
    assert refit.extra["pipeline_run"]["compute_factor"] == pytest.approx(factor, rel=1e-6)
    # a real round of the model replicated on both ranks, and its charge
    measured = prof.extra["replica_round"]
    assert measured["replicas"] == 2 and measured["measured_s"] > 0, measured
    refit = fit_replica_overhead(dataclasses.replace(prof, replica_s_per_byte=0.0), topo,
                                 measured["measured_s"], 2)
    assert refit.replica_s_per_byte == prof.replica_s_per_byte
    # and a real run of the data-parallel configuration the timing model ranked first,
    # charged where it took longer than predicted
    run = prof.extra["data_parallel_run"]
    assert run["measured_s"] > 0 and run["batch_size"] == auto["batch_size"], run
    assert (prof.step_excess_s > 0) == (run["measured_s"] > run["predicted_without_s"]), run
    # or, where it ran faster, its layers scaled down (as far as they took alone)
    assert run["compute_factor"] == prof.step_compute_factor <= 1.0, run
    if prof.step_compute_factor < 1.0:
        assert run["measured_s"] < run["predicted_without_s"], run


def test_no_plan_within_memory_exits_2_on_every_rank():
    proc = pipeline("--bandwidth", "1Gbit", "--memory", "1KB", expect_success=False)
    assert proc.returncode == 2, proc.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: error: no plan fits 1 kB per worker; the smallest "
                         r"budget that fits is \d+ bytes", proc.stdout), proc.stdout
    assert "epoch 0" not in proc.stdout


def test_summary_says_when_the_run_changed_the_chosen_plan():
    from pipesgd.pipeline.auto_plan import AutoPlan
    from pipesgd.pipeline.plan import Plan

    chosen = Plan.even(6, 2, micro_batch=8)
    auto = AutoPlan(chosen, "pipedream", 500.0, "pipedream", "", None, {}, {}, "given",
                    None, 8, 8, 1)
    assert auto.summary(450.0, chosen) == \
        "auto plan (pipedream): predicted 500 samples/s, measured 450 samples/s"
    changed = auto.summary(450.0, chosen.replace(schedule="gpipe"))
    assert "the prediction is for" in changed and "gpipe" in changed


def test_auto_plan_on_a_network_file_plans_on_it_instead_of_measuring(tmp_path):
    # as `pipesgd timing measure --json` writes it: 2 ranks on 1 Gbit/s links
    from pipesgd.timing.cluster import describe_cluster

    net = dataclasses.replace(describe_cluster("1Gbit", "50us", cores=2, ranks_per_host=1),
                              measured_p=2)
    path = tmp_path / "net.json"
    net.save(path)
    out = pipeline("--network", str(path), "--json", str(tmp_path / "r.json")).stdout
    ran = plans_run(out)
    assert sorted(ran) == [0, 1] and ran[0] == ran[1], out
    auto = json.loads((tmp_path / "r.json").read_text())["auto_plan"]
    assert auto["network"] == f"--network {path} ({net.source})"
    level, = auto["topology"]["levels"]
    assert level["count"] == 2 and level["bandwidth"] == pytest.approx(1e9 / 8)
    assert level["latency"] == pytest.approx(50e-6)
    # data parallelism was predicted on the file's network and charged its real run
    assert "data_parallel_run" in ModelProfile.from_dict(auto["profile"]).extra
    both = pipeline("--network", str(path), "--bandwidth", "1Gbit", expect_success=False)
    assert both.returncode == 2 and "give one of --topology, --bandwidth and --network" \
        in both.stdout + both.stderr, both.stdout


def test_cluster_options_without_plan_auto_are_refused():
    import argparse

    from pipesgd.pipeline import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="--bandwidth and --memory describe the job for "
                                         "--plan auto"):
        cli.run(parser.parse_args(["--bandwidth", "1Gbit", "--memory", "1GB"]))


def test_runs_in_turn_sample_the_same_spells_and_close_last_first():
    from pipesgd.pipeline.runtime import medians_in_turn

    order, closed = [], []

    def run(name, values):
        try:
            for v in values:
                order.append(name)
                yield v
        finally:
            closed.append(name)

    medians = medians_in_turn([run("a", [1.0, 9.0, 3.0, 2.0]),
                               run("b", [5.0, 6.0, 7.0, 100.0]),
                               run("c", [4.0, 4.0, 4.0, 4.0])])
    assert medians == [2.5, 6.5, 4.0]
    # each turn starts one run later: no run always samples first, after the same one
    assert order == list("abc" "bca" "cab" "abc")
    assert closed == ["c", "b", "a"]


def test_a_failing_run_closes_the_runs_it_was_taken_beside():
    from pipesgd.pipeline.runtime import medians_in_turn

    closed = []

    def run(name, fail_at=None):
        try:
            for i in range(10):
                if i == fail_at:
                    raise ValueError(f"{name} failed")
                yield 1.0
        finally:
            closed.append(name)

    with pytest.raises(ValueError, match="b failed"):
        medians_in_turn([run("a"), run("b", fail_at=1), run("c")])
    assert sorted(closed) == ["a", "b", "c"]
