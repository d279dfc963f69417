"""bench/planner.py's scenarios: which command each name runs, and a clear error for a
name it cannot read (before any launch); the plans it runs: every family's candidate
beside the enumerated cuts."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import load_bench
from mpirun import ROOT

sys.path.insert(0, str(ROOT / "bench"))
planner = load_bench("planner", "bench_planner")

INNER = ["python", "worker.py"]


def test_shared_memory_runs_under_mpirun() -> None:
    cmd = planner.scenario_command("shm-p4", INNER)
    assert cmd[1:4] == ["--oversubscribe", "-n", "4"] and cmd[-2:] == INNER


@pytest.mark.parametrize(("scenario", "netem"), [
    ("1gbit-p3", ["--np", "3", "--rate", "1gbit", "--"]),
    ("500mbit-b256KiB-p3", ["--np", "3", "--rate", "500mbit", "--burst", "256KiB", "--"]),
    ("2gbit-b0-p4", ["--np", "4", "--rate", "2gbit", "--burst", "0", "--"]),
])
def test_links_run_under_the_emulator_with_their_bucket(scenario, netem) -> None:
    cmd = planner.scenario_command(scenario, INNER)
    assert cmd[1].endswith("netem.py") and cmd[2:-2] == netem and cmd[-2:] == INNER


@pytest.mark.parametrize("scenario", ["1gbit", "shm-p", "shm-p1", "-p3", "1gbit-px"])
def test_a_bad_scenario_says_how_to_write_one(scenario) -> None:
    with pytest.raises(ValueError, match="LINK-pRANKS"):
        planner.scenario_command(scenario, INNER)


def test_every_family_the_chooser_ranks_is_run_beside_the_cuts() -> None:
    """A model whose PipeDream plan replicates its one stage on 4 workers (light weights,
    heavy activations): data parallelism, PipeDream's plan and the straight pipeline are
    all measured, each once, and the pick is one of them."""
    from pipesgd.planner import ModelProfile, choose
    from pipesgd.planner.topology import HierarchicalTopology

    prof = ModelProfile.from_columns([1e-3, 3e-3, 1e-3, 2e-3, 1e-3],
                                     [2e-3, 6e-3, 2e-3, 4e-3, 2e-3],
                                     [4e5, 1e5, 3e5, 2e4, 1e3], [1e3] * 5, batch_size=8)
    topo = HierarchicalTopology.parse("4x[1Gbit]")
    kept, pick = planner.select_plans(prof, topo, None, 4, 8, per_shape=1)
    labels = [k["label"] for k in kept]
    assert len(labels) == len(set(labels))
    ranked = choose(prof, topo, batch_size=8).ranked
    assert {c.family for c in ranked} == {"data-parallel", "pipedream", "straight"}
    for candidate in ranked:
        row = planner.candidate_row(candidate)
        assert row["label"] in labels, (row, labels)
    assert any(k.get("data_parallel") for k in kept)
    assert pick["label"] == planner.candidate_row(ranked[0])["label"]
    assert pick["family"] == ranked[0].family


class OneRank:
    """The one collective `side_by_side` calls, on a single rank."""

    def bcast(self, obj, root=0):
        return obj


def test_the_pick_runs_in_turn_with_the_two_fastest_other_plans() -> None:
    plans = [{"label": name, "measured": rate}
             for name, rate in (("a", 90.0), ("b", 120.0), ("pick", 100.0), ("c", 110.0))]
    order = []
    duel = planner.side_by_side(OneRank(), plans, "pick", 4,
                                lambda k: order.append(k["label"]) or len(order))
    assert order == ["pick", "b", "c", "b", "c", "pick", "c", "pick", "b", "pick", "b", "c"]
    assert duel["pick"] == "pick" and list(duel["rounds"]) == ["pick", "b", "c"]
    assert duel["rounds"]["b"] == [2, 4, 9, 11]  # each plan's rate, round by round
    assert planner.side_by_side(OneRank(), plans, "pick", 0, lambda k: 1.0) == {}


def test_the_pick_is_judged_on_per_round_ratios_against_its_closest_rival() -> None:
    """The rounds' medians put `b` 10 % ahead of the pick; side by side, round by round,
    the pick ran 0.98 of `b` (median of 1.0, 0.98, 0.9) and 1.2 of `c`: judged 0.98."""
    m = {"pick": {"label": "pick"},
         "plans": [{"label": "pick", "measured": 100.0}, {"label": "b", "measured": 110.0},
                   {"label": "c", "measured": 105.0}],
         "side_by_side": {"pick": "pick", "rounds": {"pick": [100.0, 98.0, 90.0],
                                                     "b": [100.0, 100.0, 100.0],
                                                     "c": [80.0, 80.0, 80.0]}}}
    ratio, against = planner.pick_ratio(m)
    assert ratio == pytest.approx(0.98) and against.startswith("b, side by side over 3")
    del m["side_by_side"]  # a launch without them: the medians of the rounds
    ratio, against = planner.pick_ratio(m)
    assert ratio == pytest.approx(100 / 110) and against == "b, the rounds' medians"


def test_the_rounds_spread_is_each_plans_fastest_over_its_slowest_round() -> None:
    def plans(*rounds):
        return {"plans": [{"label": str(i), "measured_rounds": r} for i, r in enumerate(rounds)]}

    results = {"shm-p3": {"models": {"mlp": plans([100.0, 80.0, 90.0], [50.0, 50.0])}},
               "shm-p4": {"models": {"cnn": plans([10.0, 20.0, 15.0], [7.0])}}}
    line = planner.rounds_spread(results)
    # spreads 1.25, 1.00 and 2.00 (a plan with one round has none): median 1.25
    assert "median 1.25, largest 2.00 over 3 plans" in line, line
    assert planner.rounds_spread({"shm-p3": {"models": {"mlp": plans([7.0])}}}) == (
        "rounds' spread: one round per plan")


def test_a_round_predicts_every_row_again_as_the_plans_were_selected() -> None:
    """`predict_row` on the same profile gives each kept row's prediction: the
    simulator's for a pipeline, the timing model's for data parallelism."""
    from pipesgd.planner import ModelProfile
    from pipesgd.planner.choose import data_parallel_network
    from pipesgd.planner.topology import HierarchicalTopology

    prof = ModelProfile.from_columns([1e-3, 3e-3, 1e-3, 2e-3, 1e-3],
                                     [2e-3, 6e-3, 2e-3, 4e-3, 2e-3],
                                     [4e5, 1e5, 3e5, 2e4, 1e3], [1e3] * 5, batch_size=8)
    topo = HierarchicalTopology.parse("4x[1Gbit]")
    kept, _ = planner.select_plans(prof, topo, None, 4, 8, per_shape=1)
    assert any("data_parallel" in k for k in kept) and any("plan" in k for k in kept)
    for k in kept:
        again = planner.predict_row(k, prof, topo, data_parallel_network(topo), 4, 8)
        assert again == pytest.approx(k["predicted"], rel=1e-12), k["label"]


def test_a_plans_error_is_the_median_of_its_rounds_ratios() -> None:
    """Where every round predicted again, the median of each round's predicted /
    measured (1.2, 0.9, 1.1 -> +10 %; then 1.5, 0.9, 1.1 -> +10 %); without them, the
    ratio of the rounds' medians. The first calibration's line reads predicted_first."""
    row = {"predicted": 110.0, "measured": 100.0, "predicted_first": 132.0,
           "predicted_rounds": [120.0, 90.0, 110.0], "measured_rounds": [100.0, 100.0, 100.0]}
    assert planner.error(row) == pytest.approx(0.10)
    row["measured_rounds"] = [80.0, 100.0, 100.0]  # 1.5, 0.9, 1.1
    assert planner.error(row) == pytest.approx(0.10)
    assert planner.error({"predicted": 90.0, "measured": 100.0,
                          "measured_rounds": [100.0, 100.0]}) == pytest.approx(-0.10)
    line = planner.first_calibration_line({"shm-p3": {"models": {"mlp": {"plans": [row]}}}})
    assert "median |error| 32.0%, worst 32.0%" in line, line
