"""The network and host side of the timing model: `NetworkParams` and `measure_network`.

Symbols follow Pipe-SGD eq. 5: α (latency of one message), β (seconds per byte on the
link), γ (seconds per byte of float32 reduction), S (global synchronisation). Added for
compression and for hosts whose cores are shared (see `pipesgd.timing.model`):

* per-byte costs of each compression kernel (`KernelCosts`), per byte of float32 input;
* β_cpu, the CPU seconds a rank's communication costs the host per byte it moves (≈ β
  over shared memory, where the copy *is* the transfer; small over a NIC that moves bytes
  by DMA; on shared cores it includes the kernel's network stack, measured as the compute
  it takes from a busy rank);
* the burst of a token-bucket link (tc's htb/tbf, a cloud VM's shaping): bytes it sends
  at line rate after idling, before the rate limit bites (0 for a plain link);
* the load latency: how much longer a ring step takes while every rank's compute thread
  keeps the shared cores busy (the comm thread waits to be scheduled); 0 on free cores;
* the host: `cores` and `ranks_per_host` (None = all ranks on this one host).

`measure_network(comm)` measures all of them on the ranks of `comm` with the transport
they actually use; every figure is the median of repetitions, with its spread.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipesgd.polling import idle_barrier
from pipesgd.timing.spread import interquartile_range, median_spread

if TYPE_CHECKING:
    from pipesgd.timing.topology import Topology

COMPRESSED_MODES = ("trunc16", "quant8")


@dataclass(frozen=True)
class KernelCosts:
    """Seconds per byte of float32 input of the four kernels a compressed ring runs.

    Attributes:
        encode: float32 -> wire (first hop of a chunk).
        decode_add_encode: one reduce-scatter hop (decode, add local block, re-encode).
        decode: allgather: every rank decodes every chunk it does not own.
        decode_add_encode_decode: the owner's last reduce-scatter hop, fused: decode, add
            the local block, encode for the allgather and decode those bytes for itself.
    """

    encode: float
    decode_add_encode: float
    decode: float
    decode_add_encode_decode: float

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> KernelCosts:
        """Also reads descriptions written before the owner's hop was fused, where it was
        decode_add, then encode and decode: the three kernels it replaces."""
        if "decode_add" in data and "decode_add_encode_decode" not in data:
            data = dict(data)
            data["decode_add_encode_decode"] = (data.pop("decode_add") + data["encode"]
                                                + data["decode"])
        return cls(**data)

    def check(self, mode: str) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not value >= 0:
                raise ValueError(f"kernel cost {mode}.{name} must be >= 0 s/byte, got {value}")


# The network's own figures, whose spread moves every prediction of communication: in
# 34 measured networks β's spread stayed under 16 %, except once at 35 %, a third below
# the rate training then ran at (4 ranks on 2 cores, links without a token bucket). The
# wait for a core (`load_latency`) moves every prediction on shared cores.
_NETWORK_FIGURES = ("alpha", "beta", "burst", "load_latency")
NOISY_SPREAD = 0.25


def _default_cores() -> int:
    return os.cpu_count() or 1


@dataclass
class NetworkParams:
    """α, β, γ, S, the kernel costs and the host, as `predict` needs them.

    Attributes:
        alpha_s: α, one-way latency of a small message (s).
        beta_s_per_byte: β, link time per byte (s/B) as the ring uses it (all ranks
            sending to the right and receiving from the left at once).
        gamma_s_per_byte: γ, float32 reduction per byte (s/B), one core.
        sync_s: S, one global synchronisation (barrier), s.
        kernels: compression mode -> `KernelCosts` (s per float32 byte), one core.
        copy_s_per_byte: memcpy per byte (packing gradients into a flat buffer), one core.
        beta_cpu_s_per_byte: CPU seconds a rank burns per byte moved on the link.
        burst_bytes: bytes a link sends at once after idling long enough to refill
            (a token bucket's burst); they cost no β time.
        load_latency_s: extra seconds per ring step while compute threads keep the
            shared cores busy (0 where ranks and comm threads have cores of their own).
        cores: cores per host shared by ranks, their comm threads and the network stack.
        ranks_per_host: ranks per host; None = all p ranks on one host.
        node_alpha_s, node_beta_s_per_byte: α and β between two ranks of one node, where
            the ranks span several nodes (α and β are then those of the network between
            nodes, the ring's slowest edges); None: not measured (one node).
        ranks_per_node: ranks per node where the ranks span several nodes; None otherwise.
        device_copy_s_per_byte: δ, seconds per byte of a copy between a rank's GPU and
            pinned host memory (the mean of both directions); each bucket crosses twice
            when gradients are staged through the host (`pipesgd.staging`). 0: the
            gradients live on the host (no staging).
        eager_bytes: the largest message whose send completes before its receive is
            posted (the transport's eager limit), between rank 0 and α's peer: the
            bytes a message moves before its receiver asks (a larger one's first
            fragment carries as many). 0: not measured.
        measured_p: number of ranks the figures were measured with (None: given by hand).
        spread: figure -> relative spread (IQR / median) of the repetitions.
        source: where the figures come from.
    """

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    sync_s: float
    kernels: dict[str, KernelCosts] = field(default_factory=dict)
    copy_s_per_byte: float = 0.0
    beta_cpu_s_per_byte: float = 0.0
    burst_bytes: float = 0.0
    load_latency_s: float = 0.0
    cores: int | None = None
    ranks_per_host: int | None = None
    node_alpha_s: float | None = None
    node_beta_s_per_byte: float | None = None
    ranks_per_node: int | None = None
    device_copy_s_per_byte: float = 0.0
    eager_bytes: int = 0
    measured_p: int | None = None
    spread: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if self.cores is None:
            self.cores = _default_cores()
        self.kernels = {
            mode: k if isinstance(k, KernelCosts) else KernelCosts.from_dict(k)
            for mode, k in self.kernels.items()
        }
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first impossible figure."""
        if not self.beta_s_per_byte > 0:
            raise ValueError(
                f"beta must be > 0 s/byte (a link of finite, non-zero bandwidth), got "
                f"{self.beta_s_per_byte}; e.g. describe_cluster('10Gbit', '20us')"
            )
        for name in ("alpha_s", "gamma_s_per_byte", "sync_s", "copy_s_per_byte",
                     "beta_cpu_s_per_byte", "burst_bytes", "load_latency_s", "eager_bytes",
                     "device_copy_s_per_byte"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if self.ranks_per_host is not None and self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1 or None, got {self.ranks_per_host}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")
        if (self.node_alpha_s is None) != (self.node_beta_s_per_byte is None):
            raise ValueError("give both node_alpha_s and node_beta_s_per_byte, or neither")
        for mode, costs in self.kernels.items():
            costs.check(mode)

    def noisy(self) -> str:
        """A warning naming the network's own figures (α, β, burst, load latency) whose
        repetitions spread by more than `NOISY_SPREAD`, or "" when none did."""
        figures = [f"{k} {v:.0%}" for k, v in self.spread.items()
                   if k in _NETWORK_FIGURES and v > NOISY_SPREAD]
        if not figures:
            return ""
        return (f"noisy: {', '.join(figures)} between repetitions; predictions that lean on "
                "them are as uncertain (measure again: pipesgd timing measure --repeats N)")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    def topology(self, p: int) -> Topology | None:
        """p ranks on nodes of `ranks_per_node`, joined by this network; None where the
        node link is unknown or p is not a whole number of nodes."""
        from pipesgd.timing.topology import Link, Topology

        rpn = self.ranks_per_node
        if rpn is None or self.node_beta_s_per_byte is None or p % rpn:
            return None
        return Topology(p // rpn, rpn, Link(self.node_alpha_s or 0.0, self.node_beta_s_per_byte),
                        Link(self.alpha_s, self.beta_s_per_byte))

    def kernel(self, mode: str) -> KernelCosts:
        if mode not in self.kernels:
            raise ValueError(
                f"no kernel costs for compression {mode!r} in this network description "
                f"(have {sorted(self.kernels)}); measure them with `pipesgd timing measure`"
            )
        return self.kernels[mode]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NetworkParams:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NetworkParams:
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("network", data))


# ------------------------------------------------------------------------------------
# Measurement


def _time_each(call: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure_kernels(
    nbytes: int = 32 << 20, repeats: int = 15, seed: int = 0
) -> tuple[float, float, dict[str, KernelCosts], dict[str, float]]:
    """γ, the copy cost and every compression kernel's cost on this process's core.

    Works on blocks of `nbytes` of float32, larger than the caches: the ring streams a
    gradient through each kernel once, from memory (a 4 MiB block that stays in L2 runs
    the kernels 3-4x faster than the ring sees them).

    Returns:
        (gamma, copy, kernels, spread), all in seconds per float32 byte.
    """
    import numpy as np

    from pipesgd import compression as C

    n = nbytes // 4
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    local = rng.standard_normal(n, dtype=np.float32)
    acc = np.empty_like(x)
    spread: dict[str, float] = {}

    def per_byte(name: str, call: Callable[[], None]) -> float:
        call()  # warm-up: page faults, first-touch
        med, sp = median_spread(_time_each(call, repeats))
        spread[name] = sp
        return med / (4 * n)

    gamma = per_byte("gamma", lambda: np.add(x, local, out=acc))
    copy = per_byte("copy", lambda: np.copyto(acc, x))
    kernels = {}
    for mode in COMPRESSED_MODES:
        wire = C.encode(x, mode)
        kernels[mode] = KernelCosts(
            encode=per_byte(f"{mode}.encode", lambda m=mode: C.encode(x, m)),
            decode_add_encode=per_byte(
                f"{mode}.decode_add_encode", lambda m=mode, w=wire: C.decode_add_encode(w, local, m)
            ),
            decode=per_byte(f"{mode}.decode", lambda m=mode, w=wire: C.decode(w, n, m)),
            # overwrites its local block: acc, whose values do not change the cost
            decode_add_encode_decode=per_byte(
                f"{mode}.decode_add_encode_decode",
                lambda m=mode, w=wire: C.decode_add_encode_decode(w, acc, m),
            ),
        )
    return gamma, copy, kernels, spread


def measure_device_copy(device: Any, nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """δ: seconds per byte of a copy between `device` and pinned host memory, the mean of
    both directions (median of `repeats` each, timed by CUDA events after a warm-up).
    0.0 for the CPU, where nothing is staged."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(dst: Any, src: Any) -> float:
        samples = []
        for i in range(repeats + 1):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:  # the first is the warm-up
                samples.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    return (timed(on_device, host) + timed(host, on_device)) / (2 * nbytes)


_POLITE_POLL_S = 50e-6  # the engine's PIPESGD_POLL_US default


def _wait(requests: list[Any], polite: bool) -> None:
    """Wait for every request; politely (test, then sleep) where ranks share cores, since
    a rank spinning in MPI's Waitall takes the core from the ranks whose transfers it
    waits for."""
    from mpi4py import MPI

    from pipesgd.polling import Polling, wait_politely

    if polite:
        wait_politely(requests, Polling(spin_s=0.0, poll_s=_POLITE_POLL_S))
    else:
        MPI.Request.Waitall(requests)


def _segments(buf: Any, segment: int) -> list[Any]:
    return [buf[o : o + segment] for o in range(0, len(buf), segment)]


def node_key() -> str:
    """What identifies this process's node: ranks that share a host name and a network
    namespace share a network stack and its links (`bench/netem.py --nodes` gives each
    emulated node a namespace of its own on one host)."""
    import socket

    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


def _ping_pong(comm: Any, out: Any, back: Any, segment: int | None = None,
               polite: bool = False, peer: int = 1) -> float:
    """Rank 0 sends `out` to rank `peer` (in `segment`-byte messages, as the engine does,
    if given), which answers with `back`; the time this rank spent."""
    rank = comm.Get_rank()
    pieces = _segments(out, segment) if segment else [out]
    start = time.perf_counter()
    if rank == 0:
        _wait([comm.Isend(piece, dest=peer, tag=1) for piece in pieces], polite)
        comm.Recv(back, source=peer, tag=2)
    elif rank == peer:
        _wait([comm.Irecv(piece, source=0, tag=1) for piece in pieces], polite)
        comm.Send(back, dest=0, tag=2)
    return time.perf_counter() - start


_BURST_FIRST_BYTES = 16 << 10
# The longest single transfer the sweep may grow to: 0.5 s found a 2 MiB bucket on a
# 100 Mbit/s link (0.17 s of its rate) as 1 MiB.
_BURST_MAX_SECONDS = 1.0


def fit_token_bucket(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """The token bucket that best explains transfer times after idling: (bucket, β).

    A token-bucket link that idled long enough sends min(m, b) bytes of an m-byte
    transfer at line rate and the rest at its rate 1/β: t(m) = c + max(0, m - b) β, with
    c the transfer's fixed cost. For each candidate b (each measured size, and sizes
    between them where the kink can sit) with at least three transfers above it, c and β
    are a least-squares line through (max(0, m - b), t); the b whose line fits best, in
    residuals relative to each time, wins. β is fitted rather than taken from the ring
    step: one flow on an idle link can run at another rate than a ring step's (with
    every packet one MTU, a 2-core host sent a ring step at 55 MB/s and one flow at 85).
    Returns (0, β) when the times are best explained without a bucket.
    """
    if len(sizes) != len(times) or len(sizes) < 3:
        raise ValueError("fit_token_bucket needs at least three (size, time) pairs")
    candidates = {0.0, *map(float, sizes)}
    # (a kink below the smallest size fits exactly as well as none: those are b = 0)
    for small, large in itertools.pairwise(sizes):
        candidates.update(small + (large - small) * i / 16 for i in range(1, 16))
    best = (math.inf, 0.0, 0.0)
    for b in sorted(candidates):  # on a tie, the smaller bucket
        excess = [max(0.0, m - b) for m in sizes]
        if sum(x > 0 for x in excess) < 3:  # two points above the kink always fit exactly
            continue
        mean_x, mean_t = statistics.fmean(excess), statistics.fmean(times)
        beta = (sum((x - mean_x) * (t - mean_t) for x, t in zip(excess, times, strict=True))
                / sum((x - mean_x) ** 2 for x in excess))
        c = mean_t - beta * mean_x
        residual = sum(((c + beta * x - t) / t) ** 2 for x, t in zip(excess, times, strict=True))
        if residual < best[0]:
            best = (residual, b, beta)
    return best[1], best[2]


def _on_rate_line(sizes: list[int], times: list[float], beta: float) -> bool:
    """Whether the last three transfers lie on one line of about the link's rate: the
    bucket is behind them."""
    if len(sizes) < 3:
        return False
    slopes = [(times[i] - times[i - 1]) / (sizes[i] - sizes[i - 1]) for i in (-2, -1)]
    return min(slopes) >= 0.5 * beta and max(slopes) <= 1.3 * min(slopes)


def _burst_sweep(time_transfer: Callable[[int], float],
                 beta: float) -> tuple[list[int], list[float]]:
    """Sizes and times of transfers of doubling size, each timed by `time_transfer` after
    the link idled, until the last three lie on one line of about the link's rate (the
    saving stopped growing) or the next would take longer than `_BURST_MAX_SECONDS`.
    `fit_token_bucket` needs three transfers beyond the bucket, so the sweep finds buckets
    of up to a quarter of that in seconds of the link's rate."""
    sizes: list[int] = []
    times: list[float] = []
    size = _BURST_FIRST_BYTES
    while True:
        sizes.append(size)
        times.append(time_transfer(size))
        if _on_rate_line(sizes, times, beta) or 2 * size * beta > _BURST_MAX_SECONDS:
            return sizes, times
        size *= 2


def _measure_burst(comm: Any, beta: float, repeats: int, segment: int,
                   polite: bool, peer: int = 1) -> tuple[float, float]:
    """Bytes a link sends at line rate after idling: (burst, spread) (collective).

    Rank 0 sends transfers of doubling size to rank `peer` (which answers with one byte),
    each after the link idled long enough to refill a bucket that large (`_burst_sweep`).
    `fit_token_bucket` then finds the bucket that explains the times, whatever its size:
    no probe size caps it. One flow on one link pair: a whole ring's steps vary by more
    than the burst saves. The transfers travel in the engine's segments: sent as one
    message (Open MPI's rendezvous over TCP) they found no bucket at all in some runs at
    1 Gbit/s and p = 2.
    A bucket that saves less than 50 µs, or less than 5 % of the largest transfer, is
    noise (shared memory, a NIC without shaping): 0. The spread is that of the largest
    transfer's times.
    """
    import numpy as np

    ack = np.zeros(1, dtype=np.uint8)
    spread = 0.0

    def time_transfer(size: int) -> float:
        nonlocal spread
        buf = np.ones(size, dtype=np.uint8)
        samples = []
        for _ in range(repeats):
            idle_barrier(comm)
            # the last transfer took at most `size` bytes from the bucket
            time.sleep(1.5 * size * beta + 2e-3)
            # ranks leave the idle barrier up to a poll apart; start the transfer together
            comm.Barrier()
            samples.append(_ping_pong(comm, buf, ack, segment, polite, peer))
        took, spread = median_spread(comm.bcast(samples, root=0))
        return took

    sizes, times = _burst_sweep(time_transfer, beta)
    burst, rate_beta = fit_token_bucket(sizes, times)
    if burst * rate_beta < max(50e-6, 0.05 * times[-1]):
        return 0.0, spread
    return burst, spread


def _measure_alpha(comm: Any, small_bytes: int, repeats: int, peer: int) -> tuple[float, float]:
    """α and its spread: half the round trip of a small ping-pong, rank 0 and `peer`."""
    import numpy as np

    buf = np.zeros(small_bytes, dtype=np.uint8)
    samples = []
    for i in range(repeats * 10 + 20):
        comm.Barrier()
        round_trip = _ping_pong(comm, buf, buf, peer=peer)
        if i >= 20:
            samples.append(round_trip / 2)
    return median_spread(comm.bcast(samples, root=0))


_EAGER_TAG = 7301
_EAGER_WAIT_S = 0.01  # the receiver's lateness in an eager probe


def _sends_before_receive(comm: Any, nbytes: int, peer: int) -> bool:
    """Whether rank 0's send of `nbytes` to `peer` completes while `peer` has not yet
    posted its receive (collective; the answer on every rank)."""
    import numpy as np

    from pipesgd.polling import Polling, wait_until

    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    rank = comm.Get_rank()
    comm.Barrier()
    done = False
    if rank == 0:
        request = comm.Isend(buf, dest=peer, tag=_EAGER_TAG)
        done = wait_until(request.Test, Polling(spin_s=0.0, poll_s=1e-4),
                          timeout_s=0.75 * _EAGER_WAIT_S)
        request.Wait()
    elif rank == peer:
        time.sleep(_EAGER_WAIT_S)
        comm.Recv(buf, source=0, tag=_EAGER_TAG)
    return bool(comm.bcast(done, root=0))


def _measure_eager(comm: Any, peer: int, most: int = 1 << 20) -> int:
    """The largest message rank 0 sends to `peer` before `peer` posts its receive, to 64
    bytes (collective). Doubling sizes from 256 bytes while three probes in a row
    complete, then a bisection: a transport whose small sends wait for the receiver
    (shared memory's, at times) measures small, where the eager part hardly counts."""
    size, ok = 256, 0
    while size <= most and all(_sends_before_receive(comm, size, peer) for _ in range(3)):
        ok, size = size, size * 2
    if size > most:
        return most
    failed = size
    while failed - ok > 64:
        mid = (ok + failed) // 2
        if _sends_before_receive(comm, mid, peer):
            ok = mid
        else:
            failed = mid
    return ok


def _measure_node_link(comm: Any, small_bytes: int, repeats: int,
                       peer: int) -> tuple[float, float]:
    """(α, β) between rank 0 and `peer` on its node: a small ping-pong, and the slope of
    one-way transfers of 1 and 4 MiB (collective)."""
    import numpy as np

    alpha, _ = _measure_alpha(comm, small_bytes, repeats, peer)
    ack = np.zeros(1, dtype=np.uint8)
    medians = []
    for nbytes in (1 << 20, 4 << 20):
        buf = np.ones(nbytes, dtype=np.uint8)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            took = _ping_pong(comm, buf, ack, peer=peer)
            if i >= 2:
                samples.append(took)
        medians.append(statistics.median(comm.bcast(samples, root=0)))
    beta = max(medians[1] - medians[0], 1e-15) / (3 << 20)
    return alpha, beta


def _per_wire_byte(cost: dict[int, float], sizes: tuple[int, int], p: int,
                   gamma: float) -> float:
    """Slope of a per-allreduce cost between two sizes, per wire byte, less the reduction."""
    small, large = sizes
    extra = large - small
    reduction = (p - 1) / p * extra * gamma
    return max(cost[large] - cost[small] - reduction, 0.0) / (2 * (p - 1) / p * extra)


def _engine_cpu_per_wire_byte(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                              gamma: float) -> float:
    """CPU seconds per wire byte of engine allreduces beyond their reductions (collective).

    Taken with no thread blocked in `wait`, as when Pipe-SGD computes beside them: a
    waiting caller makes the comm thread poll without napping (its core is idle then),
    which is not what communication costs the compute beside it (`wait_unwatched`)."""
    import numpy as np

    from pipesgd.polling import wait_unwatched

    cpu: dict[int, float] = {}
    for m in sizes:
        buf = np.ones(m // 4, dtype=np.float32)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            cpu0 = time.process_time()
            wait_unwatched(engine.allreduce_async(buf, op="average"))
            if i >= 2:
                samples.append(time.process_time() - cpu0)
        cpu[m] = statistics.median(samples)
    return _per_wire_byte(cpu, sizes, comm.Get_size(), gamma)


class _Spinner:
    """A fixed unit of single-threaded compute whose lost throughput measures stolen CPU."""

    def __init__(self) -> None:
        import numpy as np

        self._a = np.linspace(1.0, 2.0, 16 << 10, dtype=np.float32)  # 64 KiB: stays in cache
        self._b = np.empty_like(self._a)
        self._sqrt = np.sqrt

    def unit(self) -> None:
        for _ in range(16):
            self._sqrt(self._a, out=self._b)

    def rate(self, comm: Any, seconds: float) -> float:
        """Units per second with every rank spinning and no communication (collective)."""
        idle_barrier(comm)
        units, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.unit()
            units += 1
        return units / (time.perf_counter() - start)


def _engine_steal_per_wire_byte(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                                gamma: float, cores: int, ranks_on_node: int) -> float:
    """CPU per wire byte of engine allreduces, seen as compute they take from a busy rank.

    Every rank spins a fixed compute unit while its comm thread runs allreduces, as
    Pipe-SGD overlaps them. The time the spinner loses, times C / R (R ranks share C
    cores), is what one rank's communication costs the host: the comm thread, the kernel's
    network stack (softirqs are charged to whoever they interrupt) and the scheduling of
    one more runnable thread. `process_time` sees only the first. Collective.
    """
    import numpy as np

    spinner = _Spinner()
    rate = spinner.rate(comm, 0.3)
    steal: dict[int, float] = {}
    for m in sizes:
        buf = np.ones(m // 4, dtype=np.float32)
        engine.allreduce(buf, op="average")  # warm-up: connections, pages
        samples = []
        for _ in range(repeats):
            idle_barrier(comm)
            start, units = time.perf_counter(), 0
            handles = [engine.allreduce_async(buf, op="average") for _ in range(2)]
            while not handles[-1].done():
                spinner.unit()
                units += 1
            elapsed = time.perf_counter() - start
            handles[-1].wait()
            samples.append(max(elapsed - units / rate, 0.0) / len(handles))
        steal[m] = statistics.median(samples) * cores / ranks_on_node
    return _per_wire_byte(steal, sizes, comm.Get_size(), gamma)


def _engine_load_latency(comm: Any, engine: Any, repeats: int,
                         nbytes: int = 4096) -> tuple[float, float]:
    """Extra seconds per ring step of an engine allreduce while every rank computes, and
    its spread (collective).

    A small allreduce is all latency: timed alone and with every rank spinning a compute
    unit beside it, the difference over its 2(p-1) steps is how long a step waits for
    its comm thread to get a core (`load_latency_from`).
    """
    import numpy as np

    spinner = _Spinner()
    buf = np.ones(nbytes // 4, dtype=np.float32)
    engine.allreduce(buf)
    idle, loaded = [], []
    for _ in range(repeats):
        idle_barrier(comm)
        start = time.perf_counter()
        engine.allreduce(buf)
        idle.append(time.perf_counter() - start)
        idle_barrier(comm)
        start = time.perf_counter()
        handle = engine.allreduce_async(buf)
        while not handle.done():
            spinner.unit()
        loaded.append(time.perf_counter() - start)
    every = comm.allgather((idle, loaded))
    return load_latency_from([i for i, _ in every], [lo for _, lo in every],
                             2 * (comm.Get_size() - 1))


def load_latency_from(idle: list[list[float]], loaded: list[list[float]],
                      steps: int) -> tuple[float, float]:
    """(λ_load, spread) from each rank's allreduce times alone (`idle[rank]`) and beside
    spinning ranks (`loaded[rank]`), paired by repetition: λ_load is the median over the
    ranks of their median difference, per step; the spread is the interquartile range of
    every pair's difference over that median difference (0 where it is 0: nothing to
    lean on). The ranks wake from their barriers at different moments, so the pairs
    spread widely (167-1779 µs per step in one launch at p = 2)."""
    extra = float(statistics.median(statistics.median(lo) - statistics.median(i)
                                    for i, lo in zip(idle, loaded, strict=True)))
    pairs = [b - a for i, lo in zip(idle, loaded, strict=True)
             for a, b in zip(i, lo, strict=True)]
    spread = interquartile_range(pairs) / extra if extra > 0 and len(pairs) >= 4 else 0.0
    return max(0.0, extra) / steps, spread


def _engine_costs(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int, gamma: float,
                  ranks_on_node: int) -> tuple[float, float, float]:
    """(β_cpu, load latency, its spread), measured on `engine` (collective).

    β_cpu: the CPU the comm thread burns per wire byte, or, where ranks and comm threads
    outnumber the cores, what communication takes from compute, if that is more. Load
    latency (`_engine_load_latency`): only where cores are shared, else 0."""
    load_latency = load_spread = 0.0
    beta_cpu = _engine_cpu_per_wire_byte(comm, engine, sizes, repeats, gamma)
    cores = _default_cores()
    if 2 * ranks_on_node > cores:
        beta_cpu = max(beta_cpu, _engine_steal_per_wire_byte(
            comm, engine, sizes, max(3, repeats // 2), gamma, cores, ranks_on_node))
        load_latency, load_spread = _engine_load_latency(comm, engine, 4 * repeats)
    return float(statistics.median(comm.allgather(beta_cpu))), load_latency, load_spread


def _ring_step(comm: Any, send: Any, recv: Any, segment: int, polite: bool) -> None:
    """`send` to the right neighbour while `recv` arrives from the left, in segments."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    requests = [comm.Irecv(piece, source=left, tag=3) for piece in _segments(recv, segment)]
    requests += [comm.Isend(piece, dest=right, tag=3) for piece in _segments(send, segment)]
    _wait(requests, polite)


def _slowest_seconds(comm: Any, run: Callable[[], None], repeats: int,
                     warmups: int) -> list[float]:
    """The slowest rank's seconds of `run` (started together after a barrier), each of
    `repeats` timed calls after `warmups` untimed ones (collective)."""
    from mpi4py import MPI

    walls = []
    for i in range(warmups + repeats):
        comm.Barrier()
        start = time.perf_counter()
        run()
        slowest = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmups:
            walls.append(slowest)
    return walls


def _measure_beta(comm: Any, sizes: tuple[int, int], repeats: int, segment: int,
                  polite: bool) -> tuple[float, float]:
    """β and its spread: the slope of the slowest rank's ring step between two sizes
    (collective)."""
    import numpy as np

    step_times: dict[int, list[float]] = {}
    for m in sizes:
        send = np.ones(m, dtype=np.uint8)
        recv = np.empty(m, dtype=np.uint8)
        step = functools.partial(_ring_step, comm, send, recv, segment, polite)
        step_times[m] = _slowest_seconds(comm, step, repeats, warmups=3)
    small, large = sizes
    t_small, _ = median_spread(step_times[small])
    t_large, spread = median_spread(step_times[large])
    return max(t_large - t_small, 1e-15) / (large - small), spread


def _measure_ring_beta(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                       gamma: float) -> tuple[float, float]:
    """β and its spread over a network: the slope of the slowest rank's uncompressed engine
    allreduce between two sizes, per wire byte, less its reductions (collective). Each
    allreduce is sized so that a link carries `sizes` bytes, as in `_measure_beta`."""
    import numpy as np

    p = comm.Get_size()
    quantum = 4 * p  # whole float32 elements in every rank's chunk
    n_sizes = tuple(max(quantum, m * p // (2 * (p - 1)) // quantum * quantum) for m in sizes)
    medians: dict[int, float] = {}
    spread = 0.0
    for n in n_sizes:
        buf = np.ones(n // 4, dtype=np.float32)
        run = functools.partial(engine.allreduce, buf, op="average")
        walls = _slowest_seconds(comm, run, repeats, warmups=1)
        medians[n], spread = median_spread(walls)
    return max(_per_wire_byte(medians, n_sizes, p, gamma), 1e-15), spread


def measure_network(
    comm: Any = None,
    *,
    small_bytes: int = 8,
    large_bytes: tuple[int, int] = (4 << 20, 16 << 20),
    repeats: int = 20,
    kernel_bytes: int = 32 << 20,
    device: Any = None,
) -> NetworkParams:
    """Measure α, β, β_cpu, γ, S and the kernel costs on the ranks of `comm` (collective).

    * α: half the round trip of a `small_bytes` ping-pong between rank 0 and the first
      rank on another node (`node_key`), or rank 1 on one node. Where ranks span nodes
      and rank 0 shares its node, the node link's α and β too (`_measure_node_link`).
    * β: the slope of the slowest rank's time between two sizes, each a link carrying one
      of the `large_bytes` sizes, so latency drops out. Where ranks span nodes, of the
      engine's own uncompressed allreduce, less its reductions (γ): the ring paces itself
      by its slowest edge and keeps the links busy through a rank's scheduling stalls,
      which a bare exchange of MPI requests does not (4 ranks on 2 cores over 200 Mbit/s
      links with a 1 MiB bucket: 150-187 Mbit/s for the bare ring step, 171-191 for the
      engine, and training ran its allreduces at about 190). Within one node (shared memory,
      where the planner's messages and MPI's own collectives go through MPI), every rank
      sends `m` bytes to its right neighbour while receiving `m` from its left (one ring
      step, in the engine's segments). Never one large `Sendrecv`: over TCP, Open MPI's
      rendezvous for a message above its eager limit ran at half the link's rate in some
      repetitions and at full rate in others (16 MiB on 1 Gbit/s links: 147 or 291 ms).
    * burst: transfers of doubling size from rank 0 to α's peer, each after an idle
      spell long enough to refill a bucket that large, until the saving stops growing;
      the token bucket that explains their times (`_measure_burst`, `fit_token_bucket`);
      0 unless it clearly saves time. Only between nodes: ranks on one node share no
      shaped link, and there the caches' sizes bend the times like a bucket would (a 2-core
      host once read a 216 KiB "bucket" between two ranks on shared memory).
    * β_cpu: the CPU time (user + system) the engine's comm thread burns per byte it moves,
      from engine allreduces at the two `large_bytes` sizes, less the reduction (γ). Not
      from the blocking `Sendrecv`: MPI busy-polls there, the engine sleeps between polls.
      Where ranks and their comm threads outnumber the cores, the larger of that and the
      compute the allreduces take from a rank spinning beside them (the network stack's
      softirqs and context switches are charged to whoever they interrupt).
    * load latency (there too): a small engine allreduce with every rank spinning beside
      it, against one alone, per ring step (`_engine_load_latency`).
    * γ, copy and kernels: `measure_kernels` on rank 0 alone (one core, the others
      sleeping); the model stretches them itself when ranks share cores.
    * eager: the largest message rank 0 sends to α's peer before the peer posts its
      receive (`_measure_eager`): the transport's eager limit (64 KiB less a header for
      Open MPI over TCP).
    * S: one `Barrier`.
    * δ, where `device` is a GPU: every rank times copies between its GPU and pinned host
      memory at once (as staging runs them, ranks sharing a bus), the slowest rank's
      figure (`measure_device_copy`).

    Each figure is the median of `repeats`, taken after a warm-up; `spread` holds the
    relative interquartile range. With one rank, α, β and S cannot be measured: they are
    set from a 2-rank-free default (α = S = 0, β = the copy cost) and `source` says so.

    Returns:
        NetworkParams, with `measured_p` = comm size and `ranks_per_host` = ranks sharing
        this node (None when that is all of them).
    """
    from mpi4py import MPI

    from pipesgd.engine import Engine

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    spread: dict[str, float] = {}
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = node.Get_size()
    node.Free()
    max_on_node = comm.allreduce(on_node, op=MPI.MAX)
    # more ranks than cores: a rank busy-polling for a transfer holds up its peers
    oversubscribed = max_on_node > _default_cores()

    # Nodes: the probes between two ranks cross between nodes where the ring does.
    keys = comm.allgather(node_key())
    peer = next((r for r in range(1, size) if keys[r] != keys[0]), 1)
    node_peer = next((r for r in range(1, size) if keys[r] == keys[0]), None)
    spans_nodes = len(set(keys)) > 1

    # alpha: ping-pong between 0 and its peer on another node, if any
    alpha, eager = 0.0, 0
    if size > 1:
        alpha, spread["alpha"] = _measure_alpha(comm, small_bytes, repeats, peer)
        eager = _measure_eager(comm, peer)
    node_link = None
    if spans_nodes and node_peer is not None:
        node_link = _measure_node_link(comm, small_bytes, repeats, node_peer)

    device_copy = 0.0
    if device is not None:
        device_copy = comm.allreduce(measure_device_copy(device), op=MPI.MAX)

    # One engine for the whole measurement: its segment size shapes the probes; its comm
    # thread sleeps until the probes that use it, last.
    engine = Engine(comm) if size > 1 else None
    try:
        # S: barrier
        samples = []
        for _ in range(repeats * 5 + 10):
            start = time.perf_counter()
            comm.Barrier()
            samples.append(time.perf_counter() - start)
        sync_local = statistics.median(samples[10:])
        sync = statistics.median(comm.allgather(sync_local)) if size > 1 else 0.0

        # gamma, copy, kernels: on one core of an otherwise idle host. Only rank 0 measures;
        # the others wait without spinning (an MPI barrier busy-polls and would take the
        # cores that ranks share).
        if rank == 0:
            gamma, copy, kernels, kernel_spread = measure_kernels(kernel_bytes, repeats)
        idle_barrier(comm)
        gamma, copy, kernels, kernel_spread = comm.bcast(
            (gamma, copy, kernels, kernel_spread) if rank == 0 else None, root=0
        )
        spread.update(kernel_spread)

        # beta: a ring at two sizes; then the burst, beta_cpu and the load latency
        beta = beta_cpu = burst = load_latency = 0.0
        if size > 1:
            segment = engine.segment_bytes
            if spans_nodes:
                beta, spread["beta"] = _measure_ring_beta(comm, engine, large_bytes, repeats,
                                                          gamma)
            else:
                beta, spread["beta"] = _measure_beta(comm, large_bytes, repeats, segment,
                                                     oversubscribed)
            if spans_nodes:  # a token bucket shapes a network link, never shared memory
                burst, spread["burst"] = _measure_burst(comm, beta, max(5, repeats // 3),
                                                        segment, oversubscribed, peer)
            beta_cpu, load_latency, spread["load_latency"] = _engine_costs(
                comm, engine, large_bytes, min(repeats, 5), gamma, max_on_node)
            beta_cpu = min(beta_cpu, beta)
    finally:
        if engine is not None:
            engine.shutdown()
    if size == 1:
        beta = copy
        source = "measured on 1 rank: alpha, S not measurable, beta = memcpy"
    else:
        library = MPI.Get_library_version().replace("\x00", "").split(",")[0].strip()
        source = f"measured on {size} ranks ({library})"
    return NetworkParams(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        sync_s=sync,
        kernels=kernels,
        copy_s_per_byte=copy,
        beta_cpu_s_per_byte=beta_cpu,
        burst_bytes=burst,
        load_latency_s=load_latency,
        cores=_default_cores(),
        ranks_per_host=None if max_on_node == size else max_on_node,
        node_alpha_s=None if node_link is None else node_link[0],
        node_beta_s_per_byte=None if node_link is None else node_link[1],
        ranks_per_node=keys.count(keys[0]) if spans_nodes else None,
        device_copy_s_per_byte=device_copy,
        eager_bytes=eager,
        measured_p=size,
        spread={k: round(v, 4) for k, v in spread.items()},
        source=source,
    )
