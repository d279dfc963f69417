"""Finding a token bucket from transfer times after idling (`_burst_sweep`,
`fit_token_bucket`).

The times are made from the token-bucket law itself, t(m) = c + max(0, m - b) β, with
multiplicative noise, on the doubling sizes the probe sends; the fit must recover b.
"""

import numpy as np
import pytest

from pipesgd.timing.token_bucket import _burst_sweep, _on_rate_line, fit_token_bucket

BETA = 40e-9  # 200 Mbit/s
C = 0.1e-3


def sweep(bucket: float, count: int, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = [(16 << 10) << i for i in range(count)]
    times = [(C + max(0.0, m - bucket) * BETA) * (1 + noise * rng.standard_normal())
             for m in sizes]
    return sizes, times


@pytest.mark.parametrize("bucket", [64 << 10, 200_000, 512 << 10, 2 << 20, 12 << 20])
def test_finds_the_bucket_of_exact_times(bucket: float) -> None:
    count = next(k for k in range(3, 20) if (16 << 10) << (k - 3) > bucket)
    found, beta = fit_token_bucket(*sweep(bucket, count))
    assert found == pytest.approx(bucket, rel=1 / 16)  # the grid between two sizes
    assert beta == pytest.approx(BETA, rel=0.02)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bucket", [64 << 10, 512 << 10, 2 << 20])
def test_finds_the_bucket_through_noise(bucket: float, seed: int) -> None:
    count = next(k for k in range(3, 20) if (16 << 10) << (k - 3) > bucket)
    found, _ = fit_token_bucket(*sweep(bucket, count, noise=0.05, seed=seed))
    assert found == pytest.approx(bucket, rel=0.25)


def test_no_bucket_is_zero() -> None:
    found, beta = fit_token_bucket(*sweep(0.0, 3))
    assert found == 0.0
    assert beta == pytest.approx(BETA)


def test_the_sweep_stops_once_three_transfers_run_at_the_rate() -> None:
    sizes, times = sweep(512 << 10, 8)  # 16 KiB .. 2 MiB
    stops = [k for k in range(1, 9) if _on_rate_line(sizes[:k], times[:k], BETA)]
    assert stops[0] == 8  # 512 KiB, 1 MiB and 2 MiB: the first three past the bucket
    # a link far slower than the ring step said is still a rate line
    assert _on_rate_line(sizes[:3], [C + m * 1.2 * BETA for m in sizes[:3]], BETA)
    assert not _on_rate_line(sizes[:2], times[:2], BETA)


def test_too_few_points_is_an_error() -> None:
    with pytest.raises(ValueError, match="three"):
        fit_token_bucket([1, 2], [1.0, 2.0])


@pytest.mark.parametrize("rate_bps", [100e6, 200e6, 1e9, 10e9])
@pytest.mark.parametrize("bucket", [0, 64 << 10, 512 << 10, 2 << 20])
def test_the_sweep_goes_far_enough_to_find_the_bucket(rate_bps: float, bucket: int) -> None:
    """On slow links too: the sweep's time limit once stopped a 100 Mbit/s link's at
    4 MiB, where a 2 MiB bucket has one transfer beyond it, and it was found as 1 MiB."""
    beta = 8 / rate_bps
    sizes, times = _burst_sweep(lambda m: C + max(0.0, m - bucket) * beta, beta)
    found, fitted = fit_token_bucket(sizes, times)
    assert found == pytest.approx(bucket, rel=0.25, abs=1.0)
    assert fitted == pytest.approx(beta, rel=0.02)
