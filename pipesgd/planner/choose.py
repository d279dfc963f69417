"""Choosing how to train on a cluster: PipeDream's plan, MadPipe's plan, a pipeline of one
stage per worker or data parallelism, ranked by predicted samples/s under a memory budget.

    ranked = choose(prof, "4x[1Gbit]", "2GiB", batch_size=32)
    print(ranked.explanation)
    ranked.best.plan            # a pipesgd.pipeline Plan, or None for data parallelism

The four families, each predicted by the model that knows how it runs:

- pipedream: `pipedream()`'s stages and replicas (schedule 1f1b-rr where a stage is
  replicated), cut where `simulate` on the topology predicts fastest
  (`refine_boundaries`), timed by `simulate`.
- madpipe: `madpipe()`'s memory-aware partition (only with a budget), run as the runtime
  runs it: 1F1B with each stage keeping its 1F1B* count in flight (the plan's
  `stage_in_flight`), timed by `simulate`. On a hierarchy MadPipe plans one level of all
  the workers at the slowest bandwidth (it knows one level only); the simulation then
  uses the real topology.
- straight: one stage per worker, none replicated (1F1B), cut where `simulate` predicts
  fastest (`straight_pipeline`), timed by `simulate`; offered where PipeDream's plan is
  not that shape already. PipeDream's objective overlaps a replicated stage's whole
  all-reduce with its backward, where the runtime's (and the simulator's) overlaps
  only the closing backward of each round, and its first layers' bucket not at all:
  on fast links it replicates stages the straight pipeline runs faster without.
- data-parallel: every worker holds the whole model; `pipesgd.timing.model.choose` ranks
  staleness x compression x overlap on a network from the topology's slowest level (a
  flat ring crosses it), or `dp_network`. Its profile is the per-layer profile's totals
  (gradients ready as the backward reaches each layer, the loss in the forward, the
  optimizer steps of every layer as its update).

Batch sizes: `batch_size` samples per optimizer step of one worker, i.e. per rank and
iteration for data parallelism (`pipesgd train --batch-size`) and micro_batch x
micro_batches_per_step for a pipeline (`pipesgd pipeline --batch-size`); `micro_batch`
(default `batch_size`) is what flows through the pipeline. The profile is scaled
linearly to either.

Memory, per worker: a pipeline's from the simulated timeline (weights x versions held +
optimizer state + saved activations x micro-batches in flight); data parallelism's is the
weights + optimizer state + the whole model's saved activations for one batch. A pipeline
over the budget at its planned depth is run shallower (fewer micro-batches in flight: less
activation and fewer stashed weights, PipeDream §5's depth trade-off): the deepest depth
that fits. Candidates that fit at no depth are excluded, with the reason.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pipesgd.pipeline.plan import Plan, StagePlan
from pipesgd.timing.cluster import describe_cluster
from pipesgd.timing.model import Prediction
from pipesgd.timing.model import choose as choose_data_parallel
from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile

from .madpipe import madpipe, smallest_budget
from .pipedream import pipedream, to_plan
from .profile import ModelProfile, scaled_compute
from .simulate import SimulationResult, batch_scale, simulate
from .topology import HierarchicalTopology, Level, as_topology, parse_bytes

FAMILIES = ("data-parallel", "pipedream", "madpipe", "straight")  # ties: the earlier one
DP_CORES_PER_WORKER = 2  # a worker's compute thread and the engine's comm thread, each on a
# core of its own: the timing model without contention, as the simulator assumes workers
TIE = 1e-9
REFINE_GAIN = 0.01  # a moved boundary must buy this much predicted speed
SEARCH_ALL_UP_TO = 1000  # cuts of the DP's stages simulated one by one (a 12-layer CNN on
# 4 stages has 165; beyond this many, a walk of boundary moves)


@dataclass(frozen=True)
class Candidate:
    """One way to train, predicted.

    Attributes:
        family: "data-parallel", "pipedream" or "madpipe".
        samples_per_s: predicted steady-state throughput of the whole cluster.
        memory_bytes: the most memory one worker needs.
        workers: workers it uses.
        reason: one line saying what it is and what bounds it.
        fits: within the memory budget (always True without one).
        plan: the runtime's plan (pipelines), None for data parallelism.
        simulation: the simulation of `plan`.
        prediction: the timing model's best configuration (data parallelism).
        least_memory_bytes: the smallest budget this family could run within.
    """

    family: str
    samples_per_s: float
    memory_bytes: float
    workers: int
    reason: str
    fits: bool = True
    plan: Plan | None = None
    simulation: SimulationResult | None = field(default=None, repr=False)
    prediction: Prediction | None = field(default=None, repr=False)
    least_memory_bytes: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "family": self.family,
            "samples_per_s": _finite(self.samples_per_s),
            "memory_bytes": _finite(self.memory_bytes),
            "workers": self.workers,
            "fits": self.fits,
            "reason": self.reason,
        }
        if self.plan is not None:
            out["plan"] = self.plan.to_dict()
        if self.simulation is not None:
            out["simulation"] = self.simulation.to_dict()
        if self.prediction is not None:
            c = self.prediction.config
            out["config"] = {"label": c.label, "staleness": c.staleness,
                             "compression": c.compression, "overlap": c.overlap,
                             "predicted_iteration_s": self.prediction.predicted_s}
        return out


@dataclass(frozen=True)
class PlanChoice:
    """What `choose` decided.

    Attributes:
        ranked: the candidates within the budget, fastest first.
        excluded: the others (over the budget, or not applicable), each saying why.
        explanation: the winner against the runner-up, in a sentence or two.
        memory_per_worker: the budget (None: not given).
        batch_size, micro_batch: as given to `choose`.
    """

    ranked: tuple[Candidate, ...]
    excluded: tuple[Candidate, ...]
    explanation: str
    memory_per_worker: float | None
    batch_size: int
    micro_batch: int

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def best_pipeline(self) -> Candidate | None:
        """The fastest candidate with a pipeline plan, if any fits."""
        return next((c for c in self.ranked if c.plan is not None), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "choice": self.best.family,
            "explanation": self.explanation,
            "memory_per_worker": self.memory_per_worker,
            "batch_size": self.batch_size,
            "micro_batch": self.micro_batch,
            "ranked": [c.to_dict() for c in self.ranked],
            "excluded": [c.to_dict() for c in self.excluded],
        }


def _finite(x: float) -> float | None:
    """JSON has no inf or NaN: None stands for them."""
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------- inputs
def at_batch(profile: ModelProfile, batch: int) -> ModelProfile:
    """The profile for `batch` samples: times, outputs, saved activations and the loss
    scaled linearly (`batch_scale`); weights, optimizer state, updates and copies kept."""
    k = batch_scale(profile, batch)
    layers = tuple(
        replace(lp, forward_s=lp.forward_s * k, backward_s=lp.backward_s * k,
                output_bytes=lp.output_bytes * k, saved_bytes=lp.saved_bytes * k)
        for lp in profile.layers
    )
    return replace(profile, layers=layers, batch_size=batch, loss_s=profile.loss_s * k)


def data_parallel_profile(profile: ModelProfile, batch_size: int) -> Profile:
    """The timing model's whole-model profile from the per-layer one at `batch_size`:
    forward (with the loss), backward and optimizer steps summed (the layers' times by
    the profile's `step_compute_factor`, with its `step_excess_s`: what a real run showed
    less or more than them), gradient bytes = weight bytes, each layer's gradient ready
    when the backward (last layer first) has passed it."""
    scaled = at_batch(scaled_compute(profile, profile.step_compute_factor), batch_size)
    backward = sum(lp.backward_s for lp in scaled.layers)
    ready, elapsed = [], 0.0
    for lp in reversed(scaled.layers):
        elapsed += lp.backward_s
        if lp.param_bytes:
            ready.append((lp.param_bytes, min(1.0, elapsed / backward) if backward else 1.0))
    return Profile(
        forward_s=sum(lp.forward_s for lp in scaled.layers) + scaled.loss_s,
        backward_s=backward,
        update_s=sum(lp.update_s for lp in scaled.layers) + profile.step_excess_s,
        gradient_bytes=sum(lp.param_bytes for lp in scaled.layers),
        gradient_ready=ready,
        threads=1,
        batch_size=batch_size,
        model=str(profile.extra.get("model", "")),
        source=f"per-layer profile summed ({profile.source})",
    )


def slowest_level(topology: HierarchicalTopology) -> Level:
    return min(topology.levels, key=lambda lv: lv.bandwidth)


def data_parallel_network(topology: HierarchicalTopology) -> NetworkParams:
    """The cluster the data-parallel ring sees: the topology's slowest level, one worker
    per host with cores for its compute and comm threads (`DP_CORES_PER_WORKER`), and
    the topology's host staging (δ) where workers are GPUs."""
    level = slowest_level(topology)
    net = describe_cluster(level.bandwidth * 8, level.latency, cores=DP_CORES_PER_WORKER,
                           ranks_per_host=1, name=f"slowest level of {topology}")
    return replace(net, device_copy_s_per_byte=topology.device_copy_s_per_byte)


