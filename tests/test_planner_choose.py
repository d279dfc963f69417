"""The chooser: ranking consistent with the simulator and the timing model on hand-made
profiles, the memory budget respected (depth lowered, candidates excluded), the error
naming the smallest budget that fits."""

import dataclasses

import pytest

from pipesgd.planner import ModelProfile, choose, fit_data_parallel_overhead, simulate
from pipesgd.planner.choose import (
    TIE,
    at_batch,
    data_parallel_memory,
    data_parallel_network,
    data_parallel_pick,
    data_parallel_profile,
)
from pipesgd.planner.profile import scaled_compute
from pipesgd.planner.topology import HierarchicalTopology
from pipesgd.timing import describe_cluster
from pipesgd.timing.model import Config
from pipesgd.timing.model import choose as choose_data_parallel

MB = 1e6


def heavy_weights():
    """4 layers of 1 + 2 ms at batch 8, 100 MB of weights each, 1 kB outputs, 10 MB saved:
    a data-parallel all-reduce of 400 MB over 1 Gbit/s takes seconds, a pipeline sends
    kilobytes."""
    return ModelProfile.from_columns([1e-3] * 4, [2e-3] * 4, [1e3] * 4, [100 * MB] * 4,
                                     saved_bytes=[10 * MB] * 4, batch_size=8)


def heavy_activations():
    """4 layers of 1 + 2 ms at batch 8, 1 kB of weights, 1 GB outputs: any cut sends 2 GB
    per micro-batch, data parallelism all-reduces 4 kB."""
    return ModelProfile.from_columns([1e-3] * 4, [2e-3] * 4, [1e9] * 4, [1e3] * 4,
                                     batch_size=8)


def by_family(choice):
    return {c.family: c for c in (*choice.ranked, *choice.excluded)}


# ----------------------------------------------------------------- ranking
def test_pipeline_wins_when_weights_are_heavy_and_matches_the_simulator():
    prof = heavy_weights()
    choice = choose(prof, "4x[1Gbit]", batch_size=8)
    assert choice.best.family == "pipedream"
    best = choice.best
    again = simulate(best.plan, prof, "4x[1Gbit]")
    assert best.samples_per_s == pytest.approx(again.samples_per_s)
    assert best.memory_bytes == pytest.approx(again.max_memory_bytes)
    assert [s.replicas for s in best.plan.stages] == [1, 1, 1, 1]
    rates = [c.samples_per_s for c in choice.ranked]
    assert rates == sorted(rates, reverse=True)
    assert "pipedream wins" in choice.explanation and "data-parallel" in choice.explanation


def test_data_parallel_wins_when_activations_are_heavy_and_matches_the_timing_model():
    prof = heavy_activations()
    topo = HierarchicalTopology.parse("4x[1Gbit]")
    choice = choose(prof, topo, batch_size=8)
    assert choice.best.family == "data-parallel"
    # the fastest predicted configuration (the families are ranked by rate)
    ranked = choose_data_parallel(data_parallel_profile(prof, 8),
                                  data_parallel_network(topo), 4, tie_tolerance=TIE)
    assert choice.best.samples_per_s == pytest.approx(4 * 8 / ranked[0].predicted_s)
    assert choice.best.prediction.config == ranked[0].config
    pipe = by_family(choice)["pipedream"]
    assert pipe.samples_per_s == pytest.approx(
        simulate(pipe.plan, prof, topo).samples_per_s)
    assert choice.best_pipeline is pipe
    assert "data-parallel wins" in choice.explanation and "Runner-up: pipedream" in \
        choice.explanation


