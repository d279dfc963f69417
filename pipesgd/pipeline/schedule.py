"""Schedules as data: actions, per-rank generators, lowering, offline deadlock check, table.

An `Action` is a tiny value that prints as `<stage><kind><minibatch>` and parses back:

    2F0   forward of micro-batch 0 on stage 2      2B0   its backward
    1RF3  receive the activation of micro-batch 3   1SF3  send it downstream
    1RB3  receive the gradient of micro-batch 3     1SB3  send it upstream
    0AR5  all-reduce round 5 among stage 0 replicas 0U5   optimizer step of round 5

`generate` builds each rank's compute actions (F, B, U) from the plan; `lower` adds the
sends, receives and all-reduces; `simulate` runs all ranks' lists offline (sends never
block, receives wait for their send, an all-reduce waits for every replica of its stage)
and raises `DeadlockError` with the table of the stuck ranks before anything runs.

1F1B (PipeDream §3.2): replica r of stage s takes micro-batches i with i % replicas == r
(1F1B-RR), runs `warmup` forwards, then alternates backward/forward, then drains. With
W_s workers from stage s to the end, warmup = ceil((NOAM * r_0 - (W_0 - W_s)) / r_s),
i.e. NOAM - s on a straight pipeline, unless the plan gives per-stage counts
(`stage_in_flight`, MadPipe's 1F1B*). An optimizer step follows every
`micro_batches_per_step`-th backward (1: PipeDream's step per micro-batch; more
accumulates the gradients of consecutive micro-batches into one step, as PipeDream-2BW).
GPipe: per step, all forwards of its micro-batches, then all backwards, then one step.
`async` (PipeMare) runs 1F1B's order; only the weights differ (`pipemare.AsyncWeights`),
and `delays` gives each stage's delay in optimizer steps.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .plan import Plan

COMPUTE = ("F", "B", "U")
COMM = ("RF", "SF", "RB", "SB", "AR")
_PATTERN = re.compile(r"^(\d+)(RF|SF|RB|SB|AR|F|B|U)(\d+)$")


class ScheduleError(RuntimeError):
    """A schedule that is malformed or cannot finish."""


class DeadlockError(ScheduleError):
    """The offline simulation found ranks that wait on each other forever."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: `kind` of micro-batch (or update round) `mb` on `stage`."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _PATTERN.match(text.strip())
        if m is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: write <stage><kind><micro-batch>, e.g. '2F0', "
                f"kinds {', '.join(COMPUTE + COMM)}"
            )
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


Schedule = dict[int, list[Action]]


def parse_schedule(rows: dict[int, Iterable[str]]) -> Schedule:
    return {rank: [Action.parse(a) for a in acts] for rank, acts in rows.items()}


# --------------------------------------------------------------------------- generators
def warmup_forwards(plan: Plan, stage: int) -> int:
    """Forwards a replica of `stage` runs before its first backward under 1F1B: the plan's
    `stage_in_flight` count if it has one, else PipeDream's."""
    if plan.stage_in_flight is not None:
        return plan.stage_in_flight[stage]
    workers = [sum(s.replicas for s in plan.stages[i:]) for i in range(plan.num_stages)]
    admitted = plan.noam * plan.stages[0].replicas
    ahead = admitted - (workers[0] - workers[stage])
    return max(1, math.ceil(ahead / plan.stages[stage].replicas))


def owned(plan: Plan, stage: int, replica: int, mbs: Iterable[int]) -> list[int]:
    return [i for i in mbs if plan.replica_of(stage, i) == replica]


def generate(plan: Plan, num_micro_batches: int) -> Schedule:
    """Compute actions (F, B, U) of every rank for one epoch of `num_micro_batches`."""
    if num_micro_batches < 1:
        raise ScheduleError("an epoch needs at least one micro-batch")
    out: Schedule = {}
    for stage, sp in enumerate(plan.stages):
        for rep in range(sp.replicas):
            rank = plan.rank_of(stage, rep)
            if plan.schedule == "gpipe":
                out[rank] = _gpipe(plan, stage, rep, num_micro_batches)
            else:
                out[rank] = _one_f_one_b(plan, stage, rep, num_micro_batches)
    return out


