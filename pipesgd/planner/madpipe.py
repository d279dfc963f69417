"""MadPipe (Beaumont, Eyraud-Dubois, Shilova; §3-4): memory-aware partitioning of a chain
of layers onto P identical workers, one contiguous stage per worker.

1F1B* (§4.1). For a contiguous partition with stage loads U(s) (forward + backward) and a
period T, walk the stages from the last to the first and close a group whenever the next
stage would push the group's load above T; a stage of group g (group 1 holds the last
stage) keeps g micro-batches' activations. Proposition 1: no periodic schedule of period
T keeps fewer on any stage. Links count as stages of load C = 2a/B between the stages
they join. Example, loads (2, 2, 2) and T = 5: groups {s3, s2} = 1 and {s1} = 2, so the
stages keep (2, 1, 1) micro-batches.

MadPipe-DP (§4.2.2) builds the partition from the last layer backwards. V, the delay
between a layer's forward and its backward that the layers after it impose, grows by
each stage and link with

    x ⊕ y = x + y                 if ceil(x/T̂) = ceil((x+y)/T̂)   (same group)
            T̂·ceil(x/T̂) + y       otherwise                       (a new group)

and a stage k..l placed after a delay V keeps g = ceil((V ⊕ U(k,l))/T̂) micro-batches.
A stage fits when weights + optimizer state + g·(saved activations) <= the budget M. The
DP returns the smallest period max(U, C) of a fitting partition for the target T̂, and
Algorithm 1 searches T̂: the period max(DP(T̂), T̂) is smallest where the non-increasing
DP(T̂) meets T̂.

Interpretations and choices:
- Only MadPipe's normal processors: every worker runs one contiguous stage (at most P
  stages; fewer leaves workers idle). The special processor, which takes several
  stages, has a memory the paper only bounds from below and a schedule that needs the
  ILP of §4.3; without it, Proposition 1 gives every stage's memory exactly, so a plan
  never exceeds the budget. MadPipe has no stage replication (data parallelism is left
  as orthogonal, §1), nor has this.
- V is continuous. Instead of discretizing it, the DP keeps, for each (layers left,
  workers used), the Pareto set of (period so far, V) over the partitions of the layers
  after them: a smaller V never costs memory or period later, so this is exact.
- A stage's count is ceil((V ⊕ U)/T̂), not the paper's ceil((V + U)/T̂): they agree
  whenever U <= T̂, and the former is the larger (never an under-count) otherwise.
- Algorithm 1 line 7 reads lb <- max(lb, min(T_i, T̃_i)), which is T_i, but the text says
  min(T_i, T̂_i) is the lower bound; this follows the text (read literally, the search
  stops at periods up to 2.2x the optimum on the tests' random cases). DP(ub) runs
  first: at T̂ = ub every stage keeps one micro-batch, so it decides whether any plan fits.
- Algorithm 1 runs a partition at T̃ = max(DP(T̂), T̂), where T̂ is wherever the search
  stopped. Here each partition it found then runs at the shortest period at which its
  1F1B* memory fits (at most T̃; counts only change where the period equals the load of
  consecutive stages and links), and the best of them is returned, its counts recomputed
  with Proposition 1 and its memory checked against the budget. On small cases this
  reaches the brute-force optimum (`tests/test_planner_madpipe.py`).
- Memory of a stage = weight_copies · weights + optimizer state + g · saved activation
  bytes (MadPipe writes 3W + g·Σa_{i-1} + communication buffers 2(a_{k-1} + a_l); the
  buffers are not counted here, and the saved bytes are what autograd keeps).
- Counts are at least 1: a stage holds its micro-batch from forward to backward even
  when its load is zero.

The result is a partition and its 1F1B* figures; `pipesgd.pipeline` runs 1F1B, not
1F1B*, so turning it into a `Plan` is left to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipesgd.pipeline.plan import StagePlan

from .profile import ModelProfile
from .topology import HierarchicalTopology, as_topology, parse_bytes

_EPS = 1e-9  # relative slack on group boundaries: float sums that hit T exactly stay inside


def _groups(x: float, period: float) -> int:
    """ceil(x / period), robust to rounding at exact multiples."""
    return max(0, math.ceil(x / period - _EPS))


def _oplus(x: float, y: float, period: float) -> float:
    g = _groups(x, period)
    return x + y if _groups(x + y, period) == g else period * g + y


def stored_activations(
    stage_compute_s: Sequence[float],
    period: float,
    link_s: Sequence[float] | None = None,
) -> list[int]:
    """Proposition 1: micro-batches each stage keeps in flight under 1F1B* at `period`.

    Args:
        stage_compute_s: U(s), forward + backward time of each stage, first to last.
        period: T, the time between two micro-batches entering the pipeline.
        link_s: C, the time of the link after each stage but the last (2a/B); None: 0.

    Returns:
        The group number of each stage (>= 1): the fewest micro-batches any periodic
        schedule of period T keeps on that stage.

    Raises:
        ValueError: a stage or link longer than the period (no schedule reaches it), or
            a `link_s` of the wrong length.
    """
    loads = [float(u) for u in stage_compute_s]
    links = [0.0] * max(0, len(loads) - 1) if link_s is None else [float(c) for c in link_s]
    if len(links) != max(0, len(loads) - 1):
        raise ValueError(f"{len(loads)} stages need {max(0, len(loads) - 1)} links, "
                         f"got {len(links)}")
    if not period > 0:
        raise ValueError(f"the period must be > 0, got {period}")
    chain: list[tuple[str, int, float]] = []
    for i, u in enumerate(loads):
        chain.append(("stage", i, u))
        if i < len(links):
            chain.append(("link", i, links[i]))
    counts = [0] * len(loads)
    group, filled = 1, 0.0
    for kind, i, load in reversed(chain):
        if load < 0 or load > period * (1 + _EPS):
            raise ValueError(
                f"{kind} {i} takes {load:.6g} s, more than the period {period:.6g} s: no "
                f"periodic schedule reaches that period; use a period >= {load:.6g}"
            )
        if filled + load > period * (1 + _EPS):
            group, filled = group + 1, 0.0
        filled += load
        if kind == "stage":
            counts[i] = group
    return counts


def stage_memory(
    profile: ModelProfile,
    start: int,
    end: int,
    in_flight: int,
    *,
    weight_copies: int = 1,
) -> float:
    """Bytes a worker needs for layers [start, end) keeping `in_flight` micro-batches:
    weight_copies · weights + optimizer state + in_flight · saved activations."""
    layers = profile.layers[start:end]
    return (weight_copies * sum(lp.param_bytes for lp in layers)
            + sum(lp.optimizer_bytes for lp in layers)
            + in_flight * sum(lp.saved_bytes for lp in layers))


@dataclass(frozen=True)
class MadPipeResult:
    """A contiguous partition that fits the memory budget, and its 1F1B* figures.

    Attributes:
        stages: one stage per worker used (replicas 1), as `Plan` stages.
        period_s: the period it runs at under 1F1B* (time per micro-batch).
        in_flight: per stage, micro-batches kept (Proposition 1 at `period_s`).
        memory_bytes: per stage, the memory with that many micro-batches.
        memory_per_worker: the budget.
        num_workers: workers available (some may be idle).
        target_period_s: the T̂ of Algorithm 1 that gave this partition.
    """

    stages: tuple[StagePlan, ...]
    period_s: float
    in_flight: tuple[int, ...]
    memory_bytes: tuple[float, ...]
    memory_per_worker: float
    num_workers: int
    target_period_s: float

    def describe(self) -> str:
        lines = [f"MadPipe plan: period {self.period_s:.6g} s, {len(self.stages)} stage(s) "
                 f"on {self.num_workers} worker(s), budget {self.memory_per_worker:.6g} B"]
        for i, (s, g, mem) in enumerate(
            zip(self.stages, self.in_flight, self.memory_bytes, strict=True)
        ):
            lines.append(f"  stage {i}: layers [{s.start}, {s.end}), {g} in flight, "
                         f"{mem:.6g} B")
        return "\n".join(lines)


class _Chain:
    """Prefix sums of a profile: the load U and memory of layers [start, end), and the
    link time C after each layer."""

    def __init__(self, profile: ModelProfile, bandwidth: float, weight_copies: int) -> None:
        self.n = profile.num_layers
        self._u = [0.0, *accumulate(profile.column("compute_s"))]
        fixed = [weight_copies * lp.param_bytes + lp.optimizer_bytes for lp in profile.layers]
        self._fixed = [0.0, *accumulate(fixed)]
        self._saved = [0.0, *accumulate(profile.column("saved_bytes"))]
        self.link = [2.0 * a / bandwidth for a in profile.column("output_bytes")]

    def load(self, start: int, end: int) -> float:
        return self._u[end] - self._u[start]

    def memory(self, start: int, end: int, in_flight: int) -> float:
        return (self._fixed[end] - self._fixed[start]
                + in_flight * (self._saved[end] - self._saved[start]))


def _madpipe_dp(
    chain: _Chain, workers: int, budget: float, target: float
) -> tuple[float, list[tuple[int, int]] | None]:
    """MadPipe-DP without a special processor: the smallest period max(U, C) of a
    partition into <= `workers` stages whose memory at target period `target` fits.

    Returns (period, stages as half-open layer ranges) or (inf, None).
    """
    n = chain.n
    # fronts[(rest, p)]: entries (period, V, start, end, parent) for the partitions of
    # layers [rest, n) onto p workers; [start, end) is the entry's stage (start = rest),
    # `parent` the entry of the stages after it.
    fronts: dict[tuple[int, int], list[tuple]] = {(n, 0): [(0.0, 0.0, n, n, None)]}
    for rest in range(n, 0, -1):
        for p in range(workers):
            front = fronts.pop((rest, p), None)
            if not front:
                continue
            front.sort(key=lambda e: (e[0], e[1]))
            kept, best_v = [], math.inf
            for entry in front:  # Pareto: keep an entry only if its V beats every cheaper one
                if entry[1] < best_v:
                    kept.append(entry)
                    best_v = entry[1]
            for entry in kept:
                period, v = entry[0], entry[1]
                for start in range(rest - 1, -1, -1):
                    u = chain.load(start, rest)
                    x = _oplus(v, u, target)
                    if chain.memory(start, rest, max(1, _groups(x, target))) > budget:
                        break  # more layers only need more memory
                    link = chain.link[start - 1] if start > 0 else 0.0
                    v_next = _oplus(x, link, target) if start > 0 else x
                    fronts.setdefault((start, p + 1), []).append(
                        (max(period, u, link), v_next, start, rest, entry)
                    )
    finals = [e for (rest, _), front in fronts.items() if rest == 0 for e in front]
    if not finals:
        return math.inf, None
    entry = min(finals, key=lambda e: (e[0], e[1]))
    period, stages = entry[0], []
    while entry[4] is not None:
        stages.append((entry[2], entry[3]))
        entry = entry[4]
    return period, stages


def smallest_budget(
    profile: ModelProfile, num_workers: int, *, weight_copies: int = 1
) -> tuple[float, tuple[StagePlan, ...]]:
    """The least memory per worker any contiguous partition onto `num_workers` needs:
    every stage keeping one micro-batch (a period long enough to run them one at a
    time), the partition minimizing the largest stage. Returns (bytes, stages)."""
    chain = _Chain(profile, 1.0, weight_copies)
    n = chain.n
    best = [[math.inf] * (num_workers + 1) for _ in range(n + 1)]
    cut = [[0] * (num_workers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for end in range(1, n + 1):
        for p in range(1, num_workers + 1):
            for k in range(end):
                value = max(best[k][p - 1], chain.memory(k, end, 1))
                if value < best[end][p]:
                    best[end][p], cut[end][p] = value, k
    p = min(range(1, num_workers + 1), key=lambda q: (best[n][q], q))
    budget, stages, end = best[n][p], [], n
    while end > 0:
        k = cut[end][p]
        stages.append(StagePlan(k, end))
        end, p = k, p - 1
    return budget, tuple(stages[::-1])


def _setup(
    profile: ModelProfile,
    topology: HierarchicalTopology | str,
    memory_per_worker: float | str | None,
    weight_copies: int,
    num_layers: int | None,
) -> tuple[_Chain, int, float]:
    topo = as_topology(topology)
    profile.check(num_layers)
    if topo.num_levels != 1:
        raise ValueError(
            f"MadPipe plans one level of identical workers; {str(topo)!r} has "
            f"{topo.num_levels} levels: give one, e.g. '{topo.num_workers}x[10Gbit]', or "
            "use pipedream() for a hierarchy"
        )
    given = memory_per_worker if memory_per_worker is not None else topo.memory_per_worker
    if given is None:
        raise ValueError("MadPipe needs the memory of a worker: madpipe(profile, '4x[10Gbit]', "
                         "memory_per_worker='16GB')")
    if weight_copies < 0:
        raise ValueError(f"weight_copies must be >= 0, got {weight_copies}")
    chain = _Chain(profile, topo.levels[0].bandwidth, weight_copies)
    return chain, topo.num_workers, parse_bytes(given)


def madpipe_dp(
    profile: ModelProfile,
    topology: HierarchicalTopology | str,
    target_period_s: float,
    *,
    memory_per_worker: float | str | None = None,
    weight_copies: int = 1,
) -> tuple[float, tuple[StagePlan, ...] | None]:
    """MadPipe-DP for one target period T̂ (the step Algorithm 1 repeats): the smallest
    period max(U, C) of a partition whose memory fits when every stage keeps the
    micro-batches 1F1B* needs at T̂. Returns (period, stages), or (inf, None) if none fits.
    """
    if not target_period_s > 0:
        raise ValueError(f"the target period must be > 0, got {target_period_s}")
    chain, workers, budget = _setup(profile, topology, memory_per_worker, weight_copies, None)
    period, stages = _madpipe_dp(chain, workers, budget, target_period_s)
    if stages is None:
        return period, None
    return period, tuple(StagePlan(start, end) for start, end in stages)


def madpipe(
    profile: ModelProfile,
    topology: HierarchicalTopology | str,
    *,
    memory_per_worker: float | str | None = None,
    iterations: int = 10,
    weight_copies: int = 1,
    num_layers: int | None = None,
) -> MadPipeResult:
    """Algorithm 1: the contiguous partition with the smallest 1F1B* period that fits.

    Args:
        profile: per-layer compute, output bytes, weights, optimizer state, saved bytes.
        topology: one level of identical workers, e.g. "4x[10Gbit]" (MadPipe's P and β).
        memory_per_worker: the budget M in bytes (or "16GB"); None: the topology's.
        iterations: K, the binary-search steps on the target period (the paper uses 10).
        weight_copies: copies of the weights a stage holds: 1 the parameters alone, 2 with
            their gradients, 3 as MadPipe counts (two versions, PipeDream-2BW, + gradients).
        num_layers: the model's layer count, checked against the profile (None: skip).

    Raises:
        ValueError: a topology of several levels, no budget, a profile of another layer
            count, or no partition that fits (the message gives the smallest budget).
    """
    if iterations < 1:
        raise ValueError(f"need iterations >= 1, got {iterations}")
    chain, workers, budget = _setup(profile, topology, memory_per_worker, weight_copies,
                                    num_layers)
    n = chain.n

    total = chain.load(0, n)
    lb = total / workers
    ub = total + sum(chain.link[: n - 1])
    if ub <= 0:
        ub = 1.0  # an all-zero profile: every period works
    candidates: list[tuple[float, float, list[tuple[int, int]]]] = []

    def evaluate(target: float) -> float:
        period, stages = _madpipe_dp(chain, workers, budget, target)
        if stages is not None:
            candidates.append((max(period, target), target, stages))
        return period

    if evaluate(ub) == math.inf:
        least, stages = smallest_budget(profile, workers, weight_copies=weight_copies)
        shown = " ".join(f"[{s.start},{s.end})" for s in stages)
        need = math.ceil(least)
        raise ValueError(
            f"no partition of {n} layers onto {workers} workers fits {budget:.0f} bytes per "
            f"worker; the smallest budget that fits is {need} bytes ({need / 1e9:.3g} GB: "
            f"stages {shown}, one micro-batch in flight each): give "
            f"memory_per_worker={need} or more, or more workers"
        )
    target = lb if lb > 0 else ub
    for _ in range(iterations):
        period = evaluate(target)
        lb = max(lb, min(period, target))
        ub = min(ub, max(period, target))
        target = (lb + ub) / 2

    best: MadPipeResult | None = None
    for dp_period, target, stages in candidates:
        result = _at_least_period(chain, stages, budget, workers, target, dp_period)
        if best is None or (result.period_s, len(result.stages)) < \
                (best.period_s, len(best.stages)):
            best = result
    assert best is not None  # DP(ub) found one
    return best


def _at_least_period(
    chain: _Chain,
    stages: list[tuple[int, int]],
    budget: float,
    workers: int,
    target: float,
    fits_at: float,
) -> MadPipeResult:
    """The partition at the shortest period at which its 1F1B* memory fits. Counts only
    change where the period equals the load of a run of consecutive stages and links, so
    those periods (and the longest single load) are the ones to try, with `fits_at`, the
    T̃ = max(DP(T̂), T̂) at which the DP found it fits (the answer is never longer)."""
    loads = [chain.load(start, end) for start, end in stages]
    links = [chain.link[end - 1] for _, end in stages[:-1]]
    items = [x for pair in zip(loads, [*links, 0.0], strict=True) for x in pair][:-1]
    longest = max(items)
    runs = {sum(items[i:j]) for i in range(len(items)) for j in range(i + 1, len(items) + 1)}
    for period in sorted(r for r in runs | {fits_at} if longest <= r <= fits_at and r > 0):
        counts = stored_activations(loads, period, links)
        memory = [chain.memory(start, end, g)
                  for (start, end), g in zip(stages, counts, strict=True)]
        if max(memory) <= budget * (1 + _EPS):
            return MadPipeResult(
                stages=tuple(StagePlan(start, end) for start, end in stages),
                period_s=period,
                in_flight=tuple(counts),
                memory_bytes=tuple(memory),
                memory_per_worker=budget,
                num_workers=workers,
                target_period_s=target,
            )
    raise AssertionError("MadPipe-DP returned partitions that do not fit")  # pragma: no cover