def test_the_straight_pipeline_wins_where_pipedreams_replicas_wait_for_their_ring():
    """Two layers of 2 and 4 ms on 2 workers at 100 Gbit/s, 30 MB of weights in the
    first. PipeDream's objective overlaps a replicated stage's all-reduce (4.8 ms) with
    its compute (6 ms) and replicates the whole model: 3 ms per micro-batch against the
    straight pipeline's 4. The runtime (and the simulator) starts each bucket once the
    backward has made its gradients, and the first layer's come last: (6 + 2.4) / 2 =
    4.2 ms, so one stage per worker is faster."""
    prof = ModelProfile.from_columns([2e-3 / 3, 4e-3 / 3], [4e-3 / 3, 8e-3 / 3],
                                     [1e3] * 2, [30 * MB, 0.0], batch_size=8)
    topo = "2x[100Gbit]"
    choice = choose(prof, topo, batch_size=8)
    families = by_family(choice)
    replicated = families["pipedream"].plan
    assert [(s.start, s.end, s.replicas) for s in replicated.stages] == [(0, 2, 2)]
    straight = families["straight"]
    assert [(s.start, s.end, s.replicas) for s in straight.plan.stages] == \
        [(0, 1, 1), (1, 2, 1)]
    assert straight.samples_per_s == pytest.approx(
        simulate(straight.plan, prof, topo).samples_per_s)
    assert straight.samples_per_s > 1.03 * families["pipedream"].samples_per_s
    assert choice.best.family == "straight" and choice.best_pipeline is straight
    assert "straight wins" in choice.explanation


def test_the_straight_pipeline_is_cut_where_the_simulator_predicts_fastest():
    """PipeDream replicates this model of light weights on every worker; the straight
    candidate is the fastest of every 4-stage cut of its 7 uneven layers, as a brute
    force finds it (within REFINE_GAIN of it)."""
    import itertools

    from pipesgd.pipeline.plan import Plan, StagePlan

    prof = ModelProfile.from_columns([1e-3, 3e-3, 1e-3, 2e-3, 1e-3, 4e-3, 1e-3],
                                     [2e-3, 6e-3, 2e-3, 4e-3, 2e-3, 8e-3, 2e-3],
                                     [4e5, 1e5, 3e5, 2e4, 5e5, 1e5, 1e3], [1e3] * 7,
                                     batch_size=8)
    topo = "4x[1Gbit]"
    families = by_family(choose(prof, topo, batch_size=8))
    assert [s.replicas for s in families["pipedream"].plan.stages] == [4]
    straight = families["straight"]
    rates = []
    for cut in itertools.combinations(range(1, 7), 3):
        b = (0, *cut, 7)
        plan = Plan(tuple(StagePlan(x, y) for x, y in itertools.pairwise(b)), micro_batch=8)
        rates.append(simulate(plan, prof, topo).samples_per_s)
    assert straight.samples_per_s == pytest.approx(max(rates), rel=0.011)  # REFINE_GAIN
    assert all(s.replicas == 1 for s in straight.plan.stages)


def test_no_straight_candidate_where_pipedream_plans_that_shape_or_layers_are_few():
    # heavy_weights: PipeDream's plan is one stage per worker already
    assert "straight" not in by_family(choose(heavy_weights(), "4x[1Gbit]", batch_size=8))
    # fewer layers than workers: no pipeline of one stage per worker
    prof = ModelProfile.from_columns([1e-3] * 2, [2e-3] * 2, [1e9] * 2, [1e3] * 2,
                                     batch_size=8)
    assert "straight" not in by_family(choose(prof, "4x[1Gbit]", batch_size=8))


@pytest.mark.parametrize("seed", range(4))
def test_the_balanced_cut_minimizes_the_largest_stage(seed):
    import itertools
    import random

    from pipesgd.planner.choose import _balanced_bounds

    rng = random.Random(seed)
    compute = [rng.uniform(0.1, 5.0) for _ in range(9)]
    for stages in (1, 2, 3, 5, 9):
        bounds = _balanced_bounds(compute, stages)
        assert bounds[0] == 0 and bounds[-1] == 9 and len(bounds) == stages + 1
        assert all(a < b for a, b in itertools.pairwise(bounds))
        best = min(max(sum(compute[a:b]) for a, b in itertools.pairwise((0, *c, 9)))
                   for c in itertools.combinations(range(1, 9), stages - 1))
        assert max(sum(compute[a:b]) for a, b in itertools.pairwise(bounds)) == \
            pytest.approx(best)


