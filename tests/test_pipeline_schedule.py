"""Plans and schedules as data: format, generators, lowering, offline deadlock check."""

import json
import math

import pytest

from pipesgd.pipeline import schedule as sched
from pipesgd.pipeline.plan import Plan, PlanError, StagePlan
from pipesgd.pipeline.schedule import Action, DeadlockError, ScheduleError


def straight(stages, layers=8, **kw):
    return Plan.even(layers, stages, **kw)


def test_action_prints_and_parses_back():
    for text in ["2F0", "0B13", "1RF3", "1SB7", "0AR5", "3U2"]:
        assert str(Action.parse(text)) == text
    with pytest.raises(ScheduleError, match="2F0"):
        Action.parse("F2")


def test_plan_json_round_trip(tmp_path):
    plan = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 1)), schedule="1f1b-rr",
                micro_batch=4, extra={"planner": "madpipe"})
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["stages"] == [{"layers": [0, 3], "replicas": 2}, {"layers": [3, 5], "replicas": 1}]
    again = Plan.load(tmp_path / "plan.json")
    assert again == plan and again.extra == {"planner": "madpipe"}
    assert again.world_size == 3 and again.noam == 2
    assert [again.position(r) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]


@pytest.mark.parametrize(
    "stages, message",
    [
        ((StagePlan(0, 3), StagePlan(4, 5)), "must start at layer 3"),
        ((StagePlan(0, 3), StagePlan(3, 3)), "non-empty"),
    ],
)
def test_bad_plans_say_what_to_do(stages, message):
    with pytest.raises(PlanError, match=message):
        Plan(stages=stages)


def test_plan_must_cover_the_model_and_the_ranks():
    plan = straight(2, layers=5)
    with pytest.raises(PlanError, match=r"Plan\.even"):
        plan.validate(num_layers=7)
    with pytest.raises(PlanError, match="mpirun -n 2"):
        plan.check_world(3)
    with pytest.raises(PlanError, match="1f1b-rr"):
        Plan(stages=(StagePlan(0, 2, 2), StagePlan(2, 4)), schedule="1f1b")


def run_counts(acts):
    """(forwards before the first backward, max micro-batches in flight)."""
    warm = next(i for i, a in enumerate(acts) if a.kind == "B")
    live, peak = 0, 0
    for a in acts:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return warm, peak


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_1f1b_admits_noam_and_alternates(stages):
    plan = straight(stages)
    n = 10
    compute = sched.generate(plan, n)
    for rank, acts in compute.items():
        fb = [a for a in acts if a.kind in "FB"]
        warm, peak = run_counts(fb)
        # PipeDream Fig. 4: stage s admits NOAM - s minibatches, then strictly alternates.
        assert warm == peak == stages - rank
        steady = fb[warm : warm + 2 * (n - warm)]
        assert [a.kind for a in steady] == ["B", "F"] * (n - warm)
        assert [a.mb for a in fb if a.kind == "B"] == list(range(n))
        assert sum(a.kind == "U" for a in acts) == n
    sched.simulate(plan, sched.lower(plan, compute))


def test_gpipe_flushes_every_step():
    plan = straight(3, schedule="gpipe", micro_batches_per_step=4)
    compute = sched.generate(plan, 10)
    for acts in compute.values():
        kinds = "".join(a.kind for a in acts)
        assert kinds == "FFFFBBBBU" * 2 + "FFBBU"
    sched.build(plan, 10)


