"""The pipeline simulator against hand-worked timelines: PipeDream Figs. 4 and 8, GPipe's
bubble, balanced pipelines, MadPipe's 1F1B* counts, links, all-reduce and memory."""

import dataclasses
import importlib
import math

import pytest

from pipesgd.pipeline.plan import Plan, StagePlan
from pipesgd.pipeline.replicas import DEFAULT_BUCKET_BYTES
from pipesgd.planner import (
    ModelProfile,
    fit_pipeline_overhead,
    fit_replica_overhead,
    simulate,
    stored_activations,
)
from pipesgd.planner.calibrate import COMPUTE_BOUND, compute_share
from pipesgd.planner.simulate import _TokenBucket
from pipesgd.planner.topology import HierarchicalTopology, Level, SharedCores

# the module, which the package's `simulate` (the function) hides
SIMULATE = importlib.import_module("pipesgd.planner.simulate")


def chain(forward, backward, *, output=None, weights=None, optimizer=None, saved=None,
          batch=4):
    """A profile of one layer per stage (times in seconds, for `batch` samples)."""
    n = len(forward)
    return ModelProfile.from_columns(forward, backward, output or [0.0] * n,
                                     weights or [0.0] * n, optimizer, saved, batch_size=batch)


@pytest.fixture
def one_bucket_per_gigabyte(monkeypatch):
    """Replicas hand their gradient to the ring in buckets of 1 GB (the runtime's are
    4 MiB, each paying the ring's latencies): the hand-worked rings of 1 GB below are one
    all-reduce."""
    monkeypatch.setattr(SIMULATE, "REPLICA_BUCKET_BYTES", 10**9)


def starts(sim, rank, until):
    """'F0@0'-style cells of one rank's compute actions starting before `until`."""
    return [f"{iv.action[1:]}@{iv.start:g}" for iv in sim.timeline
            if iv.rank == rank and iv.start < until]


# ----------------------------------------------------------------- PipeDream Fig. 4
# 4 workers, one stage each, backward twice the forward (F = 1, B = 2), NOAM 4. Worked
# by hand: stage 0 admits 0..3 at t = 0..3; micro-batch 0 reaches stage 3 at 3, whose
# backward (4..6) goes back one stage every 2 units, so stage 0 runs B0 at 10..12 and then
# alternates F4, B1, F5, ... with no gap. Each stage alternates once it has a backward.
FIG4 = {
    0: ["F0@0", "F1@1", "F2@2", "F3@3", "B0@10", "F4@12", "B1@13", "F5@15", "B2@16"],
    1: ["F0@1", "F1@2", "F2@3", "B0@8", "F3@10", "B1@11", "F4@13", "B2@14", "F5@16"],
    2: ["F0@2", "F1@3", "B0@6", "F2@8", "B1@9", "F3@11", "B2@12", "F4@14", "B3@15"],
    3: ["F0@3", "B0@4", "F1@6", "B1@7", "F2@9", "B2@10", "F3@12", "B3@13", "F4@15", "B4@16"],
}


def test_pipedream_fig4_startup_matches_the_hand_timeline():
    sim = simulate(Plan.even(4, 4, micro_batch=4), chain([1.0] * 4, [2.0] * 4))
    for rank, cells in FIG4.items():
        assert starts(sim, rank, 17) == cells


def test_pipedream_fig4_steady_state_has_no_bubble():
    plan = Plan.even(4, 4, micro_batch=4)
    assert plan.noam == 4
    sim = simulate(plan, chain([1.0] * 4, [2.0] * 4))
    assert sim.time_per_micro_batch_s == pytest.approx(3.0)
    assert sim.samples_per_s == pytest.approx(4 / 3.0)
    assert sim.bubble_fraction == pytest.approx((0.0, 0.0, 0.0, 0.0), abs=1e-9)
    # stage s keeps NOAM - s micro-batches between forward and backward
    assert [s.in_flight for s in sim.stages] == [4, 3, 2, 1]


def test_fig4_memory_counts_weights_stash_and_activations():
    # W = 10, optimizer 5, saved 1 per micro-batch on every stage. A stage keeping k >= 2
    # micro-batches stashes one weight copy per micro-batch (each saw another update),
    # beside the live weights; the last stage's micro-batches run on the live ones.
    prof = chain([1.0] * 4, [2.0] * 4, weights=[10.0] * 4, optimizer=[5.0] * 4,
                 saved=[1.0] * 4)
    sim = simulate(Plan.even(4, 4, micro_batch=4), prof)
    assert [s.weight_versions for s in sim.stages] == [5, 4, 3, 1]
    by_hand = [(1 + c) * 10 + 5 + k * 1 for c, k in ((4, 4), (3, 3), (2, 2), (0, 1))]
    assert list(sim.peak_memory_bytes) == pytest.approx(by_hand)  # 59, 48, 37, 16
    assert sim.max_memory_bytes == pytest.approx(59)


# ----------------------------------------------------------------- PipeDream Fig. 8
# Stage 0 (F = B = 2) on two replicas, even micro-batches on the first, odd on the second;
# stage 1 (F = B = 1) on one worker. NOAM = ceil(3 / 2) = 2.
FIG8_PLAN = Plan((StagePlan(0, 1, 2), StagePlan(1, 2, 1)), schedule="1f1b-rr", micro_batch=4)
FIG8_PROFILE = chain([2.0, 1.0], [2.0, 1.0])

# With the replicas' all-reduce one round behind (staleness 2), no replica waits for the
# other: by hand, worker 3 gets 0 and 1 at t = 2, runs F0 B0 F1 ... and every stage is
# busy from t = 5 on: one micro-batch every 2 units, as the figure shows.
FIG8 = {
    0: ["F0@0", "F2@2", "B0@5", "F4@7", "B2@9", "F6@11", "B4@13"],
    1: ["F1@0", "F3@2", "B1@7", "F5@9", "B3@11", "F7@13"],
    2: ["F0@2", "F1@3", "B0@4", "F2@5", "B1@6", "F3@7", "B2@8", "F4@9", "B3@10", "F5@11",
        "B4@12", "F6@13"],
}


def test_pipedream_fig8_round_robin_replicas():
    assert FIG8_PLAN.noam == 2
    sim = simulate(FIG8_PLAN, FIG8_PROFILE, staleness=2)
    for rank, cells in FIG8.items():
        assert starts(sim, rank, 14) == cells
    assert sim.time_per_micro_batch_s == pytest.approx(2.0)
    assert sim.bubble_fraction == pytest.approx((0.0, 0.0), abs=1e-9)
    assert [s.in_flight for s in sim.stages] == [2, 2]


