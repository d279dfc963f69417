"""The pipeline plan: which layers each stage owns, how often it is replicated, how deep
the pipeline runs. It is the format a planner emits (JSON or a `Plan` object).

    {"stages": [{"layers": [0, 6], "replicas": 2}, {"layers": [6, 13], "replicas": 1}],
     "schedule": "1f1b-rr", "micro_batch": 8, "in_flight": null}

`layers` is a half-open range of global layer indices. Ranks are assigned stage by
stage: stage 0's replicas take ranks 0..r0-1, stage 1's the next r1 ranks, and so on.
`in_flight` is PipeDream's NOAM (minibatches admitted per input-stage replica); null
means the optimum, ceil(#workers / #input-stage replicas). `stage_in_flight`, if given,
sets per stage how many micro-batches a replica keeps in flight under 1F1B (its
forwards before its first backward) instead of PipeDream's formula: MadPipe's 1F1B*
counts (`pipesgd.planner.madpipe`), for example [3, 3, 1]. Counts that cannot finish
(a stage keeping more than its upstream feeds it) fail the offline deadlock check
(`schedule.build`) before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipesgd.json_files import load_json

SCHEDULES = ("1f1b", "1f1b-rr", "gpipe", "async")


class PlanError(ValueError):
    """A plan that cannot run; the message shows a plan that would."""


@dataclass(frozen=True)
class StagePlan:
    """One stage: global layers [start, end) on `replicas` ranks."""

    start: int
    end: int
    replicas: int = 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class Plan:
    """Stage boundaries, replicas per stage, pipeline depth, schedule and micro-batch size.

    Args:
        stages: consecutive stages covering layers 0..num_layers-1 without gaps.
        schedule: "1f1b", "1f1b-rr" (1f1b with replicated stages), "gpipe", or "async"
            (1f1b's order without weight stashing: PipeMare, `pipeline.pipemare`).
        micro_batch: samples per micro-batch (PipeDream's minibatch) sent through the pipe.
        in_flight: minibatches admitted per input-stage replica (NOAM); None = optimum.
        stage_in_flight: per stage, micro-batches a replica keeps in flight under 1F1B;
            None = PipeDream's count from `in_flight`.
        micro_batches_per_step: micro-batches per optimizer step. gpipe: per flush. 1f1b:
            the gradients of this many consecutive micro-batches of a replica are summed
            into one step (PipeDream-2BW's accumulation; 1 = a step per micro-batch).
    """

    stages: tuple[StagePlan, ...]
    schedule: str = "1f1b"
    micro_batch: int = 8
    in_flight: int | None = None
    micro_batches_per_step: int = 1
    stage_in_flight: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.stage_in_flight is not None:
            object.__setattr__(self, "stage_in_flight",
                               tuple(int(c) for c in self.stage_in_flight))
        self.validate()

    # ----------------------------------------------------------------- construction
    @classmethod
    def even(
        cls,
        num_layers: int,
        stages: int,
        *,
        replicas: tuple[int, ...] | None = None,
        **kwargs,
    ) -> Plan:
        """Cut `num_layers` layers into `stages` contiguous stages of near-equal length."""
        if not 1 <= stages <= num_layers:
            raise PlanError(
                f"cannot cut {num_layers} layers into {stages} stages; "
                f"use 1 <= stages <= {num_layers}, e.g. Plan.even({num_layers}, 2)"
            )
        bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
        reps = replicas or (1,) * stages
        return cls(
            stages=tuple(
                StagePlan(bounds[i], bounds[i + 1], reps[i]) for i in range(stages)
            ),
            **kwargs,
        )

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The plan `to_dict` wrote.

        Raises:
            ValueError: no list of stages, each {"layers": [start, end], "replicas": r}.
        """
        try:
            stages = tuple(
                StagePlan(int(s["layers"][0]), int(s["layers"][1]), int(s.get("replicas", 1)))
                for s in data["stages"]
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                'not a plan: expected {"stages": [{"layers": [start, end], "replicas": r}, '
                f'...], ...}} (`pipesgd plan --json` writes one); {type(exc).__name__}: {exc}'
            ) from exc
        known = {"stages", "schedule", "micro_batch", "in_flight", "micro_batches_per_step",
                 "stage_in_flight"}
        return cls(
            stages=stages,
            schedule=data.get("schedule", "1f1b"),
            micro_batch=int(data.get("micro_batch", 8)),
            in_flight=data.get("in_flight"),
            micro_batches_per_step=int(data.get("micro_batches_per_step", 1)),
            stage_in_flight=data.get("stage_in_flight"),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan a JSON file holds (`save`, `pipesgd plan --json`).

        Raises:
            ValueError: the file holds no plan (not JSON, or from_dict's errors), with its
                name.
        """
        return load_json(path, "a pipeline plan (`pipesgd plan --json`)", cls.from_dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stages"] = [
            {"layers": [s.start, s.end], "replicas": s.replicas} for s in self.stages
        ]
        extra = out.pop("extra")
        out.update(extra)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes) -> Plan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def at_depth(self, depth: int) -> Plan:
        """A copy admitting at most `depth` micro-batches per input-stage replica: NOAM
        `depth`, or every per-stage count capped at `depth`."""
        if self.stage_in_flight is not None:
            return self.replace(stage_in_flight=tuple(min(c, depth)
                                                      for c in self.stage_in_flight))
        return self.replace(in_flight=depth)

    # ----------------------------------------------------------------- validation
    def validate(self, num_layers: int | None = None) -> None:
        example = (
            '{"stages": [{"layers": [0, 3], "replicas": 1}, {"layers": [3, 5], "replicas": 1}], '
            '"schedule": "1f1b", "micro_batch": 8}'
        )
        if not self.stages:
            raise PlanError(f"a plan needs at least one stage, e.g. {example}")
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        expect = 0
        for i, s in enumerate(self.stages):
            if s.start != expect or s.end <= s.start:
                raise PlanError(
                    f"stage {i} covers layers [{s.start}, {s.end}) but must start at layer "
                    f"{expect} and be non-empty: stages are consecutive half-open ranges, "
                    f"e.g. {example}"
                )
            if s.replicas < 1:
                raise PlanError(f"stage {i} has {s.replicas} replicas; use replicas >= 1")
            expect = s.end
        if num_layers is not None and expect != num_layers:
            raise PlanError(
                f"the plan covers layers [0, {expect}) but the model has {num_layers} layers; "
                f"make the last stage end at {num_layers}, e.g. "
                f"Plan.even({num_layers}, {len(self.stages)})"
            )
        if self.micro_batch < 1:
            raise PlanError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.in_flight is not None and self.in_flight < 1:
            raise PlanError(f"in_flight must be >= 1 or null, got {self.in_flight}")
        if self.stage_in_flight is not None:
            counts = self.stage_in_flight
            if len(counts) != len(self.stages) or min(counts) < 1:
                raise PlanError(
                    f"stage_in_flight must give every one of the {len(self.stages)} stages a "
                    f"count >= 1, got {list(counts)}; e.g. "
                    f"{list(range(len(self.stages), 0, -1))}"
                )
            if self.schedule == "gpipe":
                raise PlanError("stage_in_flight sets 1F1B's warm-up; gpipe keeps a whole "
                                "step in flight: drop it or use schedule '1f1b'")
            if self.in_flight is not None and self.in_flight != counts[0]:
                raise PlanError(
                    f"in_flight {self.in_flight} contradicts stage_in_flight {list(counts)}, "
                    f"whose first count is what the input stage admits: drop in_flight"
                )
        if self.micro_batches_per_step < 1:
            raise PlanError(
                f"micro_batches_per_step must be >= 1, got {self.micro_batches_per_step}"
            )
        if self.schedule == "async" and any(s.replicas > 1 for s in self.stages):
            raise PlanError(
                "schedule 'async' (PipeMare) runs one rank per stage; this plan replicates a "
                "stage: set every stage's replicas to 1")
        if self.schedule == "1f1b" and any(s.replicas > 1 for s in self.stages):
            raise PlanError(
                "schedule '1f1b' runs one rank per stage; this plan replicates a stage: "
                "use schedule '1f1b-rr' for replicated stages"
            )

    # ----------------------------------------------------------------- layout
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def noam(self) -> int:
        """Minibatches admitted per input-stage replica (PipeDream §3.2)."""
        if self.stage_in_flight is not None:
            return self.stage_in_flight[0]
        if self.in_flight is not None:
            return self.in_flight
        return math.ceil(self.world_size / self.stages[0].replicas)

    @property
    def cycle(self) -> int:
        """Micro-batches after which the schedule repeats: every stage's replicas take
        their turns (round-robin) and update rounds end together. A steady rate counted
        over whole cycles does not depend on where in a cycle the count starts."""
        return self.micro_batches_per_step * math.lcm(*(s.replicas for s in self.stages))

    def first_rank(self, stage: int) -> int:
        return sum(s.replicas for s in self.stages[:stage])

    def rank_of(self, stage: int, replica: int) -> int:
        return self.first_rank(stage) + replica

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) run by `rank`."""
        for stage, s in enumerate(self.stages):
            first = self.first_rank(stage)
            if first <= rank < first + s.replicas:
                return stage, rank - first
        raise PlanError(
            f"rank {rank} has no stage: the plan needs {self.world_size} ranks; "
            f"run `mpirun -n {self.world_size} ...`"
        )

    def replica_of(self, stage: int, micro_batch: int) -> int:
        """Round-robin routing (1F1B-RR): forward and backward meet on the same replica."""
        return micro_batch % self.stages[stage].replicas

    def check_world(self, size: int) -> None:
        if size != self.world_size:
            raise PlanError(
                f"the plan places {self.world_size} stage replicas but {size} ranks run; "
                f"run `mpirun -n {self.world_size} ...` or change the plan's replicas"
            )
