"""bench/core_wait.py judges the timing model's core-wait rule with the library's own
function, against the form it replaced, on hand-worked records."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

core_wait = load_bench("core_wait")


def record(W: float, D: float, C: float, measured: float) -> dict:
    return {"compression": "quant8", "W_s": W, "D_s": D, "C_s": C, "pipe_sgd_s": measured,
            "d_sync_s": 0.010, "d_sync_sleeping_s": 0.009}


def test_the_rule_runs_the_ring_at_its_loaded_pace_while_compute_runs() -> None:
    # W = 4 ms, D = 8 ms, C = 3 ms: for 3 ms the ring advances at 4/12 of its pace (1 ms
    # of its work), then does the other 3 ms unloaded: 6 ms in all.
    [row] = core_wait.evaluate([record(4e-3, 8e-3, 3e-3, 5e-3)])
    assert row["rule_s"] == pytest.approx(6e-3)
    assert row["rule_error"] == pytest.approx(6 / 5 - 1)
    # the replaced form: W' = W + D C / W', W'^2 - 4 W' - 24 = 0 (ms)
    assert row["old_s"] == pytest.approx((4 + (16 + 96) ** 0.5) / 2 * 1e-3)
    assert row["d_sync_extra_s"] == pytest.approx(1e-3)


def test_compute_longer_than_the_loaded_ring_bounds_the_iteration() -> None:
    [row] = core_wait.evaluate([record(4e-3, 8e-3, 20e-3, 20e-3)])
    assert row["rule_s"] == row["old_s"] == pytest.approx(20e-3)
    assert row["rule_error"] == pytest.approx(0.0)