def test_round_robin_routes_forward_and_backward_to_one_replica():
    plan = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 1), StagePlan(5, 8, 3)),
                schedule="1f1b-rr")
    n = 11  # uneven: 6/5 on stage 0, 4/4/3 on stage 2
    table = sched.build(plan, n)
    for rank, acts in table.items():
        stage, rep = plan.position(rank)
        fwd = [a.mb for a in acts if a.kind == "F"]
        assert fwd == [i for i in range(n) if i % plan.stages[stage].replicas == rep]
        rounds = -(-n // plan.stages[stage].replicas)
        assert [a.mb for a in acts if a.kind == "U"] == list(range(rounds))
        if plan.stages[stage].replicas > 1:
            assert [a.mb for a in acts if a.kind == "AR"] == list(range(rounds))


@pytest.mark.parametrize("per_step", [2, 3])
def test_1f1b_accumulating_steps_after_every_mth_backward(per_step):
    plan = straight(3, micro_batches_per_step=per_step)
    n = 10
    for acts in sched.generate(plan, n).values():
        backwards = 0
        for a, nxt in zip(acts, [*acts[1:], None], strict=True):
            if a.kind == "B":
                backwards += 1
                # a step right after every per_step-th backward and after the last one
                due = backwards % per_step == 0 or backwards == n
                assert (nxt is not None and nxt.kind == "U") == due, (a, nxt)
        assert [a.mb for a in acts if a.kind == "U"] == list(range(-(-n // per_step)))
    sched.build(plan, n)


def test_round_robin_accumulating_with_uneven_replicas_joins_every_round():
    plan = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 1)), schedule="1f1b-rr",
                micro_batches_per_step=2)
    n = 9  # stage 0: 5/4 micro-batches, 3 rounds each (the short replica's last is empty)
    table = sched.build(plan, n)
    for rank, acts in table.items():
        stage, _ = plan.position(rank)
        rounds = math.ceil(math.ceil(n / plan.stages[stage].replicas) / 2)
        assert [a.mb for a in acts if a.kind == "U"] == list(range(rounds))
        if plan.stages[stage].replicas > 1:
            assert [a.mb for a in acts if a.kind == "AR"] == list(range(rounds))


def test_closing_backwards_are_each_rounds_last_before_its_all_reduce():
    # (micro-batch of the closing backward -> the round its all-reduce closes)
    # replica 0 of stage 0 takes micro-batches 0, 2, 4, 6, 8 and replica 1 takes 1, 3,
    # 5, 7, two per round: rounds {0, 2}, {4, 6}, {8}; {1, 3}, {5, 7} and an empty one
    plan = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 1)), schedule="1f1b-rr",
                micro_batches_per_step=2)
    table = sched.build(plan, 9)
    assert sched.closing_backwards(table[0]) == {2: 0, 6: 1, 8: 2}
    assert sched.closing_backwards(table[1]) == {3: 0, 7: 1}  # its last round: none
    assert sched.closing_backwards(table[2]) == {}  # no all-reduce: no replicas
    # by hand: the backward nearest before each all-reduce, forwards in between or not
    acts = [Action.parse(t) for t in ("0F0", "0B0", "0F1", "0AR0", "0U0", "0B1", "0AR1",
                                      "0U1", "0AR2", "0U2")]
    assert sched.closing_backwards(acts) == {0: 0, 1: 1}


def test_lowering_adds_matching_sends_and_receives():
    plan = straight(3)
    table = sched.build(plan, 4)
    assert [str(a) for a in table[1][:3]] == ["1RF0", "1F0", "1SF0"]
    sends = {(sched.peer(plan, a), sched.message_key(a)) for r in table for a in table[r]
             if a.kind in ("SF", "SB")}
    recvs = {(r, sched.message_key(a)) for r in table for a in table[r]
             if a.kind in ("RF", "RB")}
    assert sends == recvs and len(sends) == 2 * 2 * 4


def test_csv_round_trip():
    table = sched.build(straight(2), 5)
    assert sched.from_csv(sched.to_csv(table)) == table


def test_deadlock_check_rejects_a_hand_broken_schedule():
    plan = straight(2)
    table = sched.build(plan, 4)
    broken = {r: list(acts) for r, acts in table.items()}
    # Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 0 forward.
    acts = broken[0]
    rb = acts.index(Action(0, "RB", 0))
    acts.insert(acts.index(Action(0, "SF", 0)), acts.pop(rb))
    with pytest.raises(DeadlockError) as info:
        sched.simulate(plan, broken)
    text = str(info.value)
    assert "rank 0 waits at 0RB0" in text and "rank 1 waits at 1RF0" in text
    assert ">0RB0<" in text and ">1RF0<" in text  # the table marks the stuck actions


