"""How much repeated measurements of one figure disagree: every figure `pipesgd.timing`
measures carries its median and the interquartile range over that median."""

from __future__ import annotations

import statistics


def interquartile_range(samples: list[float]) -> float:
    """Third quartile less the first (at least two samples)."""
    q = statistics.quantiles(samples, n=4)
    return q[2] - q[0]


def median_spread(samples: list[float]) -> tuple[float, float]:
    """(median, interquartile range / median); the spread is 0 with fewer than four
    samples or a median of 0 (nothing to judge it by)."""
    med = statistics.median(samples)
    if len(samples) < 4 or med == 0:
        return med, 0.0
    return med, interquartile_range(samples) / med