def delays(plan: Plan, num_micro_batches: int | None = None) -> list[tuple[int, int]]:
    """(tau_fwd, tau_bkwd) of every stage under 1F1B's order with one set of weights:
    the optimizer steps a micro-batch's forward weights lag behind the step its gradient
    is applied in, and the same for its backward weights (PipeMare's tau_fwd,i, tau_bkwd,i).

    The backward runs on the weights current then and its gradient goes into the next
    step, so tau_bkwd is 0; tau_fwd counts the steps between a micro-batch's forward
    and its backward, at its largest over an epoch of `num_micro_batches` (default: long
    enough to reach the steady state).
    """
    n = num_micro_batches or 4 * plan.world_size * plan.micro_batches_per_step + 8
    one_f_one_b = plan if plan.schedule != "gpipe" else plan.replace(schedule="1f1b")
    out = []
    for stage in range(plan.num_stages):
        acts = _one_f_one_b(one_f_one_b, stage, 0, n)
        steps, forward_at, tau = 0, {}, 0
        for a in acts:
            if a.kind == "U":
                steps += 1
            elif a.kind == "F":
                forward_at[a.mb] = steps
            elif a.kind == "B":
                tau = max(tau, steps - forward_at.pop(a.mb))
        out.append((tau, 0))
    return out