def test_data_parallel_profile_sums_the_layers():
    prof = heavy_weights()
    dp = data_parallel_profile(prof, 16)  # twice the profiled batch
    assert dp.forward_s == pytest.approx(8e-3) and dp.backward_s == pytest.approx(16e-3)
    assert dp.gradient_bytes == 400 * MB and dp.update_s == 0.0
    # the last layer's gradient is ready after a quarter of the backward, the first's at
    # the end
    assert [f for _, f in dp.gradient_ready] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert data_parallel_memory(prof, 16) == pytest.approx(400 * MB + 4 * 20 * MB)


def test_a_data_parallel_run_slower_than_predicted_charges_its_excess_to_every_config():
    # heavy_activations at batch 8: 4 + 8 ms of compute, 4 kB of gradient. Pipe-SGD is
    # compute-bound, so a real iteration of 15 ms leaves 3 ms per iteration unaccounted.
    prof = heavy_activations()
    topo = HierarchicalTopology.parse("4x[1Gbit]")
    pipe_sgd = Config(2, "none", "sequential")
    fitted = fit_data_parallel_overhead(prof, topo, 15e-3, pipe_sgd, 8)
    assert fitted.step_excess_s == pytest.approx(3e-3, abs=1e-6)
    run = fitted.extra["data_parallel_run"]
    assert run["config"] == "Pipe-SGD" and run["measured_s"] == 15e-3
    assert run["predicted_without_s"] == pytest.approx(12e-3, abs=1e-6)
    assert data_parallel_profile(fitted, 8).update_s == pytest.approx(3e-3, abs=1e-6)
    # every configuration pays it: the chooser's data-parallel rate is 32 samples / 15 ms
    dp = by_family(choose(fitted, topo, batch_size=8))["data-parallel"]
    assert dp.samples_per_s == pytest.approx(32 / 15e-3, rel=1e-3)
    assert data_parallel_pick(fitted, topo, 8).predicted_s == pytest.approx(15e-3, rel=1e-3)
    # 4 ranks on 2 cores: compute and the excess both run at half speed, so a 30 ms
    # iteration leaves the same 3 ms of CPU work per rank
    shared = describe_cluster("1Gbit", "1us", cores=2, ranks_per_host=4)
    on_shared = fit_data_parallel_overhead(prof, topo, 30e-3, pipe_sgd, 8, shared)
    assert on_shared.step_excess_s == pytest.approx(3e-3, abs=1e-5)
    # a run faster than its prediction: nothing to add (and, with the layers as they
    # ran alone, nothing to take off either)
    faster = fit_data_parallel_overhead(prof, topo, 10e-3, pipe_sgd, 8)
    assert faster.step_excess_s == 0.0 and faster.step_compute_factor == 1.0
    with pytest.raises(ValueError, match="positive number of seconds"):
        fit_data_parallel_overhead(prof, topo, 0.0, pipe_sgd, 8)


def test_a_data_parallel_run_faster_than_predicted_scales_its_layers_toward_alone():
    # heavy_activations' 12 ms of compute per Pipe-SGD iteration at batch 8, scaled by
    # `calibrate` by 1.5 from what the layers took alone (8 ms at the least)
    prof = dataclasses.replace(heavy_activations(), extra={
        "calibration": {"forward": 1.5, "backward": 1.5, "update": 1.5}})
    topo = HierarchicalTopology.parse("4x[1Gbit]")
    pipe_sgd = Config(2, "none", "sequential")
    fitted = fit_data_parallel_overhead(prof, topo, 10e-3, pipe_sgd, 8)
    assert fitted.step_excess_s == 0.0
    assert fitted.step_compute_factor == pytest.approx(10 / 12, rel=1e-3)  # + the ring's µs
    assert fitted.extra["data_parallel_run"]["compute_factor"] == fitted.step_compute_factor
    dp = data_parallel_profile(fitted, 8)
    assert dp.forward_s + dp.backward_s == pytest.approx(10e-3, rel=1e-3)
    assert data_parallel_pick(fitted, topo, 8).predicted_s == pytest.approx(10e-3, rel=1e-3)
    # the pipelines keep their layers: the run was data parallelism's
    assert fitted.layers == prof.layers
    pipeline = by_family(choose(fitted, topo, batch_size=8))["straight"]
    assert pipeline.samples_per_s == pytest.approx(
        by_family(choose(prof, topo, batch_size=8))["straight"].samples_per_s)
    # never faster than the layers alone: 2/3 of the profile at the most
    floor = fit_data_parallel_overhead(prof, topo, 6e-3, pipe_sgd, 8)
    assert floor.step_compute_factor == pytest.approx(2 / 3, rel=1e-9)
    # nor below what the pipeline's fit left them at (already scaled by 0.8 there)
    piped = dataclasses.replace(
        scaled_compute(prof, 0.8),
        extra={**prof.extra, "pipeline_run": {"compute_factor": 0.8}})
    assert fit_data_parallel_overhead(piped, topo, 6e-3, pipe_sgd, 8) \
        .step_compute_factor == pytest.approx((2 / 3) / 0.8, rel=1e-9)
    # a later fit starts again from the layers, whatever the profile carried
    again = fit_data_parallel_overhead(fitted, topo, 11e-3, pipe_sgd, 8)
    assert again.step_compute_factor == pytest.approx(11 / 12, rel=1e-3)


