"""Predicted iteration time of every configuration: Pipe-SGD eqs. 2-7, extended.

Notation (per iteration; the paper's totals are T times these): l_up, l_for, l_back from
a `Profile`; α, β, γ, S from `NetworkParams`; n gradient bytes; p ranks; L allreduce
calls (buckets) per iteration.

Paper, as implemented here (`eq2_sync` ... `eq7_scaling_efficiency` are the literal forms):

    eq. 2  D-Sync:            l_up + l_comp + l_comm
    eq. 4  Pipe-SGD:          max(l_up + l_comp, l_comm)                 (K >= 2)
    eq. 5  ring, sequential:  l_comm = 2(p-1)α + 2(p-1)/p n β + (p-1)/p n γ + S
    eq. 6  ring, L segments:  l_comm = 2(p-1)L α + 2(p-1)/p n β + (p-1)/p n γ + L S
    eq. 7  scaling eff.:      SE = (l_up + l_comp) / max(l_up + l_comp, l_comm)

Extensions (`ring_allreduce_cost`, `in_place_allreduce_cost`, `predict`):

* Compression: the wire carries `wire_bytes` (n/2 for trunc16; n/4 + 4 B per ring segment
  for quant8), so the β term is 2(p-1) w β with w the wire bytes of one chunk of n/p. The
  γ term becomes the kernels each rank runs on its n/p-byte chunks: 1 encode (first hop),
  p-2 decode_add_encode (middle hops), 1 decode_add_encode_decode (the owner's fused last
  hop), p-1 decodes (the chunks the allgather brings) -- `compression_seconds`. All of
  it runs on the comm thread, so it sits on the critical path of D-Sync (K = 1) and on
  the comm side of eq. 4 for Pipe-SGD, hidden as long as the comm side is shorter than
  the compute side.
* Shared cores: R ranks per host (R = p when all ranks share this machine), each with t
  compute threads and one comm thread, on C cores. Computing together, ranks get
  C / (R t) of the cores they were profiled with: compute stretches by
  s_comp = max(1, R t / C). The kernels of R comm threads stretch by s_comm = max(1, R/C)
  when only they run (D-Sync). Pipe-SGD overlaps the two, so its iteration is also bounded
  by the CPU work of the host: R (t l_comp + W_comm) / C, with W_comm = kernels + the CPU
  the transfer burns (2(p-1) w β_cpu). With free cores (a GPU cluster, C >= R (t + 1))
  all of this vanishes and the paper's equations remain.
* Waiting for a core (`load_latency_s`, measured): on shared cores a ring step that runs
  while the compute threads run waits λ_load for its comm thread to be scheduled, less
  the step's own wire time t_step, which the transport's buffers keep moving meanwhile
  (`core_wait_seconds`: over 300 Mbit/s with 1 MB buckets, L = 10, charging every step
  a whole λ_load put Pipe-SGD+Q overlapped 26 % over its measured time). Pipe-SGD
  overlaps them for the compute part of each iteration. With D = Σ over its ring steps
  of max(0, λ_load - t_step), the ring runs at the loaded pace W / (W + D) while compute
  runs and at full pace after it, so it takes W' = W + D min(1, compute / (W + D))
  (`loaded_comm_seconds`; W the unloaded time). D-Sync's communication runs while
  compute waits, except at its end: ranks leave the allreduce one after another, the
  first ones start computing, and the last ring step of the others waits for a core
  where those ranks' compute threads take every core ((R - 1) t + 1 > C), so D-Sync's
  iteration is one λ_load longer (4 ranks on 2 cores, 1 Gbit/s: the ranks left the
  allreduce 3-4 ms apart, and D-Sync ran 1.2-1.4 ms, about λ_load, over the model
  without it, in every compression mode). Two ranks on two cores leave a core free, and
  D-Sync charged λ_load there ran high (docs/timing_model.md).
* Comm threads beyond their fair share (`unshared_fraction`): alone, the R comm threads
  of a host keep u = R W_cpu / (C W) of its cores busy. Beside R t compute threads their
  fair share is 1 / (t + 1) of the cores; the part of their demand beyond it,
  f = (u - 1/(t+1)) / (1 - 1/(t+1)), does not overlap with compute: Pipe-SGD's iteration
  is f of the way from the overlapped one above to D-Sync's compute + W + λ_load, and
  D-Sync + overlap's f of the way to its buckets run after backward. (TCP links without
  a token bucket, 2 ranks per core: the kernel's packet work keeps the cores busy while
  the ring runs alone, u 0.7-1.0, and Pipe-SGD ran level with D-Sync;
  docs/timing_model.md.)
* Buckets: the optimizer reduces its L buckets (`bucket_plan`) one allreduce each, so
  every bucket pays its ring's latency, sync and core waits. Sequential communication
  (eq. 5) submits them all after backward, back to back (docs/timing_model.md);
  `segments` keeps the paper's single allreduce there.
* Overlap with backward (eq. 6): bucket i can start once its gradients exist (ready times
  from the profile); the comm thread runs buckets one after another. D-Sync + overlap
  waits for the last bucket: l_up + l_for + max(l_back, end of bucket L). On shared
  cores it is also bounded by the CPU work beside backward, R (t compute + the comm
  CPU of the buckets' part beside it) / C, plus the tail after backward, which runs
  with no compute beside it (docs/timing_model.md). Pipe-SGD +
  overlap is eq. 6; its compute side is the whole l_up + l_for + l_back (the compute
  thread still runs the whole backward pass; eq. 6 writes only the first segment l_b).
* Kernels behind the wire (`ring_allreduce_cost`): the engine reduces segment i of a
  chunk while segment i+1 is on the wire. Over a NIC that moves bytes by DMA (β_cpu = 0,
  a described cluster) the ring costs 2(p-1)α + max(transfer, kernels) + one segment's
  kernel (the pipeline's fill) + S, so the γ term of eq. 5 (or the compression
  kernels) is hidden while the transfer is longer. Where the comm thread's own CPU
  moves the bytes (β_cpu > 0, every measured network) kernels and transfer take turns
  on that core and add up, as in eq. 5.
* In place on one node (`in_place_allreduce_cost`): where every rank shares one node's
  memory, the optimizer's buckets are the engine's own buffers, and an uncompressed
  allreduce of them is no ring: two waits on the board, then each rank reads and writes
  n bytes once (`Engine.zeros`; docs/engine.md). It costs 2 α + n β_in_place + S, with
  β_in_place measured whole (the sums included) and burnt on the comm thread's CPU;
  compressed allreduces, and buckets staged from a GPU, keep the ring.
* Packing gradients into the flat buffer and back (2 n memcpy) is part of the update.
* Host staging (`device_copy_s_per_byte`, δ, measured on a GPU): gradients on a GPU
  reach the ring through pinned host buckets, each bucket copied to the host before its
  allreduce and back after it: 2 b δ more on the comm thread's side per bucket of b
  bytes (`RingCost.staging`). The copies run on a side stream by DMA, so they take no
  core and compute does not wait for them: D-Sync pays them on its critical path,
  Pipe-SGD only where communication is the longer side.
* Token-bucket links (`burst_bytes`, measured): a link that idled for d seconds sends
  its first min(burst, d/β) bytes at line rate, saving up to burst·β of transfer. D-Sync's
  link idles whenever it carries none of the allreduce's bytes (while the iteration
  computes, and for the ring's time off the wire: latency, kernels, sync, staging, the
  last step's wait for a core), so its allreduces gain that much, the first
  bucket's and, where it carries fewer bytes than the burst, the next ones' (the bucket
  serves the link's next bytes, whichever allreduce they belong to; `burst_saving`).
  Pipe-SGD's allreduce runs beside compute, and its link idles between them: where the
  bucket holds every byte an iteration puts on the link it is full again at each start
  and sends them all at line rate, and the link's token rate (the transfer) bounds the
  iteration instead; a smaller bucket saves Pipe-SGD nothing in the model
  (`pipelined_burst_saving`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile

MODES = ("none", "trunc16", "quant8")
OVERLAPS = ("sequential", "backward")
DEFAULT_SEGMENT_BYTES = 1 << 20  # the engine's largest (csrc/transport.h); only quant8's
# per-segment scale depends on it
DEFAULT_BUCKET_BYTES = 25 << 20
# Predictions closer than this are one: the model's error is several times wider (median
# 2-8 % over the suite's scenarios), and so is the spread of one configuration's
# measurements (docs/timing_model.md, "Ties within the model's resolution").
TIE_TOLERANCE = 0.01
BREAKDOWN_KEYS = ("update", "forward", "backward", "communication", "compression", "staging",
                  "contention")


# ------------------------------------------------------------------------------------
# Checks


def _check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_p(p: int) -> None:
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"p (number of ranks) must be an integer >= 1, got {p!r}")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be > 0, got {value!r}")


# ------------------------------------------------------------------------------------
# The paper's equations, literally (per iteration)


def eq2_sync(l_up: float, l_comp: float, l_comm: float) -> float:
    """Eq. 2 per iteration: D-Sync pays every stage in turn."""
    _check_nonnegative(l_up=l_up, l_comp=l_comp, l_comm=l_comm)
    return l_up + l_comp + l_comm


def eq4_pipelined(l_up: float, l_comp: float, l_comm: float) -> float:
    """Eq. 4 per iteration: Pipe-SGD (K >= 2) is bound by the slower resource."""
    _check_nonnegative(l_up=l_up, l_comp=l_comp, l_comm=l_comm)
    return max(l_up + l_comp, l_comm)


def eq5_ring_comm(p: int, n: float, alpha: float, beta: float, gamma: float, sync: float) -> float:
    """The communication term of eq. 5: one ring-AllReduce of n bytes."""
    return eq6_ring_comm(p, n, alpha, beta, gamma, sync, segments=1)


def eq6_ring_comm(
    p: int, n: float, alpha: float, beta: float, gamma: float, sync: float, segments: int
) -> float:
    """The communication term of eq. 6: n bytes in L = `segments` ring-AllReduces."""
    _check_p(p)
    _check_nonnegative(n=n, alpha=alpha, gamma=gamma, sync=sync)
    _check_positive("beta", beta)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments (L) must be an integer >= 1, got {segments!r}")
    if p == 1:
        return 0.0
    L = segments
    return 2 * (p - 1) * L * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma + L * sync


def eq5_pipe_sequential(l_up: float, l_for: float, l_back: float, l_comm: float) -> float:
    """Eq. 5 per iteration: max(l_up + l_for + l_back, l_comm)."""
    return eq4_pipelined(l_up, l_for + l_back, l_comm)


def eq6_pipe_segmented(l_up: float, l_for: float, l_b: float, l_comm: float) -> float:
    """Eq. 6 per iteration as written: max(l_up + l_for + l_b, l_comm), l_b the backward
    time of the first segment."""
    return eq4_pipelined(l_up, l_for + l_b, l_comm)


def eq7_scaling_efficiency(l_up: float, l_comp: float, l_comm: float) -> float:
    """Eq. 7: (l_up + l_comp) / max(l_up + l_comp, l_comm)."""
    _check_nonnegative(l_up=l_up, l_comp=l_comp, l_comm=l_comm)
    compute = l_up + l_comp
    bound = max(compute, l_comm)
    return 1.0 if bound == 0 else compute / bound


# ------------------------------------------------------------------------------------
# Ring-AllReduce with compression


def wire_bytes(elements: int, mode: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> float:
    """Bytes on the wire for `elements` float32 sent as ring segments of `segment_bytes`.

    quant8 carries a float32 scale per segment (segments are cut on the float32 bytes).
    """
    if mode not in MODES:
        raise ValueError(f"unknown compression {mode!r}; valid: {MODES}")
    if mode == "none":
        return 4.0 * elements
    if mode == "trunc16":
        return 2.0 * elements
    segments = max(1, math.ceil(4 * elements / segment_bytes)) if elements else 0
    return float(elements + 4 * segments)


@dataclass(frozen=True)
class RingCost:
    """One ring-AllReduce on one rank, split by what it spends the time on (seconds).

    latency: 2(p-1) α; transfer: 2(p-1) w β; kernels: γ or compression kernels on one
    core that the transfer does not hide (`ring_allreduce_cost`); sync: S; cpu: CPU
    seconds the comm thread burns (all kernels + 2(p-1) w β_cpu); staging: the bucket's
    copies from the GPU to the host and back, 2 n δ (DMA: no CPU); waits: steps that
    each wait for another rank (`in_place_allreduce_cost` has two).
    """

    latency: float = 0.0
    transfer: float = 0.0
    kernels: float = 0.0
    sync: float = 0.0
    cpu: float = 0.0
    staging: float = 0.0
    waits: float = 0.0  # steps that wait for another rank: 2(p-1) on the ring, 2 in place

    def wall(self, kernel_stretch: float = 1.0) -> float:
        return (self.latency + self.transfer + self.kernels * kernel_stretch + self.sync
                + self.staging)

    def __add__(self, other: RingCost) -> RingCost:
        return RingCost(*(a + b for a, b in zip(dataclasses.astuple(self),
                                               dataclasses.astuple(other), strict=True)))


def burst_saving(net: NetworkParams, idle_s: float, transfer_s: float) -> float:
    """Transfer seconds a token-bucket link saves after idling `idle_s`: the bucket has
    refilled min(burst, idle/β) bytes, which go at line rate (at most the whole transfer)."""
    return max(0.0, min(net.burst_bytes * net.beta_s_per_byte, idle_s, transfer_s))


def pipelined_burst_saving(net: NetworkParams, transfer_s: float) -> float:
    """Transfer seconds Pipe-SGD's allreduces save on a token-bucket link: all of them
    where the bucket holds every byte an iteration puts on the link (burst·β >= the
    transfer), else none. Its allreduce runs beside compute, so the link idles between
    them for the iteration less the allreduce; and the iteration is no shorter than its
    transfer (the link's token rate), so the bucket is full again at each start. Below
    that size the saving depends on how the ring's gaps refill the bucket, which the
    recorded runs put short of what those gaps would give (docs/timing_model.md)."""
    held = burst_saving(net, math.inf, transfer_s)  # what a full bucket sends at once
    return transfer_s if held >= transfer_s else 0.0


def loaded_comm_seconds(comm_s: float, compute_s: float, delay_s: float) -> float:
    """W' = W + D min(1, C / (W + D)): communication of W seconds that takes W + D while
    compute keeps the cores busy (D = its ring steps' waits for a core) and W after.

    Beside C seconds of compute the ring advances at the loaded pace W / (W + D), so
    those C seconds cost it C D / (W + D) of delay; the rest runs unloaded. (Spreading D
    over the loaded time W' instead charged Pipe-SGD+Q up to 37 % over its measured
    iteration; synthetic iterations of compute beside quant8, trunc16 and plain
    allreduces follow this form: `bench/core_wait.py`; docs/timing_model.md.)"""
    if delay_s <= 0 or comm_s <= 0:
        return comm_s
    return comm_s + delay_s * min(1.0, compute_s / (comm_s + delay_s))


def unshared_fraction(comm_cpu_s: float, comm_wall_s: float, ranks: int, cores: int,
                      threads: int) -> float:
    """How much of an allreduce beside compute runs as if after it, on shared cores.

    The R comm threads of a host keep u = R W_cpu / (C W) of its C cores busy while
    their allreduce of W seconds runs alone. Beside R t compute threads their fair share
    is 1 / (t + 1) of the cores; the part of their demand beyond it, (u - 1/(t+1)) /
    (1 - 1/(t+1)), does not overlap with compute (0 with free cores)."""
    if comm_wall_s <= 0 or ranks * (threads + 1) <= cores:
        return 0.0
    busy = ranks * comm_cpu_s / (cores * comm_wall_s)
    fair = 1.0 / (threads + 1)
    return min(1.0, max(0.0, (busy - fair) / (1.0 - fair)))


def toward_serial(overlapped_s: float, serial_s: float, unshared: float) -> float:
    """An iteration `unshared` (`unshared_fraction`) of the way from its `overlapped_s`
    prediction to its communication run after compute (`serial_s`), never faster than
    the overlapped one."""
    return max(overlapped_s, unshared * serial_s + (1 - unshared) * overlapped_s)


def core_wait_seconds(cost: RingCost, net: NetworkParams) -> float:
    """What waiting for a core adds to one allreduce of `cost` while compute keeps
    the shared cores busy (`steps_core_wait` of its `RingCost.waits` steps)."""
    return steps_core_wait(cost.waits, net.load_latency_s, cost.transfer)


def steps_core_wait(steps: float, load_latency_s: float, transfer_s: float) -> float:
    """What waiting for a core adds to an allreduce of `steps` steps that spend
    `transfer_s` on the wire in all: each step waits λ_load (`load_latency_s`) for the
    comm thread, less the step's own time on the wire, which the transport's buffers keep
    moving meanwhile (a bulk step over a slow link hides the wait; a small one pays it
    all). The planner's simulator charges a replicated stage's rounds the same."""
    if steps == 0:
        return 0.0
    return steps * max(0.0, load_latency_s - transfer_s / steps)


def compression_seconds(n: float, p: int, net: NetworkParams, mode: str) -> float:
    """Kernel seconds one rank spends in a ring-AllReduce of n float32 bytes (one core)."""
    _check_p(p)
    if p == 1:
        return 0.0
    chunk = n / p
    if mode == "none":
        return (p - 1) * chunk * net.gamma_s_per_byte  # eq. 5's (p-1)/p n γ
    k = net.kernel(mode)
    return chunk * (k.encode + (p - 2) * k.decode_add_encode + k.decode_add_encode_decode
                    + (p - 1) * k.decode)


def ring_allreduce_cost(
    n: float, p: int, net: NetworkParams, mode: str = "none",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> RingCost:
    """Cost of one ring-AllReduce of n bytes of float32 (eq. 5's l_comm, extended).

    The engine cuts each chunk into segments of `segment_bytes` (of float32) and reduces
    segment i while segment i+1 is on the wire. Where the comm thread's CPU moves the
    bytes (a measured network, β_cpu > 0: shared memory, TCP on shared cores) the two
    take turns on that core, and the kernels add to the transfer: eq. 5's sum, and
    `RingCost.kernels` is all of them. Where a NIC moves them by DMA (β_cpu = 0, a
    described cluster) the kernels run while the link carries the next segment:

        wall = 2(p-1) α + max(transfer, kernels) + kernels / (c m) + S

    with m = ceil((n/p) / segment_bytes) segments per chunk and c the kernel calls per
    chunk (p-1 reductions uncompressed; 2(p-1) compressed: 1 encode, p-2
    decode_add_encode, 1 decode_add_encode_decode, p-1 decodes): the last term is one
    segment's kernel, which no transfer hides (the pipeline's fill). `RingCost.kernels`
    is then the part of the kernels on the critical path, max(0, kernels - transfer) +
    kernels / (c m); `RingCost.cpu` counts all of them either way.
    """
    _check_p(p)
    _check_nonnegative(n=n)
    if mode not in MODES:
        raise ValueError(f"unknown compression {mode!r}; valid: {MODES}")
    if p == 1 or n == 0:
        return RingCost()
    w = wire_bytes(math.ceil(n / 4 / p), mode, segment_bytes) if mode != "none" else n / p
    kernels = compression_seconds(n, p, net, mode)
    steps = 2 * (p - 1)
    transfer = steps * w * net.beta_s_per_byte
    exposed = kernels
    if net.beta_cpu_s_per_byte == 0:
        segments = max(1, math.ceil(n / p / segment_bytes))
        calls = (p - 1) if mode == "none" else 2 * (p - 1)
        exposed = max(0.0, kernels - transfer) + kernels / (calls * segments)
    return RingCost(
        latency=steps * net.alpha_s,
        transfer=transfer,
        kernels=exposed,
        sync=net.sync_s,
        cpu=kernels + steps * w * net.beta_cpu_s_per_byte,
        staging=2 * n * net.device_copy_s_per_byte,
        waits=steps,
    )


def in_place_allreduce_cost(n: float, p: int, net: NetworkParams) -> RingCost:
    """Cost of one uncompressed allreduce of n bytes of the engine's own buffers on one
    node: two waits on the board, then each rank reads and writes the n bytes once on its
    comm thread (`Engine.zeros`), 2 α + n β_in_place + S, the sums inside β_in_place."""
    _check_p(p)
    _check_nonnegative(n=n)
    if p == 1 or n == 0:
        return RingCost()
    transfer = n * net.in_place_s_per_byte
    return RingCost(latency=2 * net.alpha_s, transfer=transfer, sync=net.sync_s,
                    cpu=transfer, waits=2)


def allreduce_cost(
    n: float, p: int, net: NetworkParams, mode: str = "none",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> RingCost:
    """One allreduce of an optimizer's bucket as the engine runs it: in place where `net`
    measured that path (one node, uncompressed, the bucket on the host), else around the
    ring."""
    if mode == "none" and net.in_place_s_per_byte > 0 and net.device_copy_s_per_byte == 0:
        return in_place_allreduce_cost(n, p, net)
    return ring_allreduce_cost(n, p, net, mode, segment_bytes)


# ------------------------------------------------------------------------------------
# Configurations and predictions


@dataclass(frozen=True)
class Config:
    """One way to run data-parallel training: staleness K, compression, overlap."""

    staleness: int
    compression: str
    overlap: str

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or self.staleness < 1:
            raise ValueError(f"staleness K must be an integer >= 1, got {self.staleness!r}")
        if self.compression not in MODES:
            raise ValueError(f"unknown compression {self.compression!r}; valid: {MODES}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"unknown overlap {self.overlap!r}; valid: {OVERLAPS}")

    @property
    def label(self) -> str:
        """Short name in the paper's style: `D-Sync`, `Pipe-SGD+T`, `Pipe-SGD+Q/ovl`."""
        name = "D-Sync" if self.staleness == 1 else (
            "Pipe-SGD" if self.staleness == 2 else f"Pipe-SGD(K={self.staleness})")
        name += {"none": "", "trunc16": "+T", "quant8": "+Q"}[self.compression]
        return name + ("/ovl" if self.overlap == "backward" else "")


def all_configs(staleness: Iterable[int] = (1, 2)) -> list[Config]:
    """Every configuration of the search space: K x compression x overlap."""
    return [Config(k, c, o) for k in staleness for c in MODES for o in OVERLAPS]


@dataclass
class Prediction:
    """Predicted time of one iteration of one configuration.

    Attributes:
        breakdown: seconds on the critical path by kind (`BREAKDOWN_KEYS`); they sum to
            `predicted_s`. Pipe-SGD's hidden communication is not in it.
        comm_s: the comm thread's busy time per iteration (hidden or not).
        compute_s: the compute thread's time per iteration, with contention.
        bound: "compute", "communication" or "cpu" (cores shared by compute and comm).
        reason: one sentence saying why.
        scaling_efficiency: single-rank iteration time / predicted_s (eq. 7 for Pipe-SGD).
    """

    config: Config
    p: int
    predicted_s: float
    breakdown: dict[str, float]
    comm_s: float
    compute_s: float
    bound: str
    reason: str
    scaling_efficiency: float
    segments: int
    details: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "staleness": self.config.staleness,
            "compression": self.config.compression,
            "overlap": self.config.overlap,
            "p": self.p,
            "predicted_s": self.predicted_s,
            "breakdown": dict(self.breakdown),
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "bound": self.bound,
            "reason": self.reason,
            "scaling_efficiency": self.scaling_efficiency,
            "segments": self.segments,
            "details": dict(self.details),
        }


def bucket_plan(
    profile: Profile, segments: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[tuple[float, float]]:
    """The L allreduces of one iteration: (bytes, fraction of backward done when ready).

    `segments` = L splits the gradient into L equal buckets ready at i/L of the backward
    pass (eq. 6's model). None groups the profile's gradients, in the order backward
    produces them, into buckets of up to `bucket_bytes` (as the optimizer does).
    """
    n = profile.gradient_bytes
    if segments is not None:
        if not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments (L) must be an integer >= 1, got {segments!r}")
        return [(n / segments, (i + 1) / segments) for i in range(segments)]
    _check_positive("bucket_bytes", bucket_bytes)
    ready = profile.gradient_ready or [(n, 1.0)]
    buckets: list[tuple[float, float]] = []
    size = 0.0
    last = 0.0
    for nbytes, fraction in ready:
        if size and size + nbytes > bucket_bytes:
            buckets.append((size, last))
            size = 0.0
        size += nbytes
        last = fraction
    if size or not buckets:
        buckets.append((size, 1.0 if not ready else last))
    return buckets


def _ranks_per_host(net: NetworkParams, p: int) -> int:
    return p if net.ranks_per_host is None else min(net.ranks_per_host, p)


def predict(
    profile: Profile,
    network: NetworkParams,
    p: int,
    staleness: int = 2,
    compression: str = "none",
    overlap: str = "sequential",
    segments: int | None = None,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Prediction:
    """Predicted iteration time of one configuration on p ranks (see the module docstring).

    Args:
        profile: l_for, l_back, l_up, n (`pipesgd.timing.profile`).
        network: α, β, γ, S, kernel costs and host (`measure_network` / `describe_cluster`).
        p: ranks (>= 1; p = 1 has no communication).
        staleness: K (1 = D-Sync, 2 = Pipe-SGD).
        compression: "none", "trunc16" or "quant8".
        overlap: "sequential" (allreduce after backward) or "backward" (buckets start as
            backward produces them).
        segments: L equal buckets, the paper's forms: eq. 6 overlapped, eq. 5's single
            allreduce sequential. None: the optimizer's buckets of `bucket_bytes`, one
            allreduce each either way.
        segment_bytes: the engine's ring segment (quant8 carries a scale per segment).

    Raises:
        ValueError: p < 1, non-positive bandwidth, negative times or sizes, unknown mode.

    Example:
        >>> from pipesgd.timing import Profile, describe_cluster, predict
        >>> prof = Profile(forward_s=0.004, backward_s=0.008, update_s=0.001,
        ...                gradient_bytes=100e6)
        >>> pred = predict(prof, describe_cluster("10Gbit", "20us"), p=4, staleness=2)
        >>> pred.bound, round(pred.predicted_s * 1e3, 1)   # ms
        ('communication', 120.4)
    """
    _check_p(p)
    config = Config(staleness, compression, overlap)
    if segments is not None and (not isinstance(segments, int) or segments < 1):
        raise ValueError(f"segments (L) must be an integer >= 1 or None, got {segments!r}")
    profile.check()
    network.check()
    l_up, l_for, l_back = profile.update_s, profile.forward_s, profile.backward_s
    n = profile.gradient_bytes
    pack = 2 * n * network.copy_s_per_byte if p > 1 else 0.0
    l_comp = l_for + l_back
    single = l_up + l_comp

    # Overlapped, the L buckets leave as backward makes their gradients (eq. 6).
    # Sequential, the optimizer's buckets leave after backward, one allreduce each, back
    # to back; eq. 5's single allreduce where `segments` asks for the paper's forms.
    if p > 1 and overlap == "backward":
        buckets = bucket_plan(profile, segments, bucket_bytes)
    elif p > 1 and segments is None:
        buckets = [(size, 1.0) for size, _ in bucket_plan(profile, None, bucket_bytes)]
    else:
        buckets = [(n, 1.0)]
    R = _ranks_per_host(network, p)
    C = int(network.cores or 1)
    t = profile.threads
    costs = [allreduce_cost(b, p, network, compression, segment_bytes) for b, _ in buckets]
    total = sum(costs, RingCost())
    s_comp = max(1.0, R * t / C)
    s_comm = max(1.0, R / C)

    update = l_up + pack
    compute_work = update + l_comp  # one rank, profiled cores
    compute_wall = compute_work * s_comp
    comm_wall = total.wall(s_comm)
    wire_s = total.latency + total.transfer + total.sync
    kern_s = total.kernels * s_comm
    stage_s = total.staging
    cpu_bound = R * (t * compute_work + total.cpu) / C
    contention_compute = compute_work * (s_comp - 1)

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    breakdown.update(update=update, forward=l_for, backward=l_back)
    bound: str
    burst_s = 0.0
    loaded = comm_wall
    # The last ring step of the ranks that leave an allreduce last waits for a core, if
    # the ranks that left first keep every core of the host busy (D-Sync, and what of
    # Pipe-SGD's allreduce runs after compute).
    cores_taken = (R - 1) * t + 1 > C
    last_step_wait = network.load_latency_s if p > 1 and cores_taken else 0.0
    # what of the allreduce beside compute runs as if after it (Pipe-SGD, and D-Sync's
    # buckets beside backward)
    overlaps = staleness > 1 or overlap == "backward"
    unshared = unshared_fraction(total.cpu, comm_wall, R, C, t) if overlaps else 0.0
    serialized = False  # the iteration set by the part of its allreduce unshared
    if staleness == 1:
        # The link idled from the last allreduce's bytes until the first bucket leaves:
        # the compute before it, the last ring step's wait for a core, and the ring's
        # time off the wire (latency, kernels, sync, staging), which follow those bytes.
        idle = ((update + l_for + buckets[0][1] * l_back) * s_comp + last_step_wait
                + comm_wall - total.transfer)
        # The refilled token bucket carries the link's next bytes, whichever of the
        # iteration's allreduces they belong to.
        burst_s = burst_saving(network, idle, total.transfer)
        if overlap == "sequential":
            tail = comm_wall - burst_s
        else:
            # bucket i leaves when ready and when the comm thread is free; backward is
            # stretched like all compute.
            walls = [cost.wall(s_comm) for cost in costs]
            left = burst_s  # the first buckets leave on the refilled bucket
            for i, cost in enumerate(costs):
                used = min(left, cost.transfer)
                walls[i] -= used
                left -= used
            end = 0.0
            for (_, ready), wall in zip(buckets, walls, strict=True):
                end = max(end, ready * l_back * s_comp) + wall
            tail = max(0.0, end - l_back * s_comp)
        share = tail / (comm_wall - burst_s) if comm_wall > burst_s else 0.0
        breakdown["communication"] = (wire_s - burst_s) * share
        breakdown["compression"] = kern_s * share
        breakdown["staging"] = stage_s * share
        loaded = comm_wall + last_step_wait
        breakdown["contention"] = contention_compute + last_step_wait
        iteration = compute_wall + tail + last_step_wait
        bound = "communication" if comm_wall > compute_wall else "compute"
        if overlap == "backward":
            # Buckets beside backward share the cores with compute: never beat the CPU
            # work of what runs beside it, and the tail after it, with no compute beside
            # it, adds its whole time.
            cpu_bound = R * (t * compute_work + total.cpu * (1 - share)) / C \
                + tail + last_step_wait
            # The comm threads' demand beyond their fair share does not overlap, as for
            # Pipe-SGD: f of the way to the buckets run after backward.
            serial = compute_wall + comm_wall - burst_s + last_step_wait
            overlapped = max(iteration, cpu_bound)
            slowest = toward_serial(overlapped, serial, unshared)
            serialized = slowest > overlapped
            if slowest > iteration:
                breakdown["contention"] += slowest - iteration
                iteration, bound = slowest, "cpu"
    else:
        # On a token bucket that holds an iteration's bytes they leave at line rate, and
        # the link's token rate bounds the iteration instead.
        burst_s = pipelined_burst_saving(network, total.transfer)
        comm_wall -= burst_s
        wire_s -= burst_s
        loaded = loaded_comm_seconds(comm_wall, compute_wall,
                                     sum(core_wait_seconds(c, network) for c in costs))
        link = max(loaded, total.transfer if burst_s else 0.0)
        overlapped = max(compute_wall, link, cpu_bound)
        serial = compute_wall + comm_wall + last_step_wait
        iteration = toward_serial(overlapped, serial, unshared)
        serialized = iteration > overlapped
        if serialized:
            exposed = min(comm_wall, iteration - compute_wall)
            share = exposed / comm_wall if comm_wall > 0 else 0.0
            breakdown["communication"] = share * wire_s
            breakdown["compression"] = share * kern_s
            breakdown["staging"] = share * stage_s
            breakdown["contention"] = iteration - compute_work - exposed
            bound = "cpu"
        elif link >= max(compute_wall, cpu_bound) and link > compute_work:
            exposed = link - compute_work
            breakdown["communication"] = exposed * (wire_s + link - loaded) / link
            breakdown["compression"] = exposed * kern_s / link
            breakdown["staging"] = exposed * stage_s / link
            breakdown["contention"] = exposed * (loaded - comm_wall) / link
            bound = "communication"
        else:
            breakdown["contention"] = iteration - compute_work
            bound = "cpu" if cpu_bound > compute_wall and cpu_bound > link else "compute"

    ms = 1e3
    staged = f", staging {stage_s * ms:.2f} ms" if stage_s else ""
    why = (f"compute {compute_wall * ms:.2f} ms vs communication {comm_wall * ms:.2f} ms "
           f"(wire {wire_s * ms:.2f} ms, kernels {kern_s * ms:.2f} ms{staged}, "
           f"L={len(buckets)})")
    if staleness > 1 and burst_s:
        why += (f", its bytes at line rate from a token bucket that holds them, the link's "
                f"rate {total.transfer * ms:.2f} ms")
    if loaded > comm_wall:
        why += f", {loaded * ms:.2f} ms while compute keeps the shared cores busy"
    if serialized:
        why += (f"; {R} comm threads want more than their fair share of {C} cores beside "
                f"{R * t} compute threads: {unshared:.0%} of the allreduce does not overlap")
    elif bound == "cpu":
        why += (f"; {R} ranks x ({t} compute + 1 comm thread) share {C} cores: CPU work "
                f"{cpu_bound * ms:.2f} ms per iteration binds")
    elif s_comp > 1:
        why += f"; compute stretched x{s_comp:.2f} by {R} ranks on {C} cores"
    if p == 1:
        why = f"one rank: no communication, compute {compute_wall * ms:.2f} ms"
        bound = "compute"
    return Prediction(
        config=config,
        p=p,
        predicted_s=iteration,
        breakdown=breakdown,
        comm_s=comm_wall,
        compute_s=compute_wall,
        bound=bound,
        reason=f"{bound}-bound: {why}",
        scaling_efficiency=single / iteration if iteration else 1.0,
        segments=len(buckets),
        details={
            "latency_s": total.latency,
            "transfer_s": total.transfer,
            "kernels_s": total.kernels,
            "sync_s": total.sync,
            "staging_s": stage_s,
            "burst_saving_s": burst_s,
            "load_delay_s": loaded - comm_wall,
            "comm_cpu_s": total.cpu,
            "cpu_bound_s": cpu_bound,
            "unshared_fraction": unshared,
            "compute_stretch": s_comp,
            "kernel_stretch": s_comm,
            "ranks_per_host": R,
            "cores": C,
        },
    )


def choose(
    profile: Profile,
    network: NetworkParams,
    p: int,
    configs: Sequence[Config] | None = None,
    segments: int | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
    **kwargs: Any,
) -> list[Prediction]:
    """Every configuration, fastest predicted first.

    Ties (within `tie_tolerance` of the fastest, relative) go last to a configuration
    that ties only thanks to the burst it counts on (`burst_saving` is an upper bound: on
    emulated 1 Gbit/s links, p = 2, a ring after 2 ms of idling saved 50-75 % of it, so a
    D-Sync that ties Pipe-SGD only thanks to the burst runs slower); where the ranks'
    compute threads outnumber the host's cores (compute stretched), then D-Sync last:
    its ranks fall out of step there, which costs a synchronous allreduce time the model
    does not charge (docs/timing_model.md, "Ties within the model's resolution"); and
    otherwise first to the simpler one: lower staleness, then less compression, then
    sequential communication.

    Example:
        >>> ranked = choose(prof, net, p=4)
        >>> best = ranked[0]; print(best.config.label, best.reason)
    """
    configs = list(configs) if configs is not None else all_configs()
    if not configs:
        raise ValueError("configs is empty; pass None for every configuration")
    preds = [predict(profile, network, p, c.staleness, c.compression, c.overlap, segments,
                     **kwargs) for c in configs]
    fastest = min(pr.predicted_s for pr in preds)
    return sorted(preds, key=lambda pr: ranking_key(pr, fastest, tie_tolerance))


def ranking_key(pr: Prediction, fastest: float, tie_tolerance: float = TIE_TOLERANCE,
                ) -> tuple[int, float, int, int, int, int, int]:
    """`choose`'s order: predicted time relative to the `fastest`; among ties (within
    `tie_tolerance`), those that tie only thanks to the burst they count on last, then
    D-Sync last where compute shares too few cores, then by K, compression, overlap."""
    within = fastest * (1 + tie_tolerance)
    tie = pr.predicted_s <= within
    ratio = 0.0 if tie or fastest == 0 else round(pr.predicted_s / fastest, 6)
    by_burst = int(pr.predicted_s + pr.details["burst_saving_s"] > within)
    # More compute threads than cores: D-Sync's ranks leave each allreduce apart and take
    # turns computing, so its iteration runs longer than predicted (bench/compute_stagger.py)
    out_of_step = int(pr.config.staleness == 1 and pr.details["compute_stretch"] > 1)
    return (0 if tie else 1, ratio, by_burst, out_of_step, pr.config.staleness,
            MODES.index(pr.config.compression), OVERLAPS.index(pr.config.overlap))