def data_parallel_pick(profile: ModelProfile, topology: HierarchicalTopology,
                       batch_size: int, network: NetworkParams | None = None) -> Prediction:
    """The timing model's fastest data-parallel configuration on `topology`'s workers at
    `batch_size` samples per worker (`network`: the measured one, else the topology's
    slowest level). The fastest predicted, not `timing.choose`'s simplest within its
    resolution: the families are ranked by their predicted rates."""
    net = network if network is not None else data_parallel_network(topology)
    return choose_data_parallel(data_parallel_profile(profile, batch_size), net,
                                topology.num_workers, tie_tolerance=TIE)[0]


def data_parallel_rate(prediction: Prediction, workers: int, batch_size: int) -> float:
    """Samples/s of data parallelism on `workers` at `batch_size` samples per worker,
    whose iteration the timing model predicts as `prediction`."""
    if prediction.predicted_s <= 0:
        return math.inf
    return workers * batch_size / prediction.predicted_s


def data_parallel_memory(profile: ModelProfile, batch_size: int) -> float:
    """Weights + optimizer state + the whole model's saved activations for one batch."""
    k = batch_scale(profile, batch_size)
    return sum(lp.param_bytes + lp.optimizer_bytes + k * lp.saved_bytes
               for lp in profile.layers)


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------- families
def _data_parallel(profile: ModelProfile, topo: HierarchicalTopology, batch_size: int,
                   network: NetworkParams | None, budget: float | None) -> Candidate:
    p = topo.num_workers
    best = data_parallel_pick(profile, topo, batch_size, network)
    rate = data_parallel_rate(best, p, batch_size)
    memory = data_parallel_memory(profile, batch_size)
    fits = budget is None or memory <= budget * (1 + TIE)
    reason = (f"data parallelism on {p} workers, {best.config.label}: "
              f"{best.predicted_s * 1e3:.4g} ms per iteration of {batch_size} samples per "
              f"worker, {best.reason}")
    if not fits:
        reason = _over(memory, budget) + "; " + reason
    return Candidate("data-parallel", rate, memory, p, reason, fits, prediction=best,
                     least_memory_bytes=memory)