def test_the_step_excess_and_factor_round_trip_through_json_and_are_checked():
    prof = dataclasses.replace(heavy_activations(), step_excess_s=2e-3)
    assert ModelProfile.from_dict(prof.to_dict()).step_excess_s == 2e-3
    older = {k: v for k, v in prof.to_dict().items() if k != "step_excess_s"}
    assert ModelProfile.from_dict(older).step_excess_s == 0.0
    with pytest.raises(ValueError, match="step_excess_s"):
        dataclasses.replace(prof, step_excess_s=-1e-3)
    scaled = dataclasses.replace(prof, step_compute_factor=0.75)
    assert ModelProfile.from_dict(scaled.to_dict()).step_compute_factor == 0.75
    assert ModelProfile.from_dict(older).step_compute_factor == 1.0  # before the factor
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="step_compute_factor"):
            dataclasses.replace(prof, step_compute_factor=bad)


def test_dp_network_overrides_the_topology():
    prof = heavy_weights()
    fast = describe_cluster("400Gbit", "1us", cores=2, ranks_per_host=1)
    choice = choose(prof, "4x[1Gbit]", batch_size=8, dp_network=fast)
    dp = by_family(choice)["data-parallel"]
    best = choose_data_parallel(data_parallel_profile(prof, 8), fast, 4)[0]
    assert dp.samples_per_s == pytest.approx(32 / best.predicted_s)


def test_gpu_workers_charge_staging_to_every_family():
    # Workers on GPUs copying 1 GB/s to the host: data parallelism's prediction stages
    # its buckets (the timing model's δ), and the pipeline's simulation its messages.
    prof = heavy_weights()
    cpus = HierarchicalTopology.parse("4x[1Gbit]")
    gpus = dataclasses.replace(cpus, device_copy_s_per_byte=1e-9)
    assert data_parallel_network(gpus).device_copy_s_per_byte == 1e-9
    on_cpus, on_gpus = by_family(choose(prof, cpus, batch_size=8)), \
        by_family(choose(prof, gpus, batch_size=8))
    staged = on_gpus["data-parallel"].prediction
    assert staged.details["staging_s"] > 0
    assert on_cpus["data-parallel"].prediction.details["staging_s"] == 0
    assert on_gpus["data-parallel"].samples_per_s < on_cpus["data-parallel"].samples_per_s
    assert on_gpus["pipedream"].samples_per_s < on_cpus["pipedream"].samples_per_s


def test_a_tie_goes_to_data_parallelism():
    # one worker: data parallelism and a one-stage pipeline both run F + B per batch
    prof = heavy_weights()
    choice = choose(prof, "1x[1Gbit]", batch_size=8)
    assert [c.family for c in choice.ranked] == ["data-parallel", "pipedream"]
    assert choice.ranked[0].samples_per_s == pytest.approx(8 / 12e-3)
    assert choice.ranked[1].samples_per_s == pytest.approx(8 / 12e-3)
    assert "ties" in choice.explanation


