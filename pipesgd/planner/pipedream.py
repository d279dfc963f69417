"""PipeDream's partitioner (SOSP'19 §3.1): stages, replicas per stage and NOAM for a
hierarchical topology, by dynamic programming level by level.

With T_l = forward + backward time of layer l, a_l its output bytes, w_l its weight bytes
and level k made of m_k components of level k-1 joined at B_k bytes/s:

    A^0(i→j)    = Σ_{l=i..j} T_l
    T^k(i→j, m) = (1/m) max{ A^{k-1}(i→j, m_{k-1}),  2(m-1) Σ_{l=i..j} w_l / B_k }
    A^k(i→j, m) = min( T^k(i→j, m),
                       min_{i≤s<j} min_{1≤m'<m} max{ A^k(i→s, m-m'), 2a_s/B_k, T^k(s+1→j, m') } )

T^k is one stage over layers i..j replicated on m components of level k-1 (each of them
running the best pipeline A^{k-1} of those layers on its own m_{k-1} components, so at
k >= 2 a whole pipeline is replicated); A^k is the slowest stage of the best pipeline of
layers i..j on m components. The answer is A^L(0→N-1, m_L): the time per minibatch in
steady state. Small example, one level of 2 workers at 1 GB/s, layers of T = (3, 1) s,
a = (1 GB, ·), w = (0, 0): data parallelism T^1(0→1, 2) = 4/2 = 2 s beats the pipeline
max{3, 2·1e9/1e9, 1} = 3 s.

Interpretations of the paper (its text leaves these open):
- A^k includes the unsplit stage T^k(i→j, m): the paper's recurrence lists only splits,
  which would make data parallelism (a single replicated stage, which the paper names as
  a case) unreachable; its initialization A^k(i→j, 1) = A^{k-1}(i→j, m_{k-1}) is the m = 1
  instance of it.
- Every level uses exactly m of its components (the goal is A^L(0→N, m_L)); no worker is
  left idle even where fewer would be faster.
- A replicated level-k stage whose component runs a pipeline is flattened for `Plan`: an
  inner stage with r' replicas inside a level-k stage with r replicas becomes one stage
  with r·r' replicas. Its all-reduce is charged as the paper writes it, all of the stage's
  weights over one B_k link, although each inner stage's copies synchronize separately.
- Boundary traffic 2a_s/B_k is not divided among replicas; latency and memory are not in
  the objective (the paper's formulation has neither), so the topology's latency and
  memory are ignored here.
- The paper's layers are 1-based and i..j inclusive; here layers are 0-based and stages
  half-open [start, end), as in `Plan`. Ties go to fewer stages, then to earlier splits.

Ranks: `Plan` numbers ranks stage by stage, while the DP places replicas on components;
`PipeDreamResult.placement` says which worker (topology order, innermost level fastest)
runs each replica, for a launcher that maps ranks onto hosts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from pipesgd.pipeline.plan import Plan, StagePlan

from .profile import ModelProfile
from .topology import HierarchicalTopology, as_topology

_TIE = 1e-12  # a split must beat the incumbent by this relative margin to replace it


@dataclass(frozen=True)
class LevelStage:
    """A stage of one level's pipeline: layers [start, end) on `replicas` components of the
    level below, taking `time_s` = T^level per minibatch; `inner` is the pipeline that each
    of those components runs over the same layers (empty at level 1: a component is a
    worker).
    """

    level: int
    start: int
    end: int
    replicas: int
    time_s: float
    inner: tuple[LevelStage, ...] = ()


@dataclass(frozen=True)
class PipeDreamResult:
    """The optimal partition of PipeDream's objective.

    Attributes:
        stages: flattened over the levels, as `Plan` stages (layers and replicas).
        placement: per stage, the workers (topology order) of its replicas, in order.
        time_per_minibatch_s: A^L(0→N-1, m_L), the objective's value.
        noam: ceil(#workers / #replicas of the input stage) (PipeDream §3.2).
        num_workers: workers of the topology (all used).
        top: the top level's stages, each with the pipeline of its components inside.
        batch_size: samples per minibatch of the profile (0: not known).
    """

    stages: tuple[StagePlan, ...]
    placement: tuple[tuple[int, ...], ...]
    time_per_minibatch_s: float
    noam: int
    num_workers: int
    top: tuple[LevelStage, ...]
    batch_size: int = 0

    def describe(self) -> str:
        lines = [f"PipeDream plan: {self.time_per_minibatch_s:.6g} s per minibatch, "
                 f"{len(self.stages)} stage(s) on {self.num_workers} worker(s), "
                 f"NOAM {self.noam}"]
        for i, (stage, workers) in enumerate(zip(self.stages, self.placement, strict=True)):
            lines.append(f"  stage {i}: layers [{stage.start}, {stage.end}) x{stage.replicas} "
                         f"on workers {', '.join(map(str, workers))}")
        return "\n".join(lines)


class _Level:
    """A^k and its choices for one level k of `count` components: `value(i, j, m)`,
    `full(i, j)` = A^k(i→j, count) and `stages(i, j, m)`."""

    def __init__(
        self,
        count: int,
        bandwidth: float,
        below: Callable[[int, int], float],
        weights: Callable[[int, int], float],
        outputs: list[float],
        starts: range,
    ) -> None:
        n = len(outputs)
        self.count = count
        self.below = below  # (i, j) -> A^{k-1}(i→j, m_{k-1})
        self.bandwidth = bandwidth
        self.weights = weights  # (i, j) -> Σ w_l
        self._t: dict[tuple[int, int], list[float]] = {}
        self.a: dict[tuple[int, int], list[float]] = {}
        self.choice: dict[tuple[int, int], list[tuple[int, int] | None]] = {}
        for i in starts:
            for j in range(i, n):
                values = [math.inf] * (count + 1)
                choices: list[tuple[int, int] | None] = [None] * (count + 1)
                for m in range(1, count + 1):
                    best, pick = self.stage_time(i, j, m), None
                    for s in range(i, j):
                        comm = 2.0 * outputs[s] / bandwidth
                        left = self.a[(i, s)]
                        right = self._stage_times(s + 1, j)
                        for mp in range(1, m):
                            t = max(left[m - mp], comm, right[mp])
                            if t < best * (1 - _TIE):
                                best, pick = t, (s, mp)
                    values[m], choices[m] = best, pick
                self.a[(i, j)], self.choice[(i, j)] = values, choices

    def _stage_times(self, i: int, j: int) -> list[float]:
        row = self._t.get((i, j))
        if row is None:
            below, w = self.below(i, j), self.weights(i, j)
            row = [math.inf] + [max(below, 2.0 * (m - 1) * w / self.bandwidth) / m
                                for m in range(1, self.count + 1)]
            self._t[(i, j)] = row
        return row

    def stage_time(self, i: int, j: int, m: int) -> float:
        """T^k(i→j, m): layers i..j replicated on m components."""
        return self._stage_times(i, j)[m]

    def value(self, i: int, j: int, m: int) -> float:
        return self.a[(i, j)][m]

    def full(self, i: int, j: int) -> float:
        return self.a[(i, j)][self.count]

    def stages(self, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
        """The level-k stages (first layer, last layer, replicas) of A^k(i→j, m)."""
        out: list[tuple[int, int, int]] = []
        while True:
            pick = self.choice[(i, j)][m]
            if pick is None:
                out.append((i, j, m))
                return out[::-1]
            s, mp = pick
            out.append((s + 1, j, mp))
            j, m = s, m - mp


def pipedream(
    profile: ModelProfile,
    topology: HierarchicalTopology | str,
    *,
    num_layers: int | None = None,
) -> PipeDreamResult:
    """The partition, replicas and NOAM minimizing PipeDream's time per minibatch.

    Args:
        profile: per-layer compute (forward + backward), output and weight bytes.
        topology: levels innermost first, e.g. "4x[20GB/s], 2x[1Gbit]".
        num_layers: the model's layer count, checked against the profile (None: skip).

    Returns:
        PipeDreamResult; `to_plan(result)` turns it into a `Plan`.

    Raises:
        ValueError: a profile of another layer count, or a malformed topology.

    Cost: O(N^3 m_k^2) per level below the top, O(N^2 m_L^2) at the top (only pipelines
    that start at layer 0 are needed there).
    """
    topo = as_topology(topology)
    profile.check(num_layers)
    n = profile.num_layers
    compute = [0.0, *accumulate(profile.column("compute_s"))]
    params = [0.0, *accumulate(profile.column("param_bytes"))]
    outputs = profile.column("output_bytes")

    def weights(i: int, j: int) -> float:
        return params[j + 1] - params[i]

    def level0(i: int, j: int) -> float:
        return compute[j + 1] - compute[i]

    levels: list[_Level] = []
    below = level0
    for k, level in enumerate(topo.levels, start=1):
        top = k == topo.num_levels
        solved = _Level(level.count, level.bandwidth, below, weights, outputs,
                        range(1) if top else range(n))
        levels.append(solved)
        below = solved.full

    counts = [level.count for level in topo.levels]

    def tree(k: int, i: int, j: int, m: int) -> tuple[LevelStage, ...]:
        lv = levels[k - 1]
        return tuple(
            LevelStage(k, a, b + 1, r, lv.stage_time(a, b, r),
                       tree(k - 1, a, b, counts[k - 2]) if k > 1 else ())
            for a, b, r in lv.stages(i, j, m)
        )

    def flatten(k: int, i: int, j: int, m: int, base: int) -> list[tuple[int, int, list[int]]]:
        """Stages (start, end, workers) of A^k(i→j, m) on m components from worker `base`."""
        if k == 0:
            return [(i, j + 1, [base])]
        size = topo.component_size(k - 1)
        out: list[tuple[int, int, list[int]]] = []
        for a, b, r in levels[k - 1].stages(i, j, m):
            merged: list[tuple[int, int, list[int]]] = []
            for c in range(r):
                inner = flatten(k - 1, a, b, counts[k - 2] if k > 1 else 1, base + c * size)
                if not merged:
                    merged = [(s, e, list(w)) for s, e, w in inner]
                else:
                    for row, (_, _, w) in zip(merged, inner, strict=True):
                        row[2].extend(w)
            out.extend(merged)
            base += r * size
        return out

    L, m_top = topo.num_levels, counts[-1]
    flat = flatten(L, 0, n - 1, m_top, 0)
    stages = tuple(StagePlan(s, e, len(w)) for s, e, w in flat)
    return PipeDreamResult(
        stages=stages,
        placement=tuple(tuple(w) for _, _, w in flat),
        time_per_minibatch_s=levels[-1].value(0, n - 1, m_top),
        noam=math.ceil(topo.num_workers / stages[0].replicas),
        num_workers=topo.num_workers,
        top=tree(L, 0, n - 1, m_top),
        batch_size=profile.batch_size,
    )


def to_plan(
    result: PipeDreamResult,
    schedule: str = "1f1b-rr",
    micro_batch: int | None = None,
) -> Plan:
    """The `Plan` of a PipeDream result; `in_flight` is left to the plan's optimum (NOAM).

    Args:
        schedule: "1f1b-rr" (replicated stages) or "1f1b" (only for plans without replicas).
        micro_batch: samples per minibatch; None: the profile's batch size.

    Raises:
        ValueError: no micro-batch size known; PlanError for a schedule the plan cannot run.
    """
    if micro_batch is None:
        if result.batch_size < 1:
            raise ValueError("the profile does not say its batch size; give it, e.g. "
                             "to_plan(result, micro_batch=32)")
        micro_batch = result.batch_size
    return Plan(
        stages=result.stages,
        schedule=schedule,
        micro_batch=micro_batch,
        extra={
            "planner": "pipedream",
            "predicted_time_per_minibatch_s": result.time_per_minibatch_s,
            "placement": [list(w) for w in result.placement],
        },
    )