def test_fig8_with_a_synchronous_allreduce_the_replicas_wait_for_each_other():
    # Staleness 1 (the runtime's default): a replica's update waits for the other
    # replica's backward of the same round. The second replica's backward comes one
    # stage-1 forward + backward (2 units) after the first's, so a round of two
    # micro-batches takes stage 0's F + B (4) + 2 = 6 units: 3 per micro-batch.
    sim = simulate(FIG8_PLAN, FIG8_PROFILE, staleness=1)
    assert starts(sim, 0, 12) == ["F0@0", "F2@2", "B0@5", "F4@9", "B2@11"]
    assert starts(sim, 1, 12) == ["F1@0", "F3@2", "B1@7", "F5@9"]
    assert sim.time_per_micro_batch_s == pytest.approx(3.0)
    assert sim.bubble_fraction == pytest.approx((1 / 3, 1 / 3))


# ----------------------------------------------------------------- GPipe
@pytest.mark.parametrize("stages,micro", [(4, 8), (2, 4), (3, 1), (5, 16)])
def test_gpipe_bubble_fraction(stages, micro):
    # All forwards then all backwards, a flush per step: every stage computes M(F + B)
    # of a step lasting (M + S - 1)(F + B), so it idles (S - 1) / (M + S - 1).
    plan = Plan.even(stages, stages, schedule="gpipe", micro_batch=4,
                     micro_batches_per_step=micro)
    sim = simulate(plan, chain([1.0] * stages, [2.0] * stages))
    expected = (stages - 1) / (micro + stages - 1)
    assert sim.bubble_fraction == pytest.approx((expected,) * stages)
    assert sim.time_per_micro_batch_s == pytest.approx(3.0 * (micro + stages - 1) / micro)
    assert all(s.weight_versions == 1 for s in sim.stages)  # no stash under gpipe


# ----------------------------------------------------------------- balanced pipelines
@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (0.004, 0.004), (0.25, 1.5)])
def test_balanced_pipeline_runs_at_one_micro_batch_per_stage_time(stages, fwd, bwd):
    plan = Plan.even(stages, stages, micro_batch=16)
    sim = simulate(plan, chain([fwd] * stages, [bwd] * stages, batch=16))
    assert sim.samples_per_s == pytest.approx(16 / (fwd + bwd))
    assert max(sim.bubble_fraction) == pytest.approx(0.0, abs=1e-9)


def test_balanced_with_replicas_and_free_links():
    # stage loads 4, 2, 6 on 2, 1, 3 replicas: 2 units per micro-batch everywhere
    plan = Plan((StagePlan(0, 1, 2), StagePlan(1, 2, 1), StagePlan(2, 3, 3)),
                schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, chain([1.0, 0.5, 2.0], [3.0, 1.5, 4.0]), "6x[10Gbit]", staleness=2)
    assert sim.time_per_micro_batch_s == pytest.approx(2.0)


def test_times_scale_with_the_micro_batch():
    prof = chain([1.0, 1.0], [2.0, 2.0], batch=8)
    sim = simulate(Plan.even(2, 2, micro_batch=16), prof)
    assert sim.stages[0].forward_s == 2.0 and sim.stages[0].backward_s == 4.0
    assert sim.time_per_micro_batch_s == pytest.approx(6.0)


# ----------------------------------------------------------------- MadPipe (1F1B*)
def test_runtime_depth_two_keeps_the_1f1b_star_counts_at_its_period():
    # Loads U = (2, 2, 2) (F = B = 1). By hand with 2 in flight (warm-up 2, 1, 1):
    # stage 0 runs B0 at 5, B1 at 9, B2 at 13: a period of 4 = U(s1) + U(s2), the two
    # last stages forming one 1F1B* group, keeping (2, 1, 1) micro-batches, which is
    # MadPipe's Proposition 1 minimum at T = 4 (MadPipe's docstring example).
    sim = simulate(Plan.even(3, 3, micro_batch=4, in_flight=2), chain([1.0] * 3, [1.0] * 3))
    assert starts(sim, 0, 14) == ["F0@0", "F1@1", "B0@5", "F2@6", "B1@9", "F3@10", "B2@13"]
    assert sim.time_per_micro_batch_s == pytest.approx(4.0)
    counts = [s.in_flight for s in sim.stages]
    assert counts == [2, 1, 1] == stored_activations([2, 2, 2], 4.0)
    # the full depth (NOAM 3) reaches the period of one stage, keeping (3, 2, 1)
    sim = simulate(Plan.even(3, 3, micro_batch=4), chain([1.0] * 3, [1.0] * 3))
    assert sim.time_per_micro_batch_s == pytest.approx(2.0)
    assert [s.in_flight for s in sim.stages] == [3, 2, 1] == stored_activations([2] * 3, 2.0)


@pytest.mark.parametrize("fwd,bwd,depth", [
    ([1, 2, 1, 3], [2, 3, 1, 4], None),
    ([1, 2, 1, 3], [2, 3, 1, 4], 2),
    ([3, 1, 1], [3, 1, 2], None),
    ([1, 1, 1, 1, 1], [1, 4, 1, 1, 2], 3),
])
def test_proposition1_bounds_what_the_runtime_keeps(fwd, bwd, depth):
    # No periodic schedule keeps fewer micro-batches than 1F1B* at its period (MadPipe,
    # Proposition 1), so neither does the runtime's 1F1B in its steady state.
    n = len(fwd)
    sim = simulate(Plan.even(n, n, micro_batch=4, in_flight=depth),
                   chain([float(x) for x in fwd], [float(x) for x in bwd]))
    loads = [f + b for f, b in zip(fwd, bwd, strict=True)]
    floor = stored_activations(loads, sim.time_per_micro_batch_s)
    assert all(s.in_flight >= g for s, g in zip(sim.stages, floor, strict=True))