def _over(memory: float, budget: float | None) -> str:
    return f"needs {format_bytes(memory)} per worker, over the {format_bytes(budget or 0)} budget"


def _deepest_fitting(
    plan: Plan, run: Callable[[Plan], SimulationResult], budget: float | None
) -> tuple[SimulationResult | None, float, SimulationResult]:
    """The simulation of `plan` at the deepest depth <= its own whose memory fits the
    budget (memory grows with depth, so by bisection), the memory at depth 1, and the
    simulation of `plan` as it is."""
    cache: dict[int, SimulationResult] = {}

    def at(depth: int) -> SimulationResult:
        if depth not in cache:
            cache[depth] = run(plan if depth == plan.noam else plan.at_depth(depth))
        return cache[depth]

    def fits(depth: int) -> bool:
        return budget is None or at(depth).max_memory_bytes <= budget * (1 + TIE)

    deepest = plan.noam
    if fits(deepest):
        return (at(deepest), (at(1).max_memory_bytes if budget is not None else math.nan),
                at(deepest))
    least = at(1).max_memory_bytes
    if not fits(1):
        return None, least, at(deepest)
    lo, hi = 1, deepest  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return at(lo), least, at(deepest)


def _pipeline_reason(family: str, sim: SimulationResult, total_workers: int,
                     planned_depth: int) -> str:
    plan = sim.plan
    reps = "/".join(str(s.replicas) for s in plan.stages)
    depth = f"{plan.noam} micro-batch(es) in flight"
    if plan.noam < planned_depth:
        depth += f" (lowered from {planned_depth} to fit)"
    return (f"{family}: {plan.num_stages} stage(s), replicas {reps}, on {plan.world_size} of "
            f"{total_workers} workers, {plan.schedule}, {depth}; "
            f"{sim.time_per_micro_batch_s * 1e3:.4g} ms per micro-batch of "
            f"{plan.micro_batch}, bottleneck {sim.bottleneck}; peak "
            f"{format_bytes(sim.max_memory_bytes)} per worker")


