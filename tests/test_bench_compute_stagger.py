"""bench/compute_stagger.py counts how many ranks compute at once from their compute spells."""

import pytest
from bench_scripts import load_bench

compute_stagger = load_bench("compute_stagger")


def spells(offset: float, n: int = 10, period: float = 10.0, length: float = 2.0):
    return [(offset + i * period, offset + i * period + length) for i in range(n)]


def test_ranks_in_step_all_compute_at_once():
    every = [spells(0.0) for _ in range(4)]
    assert compute_stagger.overlap_with_others(every, 0, 5) == pytest.approx(4.0)


def test_staggered_ranks_overlap_by_their_shared_time():
    # rank 1 starts half a spell later; rank 2 computes while nobody else does
    every = [spells(0.0), spells(1.0), spells(5.0)]
    assert compute_stagger.overlap_with_others(every, 0, 5) == pytest.approx(1.5)
    assert compute_stagger.overlap_with_others(every, 2, 5) == pytest.approx(1.0)
    line = compute_stagger.summarize("D-Sync", every, [b for b, _ in every[0]], skip=2)
    # seconds in, milliseconds out
    assert "iteration 10000.00 ms" in line and "compute 2000.00 ms" in line
    assert "starts spread 5000.00 ms" in line