def test_micro_batches_scale_the_pipeline_and_accumulate_steps():
    prof = heavy_weights()
    choice = choose(prof, "4x[1Gbit]", batch_size=32, micro_batch=16)
    plan = by_family(choice)["pipedream"].plan
    assert plan.micro_batch == 16 and plan.micro_batches_per_step == 2
    assert at_batch(prof, 16).layers[0].forward_s == pytest.approx(2e-3)
    assert at_batch(prof, 16).layers[0].param_bytes == 100 * MB


def test_hierarchy_plans_madpipe_on_one_level():
    prof = heavy_weights()
    choice = choose(prof, "2x[10GB/s], 2x[1Gbit]", "1GB", batch_size=8)
    mad = by_family(choice)["madpipe"]
    assert mad.fits and mad.plan.world_size <= 4
    sim = simulate(mad.plan, prof, "2x[10GB/s], 2x[1Gbit]")
    assert mad.samples_per_s == pytest.approx(sim.samples_per_s)
    # The runtime keeps MadPipe's 1F1B* count on every stage, as the simulation shows.
    counts = mad.plan.extra["one_f_one_b_star"]["in_flight"]
    assert list(mad.plan.stage_in_flight) == counts
    assert [s.in_flight for s in sim.stages] == counts


# ----------------------------------------------------------------- memory
def test_madpipe_needs_a_budget():
    choice = choose(heavy_weights(), "4x[1Gbit]", batch_size=8)
    mad = by_family(choice)["madpipe"]
    assert not mad.fits and "memory budget" in mad.reason
    assert mad in choice.excluded


def test_budget_lowers_the_depth_and_excludes_what_does_not_fit():
    # At depth d stage 0 keeps d micro-batches (10 MB each) and, from d = 2 on, one
    # stashed copy of its 100 MB weights per micro-batch beside the live ones:
    # d = 1: 110 MB, d = 2: 320 MB, d = 3: 430 MB, d = 4 (NOAM): 540 MB.
    # Data parallelism needs 400 + 4 x 10 = 440 MB.
    prof = heavy_weights()
    choice = choose(prof, "4x[1Gbit]", 330 * MB, batch_size=8)
    fam = by_family(choice)
    assert fam["pipedream"].plan.in_flight == 2
    assert fam["pipedream"].memory_bytes == pytest.approx(320 * MB)
    assert "lowered from 4 to fit" in fam["pipedream"].reason
    assert not fam["data-parallel"].fits and "over the 330 MB budget" in \
        fam["data-parallel"].reason
    assert all(c.memory_bytes <= 330 * MB for c in choice.ranked)
    assert fam["madpipe"].fits

    choice = choose(prof, "4x[1Gbit]", 300 * MB, batch_size=8)
    assert by_family(choice)["pipedream"].plan.in_flight == 1
    assert all(c.memory_bytes <= 300 * MB for c in choice.ranked)

    roomy = choose(prof, "4x[1Gbit]", "1GB", batch_size=8)
    fam = by_family(roomy)
    assert fam["pipedream"].plan.in_flight is None  # NOAM
    assert fam["pipedream"].memory_bytes == pytest.approx(540 * MB)
    assert fam["data-parallel"].fits


def test_no_plan_fits_names_the_smallest_budget():
    # one layer per worker, one micro-batch in flight: 100 MB + 10 MB
    prof = heavy_weights()
    with pytest.raises(ValueError, match=r"smallest budget that fits is 110000000 bytes"):
        choose(prof, "4x[1Gbit]", 100 * MB, batch_size=8)
    choice = choose(prof, "4x[1Gbit]", 110 * MB, batch_size=8)
    assert choice.best.memory_bytes == pytest.approx(110 * MB)


def test_topology_memory_is_the_default_budget():
    topo = HierarchicalTopology.parse("4x[1Gbit]", memory_per_worker="330MB")
    choice = choose(heavy_weights(), topo, batch_size=8)
    assert choice.memory_per_worker == 330 * MB
    assert by_family(choice)["pipedream"].plan.in_flight == 2


