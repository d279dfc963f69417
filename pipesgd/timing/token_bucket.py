"""A token bucket on a link (tc's htb/tbf, a cloud VM's shaping), found whatever its size.

After idling, such a link sends its bucket's bytes at line rate before its rate limit
bites. `measure_burst` times transfers of doubling size, each after an idle spell long
enough to refill a bucket that large, until the saving stops growing, and
`fit_token_bucket` finds the bucket that explains their times: no probe size caps it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from pipesgd.polling import idle_barrier
from pipesgd.timing.link_probes import ping_pong
from pipesgd.timing.spread import median_spread

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


def measure_burst(comm: Any, beta: float, repeats: int, segment: int,
                   polite: bool, peer: int = 1) -> tuple[float, float, float]:
    """Bytes a link sends at line rate after idling, and one flow's rate: (burst, flow β,
    spread) (collective).

    Rank 0 sends transfers of doubling size to rank `peer` (which answers with one byte),
    each after the link idled long enough to refill a bucket that large (`_burst_sweep`).
    `fit_token_bucket` then finds the bucket that explains the times, whatever its size:
    no probe size caps it. One flow on one link pair: a whole ring's steps vary by more
    than the burst saves. The transfers travel in the engine's segments: sent as one
    message (Open MPI's rendezvous over TCP) they found no bucket at all in some runs at
    1 Gbit/s and p = 2.
    A bucket that saves less than 50 µs, or less than 5 % of the largest transfer, is
    noise (shared memory, a NIC without shaping): 0. Flow β is the fit's slope: the
    seconds per byte of this one flow beyond the bucket, with every other link idle
    (`NetworkParams.flow_beta_s_per_byte`). The spread is that of the largest transfer's
    times.
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
            samples.append(ping_pong(comm, buf, ack, segment, polite, peer))
        took, spread = median_spread(comm.bcast(samples, root=0))
        return took

    sizes, times = _burst_sweep(time_transfer, beta)
    burst, flow_beta = fit_token_bucket(sizes, times)
    if burst * flow_beta < max(50e-6, 0.05 * times[-1]):
        burst = 0.0
    return burst, max(flow_beta, 0.0), spread