# ----------------------------------------------------------------- communication
def test_links_one_micro_batch_in_flight_adds_both_transfers():
    # 1 GB/s link, 0.1 s latency, a_0 = 0.5 GB: with one micro-batch in flight nothing
    # overlaps. A message is a header (its latency), then the payload the receiver asks
    # for on reading it (0.5 s and a latency): 0.7 s. F0 1, activation 0.7, F1 + B1 3,
    # gradient 0.7, B0 2: 7.4 s per micro-batch.
    prof = chain([1.0, 1.0], [2.0, 2.0], output=[0.5e9, 0.0])
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, "2x[1GB/s, 100ms]")
    assert sim.time_per_micro_batch_s == pytest.approx(7.4)
    assert sim.link_busy[0] == pytest.approx(1.0 / 7.4)
    assert sim.bottleneck.startswith("pipeline depth")


@pytest.mark.parametrize("delta, expected", [(0.2e-9, 7.6), (1e-9, 9.2)])
def test_gpu_workers_stage_each_message_through_the_host(delta, expected):
    # The example above on GPUs whose copies to and from pinned host memory take δ per
    # byte. A send posts its header at once and the payload once it is on the host; the
    # receiver copies it to its GPU before computing on it. δ = 0.2 ns/B: the 0.1 s copy
    # out hides behind the header's 0.1 s latency, the copy in adds 0.1 s per message:
    # 7.4 + 2 x 0.1. δ = 1 ns/B: the payload leaves at 0.5 s (0.4 s after the header is
    # in), and the copy in takes 0.5 s: 7.4 + 2 x 0.9.
    prof = chain([1.0, 1.0], [2.0, 2.0], output=[0.5e9, 0.0])
    topo = dataclasses.replace(HierarchicalTopology.parse("2x[1GB/s, 100ms]"),
                               device_copy_s_per_byte=delta)
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, topo)
    assert sim.time_per_micro_batch_s == pytest.approx(expected)


def test_links_both_directions_share_the_link():
    # 2 x 0.5 GB cross the link per micro-batch at 0.25 GB/s: 4 s, against 0.03 s of
    # compute per stage. A payload moves only while its receiver waits for it, so the
    # link rests while a stage computes: 4 s of transfers and the 0.03 s of compute
    # between them per micro-batch.
    prof = chain([0.01, 0.01], [0.02, 0.02], output=[0.5e9, 0.0])
    sim = simulate(Plan.even(2, 2, micro_batch=4), prof, "2x[0.25GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx(4.03)
    assert sim.link_busy[0] == pytest.approx(4.0 / 4.03)
    assert sim.bottleneck == "link 0-1"


def test_placement_picks_the_level_of_each_link():
    # two nodes of two workers: 10 GB/s inside a node, 1 GB/s between nodes
    prof = chain([1.0, 1.0], [1.0, 1.0], output=[1e9, 0.0])
    plan = Plan.even(2, 2, micro_batch=4, in_flight=1)
    topo = "2x[10GB/s], 2x[1GB/s]"
    inside = simulate(plan, prof, topo, placement=[[0], [1]])
    across = simulate(plan, prof, topo, placement=[[0], [2]])
    assert inside.time_per_micro_batch_s == pytest.approx(4.0 + 2 * 0.1)
    assert across.time_per_micro_batch_s == pytest.approx(4.0 + 2 * 1.0)
    with_extra = simulate(plan.replace(extra={"placement": [[1], [3]]}), prof, topo)
    assert with_extra.time_per_micro_batch_s == pytest.approx(across.time_per_micro_batch_s)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
def test_replicated_stage_allreduce_is_a_ring():
    # One stage on 4 replicas (data parallelism on the pipeline runtime): every round of
    # 4 micro-batches computes F + B = 3, then all-reduces W = 1 GB over 1 GB/s in a ring,
    # 2 (4 - 1) / 4 x 1 s = 1.5 s, and 6 latencies of 10 ms: 4.56 s per 4 micro-batches.
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "4x[1GB/s, 10ms]")
    assert sim.stages[0].allreduce_s == pytest.approx(1.56)
    assert sim.time_per_micro_batch_s == pytest.approx(4.56 / 4)
    assert sim.bubble_fraction[0] == pytest.approx(1.56 / 4.56)
    assert sim.allreduce_busy[0] == pytest.approx(1.56 / 4.56)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
def test_gpu_replicas_stage_the_allreduce_through_the_host():
    # The ring above, on GPUs copying 0.1 ns/B: the 1 GB gradient goes to the host
    # before the ring and comes back after it, 0.1 s each way: 1.76 s per round.
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4)
    topo = dataclasses.replace(HierarchicalTopology.parse("4x[1GB/s, 10ms]"),
                               device_copy_s_per_byte=0.1e-9)
    sim = simulate(plan, prof, topo)
    assert sim.stages[0].allreduce_s == pytest.approx(1.76)
    assert sim.time_per_micro_batch_s == pytest.approx(4.76 / 4)


