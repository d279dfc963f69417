"""bench/compute_stagger.py counts how many ranks compute at once from their compute spells,
and splits an iteration at the last rank's call of step()."""

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
    # each rank's step() returns 2.5 s after its compute ends, or after the last rank's
    # (rank 2's, 7 s into the iteration) for the ranks waiting on it
    returns = [[max(e, 7.0 + 10.0 * i) + 2.5 for i, (_, e) in enumerate(s)] for s in every]
    line = compute_stagger.summarize("D-Sync", every, [b for b, _ in every[0]], returns,
                                     skip=2)
    # seconds in, milliseconds out
    assert "iteration 10000.00 ms" in line and "compute 2000.00 ms" in line
    assert "starts spread 5000.00 ms" in line
    # the last rank in 7 s after the first began; the first out 2.5 s after that
    assert "last in 7000.00 ms" in line and "after 2500.00 ms" in line