def _pipeline(family: str, plan: Plan, run: Callable[[Plan], SimulationResult],
              budget: float | None, total_workers: int) -> Candidate:
    sim, least, top = _deepest_fitting(plan, run, budget)
    if sim is None:
        return Candidate(family, top.samples_per_s, top.max_memory_bytes, plan.world_size,
                         f"{family}: " + _over(least, budget) + " even with one micro-batch "
                         f"in flight ({_pipeline_reason(family, top, total_workers, plan.noam)})",
                         fits=False, plan=plan, simulation=top, least_memory_bytes=least)
    return Candidate(family, sim.samples_per_s, sim.max_memory_bytes, plan.world_size,
                     _pipeline_reason(family, sim, total_workers, plan.noam), plan=sim.plan,
                     simulation=sim, least_memory_bytes=least)


def _moved_boundaries(plan: Plan) -> list[Plan]:
    """The plans one stage boundary away: each moved by one layer either way, every stage
    keeping a layer and its replicas."""
    out = []
    stages = plan.stages
    for i in range(len(stages) - 1):
        left, right = stages[i], stages[i + 1]
        for cut in (left.end - 1, left.end + 1):
            if left.start < cut < right.end:
                moved = (*stages[:i], replace(left, end=cut), replace(right, start=cut),
                         *stages[i + 2:])
                out.append(plan.replace(stages=moved))
    return out


def _every_cut(plan: Plan) -> list[Plan]:
    """Every plan with `plan`'s stages and replicas in order, cut anywhere."""
    n, stages = plan.num_layers, plan.stages
    out = []
    for cut in itertools.combinations(range(1, n), len(stages) - 1):
        bounds = (0, *cut, n)
        out.append(plan.replace(stages=tuple(
            replace(st, start=a, end=b)
            for st, (a, b) in zip(stages, itertools.pairwise(bounds), strict=True))))
    return out


def refine_boundaries(plan: Plan, run: Callable[[Plan], SimulationResult],
                      search_all_up_to: int = SEARCH_ALL_UP_TO) -> Plan:
    """PipeDream's DP balances its own cost (compute, 2a/B per boundary); the simulator
    counts more of what the runtime does (a payload moving once its receiver asks, eager
    bytes, shared cores). Keeping the DP's stages and replicas, cut where the simulation
    predicts fastest: every cut, where there are at most `search_all_up_to` (the
    simulator's optimum can lie several boundary moves away, past slower plans);
    otherwise walk from the DP's cut to the plan a boundary away that the simulation
    predicts fastest, also sideways (a bottleneck stage's neighbours may have to move
    before it can shrink), never back, for at most two steps per layer, and keep the
    first plan of the walk at least REFINE_GAIN faster than any before it. A cut other
    than the DP's must be predicted REFINE_GAIN faster than it."""
    rates: dict[tuple, float] = {}

    def key(p: Plan) -> tuple:
        return tuple((st.start, st.end) for st in p.stages)

    def rate(p: Plan) -> float:
        if key(p) not in rates:
            rates[key(p)] = run(p).samples_per_s
        return rates[key(p)]

    if math.comb(plan.num_layers - 1, len(plan.stages) - 1) <= search_all_up_to:
        fastest = max(_every_cut(plan), key=rate)  # a tie keeps the earlier cut
        return fastest if rate(fastest) > rate(plan) * (1 + REFINE_GAIN) else plan
    best = current = plan
    best_rate = current_rate = rate(plan)
    seen = {key(plan)}
    for _ in range(2 * plan.num_layers):
        moves = [m for m in _moved_boundaries(current) if key(m) not in seen]
        if not moves:
            break
        step = max(moves, key=rate)
        if rate(step) < current_rate * (1 - TIE):
            break  # every move is downhill
        current, current_rate = step, rate(step)
        seen.add(key(step))
        if current_rate > best_rate * (1 + REFINE_GAIN):
            best, best_rate = current, current_rate
    return best


