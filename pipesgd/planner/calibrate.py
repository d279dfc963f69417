"""Charges fitted to real runs: what ranks sharing cores lose beyond the models' account.

Three short runs on every rank (`pipesgd pipeline --plan auto`, `bench/planner.py`) are
set beside their predictions, and each excess becomes a charge the models then apply to
every candidate of its family:

- `fit_pipeline_overhead`: the pipeline of one stage per rank the chooser offers
  (`planner.straight_pipeline`, `pipeline.runtime.pipeline_micro_batch_s`) against the
  simulator, charged as CPU work per micro-batch to every stage of every plan
  (`ModelProfile.stage_excess_s`), or, where it ran faster than simulated, its layers'
  times scaled down towards what they took alone;
- `fit_replica_overhead`: a round of the whole model replicated on every rank
  (`pipeline.runtime.replicated_round_s`) against the simulator, charged per weight byte
  to every replicated stage's hand-off to the ring (`ModelProfile.replica_s_per_byte`);
- `fit_data_parallel_overhead`: an iteration of data parallelism
  (`pipeline.runtime.data_parallel_iteration_s`) against the timing model, charged as CPU
  work per iteration to every data-parallel configuration
  (`ModelProfile.step_excess_s`), or, where it ran faster than predicted, its layers'
  times in data parallelism scaled down (`ModelProfile.step_compute_factor`).

Each charge is the smallest that makes the model as slow as the run; 0 where the model is
that slow already (the pipeline's and data parallelism's then scale the layers down
instead, to what they took alone at most). The pipeline's charge, carried to plans
other than the one it was fitted on, is fitted only where that run follows its stages'
CPU (`compute_share`, `COMPUTE_BOUND`). The pipeline's is fitted first: the
replicated round is simulated with it, and the data-parallel iteration predicted with
its layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pipesgd.pipeline.plan import Plan, StagePlan
from pipesgd.timing.model import Config, predict
from pipesgd.timing.network import NetworkParams

from .choose import data_parallel_network, data_parallel_profile
from .profile import ModelProfile, scaled_compute
from .simulate import simulate
from .topology import HierarchicalTopology


def _charge_reaching(model_s: Callable[[float], float], measured_s: float,
                     first_guess: float) -> float:
    """The smallest charge for which `model_s(charge)`, which grows with it, reaches
    `measured_s`: bracketed from `first_guess` upwards, then bisected; 0 where
    `first_guess` is not positive (the model without a charge is that slow already)."""
    if first_guess <= 0:
        return 0.0
    low, high = 0.0, first_guess
    for _ in range(20):
        if model_s(high) >= measured_s:
            break
        low, high = high, 2 * high
    return _least_reaching(model_s, measured_s, low, high)


def _least_reaching(model_s: Callable[[float], float], measured_s: float, low: float,
                    high: float) -> float:
    """The least x in [low, high] at which `model_s(x)`, which grows with x, reaches
    `measured_s` (`model_s(high)` does), bisected."""
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if model_s(mid) < measured_s else (low, mid)
    return high


def _check_seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


# A run tells what its stages' CPU costs only where its time follows that CPU: where the
# model moves its time by less than this share of a change in the layers' times (a run
# bound by its links or by the pipeline's depth), any gap between model and run, noise
# included, would be charged to the CPU magnified beyond this share's inverse, so none
# is fitted from it (docs/planner.md, "What a stage pays").
COMPUTE_BOUND = 0.5


def compute_share(model_s: Callable[[ModelProfile], float], profile: ModelProfile,
                  step: float = 0.1, at_s: float | None = None) -> float:
    """How much of a relative change in `profile`'s layer times `model_s` passes on to the
    time it models: d ln(time) / d ln(layer times), 1 where compute alone bounds it and 0
    where nothing of it does. `at_s`: `model_s(profile)` where the caller has it."""
    t0 = model_s(profile) if at_s is None else at_s
    return (model_s(scaled_compute(profile, 1 + step)) - t0) / (step * t0) if t0 > 0 else 0.0


def fit_pipeline_overhead(profile: ModelProfile, topology: HierarchicalTopology | str,
                          plan: Plan, micro_batch_s: float) -> ModelProfile:
    """`profile` with the `stage_excess_s` that makes the simulator time a micro-batch of
    `plan` on `topology` as a real run of it took (`micro_batch_s`, in the steady state:
    `pipeline.runtime.pipeline_micro_batch_s`). Where the simulation is slower than the
    run, no charge: its layers' forward, backward and update times scaled by the one
    factor that matches the run instead, at least what `calibrate` scaled them from
    (the layers alone). The plan, the measured and the simulated seconds and that
    factor (1: none) go in `extra["pipeline_run"]`.

    On shared cores a stage's micro-batch costs more than its layers as the profile ran
    them and the runtime's own time: the activations arrive from another process, the
    saved tensors of several micro-batches in flight share the caches, every stage's
    thread wants a core. Charged as CPU work per micro-batch to every stage, it grows
    with the stages a plan has, as the loss does (`bench/planner.py`; BENCHMARKS.md).
    It can cost less, too: the profile is scaled to whole models run on every rank at
    once (`calibrate`), and a stage holds a part of the model, which shares the caches
    with fewer bytes (the small MLP's straight pipelines on 3 and 4 ranks of 2 cores ran
    their micro-batches 15-34 % faster than so simulated).

    Raises:
        ValueError: a time that is not a positive number of seconds.
    """
    _check_seconds("micro_batch_s", micro_batch_s)

    def simulated(prof: ModelProfile) -> float:
        return simulate(plan, prof, topology).time_per_micro_batch_s

    base = replace(profile, stage_excess_s=0.0)
    unfitted = simulated(base)
    share = compute_share(simulated, base, at_s=unfitted)
    factor, excess = 1.0, 0.0
    if share < COMPUTE_BOUND:
        pass  # the run does not follow its stages' CPU: nothing to fit from it
    elif unfitted > micro_batch_s:
        # the floor from `calibrate` alone: a pipeline factor in `extra` is the one this
        # fit replaces
        factor = _factor_reaching(lambda f: simulated(scaled_compute(base, f)),
                                  micro_batch_s, _layers_alone(base))
    else:
        excess = _charge_reaching(lambda e: simulated(replace(base, stage_excess_s=e)),
                                  micro_batch_s, micro_batch_s - unfitted)
    return replace(scaled_compute(profile, factor), stage_excess_s=excess, extra={
        **profile.extra, "pipeline_run": {"plan": plan.to_dict(), "measured_s": micro_batch_s,
                                          "simulated_without_s": unfitted,
                                          "compute_share": share,
                                          "compute_factor": factor}})


def _factor_reaching(model_s: Callable[[float], float], measured_s: float,
                     low: float) -> float:
    """The factor of the layers' times at which `model_s(factor)`, which grows with it,
    reaches `measured_s` (bisected between `low` and 1), at least `low`."""
    if model_s(low) >= measured_s:
        return low
    return _least_reaching(model_s, measured_s, low, 1.0)


def _layers_alone(profile: ModelProfile, applied: float = 1.0) -> float:
    """The factor that undoes `calibrate`'s scaling of the layers' forward, backward and
    update times (the most of the three), and a factor `applied` to them since: the
    least a fit scales them by (to what they took alone)."""
    scaled_by = profile.extra.get("calibration", {}).values()
    low = min(1.0, max((1.0 / f for f in scaled_by if f > 0), default=1.0))
    return min(1.0, low / applied)


def fit_replica_overhead(profile: ModelProfile, topology: HierarchicalTopology | str,
                         round_s: float, replicas: int) -> ModelProfile:
    """`profile` with the `replica_s_per_byte` that makes the simulator time a round of
    the whole model replicated on `replicas` workers of `topology` (1F1B-RR, a
    micro-batch of `profile.batch_size`) as a real run of that plan took (`round_s`:
    `pipeline.runtime.replicated_round_s`); 0 where the simulation is that slow already.
    The measured and simulated rounds go in `extra["replica_round"]`.

    On shared cores a replicated round loses time its actions and its ring's bytes do
    not account for (caches evicted while it waited, the engine's thread beside the
    compute, ring steps waiting for a core), and the loss grows with the weights the
    round moves and touches: charged as CPU work per weight byte to each replica's
    hand-off to the ring, it carries over to the replicated stages of other plans
    (`bench/planner.py`).

    Raises:
        ValueError: fewer than 2 replicas, or a round that is not a positive time.
    """
    if replicas < 2:
        raise ValueError(f"a replicated round needs at least 2 replicas, got {replicas}")
    _check_seconds("round_s", round_s)
    weight = sum(profile.column("param_bytes"))
    plan = Plan((StagePlan(0, profile.num_layers, replicas),), schedule="1f1b-rr",
                micro_batch=profile.batch_size or 1)

    def round_at(rate: float) -> float:
        sim = simulate(plan, replace(profile, replica_s_per_byte=rate), topology)
        return sim.time_per_micro_batch_s * replicas

    unfitted = round_at(0.0)
    rate = _charge_reaching(round_at, round_s,
                            (round_s - unfitted) / weight if weight > 0 else 0.0)
    return replace(profile, replica_s_per_byte=rate, extra={
        **profile.extra, "replica_round": {"replicas": replicas, "measured_s": round_s,
                                           "simulated_without_s": unfitted}})


def fit_data_parallel_overhead(profile: ModelProfile, topology: HierarchicalTopology,
                               iteration_s: float, config: Config, batch_size: int,
                               network: NetworkParams | None = None) -> ModelProfile:
    """`profile` with the `step_excess_s` that makes the timing model predict `config` on
    `topology`'s workers (`batch_size` samples each; `network`: the measured one, else
    the topology's slowest level) as a real run of it took (`iteration_s`:
    `pipeline.runtime.data_parallel_iteration_s`). Where the prediction is slower than
    the run, no charge: the `step_compute_factor` of the layers' times in a data-parallel
    iteration that matches the run instead, at least what `calibrate` scaled them from
    (the layers alone), as `fit_pipeline_overhead` scales a pipeline's. The measured and
    predicted iterations and that factor (1: none) go in `extra["data_parallel_run"]`.

    On shared cores an iteration of `DistributedOptimizer` costs each rank more CPU than
    its profiled forward, backward and update and its ring's modelled work: the step
    hands buckets to the engine and back, its thread competes for the cores and the
    caches. Charged as CPU work per iteration, it carries over to the other
    configurations, which run the same step (`bench/planner.py`). It can cost less, too
    (the timing model's account of shared cores is a model): a run faster than predicted
    left data parallelism ranked too slow beside pipelines fitted to their own runs in
    8 of 20 scenario-models of `bench/planner.py` (up to 8 % apart).

    Raises:
        ValueError: an iteration that is not a positive time.
    """
    _check_seconds("iteration_s", iteration_s)
    net = network if network is not None else data_parallel_network(topology)

    def predicted(prof: ModelProfile) -> float:
        return predict(data_parallel_profile(prof, batch_size), net, topology.num_workers,
                       config.staleness, config.compression, config.overlap).predicted_s

    base = replace(profile, step_excess_s=0.0, step_compute_factor=1.0)
    unfitted = predicted(base)
    factor, excess = 1.0, 0.0
    if unfitted > iteration_s:
        piped = base.extra.get("pipeline_run", {}).get("compute_factor", 1.0)
        factor = _factor_reaching(lambda f: predicted(replace(base, step_compute_factor=f)),
                                  iteration_s, _layers_alone(base, piped))
    else:
        excess = _charge_reaching(lambda e: predicted(replace(base, step_excess_s=e)),
                                  iteration_s, iteration_s - unfitted)
    return replace(profile, step_excess_s=excess, step_compute_factor=factor, extra={
        **profile.extra, "data_parallel_run": {
            "config": config.label, "batch_size": batch_size, "measured_s": iteration_s,
            "predicted_without_s": unfitted, "compute_factor": factor}})


__all__ = ["fit_data_parallel_overhead", "fit_pipeline_overhead", "fit_replica_overhead"]
