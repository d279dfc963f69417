"""Discrete-event simulation of a `Plan`: the runtime's own action lists, timed.

Every rank runs its list of `schedule.lower(plan, schedule.generate(plan, n))`, the list
`Pipeline.train_epoch` executes (`schedule.build` returns it after a deadlock check, which
this simulation repeats in passing), one action at a time:

    F, B     busy for the stage's forward / backward time: the sum of its layers' times in
             the profile, times micro_batch / profile.batch_size; the last stage's
             forward adds the loss (`loss_s`, scaled alike), every forward the
             runtime's own time per micro-batch (`stage_overhead_s`) and what a real
             pipeline run took beyond the simulation (`stage_excess_s`), and a forward
             that takes a new stashed version of the weights their copy (`copy_s`)
    SF, SB   free (the runtime's sends are non-blocking); the message's header arrives
             one latency later, and the payload's first `eager_bytes` (the level's: the
             transport's eager limit, or all of it between nodes, where the runtime
             sends eager pieces) leave at once
    RF, RB   waits for the payload, a_l bytes of the layer at the stage boundary
             (scaled like the times): the runtime posts a payload's receive when it reads
             the header, at this action, so the rest of the payload moves only once the
             receiver is here and the header in. Every part waits for the link between
             the two ranks and for the sender's previous message (one NIC per rank, to
             whichever peer), occupies both for what the sender's token bucket on that
             level does not cover (`Level.burst_bytes`: it sends what it holds at once
             and refills at the bandwidth) / bandwidth, and arrives one latency after
             that; a receiver that slept meanwhile resumes `receive_delay_s` later
             (the profile's)
    B        of a replicated stage's last micro-batch before an all-reduce (its closing
             backward) hands the round to the ring as it goes, as the runtime does
             (PipeDream's wait-free rule, `ReplicaGradientSync.open_round`): the
             gradient is cut into the runtime's buckets (`REPLICA_BUCKET_BYTES`, in
             layer order), and once the backward, last layer first, has made the first
             layer of a bucket, the rank copies it out (its share of `copy_s`) and pays
             what a replicated round loses beyond its actions and its ring's bytes
             (its bytes x the profile's `replica_s_per_byte`, fitted to a real round)
    AR       hands over the buckets no backward did (a replica without a micro-batch in
             the round), paying the same; then free. Each bucket's all-reduce starts
             once every replica has handed it over and the stage's previous one is done
             (the engine runs them in order), and takes 2(r-1)/r n / B_r + 2(r-1)
             latency for its n bytes (ring; the token bucket covers its first bytes) on
             every replica's NIC, after the messages already on it (and the messages
             sent later queue behind it: all-reduces and activations share the links);
             on a level that reduces in place (`Level.in_place_s_per_byte`: one node,
             `Engine.zeros`), two latencies and n x that rate of CPU instead.
             Where workers share cores, each step also waits for one
             (`SharedCores.load_latency_s` less the step's time on the wire, as the
             timing model's `steps_core_wait`). B_r is the level's bandwidth, or,
             where one flow alone was measured faster (links bound by what their hosts
             move in all, as TCP on shared cores is), the level's total over r flows,
             at most that flow's rate (`Level.round_bandwidth`)
    U        waits for the all-reduce it applies: its own round's (staleness K = 1, the
             runtime's default), the one K-1 rounds back, or every one at the last round;
             then busy for the optimizer step of the stage's layers (`update_s`)

so a round's last buckets (the first layers') can only leave after its closing backward.
The runtime's first round allocates its buffer at the all-reduce instead (outside the
steady state). An F, B or U that follows a
wait the rank slept through (RF, RB, U) is busy longer by the stage's weight bytes x the
profile's `cold_s_per_byte`: its data left the caches meanwhile. So is a B on a stashed
version of the weights older than the live one: the forwards since copied newer
versions, which evicted it (the forward itself reads the copy it just made; measured
in BENCHMARKS.md, "Planner: predicted against measured").

Links and placement. Ranks map to topology workers by `plan.extra["placement"]` (what
`to_plan` writes) or in rank order. Two ranks talk over the lowest level holding both;
a replica ring over the lowest level holding all of them. One link joins each pair of
ranks and both directions share it, as PipeDream's 2a_s/B_k and MadPipe's C = 2a/β count
it. Without a topology communication is free.

Steady state. Let c_i be the end of stage 0's backward of micro-batch i (its last compute).
Enough micro-batches are run that the window from c_a to c_b, b - a a whole number of
cycles (micro_batches_per_step x the lcm of the replica counts) with the startup before a
and the drain after b, sees the periodic regime: samples/s = (b - a) micro_batch /
(c_b - c_a); a stage's bubble is the fraction of that window its replicas spend not
computing (waiting for a message, a neighbour or an all-reduce), averaged over them.

Memory, counted along each rank's timeline as the runtime holds it: weights x (1 + the
stashed copies alive, `WeightStash` for 1f1b, none for gpipe's `LatestWeights`) +
optimizer state + saved activations x micro-batches between their forward and backward;
the peak over the run, the largest over a stage's replicas.

Shared cores. Where the topology's workers share CPU cores (`SharedCores`: training on
CPUs), every busy thread of a host progresses at min(1, cores / busy threads) (processor
sharing): a rank's F, B, U and its gradient copy; each transfer's CPU work (bytes x
`cpu_s_per_byte`, on the receiver's host, which pulls the payload; it is in when both the
wire and the CPU are done); each replica's share of an all-reduce round (2(r-1)/r n bytes moved at
`cpu_s_per_byte`, (r-1)/r n summed at `reduce_s_per_byte`; the round ends when its wire
time and every replica's CPU work are done). Without shared cores each worker computes
alone, and transfers and rounds take their wire time.

Left out: compression of the replicas' all-reduce and the 8-byte all-reduce of their
micro-batch count after each round (docs/planner.md), gradient and communication
buffers in memory; a NIC's messages and all-reduces are sent one after another where
TCP would share the link between them (the same bytes, in another order); the receiving
side of a link (its own token bucket and NIC).

Example (PipeDream Fig. 4: 4 stages, backward twice the forward):

    prof = ModelProfile.from_columns([1] * 4, [2] * 4, [0] * 4, [0] * 4, batch_size=8)
    sim = simulate(Plan.even(4, 4, micro_batch=8), prof)
    sim.time_per_micro_batch_s, sim.bubble_fraction     # 3.0, (0.0, 0.0, 0.0, 0.0)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipesgd.pipeline import schedule as sched
from pipesgd.pipeline.plan import Plan
from pipesgd.pipeline.replicas import DEFAULT_BUCKET_BYTES
from pipesgd.pipeline.schedule import no_step_between_forward_and_backward
from pipesgd.timing.model import steps_core_wait

from .profile import ModelProfile
from .topology import HierarchicalTopology, Level, SharedCores, as_topology

SATURATED = 0.99  # a resource busier than this in steady state is the bottleneck
MIN_MEASURED_CYCLES = 4
REPLICA_BUCKET_BYTES = DEFAULT_BUCKET_BYTES  # the runtime's all-reduce of a replica's round


@dataclass(frozen=True)
class Interval:
    """One compute action of one rank: `action` (e.g. "2F0") from `start` to `end` (s)."""

    rank: int
    action: str
    start: float
    end: float


@dataclass(frozen=True)
class StageReport:
    """One stage in the simulation.

    Attributes:
        stage, start, end, replicas: the plan's stage (layers [start, end)).
        forward_s, backward_s: one micro-batch on one replica.
        allreduce_s: one round of the replicas' ring all-reduce, its buckets one after
            another (0: not replicated).
        busy: steady-state fraction of time its replicas compute (mean over replicas).
        in_flight: most micro-batches one replica holds between forward and backward.
        weight_versions: most weight versions one replica holds (live + stashed copies).
        memory_bytes: peak memory of its busiest replica.
    """

    stage: int
    start: int
    end: int
    replicas: int
    forward_s: float
    backward_s: float
    allreduce_s: float
    busy: float
    in_flight: int
    weight_versions: int
    memory_bytes: float

    @property
    def bubble(self) -> float:
        """Steady-state fraction of time its replicas are idle."""
        return 1.0 - self.busy

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class SimulationResult:
    """What `simulate` found.

    Attributes:
        plan: the plan simulated.
        samples_per_s: steady-state throughput.
        time_per_micro_batch_s: steady-state time between two micro-batches.
        stages: one `StageReport` per stage.
        link_busy: per stage boundary (stage s to s+1), the busiest of its links' fraction
            of steady-state time carrying activations or gradients.
        allreduce_busy: per stage, fraction of steady-state time its all-reduce runs.
        bottleneck: the busiest resource ("stage 1", "link 0-1", "all-reduce of stage 0"),
            or "pipeline depth" when none is saturated (the pipeline waits on latency).
        num_micro_batches: micro-batches simulated.
        window_s: (start, end) of the steady-state window.
        makespan_s: time until the last rank finished.
        timeline: every F and B of every rank.
    """

    plan: Plan
    samples_per_s: float
    time_per_micro_batch_s: float
    stages: tuple[StageReport, ...]
    link_busy: tuple[float, ...]
    allreduce_busy: tuple[float, ...]
    bottleneck: str
    num_micro_batches: int
    window_s: tuple[float, float]
    makespan_s: float
    timeline: tuple[Interval, ...] = field(repr=False, default=())

    @property
    def bubble_fraction(self) -> tuple[float, ...]:
        return tuple(s.bubble for s in self.stages)

    @property
    def peak_memory_bytes(self) -> tuple[float, ...]:
        return tuple(s.memory_bytes for s in self.stages)

    @property
    def max_memory_bytes(self) -> float:
        """The most memory any worker needs."""
        return max(self.peak_memory_bytes)

    def describe(self) -> str:
        plan = self.plan
        lines = [f"simulated {plan.schedule} plan, {plan.num_stages} stage(s) on "
                 f"{plan.world_size} worker(s), micro-batch {plan.micro_batch}, in flight "
                 f"{plan.noam}: {self.samples_per_s:.6g} samples/s "
                 f"({self.time_per_micro_batch_s * 1e3:.6g} ms per micro-batch), "
                 f"bottleneck {self.bottleneck}"]
        for s in self.stages:
            lines.append(f"  stage {s.stage}: layers [{s.start}, {s.end}) x{s.replicas}, "
                         f"{s.compute_s * 1e3:.4g} ms, bubble {s.bubble:.0%}, "
                         f"{s.in_flight} in flight, {s.memory_bytes / 1e6:.4g} MB")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples_per_s": self.samples_per_s,
            "time_per_micro_batch_s": self.time_per_micro_batch_s,
            "bottleneck": self.bottleneck,
            "stages": [
                {"layers": [s.start, s.end], "replicas": s.replicas,
                 "forward_s": s.forward_s, "backward_s": s.backward_s,
                 "allreduce_s": s.allreduce_s, "bubble": s.bubble,
                 "in_flight": s.in_flight, "weight_versions": s.weight_versions,
                 "memory_bytes": s.memory_bytes}
                for s in self.stages
            ],
            "link_busy": list(self.link_busy),
            "allreduce_busy": list(self.allreduce_busy),
            "num_micro_batches": self.num_micro_batches,
        }


# --------------------------------------------------------------------------- the model
def batch_scale(profile: ModelProfile, batch: int) -> float:
    """Factor from the profile's figures to `batch` samples (times, activations): linear;
    1 where the profile does not say its batch size."""
    return batch / profile.batch_size if profile.batch_size else 1.0


@dataclass(frozen=True)
class _StageCost:
    forward_s: float
    backward_s: float
    update_s: float
    copy_s: float  # one stashed version of the weights
    output_bytes: float  # sent downstream per micro-batch
    input_bytes: float  # its gradient, sent upstream per micro-batch
    weight_bytes: float
    optimizer_bytes: float
    saved_bytes: float  # per micro-batch


def _stage_costs(plan: Plan, profile: ModelProfile) -> list[_StageCost]:
    k = batch_scale(profile, plan.micro_batch)
    layers = profile.layers
    out = []
    for sp in plan.stages:
        mine = layers[sp.start:sp.end]
        loss = k * profile.loss_s if sp.end == len(layers) else 0.0
        out.append(_StageCost(
            forward_s=k * sum(lp.forward_s for lp in mine) + loss
            + profile.stage_overhead_s + profile.stage_excess_s,
            backward_s=k * sum(lp.backward_s for lp in mine),
            update_s=sum(lp.update_s for lp in mine),
            copy_s=sum(lp.copy_s for lp in mine),
            output_bytes=k * layers[sp.end - 1].output_bytes,
            input_bytes=k * layers[sp.start - 1].output_bytes if sp.start > 0 else 0.0,
            weight_bytes=sum(lp.param_bytes for lp in mine),
            optimizer_bytes=sum(lp.optimizer_bytes for lp in mine),
            saved_bytes=k * sum(lp.saved_bytes for lp in mine),
        ))
    return out


def _closing_backward(plan: Plan, profile: ModelProfile, stage: int,
                      ) -> tuple[list[tuple[float, int | None]], list[tuple[float, ...]]]:
    """How a replica's closing backward hands its round to the ring, as the runtime does
    (`ReplicaGradientSync.open_round`): (chunks, groups). The stage's flat gradient is cut
    into buckets of `REPLICA_BUCKET_BYTES` in layer order; a bucket can leave once the
    backward has made the gradients of the first layer in it, so the buckets a layer
    completes form one group, all-reduced one after another (groups[g]: their bytes).
    The backward runs last layer first, in chunks of (seconds, the group it completes,
    or None for the layers after the last group's). A stage without weights: one group
    without bytes (its round still all-reduces the micro-batch count)."""
    k = batch_scale(profile, plan.micro_batch)
    sp = plan.stages[stage]
    mine = profile.layers[sp.start:sp.end]
    weights = [lp.param_bytes for lp in mine]
    total = sum(weights)
    if total <= 0:
        return [(k * sum(lp.backward_s for lp in mine), None)], [()]
    size = REPLICA_BUCKET_BYTES
    offsets = list(itertools.accumulate(weights, initial=0.0))
    completes: dict[int, list[float]] = defaultdict(list)  # layer -> buckets' bytes
    for b in range(math.ceil(total / size)):
        lo, hi = b * size, min((b + 1) * size, total)
        first = min(i for i, w in enumerate(weights)
                    if w > 0 and offsets[i] < hi and offsets[i + 1] > lo)
        completes[first].append(hi - lo)
    chunks: list[tuple[float, int | None]] = []
    groups: list[tuple[float, ...]] = []
    work = 0.0
    for i in reversed(range(len(mine))):
        work += k * mine[i].backward_s
        if i in completes:
            chunks.append((work, len(groups)))
            groups.append(tuple(completes[i]))
            work = 0.0
    if work > 0:
        chunks.append((work, None))
    return chunks, groups


class _Cpu:
    """One host's cores, shared by the threads busy on it (processor sharing): each
    progresses at min(1, cores / busy threads). Jobs: key -> [work left (s), token]; a
    job's finish event carries its token (never reused, as keys are), so an event
    scheduled before the rate last changed is ignored."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.jobs: dict[tuple, list[Any]] = {}
        self.t = 0.0
        self._tokens = itertools.count()

    def rate(self) -> float:
        return min(1.0, self.cores / len(self.jobs)) if self.jobs else 1.0

    def advance(self, t: float) -> None:
        rate = self.rate()
        for job in self.jobs.values():
            job[0] = max(0.0, job[0] - (t - self.t) * rate)
        self.t = t

    def schedule(self, t: float) -> list[tuple[float, tuple, int]]:
        """(finish time, key, token) of every job at the current rate."""
        rate = self.rate()
        out = []
        for key, job in self.jobs.items():
            job[1] = next(self._tokens)
            out.append((t + job[0] / rate, key, job[1]))
        return out


class _TokenBucket:
    """A sender's token bucket on one level's links: it holds up to `size` bytes and
    refills at `rate` bytes/s; bytes it covers leave at once, the rest at `rate`."""

    def __init__(self, size: float, rate: float) -> None:
        self.size, self.rate = size, rate
        self.tokens, self.t = size, 0.0

    def send(self, start: float, nbytes: float, rate: float | None = None) -> float:
        """Seconds `nbytes` take from `start` (at or after the bucket's last send ended),
        the bytes beyond the tokens at `rate` (default: the bucket's own)."""
        rate = self.rate if rate is None else rate
        if self.size <= 0:
            return nbytes / rate
        tokens = min(self.size, self.tokens + (start - self.t) * self.rate)
        seconds = max(0.0, nbytes - tokens) / rate
        # while it sends beyond its tokens the bucket earns what it spends
        self.tokens, self.t = max(0.0, tokens - nbytes), start + seconds
        return seconds


class _Network:
    """Bandwidth and latency between ranks, from the topology and the placement."""

    def __init__(self, plan: Plan, topology: HierarchicalTopology | None,
                 placement: Sequence[Sequence[int]] | None) -> None:
        self.topology = topology
        # δ: what staging a tensor through pinned host memory costs per byte, each way
        self.device_copy_s_per_byte = 0.0 if topology is None else \
            topology.device_copy_s_per_byte
        world = plan.world_size
        if topology is None:
            self.worker = list(range(world))
            return
        if topology.num_workers < world:
            raise ValueError(f"the plan needs {world} workers but the topology "
                             f"{str(topology)!r} has {topology.num_workers}")
        if placement is None:
            placement = plan.extra.get("placement")
        if placement is None:
            self.worker = list(range(world))
            return
        shape = [len(w) for w in placement]
        if shape != [s.replicas for s in plan.stages]:
            raise ValueError(f"the placement gives {shape} workers per stage but the plan "
                             f"has {[s.replicas for s in plan.stages]} replicas")
        self.worker = [int(w) for ws in placement for w in ws]
        if len(set(self.worker)) != world or not all(
                0 <= w < topology.num_workers for w in self.worker):
            raise ValueError(f"the placement {list(map(list, placement))} must name "
                             f"{world} distinct workers of 0..{topology.num_workers - 1}")

    def _level_index(self, workers: Sequence[int]) -> int:
        """The index in `topology.levels` of the lowest level holding all `workers`."""
        assert self.topology is not None
        for k in range(1, self.topology.num_levels + 1):
            size = self.topology.component_size(k)
            if len({w // size for w in workers}) == 1:
                return k - 1
        raise AssertionError("the top level holds every worker")  # pragma: no cover

    def _level(self, workers: Sequence[int]) -> Level:
        assert self.topology is not None
        return self.topology.levels[self._level_index(workers)]

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bytes/s, latency s) between ranks a and b."""
        if self.topology is None:
            return math.inf, 0.0
        level = self._level([self.worker[a], self.worker[b]])
        return level.bandwidth, level.latency

    def bucket_key(self, ranks: Sequence[int]) -> int:
        """The level whose links join `ranks` (a sender has one token bucket per level)."""
        return 0 if self.topology is None else \
            self._level_index([self.worker[r] for r in ranks])

    def new_bucket(self, level: int) -> _TokenBucket:
        """A full token bucket for a sender on `level`'s links."""
        if self.topology is None:
            return _TokenBucket(0.0, math.inf)
        lv = self.topology.levels[level]
        return _TokenBucket(lv.burst_bytes, lv.bandwidth)

    def eager_bytes(self, a: int, b: int) -> float:
        """Bytes of a message from a to b that move before b asks for it."""
        if self.topology is None:
            return 0.0
        return self._level([self.worker[a], self.worker[b]]).eager_bytes

    def host(self, rank: int) -> int:
        """The host whose cores the rank computes on (its own without shared cores)."""
        shared = self.shared
        return rank if shared is None else self.worker[rank] // shared.workers_per_host

    def cpus(self) -> dict[int, _Cpu]:
        shared = self.shared
        cores = math.inf if shared is None else shared.cores
        return {h: _Cpu(cores) for h in {self.host(r) for r in range(len(self.worker))}}

    @property
    def shared(self) -> SharedCores | None:
        return self.topology.shared_cores if self.topology is not None else None

    def _round_level(self, ranks: Sequence[int]) -> Level | None:
        """The level of a replicated stage's all-reduce among `ranks` (None: no round)."""
        if len(ranks) < 2 or self.topology is None:
            return None
        return self._level([self.worker[x] for x in ranks])

    def in_place(self, ranks: Sequence[int]) -> bool:
        """Whether the engine reduces the replicas' buffers in place (one node's shared
        memory, `Engine.zeros`) rather than around the ring; never on GPUs, whose
        gradients reach the engine through host copies of their own."""
        level = self._round_level(ranks)
        return level is not None and level.in_place_s_per_byte > 0 \
            and self.device_copy_s_per_byte == 0

    def ring_cpu_s(self, ranks: Sequence[int], nbytes: float) -> float:
        """CPU time of one replica's comm thread in an all-reduce of `nbytes`: in place,
        its share of reading and writing every part (n β_in_place); around a ring, it
        moves 2(r-1)/r n bytes and sums (r-1)/r n of them."""
        r, shared, level = len(ranks), self.shared, self._round_level(ranks)
        if level is None:
            return 0.0
        if self.in_place(ranks):
            return nbytes * level.in_place_s_per_byte
        if shared is None:
            return 0.0
        return (r - 1) / r * nbytes * (2 * shared.cpu_s_per_byte + shared.reduce_s_per_byte)

    def transfer_cpu_s(self, nbytes: float) -> float:
        """CPU time of moving `nbytes` from one rank to another."""
        return 0.0 if self.shared is None else nbytes * self.shared.cpu_s_per_byte

    def ring_bytes(self, ranks: Sequence[int], nbytes: float) -> float:
        """Bytes one replica sends over its link in a ring all-reduce of `nbytes` among
        `ranks`, 2(r-1)/r n; 0 in place (nothing crosses a link)."""
        if self._round_level(ranks) is None or self.in_place(ranks):
            return 0.0
        return 2 * (len(ranks) - 1) / len(ranks) * nbytes

    def ring_rate(self, ranks: Sequence[int]) -> float:
        """Bytes/s each replica's link carries in the ring among `ranks`
        (`Level.round_bandwidth`: faster than the level's bandwidth where one flow
        alone is, and fewer than all its workers send)."""
        level = self._round_level(ranks)
        return math.inf if level is None else level.round_bandwidth(len(ranks))

    def ring_wire_s(self, ranks: Sequence[int], nbytes: float) -> float:
        """What those bytes take at that rate."""
        sent = self.ring_bytes(ranks, nbytes)
        return sent / self.ring_rate(ranks) if sent else 0.0

    def ring_s(self, ranks: Sequence[int], nbytes: float) -> float:
        """A replicated stage's all-reduce of `nbytes` among `ranks`, apart from its CPU
        work: in place two waits of a latency, else the ring's 2(r-1)/r n / B and
        2(r-1) latencies; where compute keeps shared cores busy, each of those waits
        also waits for a core (the timing model's `steps_core_wait`: λ_load less
        the step's own time on the wire); on GPUs, the gradient's copy to the host
        before it and back after it."""
        level = self._round_level(ranks)
        if level is None:
            return 0.0
        steps = 2 if self.in_place(ranks) else 2 * (len(ranks) - 1)
        wire = self.ring_wire_s(ranks, nbytes)
        load = self.shared.load_latency_s if self.shared is not None else 0.0
        return (wire + steps * level.latency + steps_core_wait(steps, load, wire)
                + 2 * nbytes * self.device_copy_s_per_byte)


class _Memory:
    """One rank's memory as the runtime's weight policy and stage hold it."""

    def __init__(self, cost: _StageCost, stash: bool, live_ok: set[int]) -> None:
        self.cost = cost
        self.stash = stash
        self.live_ok = live_ok
        self.version = 0
        self.copies: dict[int, set[int]] = {}  # stashed version -> micro-batches using it
        self.of_mb: dict[int, int | None] = {}  # micro-batch -> its copy (None: live)
        self.peak_bytes = 0.0
        self.peak_in_flight = 0
        self.peak_versions = 1

    def forward(self, mb: int) -> bool:
        """Hold micro-batch mb's version; True when that takes a new copy of the weights."""
        v = self.version
        copied = False
        if not self.stash or (mb in self.live_ok and v not in self.copies):
            self.of_mb[mb] = None
        else:
            copied = v not in self.copies
            self.copies.setdefault(v, set()).add(mb)
            self.of_mb[mb] = v
        self._record()
        return copied

    def on_older_copy(self, mb: int) -> bool:
        """Whether micro-batch mb runs on a stashed copy of the weights that an update has
        since left behind."""
        v = self.of_mb[mb]
        return v is not None and v != self.version

    def backward_done(self, mb: int) -> None:
        v = self.of_mb.pop(mb)
        if v is not None:
            users = self.copies[v]
            users.discard(mb)
            if not users:
                del self.copies[v]

    def update(self) -> None:
        self.version += 1

    def _record(self) -> None:
        c = self.cost
        versions = 1 + len(self.copies)
        in_flight = len(self.of_mb)
        held = versions * c.weight_bytes + c.optimizer_bytes + in_flight * c.saved_bytes
        self.peak_bytes = max(self.peak_bytes, held)
        self.peak_in_flight = max(self.peak_in_flight, in_flight)
        self.peak_versions = max(self.peak_versions, versions)


def _window_sizes(plan: Plan) -> tuple[int, int]:
    """(micro-batches per cycle, cycles to skip for the startup and keep for the drain)."""
    cycle = plan.cycle
    admitted = (plan.micro_batches_per_step if plan.schedule == "gpipe"
                else plan.noam * plan.stages[0].replicas)
    settle = math.ceil((2 * admitted + 2 * plan.world_size) / cycle)
    return cycle, settle


def _busy(intervals: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] that the (sorted, disjoint) intervals cover."""
    return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in intervals)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


# --------------------------------------------------------------------------- simulate
def simulate(
    plan: Plan,
    profile: ModelProfile,
    topology: HierarchicalTopology | str | None = None,
    *,
    placement: Sequence[Sequence[int]] | None = None,
    num_micro_batches: int | None = None,
    staleness: int = 1,
) -> SimulationResult:
    """Time `plan` on `topology` with the per-layer figures of `profile`.

    Args:
        plan: stages, replicas, schedule, micro-batch size, depth (`in_flight`).
        profile: per-layer forward/backward time, output, weight, optimizer and saved
            bytes, for `profile.batch_size` samples (scaled linearly to the micro-batch).
        topology: e.g. "4x[20GB/s], 2x[1Gbit]"; None: communication takes no time.
        placement: per stage, the topology workers of its replicas (default: the plan's
            `extra["placement"]` if it has one, else rank order).
        num_micro_batches: micro-batches to run (None: enough for the startup, at least
            four steady-state cycles and the drain).
        staleness: K of the replicated stages' all-reduce (the runtime's `--staleness`).

    Returns:
        SimulationResult: steady-state samples/s, per-stage bubble and peak memory,
        link and all-reduce load, the bottleneck, the timeline.

    Raises:
        ValueError: a profile of another layer count, a topology with fewer workers than
            the plan, a bad placement, too few micro-batches for a steady state.
        DeadlockError: ranks that wait on each other forever (with the schedule table).
    """
    profile.check(plan.num_layers)
    if not isinstance(staleness, int) or staleness < 1:
        raise ValueError(f"staleness must be an integer >= 1, got {staleness!r}")
    topo = None if topology is None else as_topology(topology)
    net = _Network(plan, topo, placement)
    costs = _stage_costs(plan, profile)
    cycle, settle = _window_sizes(plan)
    least = (2 * settle + 1) * cycle
    n = num_micro_batches if num_micro_batches is not None else \
        (2 * settle + max(MIN_MEASURED_CYCLES, settle)) * cycle
    if n < least:
        raise ValueError(f"{n} micro-batches leave no steady state between the startup and "
                         f"the drain of this plan; simulate at least {least}")
    # The lists `schedule.build` returns, without its offline check: a stall shows here.
    acts = sched.lower(plan, sched.generate(plan, n))
    world = plan.world_size
    stage_of = [plan.position(r)[0] for r in range(world)]
    ranks_of = [[plan.rank_of(s, i) for i in range(sp.replicas)]
                for s, sp in enumerate(plan.stages)]
    # a replicated stage's round: its closing backward's chunks and bucket groups, and
    # per group the ring's time, bytes sent, time on the wire and CPU work per replica
    closing = [_closing_backward(plan, profile, s) for s in range(plan.num_stages)]
    group_bytes = [[sum(g) for g in groups] for _, groups in closing]
    ring_s = [[sum(net.ring_s(ranks_of[s], b) for b in g) if g else net.ring_s(ranks_of[s], 0.0)
               for g in closing[s][1]] for s in range(plan.num_stages)]
    ring_bytes = [[net.ring_bytes(ranks_of[s], b) for b in group_bytes[s]]
                  for s in range(plan.num_stages)]
    ring_wire_s = [[sum(net.ring_wire_s(ranks_of[s], b) for b in g) for g in closing[s][1]]
                   for s in range(plan.num_stages)]
    ring_rate = [net.ring_rate(ranks_of[s]) for s in range(plan.num_stages)]
    ring_cpu_s = [[net.ring_cpu_s(ranks_of[s], b) for b in group_bytes[s]]
                  for s in range(plan.num_stages)]
    # per rank of a replicated stage: closing backward's micro-batch -> the round it closes
    closes = [sched.closing_backwards(acts[r]) if plan.stages[stage_of[r]].replicas > 1
              else {} for r in range(world)]
    last_round = [max((a.mb for a in acts[ranks_of[s][0]] if a.kind == "U"), default=-1)
                  for s in range(plan.num_stages)]
    memory = [
        _Memory(costs[stage_of[r]], plan.schedule != "gpipe",
                no_step_between_forward_and_backward(acts[r]))
        for r in range(world)
    ]

    pc = [0] * world
    heap: list[tuple[float, int, tuple]] = []
    seq = 0

    def push(t: float, event: tuple) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, event))
        seq += 1

    def wake(t: float, rank: int) -> None:
        push(t, ("rank", rank))

    cpus = net.cpus()

    def start_job(t: float, rank: int, key: tuple, work: float) -> None:
        cpu = cpus[net.host(rank)]
        cpu.advance(t)
        cpu.jobs[key] = [work, 0]
        for finish, k, token in cpu.schedule(t):
            push(finish, ("job", net.host(rank), k, token))

    arrival: dict[tuple, float] = {}  # (dst, message key) -> arrival time
    waiting_msg: dict[tuple, int] = {}  # (dst, message key) -> rank blocked on it
    # (dst, message key) -> (src, bytes, bytes left for the receiver to ask for,
    # header arrival, arrival of the part sent eagerly, when the payload is on the host)
    posted: dict[tuple, tuple[int, float, float, float, float, float]] = {}
    ready_at: dict[tuple, float] = {}  # -> when its receiver reached it, before the send
    on_wire: dict[tuple, tuple[float, float, float]] = {}  # -> (wire arrival, latency, bytes)

    def occupy(src: int, dst: int, nbytes: float, start: float) -> float:
        """`nbytes` on the link from `start`, after the sender's previous message (one NIC)
        and the link's; when they are through."""
        pair = (min(src, dst), max(src, dst))
        start = max(start, link_free[pair], nic_free[src])
        end = start + bucket(src, net.bucket_key(pair)).send(start, nbytes)
        link_free[pair] = nic_free[src] = end
        if end > start:
            link_use[pair].append((start, end))
        return end

    def begin_transfer(key: tuple, reached: float) -> None:
        """The receiver of `key`, at its receive since `reached`, reads the header: the
        rest of the payload moves (over the link and the sender's NIC, and where cores
        are shared on the host's CPU)."""
        src, nbytes, rest, header_in, eager_in, on_host = posted.pop(key)
        dst = key[0]
        latency = net.link(src, dst)[1]
        start = max(reached, header_in, on_host)
        wire = max(occupy(src, dst, rest, start) + latency if rest > 0 else start, eager_in)
        work = net.transfer_cpu_s(nbytes)
        if work > 0:
            on_wire[key] = (wire, latency if rest > 0 else 0.0, nbytes)
            start_job(start, dst, ("transfer", key), work)
        else:
            deliver(key, wire, nbytes, slept=wire > reached)

    def deliver(key: tuple, at: float, nbytes: float, slept: bool = True) -> None:
        """The payload of `key` (`nbytes`) is in at `at`; its receiver, asleep on it,
        notices (the profile's receive_delay_s), copies it to its GPU where it computes
        on one (δ per byte), and resumes, its caches cold if it slept."""
        rank = waiting_msg.pop(key)
        cold[rank] = cold[rank] or slept
        arrival[key] = at
        wake(at + (profile.receive_delay_s if slept else 0.0)
             + nbytes * net.device_copy_s_per_byte, rank)

    buckets: dict[tuple[int, int], _TokenBucket] = {}

    def bucket(rank: int, level: int) -> _TokenBucket:
        """The rank's token bucket on `level`'s links."""
        if (rank, level) not in buckets:
            buckets[rank, level] = net.new_bucket(level)
        return buckets[rank, level]

    link_free: dict[tuple[int, int], float] = defaultdict(float)
    nic_free = [0.0] * world  # a rank sends one message at a time, whatever the peer
    link_use: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    ar_arrived: dict[tuple[int, int, int], int] = defaultdict(int)  # replicas in
    ar_end: dict[tuple[int, int], float] = {}
    # (round, group) all-reduces ready, in the order the engine runs them
    ar_queue: list[list[tuple[int, int]]] = [[] for _ in plan.stages]
    ar_running: list[tuple[float, int, int, int] | None] = [None] * plan.num_stages
    sent = [0] * world  # bucket groups the rank handed to the ring this round
    chunks_left: dict[int, tuple[int, list[tuple[float, int | None]]]] = {}
    ar_use: list[list[tuple[float, float]]] = [[] for _ in plan.stages]
    waiting_ar: dict[tuple[int, int], list[int]] = defaultdict(list)
    compute: list[list[Interval]] = [[] for _ in range(world)]
    started = [0.0] * world  # start of the rank's compute action under way
    cold = [False] * world  # the rank slept since its last compute: its caches lost its data
    copied = [False] * world  # the AR under way has copied its gradients
    done: dict[int, float] = {}  # micro-batch -> end of stage 0's backward

    def hand_over(t: float, rank: int, rnd: int, group: int) -> None:
        """The rank hands a group of its round's buckets to the engine; once every
        replica has, the group's all-reduce queues behind the stage's earlier ones."""
        stage = stage_of[rank]
        sent[rank] += 1
        key = (stage, rnd, group)
        ar_arrived[key] += 1
        if ar_arrived[key] == plan.stages[stage].replicas:
            del ar_arrived[key]
            ar_queue[stage].append((rnd, group))
            start_round(t, stage)

    def start_round(t: float, stage: int) -> None:
        """The stage's next ready group of buckets: on every replica's NIC for its ring
        time, and on each replica's comm thread for its CPU work (the engine runs
        all-reduces one at a time)."""
        if ar_running[stage] is not None or not ar_queue[stage]:
            return
        rnd, g = ar_queue[stage].pop(0)
        ar_running[stage] = (t, rnd, g, len(ranks_of[stage]) + 1)
        # each replica sends its share of the ring when its NIC is through with the
        # messages before it, and those sent later queue behind it; its token bucket
        # sends the first bytes at once
        wire_end = t
        replicas = ranks_of[stage]
        level = net.bucket_key(replicas)
        nbytes = ring_bytes[stage][g]
        rate = ring_rate[stage]
        for r in replicas:
            begin = max(t, nic_free[r])
            wire = bucket(r, level).send(begin, nbytes, rate) if nbytes > 0 else 0.0
            nic_free[r] = begin + ring_s[stage][g] - ring_wire_s[stage][g] + wire
            wire_end = max(wire_end, nic_free[r])
        push(wire_end, ("wire", stage, rnd))
        for r in ranks_of[stage]:
            start_job(t, r, ("comm", r, stage, rnd, g), ring_cpu_s[stage][g])

    def part_done(t: float, stage: int) -> None:
        """One of a round's parts (the wire, a replica's CPU work) ended at t."""
        running = ar_running[stage]
        assert running is not None
        begin, rnd, g, left = running
        if left > 1:
            ar_running[stage] = (begin, rnd, g, left - 1)
            return
        ar_running[stage] = None
        ar_use[stage].append((begin, t))
        if g == len(ring_s[stage]) - 1:  # the round's last group: its update may go
            ar_end[(stage, rnd)] = t
            for other in waiting_ar.pop((stage, rnd), []):
                wake(t, other)
        start_round(t, stage)

    def compute_action(t: float, rank: int, work: float) -> None:
        """The rank computes `work` seconds, more if it slept since its last compute."""
        if cold[rank]:
            work += costs[stage_of[rank]].weight_bytes * profile.cold_s_per_byte
            cold[rank] = False
        started[rank] = t
        start_job(t, rank, ("compute", rank), work)

    def handoff_s(stage: int, groups: Sequence[int]) -> float:
        """The rank's hand-off of these groups' buckets to the ring: their copy into the
        engine's buffer and what a replicated round loses beyond its actions and its
        ring's bytes (`replica_s_per_byte`, fitted to a real round)."""
        cost = costs[stage]
        if cost.weight_bytes <= 0:
            return 0.0
        per_byte = cost.copy_s / cost.weight_bytes + profile.replica_s_per_byte
        return per_byte * sum(group_bytes[stage][g] for g in groups)

    def next_chunk(t: float, rank: int, first: bool) -> None:
        """The next chunk of the rank's closing backward, with the hand-off of the group
        it completes."""
        _, chunks = chunks_left[rank]
        work, group = chunks[0]
        work += handoff_s(stage_of[rank], [] if group is None else [group])
        if first:
            compute_action(t, rank, work)
        else:
            start_job(t, rank, ("compute", rank), work)

    def run(rank: int, t: float) -> None:
        """Run the rank's actions from its program counter until it waits or computes."""
        mine = acts[rank]
        stage = stage_of[rank]
        cost = costs[stage]
        while pc[rank] < len(mine):
            a = mine[pc[rank]]
            if a.kind in ("F", "B"):
                d = cost.forward_s if a.kind == "F" else cost.backward_s
                if a.kind == "F":
                    d += cost.copy_s if memory[rank].forward(a.mb) else 0.0
                else:
                    cold[rank] = cold[rank] or memory[rank].on_older_copy(a.mb)
                    memory[rank].backward_done(a.mb)
                if a.kind == "B" and a.mb in closes[rank]:  # wait-free: bucket by bucket
                    chunks_left[rank] = (closes[rank][a.mb], list(closing[stage][0]))
                    next_chunk(t, rank, first=True)
                    return
                compute_action(t, rank, d)
                return
            if a.kind in ("SF", "SB"):
                dst = sched.peer(plan, a)
                key = (dst, sched.message_key(a))
                nbytes = cost.output_bytes if a.kind == "SF" else cost.input_bytes
                latency = net.link(rank, dst)[1]
                # On a GPU the payload is first copied to the host (beside compute); the
                # header leaves at once. Then the transport's eager bytes leave, whether
                # the receiver is there or not.
                on_host = t + nbytes * net.device_copy_s_per_byte
                eager = min(nbytes, net.eager_bytes(rank, dst))
                eager_in = occupy(rank, dst, eager, on_host) + latency if eager > 0 else 0.0
                posted[key] = (rank, nbytes, nbytes - eager, t + latency, eager_in, on_host)
                if key in waiting_msg:  # the receiver is there already
                    begin_transfer(key, ready_at.pop(key))
            elif a.kind in ("RF", "RB"):
                key = (rank, sched.message_key(a))
                if key in arrival:
                    del arrival[key]
                else:  # asleep until the payload is in
                    waiting_msg[key] = rank
                    if key in posted:
                        begin_transfer(key, t)
                    else:
                        ready_at[key] = t
                    return
            elif a.kind == "AR":
                # the groups its backward did not hand over leave now, after their copy
                rest = range(sent[rank], len(ring_s[stage]))
                work = handoff_s(stage, rest)
                if work > 0 and not copied[rank]:
                    copied[rank] = True  # first into the engine's buffer, on this thread
                    started[rank] = t
                    start_job(t, rank, ("compute", rank), work)
                    return
                copied[rank] = False
                for g in rest:
                    hand_over(t, rank, a.mb, g)
                sent[rank] = 0
            elif a.kind == "U":
                if plan.stages[stage].replicas > 1:
                    due = a.mb if a.mb == last_round[stage] else a.mb - (staleness - 1)
                    if due >= 0 and (stage, due) not in ar_end:
                        waiting_ar[(stage, due)].append(rank)
                        cold[rank] = True
                        return
                memory[rank].update()
                if cost.update_s > 0:
                    compute_action(t, rank, cost.update_s)
                    return
            pc[rank] += 1

    def finish_compute(rank: int, t: float) -> None:
        if rank in chunks_left:  # a chunk of a closing backward: its group leaves
            rnd, chunks = chunks_left[rank]
            _, group = chunks.pop(0)
            if group is not None:
                hand_over(t, rank, rnd, group)
            if chunks:
                next_chunk(t, rank, first=False)
                return
            del chunks_left[rank]
        a = acts[rank][pc[rank]]
        compute[rank].append(Interval(rank, str(a), started[rank], t))
        if a.kind == "B" and stage_of[rank] == 0:
            done[a.mb] = t
        if a.kind != "AR":  # after its gradient copy the AR itself runs
            pc[rank] += 1
        run(rank, t)

    for r in range(world):
        wake(0.0, r)
    while heap:
        t, _, event = heapq.heappop(heap)
        if event[0] == "rank":
            run(event[1], t)
        elif event[0] == "wire":
            part_done(t, event[1])
        else:
            _, host, key, token = event
            cpu = cpus[host]
            if key not in cpu.jobs or cpu.jobs[key][1] != token:
                continue  # rescheduled since
            cpu.advance(t)
            del cpu.jobs[key]
            for finish, k, tok in cpu.schedule(t):
                push(finish, ("job", host, k, tok))
            if key[0] == "compute":
                finish_compute(key[1], t)
            elif key[0] == "transfer":
                wire, latency, nbytes = on_wire.pop(key[1])
                deliver(key[1], max(wire, t + latency), nbytes)
            else:
                part_done(t, key[2])
    stuck = {r: pc[r] for r in range(world) if pc[r] < len(acts[r])}
    if stuck:
        detail = ", ".join(f"rank {r} waits at {acts[r][i]}" for r, i in stuck.items())
        raise sched.DeadlockError(f"schedule deadlocks: {detail}\n"
                                  f"{sched.format_table(acts, stuck)}")

    # ------------------------------------------------------------------ steady state
    measured = (n - 2 * settle * cycle) // cycle
    first, last = settle * cycle, (settle + measured) * cycle
    t0, t1 = done[first], done[last]
    span = t1 - t0
    per_mb = span / (last - first)
    samples_per_s = plan.micro_batch / per_mb if per_mb > 0 else math.inf

    def fraction(intervals: Sequence[tuple[float, float]]) -> float:
        return _busy(intervals, t0, t1) / span if span > 0 else 0.0

    busy_rank = [fraction([(iv.start, iv.end) for iv in compute[r]]) for r in range(world)]
    link_busy = []
    for s in range(plan.num_stages - 1):
        pairs = [(min(a, b), max(a, b)) for a in ranks_of[s] for b in ranks_of[s + 1]]
        link_busy.append(max((fraction(link_use[p]) for p in pairs), default=0.0))
    allreduce_busy = [fraction(_union(ar_use[s])) for s in range(plan.num_stages)]

    reports = []
    for s, sp in enumerate(plan.stages):
        held = [memory[r] for r in ranks_of[s]]
        reports.append(StageReport(
            stage=s, start=sp.start, end=sp.end, replicas=sp.replicas,
            forward_s=costs[s].forward_s, backward_s=costs[s].backward_s,
            allreduce_s=sum(ring_s[s]),
            busy=sum(busy_rank[r] for r in ranks_of[s]) / sp.replicas,
            in_flight=max(m.peak_in_flight for m in held),
            weight_versions=max(m.peak_versions for m in held),
            memory_bytes=max(m.peak_bytes for m in held),
        ))
    resources = [(f"stage {r.stage}", r.busy) for r in reports]
    resources += [(f"link {s}-{s + 1}", b) for s, b in enumerate(link_busy)]
    resources += [(f"all-reduce of stage {s}", b) for s, b in enumerate(allreduce_busy)]
    name, load = max(resources, key=lambda x: x[1])
    bottleneck = name if load >= SATURATED else \
        f"pipeline depth (busiest: {name}, {load:.0%})"
    return SimulationResult(
        plan=plan,
        samples_per_s=samples_per_s,
        time_per_micro_batch_s=per_mb,
        stages=tuple(reports),
        link_busy=tuple(link_busy),
        allreduce_busy=tuple(allreduce_busy),
        bottleneck=bottleneck,
        num_micro_batches=n,
        window_s=(t0, t1),
        makespan_s=max((c[-1].end for c in compute if c), default=0.0),
        timeline=tuple(iv for c in compute for iv in c),
    )


__all__ = [
    "Interval",
    "SimulationResult",
    "StageReport",
    "batch_scale",
    "simulate",
]
