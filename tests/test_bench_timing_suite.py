"""bench/timing_suite.py's scenario sets: what `--held-out`, `--seen` and `--scenarios`
select, and a clear error for a name it does not know."""

from __future__ import annotations

import argparse

import pytest
from bench_scripts import load_bench

suite = load_bench("timing_suite")


def args(**kw) -> argparse.Namespace:
    base = dict(scenarios=None, held_out=False, seen=False, no_netem=False, rates="1gbit",
                bursts="0", ps="2", models="mlp", bucket_mb=25.0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_held_out_and_seen_scenarios_are_apart_and_named_once() -> None:
    held = [s.name for s in suite.HELD_OUT]
    seen = [s.name for s in suite.SEEN]
    assert len(set(held + seen)) == len(held) + len(seen)
    # held-out scenarios are off the grid: none is a grid scenario
    grid = {s.name for s in suite.grid(args(rates="1gbit,200mbit", bursts="0,128KiB,1MiB",
                                            ps="2,4", models="mlp,cnn"))}
    assert not grid & set(held)
    assert suite.grid(args(held_out=True)) == list(suite.HELD_OUT)
    assert suite.grid(args(seen=True)) == list(suite.SEEN)


def test_scenarios_pick_held_out_or_seen_ones_by_name_in_the_order_given() -> None:
    first, last = suite.SEEN[0], suite.HELD_OUT[-1]
    assert suite.grid(args(scenarios=f"{last.name},{first.name}")) == [last, first]


def test_an_unknown_scenario_name_is_refused_with_the_names_known() -> None:
    with pytest.raises(SystemExit, match=r"--scenarios: unknown 9gbit-p2-mlp; held out and "
                                         r"seen: .*" + suite.HELD_OUT[0].name):
        suite.grid(args(scenarios=f"{suite.HELD_OUT[0].name},9gbit-p2-mlp"))


def run(k: int, mode: str, measured: float, confirmed: float | None = None) -> dict:
    return {"staleness": k, "compression": mode, "overlap": "sequential",
            "measured_s": measured, "confirmed_s": confirmed}


def test_the_pick_is_judged_on_the_confirmation_rounds_of_the_contenders() -> None:
    # over every round D-Sync+Q read 8 % slower than Pipe-SGD+Q; timed again, alone,
    # 2 % slower: the fresh rounds decide
    runs = [run(1, "quant8", 1.08, 1.02), run(2, "quant8", 1.00, 1.00),
            run(2, "none", 3.0)]
    assert suite.pick_ratio(runs, (1, "quant8", "sequential")) == pytest.approx(1.02)
    assert suite.pick_ratio(runs, (2, "quant8", "sequential")) == pytest.approx(1.0)


def test_a_pick_that_was_no_contender_is_judged_on_every_round() -> None:
    runs = [run(1, "quant8", 1.0, 1.0), run(2, "quant8", 1.03, 1.01), run(2, "none", 3.0)]
    assert suite.pick_ratio(runs, (2, "none", "sequential")) == pytest.approx(3.0)


def test_confirmation_windows_last_half_a_second_or_the_pace_s_steps() -> None:
    assert suite.window_steps(10, 0.005) == 100  # the MLP: 100 steps of 5 ms
    assert suite.window_steps(2, 0.05) == 10  # the CIFAR100 CNN: several turns of K = 2
    assert suite.window_steps(2, 0.8) == 2  # a slow CNN keeps its pace's steps
    assert suite.window_steps(2, 0.0) == 2


def test_a_window_is_one_round_s_timed_steps():
    # two rounds of three steps: Pipe-SGD's alternating short and long steps average out
    assert suite.window_means([0.03, 0.06, 0.03, 0.06, 0.03, 0.06], 3) == \
        pytest.approx([0.04, 0.05])


def test_runs_from_before_confirmation_are_judged_on_their_medians() -> None:
    runs = [{k: v for k, v in run(1, "quant8", 1.06).items() if k != "confirmed_s"},
            {k: v for k, v in run(2, "quant8", 1.0).items() if k != "confirmed_s"}]
    assert suite.pick_ratio(runs, (1, "quant8", "sequential")) == pytest.approx(1.06)