def test_accumulated_steps_allreduce_once_per_step():
    # 2 micro-batches per step: a round every 2 micro-batches of each replica
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4,
                micro_batches_per_step=2)
    sim = simulate(plan, prof, "4x[1GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx((6.0 + 1.5) / 8)


# ----------------------------------------------------------------- host costs
def with_costs(prof, **changes):
    """`prof` with every layer's update/copy times and the model's loss and overhead set."""
    layer = {k: v for k, v in changes.items() if k in ("update_s", "copy_s")}
    model = {k: v for k, v in changes.items() if k not in layer}
    return dataclasses.replace(
        prof, layers=tuple(dataclasses.replace(lp, **layer) for lp in prof.layers), **model)


def test_update_loss_and_overhead_lengthen_the_stage_they_belong_to():
    # Two stages, F = 1, B = 2. The step (0.5 each), the runtime's overhead (0.25 per
    # forward) and the loss (0.5 per 4 samples, last stage only) land on the stages'
    # cycles: stage 0 = 1 + 0.25 + 2 + 0.5 = 3.75, stage 1 = 1 + 0.5 + 0.25 + 2 + 0.5 =
    # 4.25, the bottleneck.
    prof = with_costs(chain([1.0, 1.0], [2.0, 2.0]), update_s=0.5, loss_s=0.5,
                      stage_overhead_s=0.25)
    sim = simulate(Plan.even(2, 2, micro_batch=4), prof)
    assert sim.time_per_micro_batch_s == pytest.approx(4.25)
    assert sim.bottleneck == "stage 1"
    # the loss scales with the micro-batch, the step does not
    twice = simulate(Plan.even(2, 2, micro_batch=8), prof)
    assert twice.time_per_micro_batch_s == pytest.approx(2 * 3.5 + 0.5 + 0.25)


def test_a_forward_that_stashes_a_new_version_pays_its_copy():
    # Two stages, F = 1, B = 2, 1F1B with a step per micro-batch. Stage 0 keeps two
    # micro-batches in flight, so a step falls between each forward and its backward:
    # every forward takes a new version and pays its copy (0.5), 3.5 per micro-batch.
    # The last stage runs each backward right after its forward, on the live weights.
    prof = with_costs(chain([1.0, 1.0], [2.0, 2.0]), copy_s=0.5)
    sim = simulate(Plan.even(2, 2, micro_batch=4), prof)
    assert sim.time_per_micro_batch_s == pytest.approx(3.5)
    assert sim.bottleneck == "stage 0"
    assert simulate(Plan.even(2, 2, micro_batch=4), chain([1.0, 1.0], [2.0, 2.0])
                    ).time_per_micro_batch_s == pytest.approx(3.0)


@pytest.mark.parametrize("cores, expected", [(8, 3.0), (3, 3.0), (2, 4.5), (1, 9.0)])
def test_workers_sharing_cores_split_them(cores, expected):
    # Three balanced stages (F = 1, B = 2) on one host: with fewer cores than busy workers
    # each progresses at cores / workers, so a micro-batch takes 9 / cores (9 units of
    # work on `cores` cores), never less than the 3 of a worker on its own.
    topo = HierarchicalTopology((Level(3, 1e15),), shared_cores=SharedCores(cores, 3))
    sim = simulate(Plan.even(3, 3, micro_batch=4), chain([1.0] * 3, [2.0] * 3), topo)
    assert sim.time_per_micro_batch_s == pytest.approx(expected)


def test_shared_cores_per_host_only_slow_the_workers_of_that_host():
    # Two hosts of two workers, one core each: stage 0 (host 0: ranks 0, 1 = two stages
    # of 3) shares one core, host 1 likewise: 6 units of work per micro-batch per host.
    topo = HierarchicalTopology((Level(4, 1e15),), shared_cores=SharedCores(1, 2))
    sim = simulate(Plan.even(4, 4, micro_batch=4), chain([1.0] * 4, [2.0] * 4), topo)
    assert sim.time_per_micro_batch_s == pytest.approx(6.0)


@pytest.mark.parametrize("cpu_s_per_byte, expected", [(0.0, 6.0), (1e-9, 8.0)])
def test_transfers_cost_cpu(cpu_s_per_byte, expected):
    # One micro-batch in flight on two stages (F = 1, B = 2) and a wire too fast to
    # count: a micro-batch takes F0 + F1 + B1 + B0 = 6, plus the CPU of its two
    # transfers (1e9 bytes x cpu_s_per_byte each).
    prof = chain([1.0, 1.0], [2.0, 2.0], output=[1e9, 0.0])
    topo = HierarchicalTopology((Level(2, 1e15),), shared_cores=SharedCores(
        8, 2, cpu_s_per_byte=cpu_s_per_byte))
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, topo)
    assert sim.time_per_micro_batch_s == pytest.approx(expected)


def test_a_rank_asleep_on_a_message_notices_it_late():
    # One micro-batch in flight on two stages (F = 1, B = 2): both receives find their
    # rank asleep, each noticed 0.25 s after it is in: 6 + 2 x 0.25 per micro-batch.
    prof = dataclasses.replace(chain([1.0, 1.0], [2.0, 2.0]), receive_delay_s=0.25)
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, "2x[1GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx(6.5)


def test_an_action_after_a_sleep_refills_the_caches():
    # The example above with 1 GB of weights per stage and 0.25 ns per byte to bring them
    # back: stage 1's forward follows its sleep on the activation, stage 0's backward its
    # sleep on the gradient; each is 0.25 s longer, the actions that follow another
    # action are not: 6 + 2 x 0.25 per micro-batch.
    prof = dataclasses.replace(chain([1.0, 1.0], [2.0, 2.0], weights=[1e9, 1e9]),
                               cold_s_per_byte=0.25e-9)
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, "2x[1GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx(6.5)
    durations = {iv.action[1] + str(iv.rank): iv.end - iv.start for iv in sim.timeline}
    assert durations == pytest.approx({"F0": 1.0, "B0": 2.25, "F1": 1.25, "B1": 2.0})
    # one rank alone never waits: nothing to refill
    alone = dataclasses.replace(chain([1.0], [2.0], weights=[1e9]), cold_s_per_byte=0.25e-9)
    assert simulate(Plan.even(1, 1, micro_batch=4), alone).time_per_micro_batch_s == \
        pytest.approx(3.0)


@pytest.mark.parametrize("cold_s_per_byte, per_micro_batch", [(0.0, 3.0), (0.25e-9, 3.25)])
def test_a_backward_on_a_version_an_update_left_behind_refills_the_caches(
        cold_s_per_byte, per_micro_batch):
    # Stage 0 (F = 1, B = 2, 1 GB of weights) keeps two micro-batches in flight and stage
    # 1 is nearly free, so stage 0 never waits: F0 F1 B0 U F2 B1 U F3 B2 ... B0 runs on
    # the live weights; every later backward on the copy its forward stashed, which the
    # update since has left behind (and the next forward's copy evicted): 0.25 s longer
    # at 0.25 ns per byte. Forwards read the copy just made: never.
    prof = dataclasses.replace(chain([1.0, 0.001], [2.0, 0.001], weights=[1e9, 0.0]),
                               cold_s_per_byte=cold_s_per_byte)
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=2), prof, "2x[1GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx(per_micro_batch)
    mine = [(iv.action, iv.end - iv.start) for iv in sim.timeline if iv.rank == 0]
    assert mine[:5] == [("0F0", 1.0), ("0F1", 1.0), ("0B0", 2.0), ("0F2", 1.0),
                        ("0B1", pytest.approx(per_micro_batch - 1.0))]


def test_the_cold_cache_cost_round_trips_through_json_and_is_checked():
    prof = dataclasses.replace(chain([1.0], [2.0]), cold_s_per_byte=1.1e-10)
    assert ModelProfile.from_dict(prof.to_dict()).cold_s_per_byte == 1.1e-10
    assert ModelProfile.from_dict(chain([1.0], [2.0]).to_dict() | {"cold_s_per_byte": 0.0}) \
        .cold_s_per_byte == 0.0
    older = {k: v for k, v in prof.to_dict().items() if k != "cold_s_per_byte"}
    assert ModelProfile.from_dict(older).cold_s_per_byte == 0.0  # written before it existed
    with pytest.raises(ValueError, match="cold_s_per_byte"):
        dataclasses.replace(prof, cold_s_per_byte=-1e-10)