def _pipedream(profile: ModelProfile, topo: HierarchicalTopology, micro_batch: int,
               steps: int, run: Callable[[Plan], SimulationResult],
               budget: float | None) -> Candidate:
    result = pipedream(at_batch(profile, micro_batch), topo)
    replicated = any(s.replicas > 1 for s in result.stages)
    plan = to_plan(result, "1f1b-rr" if replicated else "1f1b", micro_batch)
    plan = refine_boundaries(plan.replace(micro_batches_per_step=steps), run)
    return _pipeline("pipedream", plan, run, budget, topo.num_workers)


def _balanced_bounds(compute: list[float], stages: int) -> list[int]:
    """Stage boundaries (0, ..., n) of `stages` contiguous non-empty stages that minimize
    the largest stage's compute (a tie keeps the earlier cut)."""
    n = len(compute)
    prefix = [0.0, *itertools.accumulate(compute)]
    # worst[k][j]: the least largest stage over the first j layers in k stages
    worst = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    worst[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                w = max(worst[k - 1][i], prefix[j] - prefix[i])
                if w < worst[k][j]:
                    worst[k][j], cut[k][j] = w, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def straight_pipeline(profile: ModelProfile, workers: int, micro_batch: int,
                      run: Callable[[Plan], SimulationResult],
                      micro_batches_per_step: int = 1) -> Plan | None:
    """The pipeline of one stage per worker, none replicated (1F1B), cut where `run`
    predicts fastest: `refine_boundaries` from the cut that balances the layers' compute.
    None where the model has fewer layers than `workers`."""
    if not 1 < workers <= profile.num_layers:
        return None
    bounds = _balanced_bounds(profile.column("compute_s"), workers)
    plan = Plan(tuple(StagePlan(a, b, 1) for a, b in itertools.pairwise(bounds)),
                schedule="1f1b", micro_batch=micro_batch,
                micro_batches_per_step=micro_batches_per_step,
                extra={"planner": "straight"})
    return refine_boundaries(plan, run)


def _straight(profile: ModelProfile, topo: HierarchicalTopology, micro_batch: int,
              steps: int, run: Callable[[Plan], SimulationResult], budget: float | None,
              pipedream_plan: Plan | None) -> Candidate | None:
    n = topo.num_workers
    if pipedream_plan is not None and pipedream_plan.num_stages == n:
        return None  # PipeDream's plan is one stage per worker already
    plan = straight_pipeline(profile, n, micro_batch, run, steps)
    return None if plan is None else _pipeline("straight", plan, run, budget, n)


def _madpipe(profile: ModelProfile, topo: HierarchicalTopology, micro_batch: int,
             steps: int, run: Callable[[Plan], SimulationResult],
             budget: float | None) -> Candidate:
    n = topo.num_workers
    if budget is None:
        return Candidate("madpipe", 0.0, math.nan, n, "madpipe: not planned, it needs a "
                         "memory budget per worker", fits=False)
    level = slowest_level(topo)
    flat = HierarchicalTopology((Level(n, level.bandwidth, level.latency),))
    scaled = at_batch(profile, micro_batch)
    try:
        result = madpipe(scaled, flat, memory_per_worker=budget)
    except ValueError:
        least, _ = smallest_budget(scaled, n)
        return Candidate("madpipe", 0.0, least, n, "madpipe: " + _over(least, budget)
                         + " for any partition", fits=False, least_memory_bytes=least)
    # The runtime keeps MadPipe's 1F1B* counts per stage (its warm-up forwards).
    plan = Plan(result.stages, schedule="1f1b", micro_batch=micro_batch,
                stage_in_flight=result.in_flight, micro_batches_per_step=steps,
                extra={"planner": "madpipe",
                       "one_f_one_b_star": {"period_s": result.period_s,
                                            "in_flight": list(result.in_flight)}})
    return _pipeline("madpipe", plan, run, budget, n)


# --------------------------------------------------------------------------- choose
def choose(
    profile: ModelProfile,
    topology: HierarchicalTopology | str,
    memory_per_worker: float | str | None = None,
    *,
    batch_size: int,
    micro_batch: int | None = None,
    dp_network: NetworkParams | None = None,
    staleness: int = 1,
) -> PlanChoice:
    """Rank PipeDream's plan, MadPipe's plan, the straight pipeline and data parallelism by
    predicted samples/s.

    Args:
        profile: per-layer figures (`pipesgd.planner.profile`), at any batch size.
        topology: e.g. "4x[20GB/s], 2x[1Gbit]"; its memory is the default budget.
        memory_per_worker: the budget ("16GB" or bytes); None: the topology's, or none.
        batch_size: samples per optimizer step of one worker (see the module docstring).
        micro_batch: samples per pipeline micro-batch (default `batch_size`); it must
            divide `batch_size`.
        dp_network: the network data parallelism runs on (default: from the topology).
        staleness: K of replicated stages' all-reduce in the simulation (the runtime's
            `pipesgd pipeline --staleness`).

    Returns:
        PlanChoice: the candidates within the budget, fastest first, those excluded and
        why, and an explanation of the winner against the runner-up.

    Raises:
        ValueError: bad batch sizes, a profile without layers, or no candidate within the
            budget (the message names the smallest budget that fits).
    """
    topo = as_topology(topology)
    budget = (parse_bytes(memory_per_worker) if memory_per_worker is not None
              else topo.memory_per_worker)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    micro = batch_size if micro_batch is None else micro_batch
    if not isinstance(micro, int) or micro < 1 or batch_size % micro:
        raise ValueError(f"the micro-batch ({micro!r}) must be a positive divisor of the batch "
                         f"size ({batch_size}), e.g. choose(..., batch_size=32, micro_batch=8)")
    steps = batch_size // micro

    def run(plan: Plan) -> SimulationResult:
        return simulate(plan, profile, topo, staleness=staleness)

    pipedream_candidate = _pipedream(profile, topo, micro, steps, run, budget)
    straight = _straight(profile, topo, micro, steps, run, budget, pipedream_candidate.plan)
    candidates = [
        _data_parallel(profile, topo, batch_size, dp_network, budget),
        pipedream_candidate,
        _madpipe(profile, topo, micro, steps, run, budget),
        *([straight] if straight is not None else []),
    ]
    fitting = [c for c in candidates if c.fits]
    excluded = tuple(c for c in candidates if not c.fits)
    if not fitting:
        least = min((c for c in excluded if not math.isnan(c.least_memory_bytes)),
                    key=lambda c: c.least_memory_bytes)
        need = math.ceil(least.least_memory_bytes)
        each = ", ".join(f"{c.family} {format_bytes(c.least_memory_bytes)}" for c in excluded
                         if not math.isnan(c.least_memory_bytes))
        raise ValueError(
            f"no plan fits {format_bytes(budget or 0)} per worker; the smallest budget that "
            f"fits is {need} bytes ({format_bytes(need)}, {least.family}): give a budget of "
            f"at least that (memory_per_worker={need}, --memory {need}). Least per worker: "
            f"{each} (a pipeline with one micro-batch in flight)"
        )
    fastest = max(c.samples_per_s for c in fitting)

    def key(c: Candidate) -> tuple[int, float, int, int]:
        tie = c.samples_per_s >= fastest * (1 - TIE)
        return (0 if tie else 1, -c.samples_per_s, FAMILIES.index(c.family), c.workers)

    ranked = tuple(sorted(fitting, key=key))
    return PlanChoice(ranked, excluded, _explain(ranked), budget, batch_size, micro)


def _explain(ranked: tuple[Candidate, ...]) -> str:
    win = ranked[0]
    if len(ranked) == 1:
        return (f"{win.family} is the only candidate within the budget, "
                f"{win.samples_per_s:.4g} samples/s: {win.reason}")
    second = ranked[1]
    ratio = win.samples_per_s / second.samples_per_s if second.samples_per_s else math.inf
    lead = (f"{win.family} ties {second.family} at {win.samples_per_s:.4g} samples/s (ties "
            f"go to {', then '.join(FAMILIES)})" if ratio <= 1 + TIE else
            f"{win.family} wins with {win.samples_per_s:.4g} samples/s, {ratio:.2f}x the "
            f"runner-up {second.family} ({second.samples_per_s:.4g} samples/s)")
    return f"{lead}. Winner: {win.reason}. Runner-up: {second.reason}."


__all__ = [
    "DP_CORES_PER_WORKER",
    "FAMILIES",
    "Candidate",
    "PlanChoice",
    "at_batch",
    "choose",
    "data_parallel_memory",
    "data_parallel_network",
    "data_parallel_pick",
    "data_parallel_profile",
    "data_parallel_rate",
    "format_bytes",
    "refine_boundaries",
    "straight_pipeline",
]