def test_structural_errors_are_named():
    plan = straight(2)
    table = sched.build(plan, 3)
    no_backward = {r: [a for a in acts if not (a.kind == "B" and a.mb == 2)]
                   for r, acts in table.items()}
    with pytest.raises(ScheduleError, match="never runs the backward"):
        sched.simulate(plan, no_backward)
    lost = {0: table[0], 1: [a for a in table[1] if str(a) != "1RF1"]}
    with pytest.raises(ScheduleError):
        sched.simulate(plan, lost)


def test_table_marks_the_failing_action():
    table = sched.build(straight(2), 2)
    text = sched.format_table(table, {1: 2})
    assert f">{table[1][2]}<" in text and text.splitlines()[0].split() == ["step", "rank0", "rank1"]


def test_per_stage_in_flight_sets_each_stages_warmup():
    # MadPipe's 1F1B* counts: flat across stages 0-1, then down to 1.
    plan = straight(3, stage_in_flight=[2, 2, 1])
    assert plan.stage_in_flight == (2, 2, 1) and plan.noam == 2
    compute = sched.generate(plan, 9)
    assert [run_counts([a for a in compute[r] if a.kind in "FB"]) for r in range(3)] == \
        [(2, 2), (2, 2), (1, 1)]
    sched.build(plan, 9)  # lowers and passes the offline deadlock check
    # a deeper per-stage plan than PipeDream's NOAM - s is fine too, while it never grows
    sched.build(straight(3, stage_in_flight=[4, 3, 3]), 9)


def test_per_stage_in_flight_that_cannot_finish_is_refused_before_running():
    # Stage 1 waits for a second activation that stage 0 sends only after a backward.
    with pytest.raises(DeadlockError):
        sched.build(straight(2, stage_in_flight=[1, 2]), 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stage_in_flight": [2, 1]}, "every one of the 3 stages"),
        ({"stage_in_flight": [2, 0, 1]}, r"count >= 1"),
        ({"stage_in_flight": [3, 2, 1], "in_flight": 2}, "contradicts"),
        ({"stage_in_flight": [3, 2, 1], "schedule": "gpipe"}, "gpipe"),
    ],
)
def test_per_stage_in_flight_is_checked(kwargs, message):
    with pytest.raises(PlanError, match=message):
        straight(3, **kwargs)


def test_per_stage_in_flight_round_trips_and_caps(tmp_path):
    plan = straight(3, stage_in_flight=(3, 3, 1))
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["stage_in_flight"] == [3, 3, 1]
    assert Plan.load(tmp_path / "plan.json") == plan
    assert plan.at_depth(2).stage_in_flight == (2, 2, 1)
    assert straight(3).at_depth(2).in_flight == 2


def test_the_steady_state_leaves_out_a_quarter_at_each_end():
    from pipesgd.pipeline.runtime import steady_micro_batch_s

    # a slow start and a slow drain around micro-batches every 2 s, in any order
    ends = [0.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 40.0]
    assert steady_micro_batch_s(ends[::-1]) == 2.0
    # four replicas of the first stage in step: four ends 0.1 apart every 2 s. Counted
    # over whole cycles of 4, 2 s per 4 micro-batches; from a cluster's first end to
    # another's last it would read 31 micro-batches in 14.3 s, 13 % fast
    clustered = [2.0 * r + 0.1 * i for r in range(16) for i in range(4)]
    assert steady_micro_batch_s(clustered, cycle=4) == pytest.approx(0.5)
    assert steady_micro_batch_s(clustered) == pytest.approx(14.3 / 31)
    with pytest.raises(ValueError, match="too few backwards"):
        steady_micro_batch_s([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="cycles of 4"):
        steady_micro_batch_s(clustered[:6], cycle=4)