# ----------------------------------------------------------------- errors and output
def test_bad_batch_sizes():
    prof = heavy_weights()
    with pytest.raises(ValueError, match="batch_size must be"):
        choose(prof, "4x[1Gbit]", batch_size=0)
    with pytest.raises(ValueError, match="positive divisor"):
        choose(prof, "4x[1Gbit]", batch_size=8, micro_batch=3)


def test_choice_to_dict_is_json():
    import json

    choice = choose(heavy_weights(), "4x[1Gbit]", batch_size=8)
    data = json.loads(json.dumps(choice.to_dict(), allow_nan=False))
    assert data["choice"] == "pipedream"
    assert data["ranked"][0]["plan"]["stages"][0]["layers"] == [0, 1]
    assert data["excluded"][0]["family"] == "madpipe"


# ----------------------------------------------------------------- refinement
def test_the_walk_moves_boundaries_to_the_simulated_optimum():
    """6 equal layers (1 + 2 ms) on 3 stages: from the lopsided cut 0-1, 1-2, 2-6 (4 layers
    on the last stage) the walk (for plans with too many cuts to try each) moves the
    boundaries to the balanced 0-2, 2-4, 4-6, a local optimum: no plan a boundary away is
    predicted faster."""
    from pipesgd.pipeline.plan import Plan, StagePlan
    from pipesgd.planner.choose import REFINE_GAIN, refine_boundaries

    prof = ModelProfile.from_columns([1e-3] * 6, [2e-3] * 6, [1e3] * 6, [1e3] * 6,
                                     batch_size=8)

    def run(plan):
        return simulate(plan, prof, "3x[10Gbit]")

    start = Plan((StagePlan(0, 1), StagePlan(1, 2), StagePlan(2, 6)), micro_batch=8)
    refined = refine_boundaries(start, run, search_all_up_to=0)  # the walk
    assert [(s.start, s.end) for s in refined.stages] == [(0, 2), (2, 4), (4, 6)]
    best = run(refined).samples_per_s
    assert best > 1.9 * run(start).samples_per_s  # 12 ms -> 6 ms per micro-batch
    for stages in ([(0, 1), (1, 4), (4, 6)], [(0, 3), (3, 4), (4, 6)],
                   [(0, 2), (2, 3), (3, 6)], [(0, 2), (2, 5), (5, 6)]):
        other = refined.replace(stages=tuple(StagePlan(a, b) for a, b in stages))
        assert run(other).samples_per_s <= best * (1 + REFINE_GAIN)


@pytest.mark.parametrize("seed", range(4))
def test_refining_keeps_the_fastest_cut_of_every_one(seed):
    """Where the cuts are few, every one is simulated: the result is the fastest of a
    brute-force enumeration (the DP's own cut unless another is REFINE_GAIN faster), with
    the stages' replicas kept. Random 8-layer profiles, stages x1, x2, x1 on 4 workers."""
    import itertools
    import random

    from pipesgd.pipeline.plan import Plan, StagePlan
    from pipesgd.planner.choose import REFINE_GAIN, refine_boundaries

    rng = random.Random(seed)
    n = 8
    prof = ModelProfile.from_columns(
        [rng.uniform(0.2e-3, 3e-3) for _ in range(n)],
        [rng.uniform(0.4e-3, 6e-3) for _ in range(n)],
        [rng.uniform(1e3, 4e5) for _ in range(n)],
        [rng.uniform(1e3, 2e6) for _ in range(n)], batch_size=8)

    def run(plan):
        return simulate(plan, prof, "4x[1Gbit]")

    start = Plan((StagePlan(0, 2), StagePlan(2, 5, 2), StagePlan(5, 8)), schedule="1f1b-rr",
                 micro_batch=8)
    refined = refine_boundaries(start, run)
    assert [s.replicas for s in refined.stages] == [1, 2, 1]
    every = {}
    for a, b in itertools.combinations(range(1, n), 2):
        plan = start.replace(stages=(StagePlan(0, a), StagePlan(a, b, 2), StagePlan(b, n)))
        every[(a, b)] = run(plan).samples_per_s
    fastest = max(every.values())
    got = run(refined).samples_per_s
    if fastest > run(start).samples_per_s * (1 + REFINE_GAIN):
        assert got == fastest
    else:
        assert refined == start