@pytest.mark.parametrize("eager, expected", [(0.0, 6.0), (0.5e9, 5.5), (1e9, 4.0)])
def test_the_eager_part_of_a_message_moves_before_the_receiver_asks(eager, expected):
    # Two stages, two in flight, stage 0 F = B = 1, stage 1 F = 1, B = 3; every message
    # 1 s on the one link the pair shares both ways. Stage 1 ends B_i at T and sends its
    # gradient; stage 0, waiting at RB_i, pulls it over T..T+1. Without an eager part,
    # stage 1 then pulls activation i+1 (sent long before, while it computed) over
    # T+1..T+2 and runs F, B to T+6: 6 per micro-batch. With half of each message eager,
    # the gradient's first half leaves at T, its rest follows to T+1, and stage 1 pulls
    # only the activation's rest (its first half came while it computed): T+1..T+1.5,
    # then F, B to T+5.5. All eager: the activation is in at T and stage 1's 4 s bound.
    prof = chain([1.0, 1.0], [1.0, 3.0], output=[1e9, 0.0])
    topo = HierarchicalTopology((Level(2, 1e9, 0.0, eager),))
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=2), prof, topo)
    assert sim.time_per_micro_batch_s == pytest.approx(expected)


def test_a_token_bucket_sends_what_it_holds_at_once_and_refills_at_the_rate():
    bucket = _TokenBucket(size=100.0, rate=10.0)
    assert bucket.send(0.0, 50.0) == 0.0  # full: covered, 50 left
    assert bucket.send(0.0, 100.0) == pytest.approx(5.0)  # 50 covered, 50 at the rate
    assert bucket.send(5.0, 30.0) == pytest.approx(3.0)  # empty when that ended
    assert bucket.send(9.0, 10.0) == pytest.approx(0.0)  # 10 earned since 8
    assert bucket.send(1000.0, 150.0) == pytest.approx(5.0)  # refills to its size only
    assert _TokenBucket(0.0, 10.0).send(0.0, 50.0) == pytest.approx(5.0)


def test_a_links_burst_shortens_the_transfers_after_it_idled():
    # The first example of this section (7.4 s per micro-batch) on links whose token
    # bucket holds 0.25 GB: each rank sends one 0.5 GB message per micro-batch and idles
    # seconds in between, so each message finds a full bucket and takes 0.25 s, not 0.5.
    prof = chain([1.0, 1.0], [2.0, 2.0], output=[0.5e9, 0.0])
    topo = HierarchicalTopology((Level(2, 1e9, 0.1, burst_bytes=0.25e9),))
    sim = simulate(Plan.even(2, 2, micro_batch=4, in_flight=1), prof, topo)
    assert sim.time_per_micro_batch_s == pytest.approx(7.4 - 2 * 0.25)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
def test_a_replicas_round_starts_with_its_burst():
    # The ring of the test above on links whose token bucket holds 0.5 GB: each replica
    # sends 1.5 GB per round, the first 0.5 GB at once (its bucket refilled over the
    # 3 s of compute), the rest in 1 s: 4.06 s per 4 micro-batches.
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, HierarchicalTopology((Level(4, 1e9, 0.01, burst_bytes=0.5e9),)))
    assert sim.time_per_micro_batch_s == pytest.approx(4.06 / 4)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
@pytest.mark.parametrize("replicas, flow, expected_rate", [
    (2, 0.0, 1e9),    # one flow's rate not measured: the level's bandwidth
    (2, 3e9, 2e9),    # 4 workers' total (4 GB/s) over 2 flows
    (2, 1.5e9, 1.5e9),  # ... but no flow faster than one alone
    (3, 3e9, 4e9 / 3),
    (4, 3e9, 1e9),    # every worker: the bandwidth measured with all of them
    (2, 0.5e9, 1e9),  # one flow slower than the ring's links: the links' rate
])
def test_fewer_flows_share_what_the_hosts_move(replicas, flow, expected_rate):
    # A level of 4 workers at 1 GB/s, as a ring of all four measured it, on which one
    # flow alone reaches `flow`: a round among `replicas` of them sends each replica's
    # 2 (r - 1) / r x 1 GB at the hosts' 4 GB/s shared by r flows, at most `flow`.
    level = Level(4, 1e9, 0.01, flow_bandwidth=flow)
    assert level.round_bandwidth(replicas) == pytest.approx(expected_rate)
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, replicas),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, HierarchicalTopology((level,)))
    wire = 2 * (replicas - 1) / replicas * 1e9 / expected_rate
    assert sim.stages[0].allreduce_s == pytest.approx(wire + 2 * (replicas - 1) * 0.01)
    assert sim.time_per_micro_batch_s == pytest.approx(
        (3.0 + sim.stages[0].allreduce_s) / replicas)


def test_one_flows_rate_round_trips_through_json_and_is_checked():
    topo = HierarchicalTopology((Level(4, 1e9, 5e-5, flow_bandwidth=2.5e9),))
    assert HierarchicalTopology.from_dict(topo.to_dict()) == topo
    older = topo.to_dict()
    del older["levels"][0]["flow_bandwidth"]  # a topology saved before it was measured
    assert HierarchicalTopology.from_dict(older).levels[0].flow_bandwidth == 0.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="flow_bandwidth"):
            Level(2, 1e9, flow_bandwidth=bad)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
def test_replicas_on_one_node_reduce_in_place():
    # The ring above on one node whose engine reduces its own buffers in place at
    # 0.5 ns per byte: two waits of 10 ms on the wire, and 0.5 s of each replica's
    # CPU, which the round waits for: 3.5 s per 4 micro-batches.
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4)
    topo = HierarchicalTopology((Level(4, 1e9, 0.01, in_place_s_per_byte=0.5e-9),))
    sim = simulate(plan, prof, topo)
    assert sim.stages[0].allreduce_s == pytest.approx(0.02)
    assert sim.time_per_micro_batch_s == pytest.approx(3.5 / 4)
    gpu = dataclasses.replace(topo, device_copy_s_per_byte=1e-12)  # staged: the ring
    assert simulate(plan, prof, gpu).stages[0].allreduce_s > 1.5


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
@pytest.mark.parametrize("weights, expected", [(1e6, 3.0015 + 0.06 + 6 * (0.1 - 0.00025)),
                                               (1e9, 4.56)])