def _one_f_one_b(plan: Plan, stage: int, rep: int, n: int) -> list[Action]:
    m = plan.micro_batches_per_step
    mine = owned(plan, stage, rep, range(n))
    rounds = math.ceil(math.ceil(n / plan.stages[stage].replicas) / m)
    warm = min(len(mine), warmup_forwards(plan, stage))
    acts = [Action(stage, "F", i) for i in mine[:warm]]
    for k, i in enumerate(mine):
        acts.append(Action(stage, "B", i))
        if (k + 1) % m == 0 or k == len(mine) - 1:
            acts.append(Action(stage, "U", k // m))
        if warm + k < len(mine):
            acts.append(Action(stage, "F", mine[warm + k]))
    # A replica with fewer micro-batches still joins every update round (with no gradient).
    acts += [Action(stage, "U", k) for k in range(math.ceil(len(mine) / m), rounds)]
    return acts


def _gpipe(plan: Plan, stage: int, rep: int, n: int) -> list[Action]:
    m = plan.micro_batches_per_step
    acts: list[Action] = []
    for step, first in enumerate(range(0, n, m)):
        mine = owned(plan, stage, rep, range(first, min(first + m, n)))
        acts += [Action(stage, "F", i) for i in mine]
        acts += [Action(stage, "B", i) for i in mine]
        acts.append(Action(stage, "U", step))
    return acts


# --------------------------------------------------------------------------- lowering
def lower(plan: Plan, compute: Schedule) -> Schedule:
    """Add receives before and sends after each F/B, and an all-reduce before each U of
    a replicated stage."""
    last = plan.num_stages - 1
    out: Schedule = {}
    for rank, acts in compute.items():
        lowered: list[Action] = []
        for a in acts:
            s = a.stage
            if a.kind == "F":
                if s > 0:
                    lowered.append(Action(s, "RF", a.mb))
                lowered.append(a)
                if s < last:
                    lowered.append(Action(s, "SF", a.mb))
            elif a.kind == "B":
                if s < last:
                    lowered.append(Action(s, "RB", a.mb))
                lowered.append(a)
                if s > 0:
                    lowered.append(Action(s, "SB", a.mb))
            elif a.kind == "U":
                if plan.stages[s].replicas > 1:
                    lowered.append(Action(s, "AR", a.mb))
                lowered.append(a)
            else:
                lowered.append(a)
        out[rank] = lowered
    return out


def closing_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """The micro-batches of one rank's action list whose backward is the last before an
    all-reduce (AR), each with the round that AR closes: no later backward adds to the
    gradients it makes, so a replica may start reducing them during it (PipeDream's
    wait-free rule)."""
    out: dict[int, int] = {}
    last = None
    for a in actions:
        if a.kind == "B":
            last = a.mb
        elif a.kind == "AR":
            if last is not None:
                out[last] = a.mb
            last = None
    return out


def peer(plan: Plan, action: Action) -> int:
    """Rank at the other end of a send or receive."""
    s, mb = action.stage, action.mb
    if action.kind in ("SF", "RB"):
        other = s + 1
    elif action.kind in ("RF", "SB"):
        other = s - 1
    else:
        raise ScheduleError(f"{action} has no peer")
    if not 0 <= other < plan.num_stages:
        raise ScheduleError(f"{action}: stage {s} has no neighbour stage {other}")
    return plan.rank_of(other, plan.replica_of(other, mb))


def message_key(action: Action) -> tuple[str, int, int]:
    """(direction, sending stage, micro-batch): identical for a send and its receive."""
    if action.kind == "SF":
        return ("act", action.stage, action.mb)
    if action.kind == "RF":
        return ("act", action.stage - 1, action.mb)
    if action.kind == "SB":
        return ("grad", action.stage, action.mb)
    if action.kind == "RB":
        return ("grad", action.stage + 1, action.mb)
    raise ScheduleError(f"{action} is not a send or receive")


# --------------------------------------------------------------------------- simulation
def simulate(plan: Plan, schedule: Schedule) -> int:
    """Run every rank's list offline; return the number of lock-step rounds it takes.

    Raises:
        DeadlockError: some ranks can never proceed; the message holds the table with
            each stuck rank's action marked.
        ScheduleError: a message is sent twice, never received, or received from the
            wrong rank, or a micro-batch is not forwarded and backwarded exactly once.
    """
    _check_structure(plan, schedule)
    pc = dict.fromkeys(schedule, 0)
    mailbox: dict[tuple[int, tuple], int] = {}  # (dst, key) -> src
    consumed: set[tuple[int, tuple]] = set()
    arrived: dict[tuple[int, int], set[int]] = defaultdict(set)  # (stage, round) -> ranks
    rounds = 0
    while any(pc[r] < len(schedule[r]) for r in schedule):
        progressed = False
        posted: list[tuple[tuple[int, tuple], int]] = []
        for rank, acts in schedule.items():
            while pc[rank] < len(acts):
                a = acts[pc[rank]]
                if a.kind in ("SF", "SB"):
                    dst = peer(plan, a)
                    key = (dst, message_key(a))
                    if key in mailbox or key in consumed:
                        table = format_table(schedule, {rank: pc[rank]})
                        raise ScheduleError(f"rank {rank} sends {a} twice\n{table}")
                    posted.append((key, rank))
                elif a.kind in ("RF", "RB"):
                    key = (rank, message_key(a))
                    if key not in mailbox:
                        break
                    src = mailbox.pop(key)
                    if src != peer(plan, a):
                        raise ScheduleError(
                            f"rank {rank} expects {a} from rank {peer(plan, a)} but rank "
                            f"{src} sends it\n{format_table(schedule, {rank: pc[rank]})}"
                        )
                    consumed.add(key)
                elif a.kind == "AR":
                    group = arrived[(a.stage, a.mb)]
                    group.add(rank)
                    if len(group) < plan.stages[a.stage].replicas:
                        break
                pc[rank] += 1
                progressed = True
                # One compute action per round keeps the round count meaningful.
                if a.kind in COMPUTE:
                    break
        for key, src in posted:
            mailbox[key] = src
        if not progressed and not posted:
            stuck = {r: pc[r] for r in schedule if pc[r] < len(schedule[r])}
            detail = ", ".join(f"rank {r} waits at {schedule[r][i]}" for r, i in stuck.items())
            raise DeadlockError(
                f"schedule deadlocks: {detail}\n{format_table(schedule, stuck)}"
            )
        rounds += 1
    if mailbox:
        lost = ", ".join(f"{key[1]} to rank {key[0]}" for key in mailbox)
        raise ScheduleError(f"messages sent but never received: {lost}")
    return rounds


def _check_structure(plan: Plan, schedule: Schedule) -> None:
    missing = set(range(plan.world_size)) - set(schedule)
    if missing:
        raise ScheduleError(f"no actions for ranks {sorted(missing)}")
    for rank, acts in schedule.items():
        stage, _ = plan.position(rank)
        forwards: set[int] = set()
        backwards: set[int] = set()
        for i, a in enumerate(acts):
            problem = ""
            if a.stage != stage:
                problem = f"rank {rank} runs stage {stage} but lists {a}"
            elif a.kind == "F" and a.mb in forwards:
                problem = f"rank {rank} forwards micro-batch {a.mb} twice"
            elif a.kind == "B" and (a.mb not in forwards or a.mb in backwards):
                problem = f"rank {rank}: {a} needs exactly one earlier forward {stage}F{a.mb}"
            if problem:
                # the table only when raising: it costs the whole schedule per action
                raise ScheduleError(f"{problem}\n{format_table(schedule, {rank: i})}")
            if a.kind == "F":
                forwards.add(a.mb)
            elif a.kind == "B":
                backwards.add(a.mb)
        if forwards != backwards:
            raise ScheduleError(
                f"rank {rank} never runs the backward of micro-batches "
                f"{sorted(forwards - backwards)}"
            )


def no_step_between_forward_and_backward(acts: list[Action]) -> set[int]:
    """Micro-batches whose forward and backward see no optimizer step in between: the
    runtime runs them on the live weights, with no stashed copy."""
    open_since: dict[int, bool] = {}
    out = set()
    for a in acts:
        if a.kind == "F":
            open_since[a.mb] = True
        elif a.kind == "U":
            open_since = dict.fromkeys(open_since, False)
        elif a.kind == "B" and open_since.pop(a.mb):
            out.add(a.mb)
    return out


def build(plan: Plan, num_micro_batches: int) -> Schedule:
    """Generate, lower and deadlock-check the schedule of one epoch."""
    sched = lower(plan, generate(plan, num_micro_batches))
    simulate(plan, sched)
    return sched


# --------------------------------------------------------------------------- printing
def format_table(schedule: Schedule, marks: dict[int, int] | None = None) -> str:
    """Rank-by-step table; `marks` maps rank -> index of the action to flag with >...<."""
    marks = marks or {}
    ranks = sorted(schedule)
    cells = {
        r: [f">{a}<" if marks.get(r) == i else str(a) for i, a in enumerate(schedule[r])]
        for r in ranks
    }
    steps = max((len(c) for c in cells.values()), default=0)
    width = max([6, *(len(x) for c in cells.values() for x in c)]) + 1
    head = "step".ljust(5) + "".join(f"rank{r}".rjust(width) for r in ranks)
    lines = [head]
    for i in range(steps):
        row = "".join((cells[r][i] if i < len(cells[r]) else "").rjust(width) for r in ranks)
        lines.append(str(i).ljust(5) + row)
    return "\n".join(lines)


def to_csv(schedule: Schedule) -> str:
    """One line per rank: `rank,action,action,...`."""
    return "\n".join(
        ",".join([str(r), *(str(a) for a in schedule[r])]) for r in sorted(schedule)
    ) + "\n"


def from_csv(text: str) -> Schedule:
    out: Schedule = {}
    for line in text.strip().splitlines():
        rank, *acts = line.split(",")
        out[int(rank)] = [Action.parse(a) for a in acts]
    return out
