"""Published-scale profiles from layer shapes (VGG-16, GNMT-like) against published and
hand-computed counts, MadPipe's plans on them within the budget, and the comparison of
bench/planner_memory.py marking PipeDream's plan infeasible below its memory."""

import math
import sys
from pathlib import Path

import pytest

from pipesgd.planner import ModelProfile, madpipe, pipedream, stage_memory, stored_activations
from pipesgd.planner.published import DEFAULT_FLOPS_PER_S, gnmt, gnmt_shapes, vgg16

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import planner_memory as bench

VGG16_PARAMS = 138_357_544  # torchvision's vgg16, 1000 classes (the "138M" of the paper)


# ----------------------------------------------------------------- VGG-16
def test_vgg16_parameter_bytes_match_published_count():
    prof = vgg16(1)
    assert prof.num_layers == 16
    total = sum(lp.param_bytes for lp in prof.layers)
    assert total == pytest.approx(138e6 * 4, rel=0.01)
    assert total == VGG16_PARAMS * 4


def test_vgg16_forward_flops_at_batch_one():
    prof = vgg16(1)
    flops = sum(lp.forward_s for lp in prof.layers) * DEFAULT_FLOPS_PER_S
    assert flops == pytest.approx(15.5e9, rel=0.05)
    assert sum(prof.extra["forward_flops_per_sample"]) == pytest.approx(flops)


def test_vgg16_scales_with_batch_and_rate():
    one, many = vgg16(1), vgg16(64, flops_per_s=DEFAULT_FLOPS_PER_S / 2)
    for a, b in zip(one.layers, many.layers, strict=True):
        assert b.forward_s == pytest.approx(128 * a.forward_s)
        assert b.backward_s == pytest.approx(2 * b.forward_s)
        assert b.output_bytes == 64 * a.output_bytes
        assert b.saved_bytes == 64 * a.saved_bytes
        assert b.param_bytes == a.param_bytes == b.optimizer_bytes  # SGD momentum: 1 copy
    # conv1 keeps the image and its 64x224x224 output; it sends the same 64x224x224
    assert one.layers[0].saved_bytes == 4 * (3 * 224 * 224 + 64 * 224 * 224)
    assert one.layers[0].output_bytes == 4 * 64 * 224 * 224
    assert one.layers[1].output_bytes == 4 * 64 * 112 * 112  # pooled after conv2
    assert one.layers[-1].output_bytes == 4 * 1000


def test_published_profile_json_round_trip(tmp_path):
    prof = gnmt(8, 20)
    path = tmp_path / "gnmt.json"
    prof.save(path)
    back = ModelProfile.load(path)
    assert back == prof
    assert back.extra["model"] == "gnmt"


# ----------------------------------------------------------------- GNMT-like
def test_gnmt_parameter_count_by_hand():
    h, v = 1024, 32000
    embedding = v * h
    lstm = 4 * h * (h + h) + 2 * 4 * h  # W_ih, W_hh, b_ih, b_hh
    attention = h * h + (2 * h * h + h)  # W_a; W_c [context; h] with bias
    softmax = h * v + v
    expected = embedding + 8 * lstm + attention + softmax
    assert expected == 135_889_152
    prof = gnmt(64, 50)
    assert prof.num_layers == 11
    assert sum(lp.param_bytes for lp in prof.layers) == 4 * expected
    assert sum(s.params for s in gnmt_shapes(50)) == expected
    assert all(lp.optimizer_bytes == 2 * lp.param_bytes for lp in prof.layers)  # Adam


def test_gnmt_sizes_follow_sequence_and_batch():
    a, b = gnmt(16, 25), gnmt(32, 50)
    lstm_a, lstm_b = a.layers[1], b.layers[1]
    assert lstm_b.forward_s == pytest.approx(4 * lstm_a.forward_s)
    assert lstm_b.output_bytes == 4 * lstm_a.output_bytes == 4 * 4 * 16 * 25 * 1024
    assert b.layers[-1].output_bytes == 4 * 32 * 50 * 32000  # the softmax's probabilities


# ----------------------------------------------------------------- MadPipe on them
@pytest.mark.parametrize("make,budgets", [(lambda: vgg16(64), (16e9, 4e9)),
                                           (lambda: gnmt(64, 50), (2e9, 1.3e9))])
def test_madpipe_plans_stay_within_budget(make, budgets):
    prof = make()
    for budget in budgets:
        result = madpipe(prof, "8x[12GB/s]", memory_per_worker=budget, weight_copies=3)
        loads = [sum(lp.compute_s for lp in prof.layers[s.start:s.end])
                 for s in result.stages]
        links = [2 * prof.layers[s.end - 1].output_bytes / 12e9 for s in result.stages[:-1]]
        counts = stored_activations(loads, result.period_s, links)
        assert tuple(counts) == result.in_flight
        for stage, g in zip(result.stages, counts, strict=True):
            assert stage_memory(prof, stage.start, stage.end, g, weight_copies=3) <= budget


# ----------------------------------------------------------------- the comparison
def test_pipedream_without_replicas_is_a_straight_pipeline():
    setting = bench.make_setting("vgg16", "fig7", batch_size=64,
                                 flops_per_s=DEFAULT_FLOPS_PER_S)
    pd = bench.PipeDreamPlan(setting)
    assert len(pd.stages) == 8 and all(s.replicas == 1 for s in pd.stages)
    # the DP's objective, with the real weights left out of it, is the slowest stage/link
    assert pd.period == pytest.approx(pd.result.time_per_minibatch_s)
    assert pd.period == pytest.approx(
        pipedream(bench.no_replicas(setting.profile), "8x[12GB/s]").time_per_minibatch_s)


@pytest.mark.parametrize("label", ["fig7", "cluster"])
def test_comparison_marks_pipedream_infeasible_below_its_memory(label):
    setting = bench.make_setting("vgg16", label, batch_size=64,
                                 flops_per_s=DEFAULT_FLOPS_PER_S)
    pd = bench.PipeDreamPlan(setting)
    above, below = 1.01 * pd.need, 0.9 * pd.need
    high, low = bench.compare(setting, [above, below], pd)
    assert high.pipedream.fits and high.pipedream.samples_per_s > 0
    assert not low.pipedream.fits and low.pipedream.samples_per_s is None
    assert low.pipedream.memory_bytes == pytest.approx(pd.need)
    assert bench.cells(low)["PipeDream samples/s"].startswith("infeasible: needs")
    assert low.madpipe.fits and low.madpipe.memory_bytes <= below
    assert low.madpipe_wins and not low.madpipe_over_budget
    # slowed to fit, the same partition runs again, no faster than as planned
    assert low.slowed.fits and low.slowed.stages == low.pipedream.stages
    assert low.slowed.samples_per_s <= high.pipedream.samples_per_s * (1 + 1e-9)


def test_comparison_below_madpipe_smallest_budget_has_no_plan():
    setting = bench.make_setting("gnmt", "fig7", batch_size=64,
                                 flops_per_s=DEFAULT_FLOPS_PER_S)
    (row,) = bench.compare(setting, [0.5e9])
    assert not row.madpipe.fits and row.madpipe.note == "no plan"
    assert not row.pipedream.fits and not row.slowed.fits
    assert math.isnan(row.madpipe_planned_memory)
    refuted, line, _ = bench.verdict([row])
    assert refuted and "no budget of the fig7 setting where both run" in line
