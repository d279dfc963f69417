"""bench/beta_probes.py: the rate a ring allreduce puts on each link, and the optimizer's
buckets it times."""

import pytest
from bench_scripts import load_bench

beta_probes = load_bench("beta_probes")


def test_wire_rate_counts_the_rings_two_passes():
    # 4 ranks: each link carries 2 * 3/4 of the buffer; 1.5 MB in 0.1 s is 120 Mbit/s
    assert beta_probes.wire_mbit_per_s(1_000_000, 4, 0.1) == pytest.approx(120.0)
    assert beta_probes.wire_mbit_per_s(1_000_000, 2, 0.1) == pytest.approx(80.0)


def test_buckets_cover_the_gradient_in_whole_elements():
    assert beta_probes.bucket_sizes(1_150_000, 500_000) == [500_000, 500_000, 150_000]
    sizes = beta_probes.bucket_sizes(1_000_004, 333_335)  # buckets round down to elements
    assert sum(sizes) == 1_000_004 and all(n % 4 == 0 and n <= 333_335 for n in sizes)
    assert beta_probes.bucket_sizes(400, 1_000_000) == [400]


def test_bucket_sizes_refuse_empty_sizes():
    with pytest.raises(ValueError, match="positive"):
        beta_probes.bucket_sizes(0, 500_000)
    with pytest.raises(ValueError, match="positive"):
        beta_probes.bucket_sizes(1000, 0)