def test_each_step_of_a_round_waits_for_a_core_beyond_its_wire_time(weights, expected):
    # The ring above on workers that share cores (four, so compute is not slowed) and
    # whose comm threads wait λ_load = 0.1 s for one: a 1 MB round's six steps take
    # 0.25 ms each on the wire and wait the rest of 0.1 s; a 1 GB round's steps take
    # 0.25 s on the wire, which covers the wait.
    prof = chain([1.0], [2.0], weights=[weights])
    plan = Plan((StagePlan(0, 1, 4),), schedule="1f1b-rr", micro_batch=4)
    topo = HierarchicalTopology((Level(4, 1e9, 0.01),),
                                shared_cores=SharedCores(4, 4, load_latency_s=0.1))
    assert simulate(plan, prof, topo).time_per_micro_batch_s == pytest.approx(expected / 4)


def test_eager_bytes_round_trip_through_json():
    topo = HierarchicalTopology((Level(2, 1e9, 5e-5, 65408.0),))
    assert HierarchicalTopology.from_dict(topo.to_dict()) == topo
    with pytest.raises(ValueError, match="eager_bytes"):
        Level(2, 1e9, 0.0, -1.0)
    every = HierarchicalTopology((Level(2, 1e9, 5e-5, math.inf, 122880.0),))
    assert HierarchicalTopology.from_dict(every.to_dict()) == every
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="burst_bytes"):
            Level(2, 1e9, burst_bytes=bad)


def test_device_copy_round_trips_through_json_and_is_checked():
    topo = HierarchicalTopology((Level(2, 1e9),), device_copy_s_per_byte=4e-11)
    assert HierarchicalTopology.from_dict(topo.to_dict()) == topo
    assert HierarchicalTopology.from_dict({"levels": [{"count": 2, "bandwidth": 1e9}]}) \
        .device_copy_s_per_byte == 0.0  # written before it existed: CPU workers
    for bad in (-1e-10, math.inf):
        with pytest.raises(ValueError, match="device_copy_s_per_byte"):
            HierarchicalTopology((Level(2, 1e9),), device_copy_s_per_byte=bad)


def test_a_rank_sends_one_message_at_a_time():
    # Stage 0 (no compute) feeds three replicas of stage 1 (F = B = 1) round robin, each
    # activation 1 s on its own link. The replicas could take a micro-batch every 2/3 s
    # and each link carries 2/3 s per micro-batch (activation and gradient), but stage 0
    # sends one message at a time, whichever the peer: at most one micro-batch a second.
    prof = chain([0.0, 1.0], [0.0, 1.0], output=[1e9, 0.0])
    plan = Plan((StagePlan(0, 1), StagePlan(1, 2, 3)), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "4x[1GB/s]")
    assert sim.time_per_micro_batch_s >= 1.0 - 1e-9
    assert sim.link_busy[0] <= 2 / 3 + 1e-9


def test_a_replicas_allreduce_and_its_activations_share_its_nic():
    # Stage 0 on two replicas (no compute) feeds stage 1 (no compute) round robin; each
    # round all-reduces W = 1 GB over 1 GB/s between the replicas, 2 (2 - 1) / 2 x 1 s =
    # 1 s on each one's NIC. A replica's next activation (0.25 s) leaves its NIC after
    # that ring, its gradient comes back in 0.25 s, and only then can the next round's
    # ring start: 1.5 s per round of two micro-batches, where the ring alone (K = 2 keeps
    # the update from waiting for it) would allow one micro-batch every 0.5 s.
    prof = chain([1e-9, 1e-9], [1e-9, 1e-9], output=[0.25e9, 0.0], weights=[1e9, 0.0])
    plan = Plan((StagePlan(0, 1, 2), StagePlan(1, 2)), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "3x[1GB/s]", staleness=2)
    assert sim.time_per_micro_batch_s == pytest.approx(0.75, rel=1e-6)
    tiny = chain([1e-9, 1e-9], [1e-9, 1e-9], output=[1.0, 0.0], weights=[1e9, 0.0])
    assert simulate(plan, tiny, "3x[1GB/s]", staleness=2).time_per_micro_batch_s == \
        pytest.approx(0.5, rel=1e-6)


def test_a_shared_memory_allreduce_competes_for_the_cores():
    # One stage on 2 replicas sharing one core. Each round computes F + B = 3 on both
    # replicas (6 of work on one core) and then all-reduces 1 GB: 1 s on the wire; its
    # CPU work, 1 GB x 1 ns/B per comm thread, 2 s on the one core for both. A round
    # takes 6 + max(1, 2) = 8 s for 2 micro-batches.
    prof = chain([1.0], [2.0], weights=[1e9])
    plan = Plan((StagePlan(0, 1, 2),), schedule="1f1b-rr", micro_batch=4)
    alone = simulate(plan, prof, HierarchicalTopology((Level(2, 1e9),)))
    shared = simulate(plan, prof, HierarchicalTopology(
        (Level(2, 1e9),), shared_cores=SharedCores(1, 2, cpu_s_per_byte=1e-9)))
    assert alone.time_per_micro_batch_s == pytest.approx((3.0 + 1.0) / 2)
    assert shared.time_per_micro_batch_s == pytest.approx(8.0 / 2)


# ----------------------------------------------------------------- wait-free replicas
@pytest.mark.usefixtures("one_bucket_per_gigabyte")
@pytest.mark.parametrize("weights, per_micro_batch", [
    # layer 1's bucket leaves when its backward is done (t = 4, ring 4..5), layer 0's at
    # the end of the backward (6..7): the update at 7, a round of two micro-batches
    ((1e9, 1e9), 3.5),
    # the only bucket is the first layer's: it leaves at 6, as after the backward
    ((1e9, 0.0), 3.5),
    # the only bucket is the last layer's: its ring (4..5) ends before the backward does
    ((0.0, 1e9), 3.0),
])
def test_a_replicas_buckets_leave_during_its_closing_backward(weights, per_micro_batch):
    # One stage of two layers (F = 1, B = 2 each) on two replicas, 1 GB buckets over
    # 1 GB/s: a ring of two sends each bucket once, 1 s. Each replica runs F (0..2) and
    # B (2..6), layer 1's backward first, then waits for its round's all-reduce
    # (staleness 1). An all-reduce after the backward would end at 6 + the ring.
    prof = chain([1.0, 1.0], [2.0, 2.0], weights=list(weights))
    plan = Plan((StagePlan(0, 2, 2),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "2x[1GB/s]")
    assert sim.time_per_micro_batch_s == pytest.approx(per_micro_batch)
    assert sim.stages[0].allreduce_s == pytest.approx(sum(w > 0 for w in weights))


def test_each_of_the_runtimes_buckets_pays_the_rings_latencies():
    # 10 MiB of weights go to the ring as the runtime cuts them, 4, 4 and 2 MiB: three
    # all-reduces of 2 (r - 1) = 2 steps of 10 ms each, and 10 MiB at 1 GB/s on the wire.
    assert SIMULATE.REPLICA_BUCKET_BYTES == DEFAULT_BUCKET_BYTES == 4 << 20
    prof = chain([1.0], [2.0], weights=[10 << 20])
    plan = Plan((StagePlan(0, 1, 2),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "2x[1GB/s, 10ms]")
    assert sim.stages[0].allreduce_s == pytest.approx(3 * 2 * 0.01 + (10 << 20) / 1e9)


@pytest.mark.usefixtures("one_bucket_per_gigabyte")
def test_a_replica_without_a_backward_in_the_round_hands_every_bucket_over_at_once():
    # Three micro-batches on two replicas, one step per two micro-batches per replica:
    # the second round has one micro-batch, so replica 1 closes it with no backward and
    # hands both buckets over at its all-reduce; the simulation ends without a stall.
    prof = chain([1.0, 1.0], [2.0, 2.0], weights=[1e9, 1e9])
    plan = Plan((StagePlan(0, 2, 2),), schedule="1f1b-rr", micro_batch=4)
    sim = simulate(plan, prof, "2x[1GB/s]", num_micro_batches=plan.cycle * 40 + 1)
    assert sim.makespan_s > 0


# ----------------------------------------------------------------- errors
def test_errors_say_what_is_wrong():
    prof = chain([1.0] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="3 layers but the model has 4"):
        simulate(Plan.even(4, 2), prof)
    with pytest.raises(ValueError, match="needs 3 workers but the topology"):
        simulate(Plan.even(3, 3), prof, "2x[1Gbit]")
    with pytest.raises(ValueError, match="simulate at least"):
        simulate(Plan.even(3, 3), prof, num_micro_batches=4)
    with pytest.raises(ValueError, match="distinct workers"):
        simulate(Plan.even(3, 3), prof, "4x[1Gbit]", placement=[[0], [0], [1]])
    with pytest.raises(ValueError, match="workers per stage"):
        simulate(Plan.even(3, 3), prof, "4x[1Gbit]", placement=[[0], [1]])
    with pytest.raises(ValueError, match="staleness"):
        simulate(Plan.even(3, 3), prof, staleness=0)


def test_result_describes_itself():
    sim = simulate(Plan.even(4, 4, micro_batch=4), chain([1.0] * 4, [2.0] * 4))
    text = sim.describe()
    assert "stage 3: layers [3, 4)" in text and "samples/s" in text
    data = sim.to_dict()
    assert data["samples_per_s"] == pytest.approx(4 / 3) and len(data["stages"]) == 4
    assert math.isfinite(sim.makespan_s) and sim.window_s[1] > sim.window_s[0]


# ------------------------------------------------------------ a replica's round excess
def _replicated_round(rate: float = 0.0):
    """One layer (F = 1, B = 2, 1 GB of weights) on two replicas of two shared cores,
    a wire that takes no time, 0.1 ns per byte moved and summed: each rank's share of
    the ring is (r-1)/r x 1e9 x (2 x 0.1 + 0.1) ns = 0.15 s of CPU."""
    prof = dataclasses.replace(chain([1.0], [2.0], weights=[1e9]), replica_s_per_byte=rate)
    topo = HierarchicalTopology((Level(2, 1e15),), shared_cores=SharedCores(
        2, 2, cpu_s_per_byte=1e-10, reduce_s_per_byte=1e-10))
    plan = Plan((StagePlan(0, 1, 2),), schedule="1f1b-rr", micro_batch=4)
    return prof, topo, plan


def test_a_replicas_round_is_charged_its_excess_per_weight_byte():
    # Per round each rank computes F + B, copies its gradient out with the excess
    # (1e9 x 0.5 ns), then its comm thread runs its ring share while the main thread
    # waits: 3 + 0.5 + 0.15 s per round of two micro-batches, on a core each.
    prof, topo, plan = _replicated_round(rate=0.5e-9)
    assert simulate(plan, prof, topo).time_per_micro_batch_s == pytest.approx(3.65 / 2)
    plain = simulate(plan, _replicated_round()[0], topo)
    assert plain.time_per_micro_batch_s == pytest.approx(3.15 / 2)


def test_the_excess_is_fitted_to_a_measured_round():
    prof, topo, _ = _replicated_round()
    fitted = fit_replica_overhead(prof, topo, round_s=3.65, replicas=2)
    assert fitted.replica_s_per_byte == pytest.approx(0.5e-9, rel=1e-6)
    assert fitted.extra["replica_round"] == pytest.approx(
        {"replicas": 2, "measured_s": 3.65, "simulated_without_s": 3.15})
    # far beyond the first guess (the bracket grows), and the simulation reproduces it
    slow = fit_replica_overhead(prof, topo, round_s=40.0, replicas=2)
    assert slow.replica_s_per_byte == pytest.approx((40.0 - 3.15) / 1e9, rel=1e-6)
    # a round that ran faster than its simulation: nothing to add
    assert fit_replica_overhead(prof, topo, 3.0, 2).replica_s_per_byte == 0.0
    with pytest.raises(ValueError, match="at least 2 replicas"):
        fit_replica_overhead(prof, topo, 3.65, 1)
    with pytest.raises(ValueError, match="positive number of seconds"):
        fit_replica_overhead(prof, topo, float("nan"), 2)


def test_the_replica_excess_round_trips_through_json_and_is_checked():
    prof = dataclasses.replace(chain([1.0], [2.0]), replica_s_per_byte=7e-10)
    assert ModelProfile.from_dict(prof.to_dict()).replica_s_per_byte == 7e-10
    older = {k: v for k, v in prof.to_dict().items() if k != "replica_s_per_byte"}
    assert ModelProfile.from_dict(older).replica_s_per_byte == 0.0
    with pytest.raises(ValueError, match="replica_s_per_byte"):
        dataclasses.replace(prof, replica_s_per_byte=-1e-10)


# ------------------------------------------------------------ a pipeline stage's excess
def test_every_stage_pays_the_stage_excess_per_micro_batch():
    # Two stages of F = 1, B = 2 on free links: each stage is busy 3 per micro-batch in
    # the steady state; with 0.5 of excess per micro-batch on each, 3.5.
    prof = chain([1.0, 1.0], [2.0, 2.0])
    plan = Plan((StagePlan(0, 1), StagePlan(1, 2)), micro_batch=4)
    assert simulate(plan, prof, "2x[1000Gbit]").time_per_micro_batch_s == pytest.approx(3.0)
    charged = dataclasses.replace(prof, stage_excess_s=0.5)
    assert simulate(plan, charged, "2x[1000Gbit]").time_per_micro_batch_s == \
        pytest.approx(3.5)
    # a stage of two layers pays it once per micro-batch, not per layer
    one = Plan((StagePlan(0, 2),), micro_batch=4)
    assert simulate(one, charged, "1x[1000Gbit]").time_per_micro_batch_s == \
        pytest.approx(6.5)


def test_the_stage_excess_is_fitted_to_a_measured_pipeline():
    prof = chain([1.0, 1.0], [2.0, 2.0])
    plan = Plan((StagePlan(0, 1), StagePlan(1, 2)), micro_batch=4)
    fitted = fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, micro_batch_s=3.5)
    assert fitted.stage_excess_s == pytest.approx(0.5, rel=1e-6)
    run = fitted.extra["pipeline_run"]
    assert Plan.from_dict(run["plan"]) == plan
    assert run["measured_s"] == 3.5 and run["simulated_without_s"] == pytest.approx(3.0)
    # far beyond the first guess on two shared cores of one host, where both stages'
    # work runs at once: the simulation reproduces the measured time
    topo = HierarchicalTopology((Level(2, 1e15),), shared_cores=SharedCores(1, 2))
    slow = fit_pipeline_overhead(prof, topo, plan, micro_batch_s=20.0)
    assert simulate(plan, slow, topo).time_per_micro_batch_s == pytest.approx(20.0, rel=1e-6)
    # a run faster than its simulation: nothing to add, and a profile not scaled from
    # its layers alone (`calibrate`) is not scaled back
    faster = fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, 2.0)
    assert faster.stage_excess_s == 0.0 and faster.layers == prof.layers
    assert faster.extra["pipeline_run"]["compute_factor"] == 1.0
    with pytest.raises(ValueError, match="positive number of seconds"):
        fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, 0.0)


def test_a_pipeline_faster_than_simulated_scales_the_layers_back_toward_alone():
    # The layers' times were scaled x2 to whole models run beside each other
    # (`calibrate`); the straight pipeline (F + B + U = 3.5 s per micro-batch simulated)
    # ran in 2/3 of that: every layer's times x 2/3. One that ran in 1 s gets them back
    # to alone (x 1/2), and the simulation can go no faster (1.75 s).
    prof = dataclasses.replace(
        with_costs(chain([1.0, 1.0], [2.0, 2.0]), update_s=0.5),
        extra={"calibration": {"forward": 2.0, "backward": 2.0, "update": 2.0}})
    plan = Plan((StagePlan(0, 1), StagePlan(1, 2)), micro_batch=4)
    assert simulate(plan, prof).time_per_micro_batch_s == pytest.approx(3.5)
    fitted = fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, micro_batch_s=3.5 * 2 / 3)
    assert fitted.extra["pipeline_run"]["compute_factor"] == pytest.approx(2 / 3, rel=1e-6)
    assert fitted.stage_excess_s == 0.0
    assert [lp.backward_s for lp in fitted.layers] == pytest.approx([4 / 3] * 2, rel=1e-6)
    assert [lp.update_s for lp in fitted.layers] == pytest.approx([1 / 3] * 2, rel=1e-6)
    floor = fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, micro_batch_s=1.0)
    assert floor.extra["pipeline_run"]["compute_factor"] == 0.5
    assert simulate(plan, floor).time_per_micro_batch_s == pytest.approx(1.75)


def test_a_pipeline_bound_by_its_link_charges_nothing_to_its_stages():
    # Two stages of F = 1, B = 2 joined by a link that takes 10 per micro-batch each way:
    # 23 per micro-batch, of which only the 3 of compute on the critical path follow the
    # layers' times. A run a little slower or faster than simulated says nothing of its
    # CPU, and fitted to it regardless the gap would come back magnified 23/3 times.
    prof = dataclasses.replace(chain([1.0, 1.0], [2.0, 2.0], output=[1e6, 0.0]),
                               extra={"calibration": {"forward": 2.0, "backward": 2.0}})
    plan = Plan((StagePlan(0, 1), StagePlan(1, 2)), micro_batch=4)
    topo = "2x[800kbit]"
    linked = simulate(plan, prof, topo).time_per_micro_batch_s
    assert linked == pytest.approx(23.0)
    share = compute_share(lambda p: simulate(plan, p, topo).time_per_micro_batch_s, prof)
    assert share == pytest.approx(3 / 23) and share < COMPUTE_BOUND
    for measured in (linked * 1.01, linked * 0.99):
        fitted = fit_pipeline_overhead(prof, topo, plan, measured)
        assert fitted.stage_excess_s == 0.0 and fitted.layers == prof.layers
        assert fitted.extra["pipeline_run"]["compute_factor"] == 1.0
        assert fitted.extra["pipeline_run"]["compute_share"] < COMPUTE_BOUND
    # on free links the same stages bound the run, and the same gap is charged
    free = fit_pipeline_overhead(prof, "2x[1000Gbit]", plan, 3.0 * 1.01)
    assert free.stage_excess_s == pytest.approx(0.03, rel=1e-3)
    assert free.extra["pipeline_run"]["compute_share"] == pytest.approx(1.0, rel=1e-4)


def test_the_stage_excess_round_trips_through_json_and_is_checked():
    prof = dataclasses.replace(chain([1.0], [2.0]), stage_excess_s=1.5e-3)
    assert ModelProfile.from_dict(prof.to_dict()).stage_excess_s == 1.5e-3
    older = {k: v for k, v in prof.to_dict().items() if k != "stage_excess_s"}
    assert ModelProfile.from_dict(older).stage_excess_s == 0.0
    with pytest.raises(ValueError, match="stage_excess_s"):
        dataclasses.replace(prof, stage_excess_s=-1e-3)
