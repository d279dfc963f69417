"""The shared delayed-gradient schedule and queue (pipesgd.delay) against a brute-force
reference: which iteration's gradient each step applies, and at which learning rate."""

import pytest

from pipesgd.delay import DelayedQueue, DelaySchedule


def reference_applied(t: int, staleness: int, warmup: int) -> int | None:
    """The iteration s <= t whose gradient step t applies, found by search."""
    hits = [s for s in range(t + 1)
            if s + (1 if s < warmup else staleness) - 1 == t]
    assert len(hits) <= 1, f"two gradients due at step {t}: {hits}"
    return hits[0] if hits else None


@pytest.mark.parametrize("staleness", [1, 2, 3, 5])
@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("ramp", [0, 3])
def test_queue_releases_each_gradient_once_in_order(staleness, warmup, ramp):
    schedule = DelaySchedule(staleness, warmup, ramp)
    queue: DelayedQueue[int] = DelayedQueue(schedule)
    applied = []
    for t in range(30):
        queue.push(t, t * 10)
        due = queue.pop_due(t)
        expected = reference_applied(t, staleness, warmup)
        assert (due.iteration if due else None) == expected, t
        if due is not None:
            assert due.item == due.iteration * 10 and due.apply_at == t
            applied.append(due.iteration)
    leftover = [e.iteration for e in queue.drain()]
    assert applied + leftover == list(range(30))
    assert len(leftover) == staleness - 1 and len(queue) == 0
    # K - 1 steps apply nothing: at the start without warm-up, after the switch with it
    assert 30 - len(applied) == staleness - 1


def test_ramp_scales_the_first_stale_updates():
    schedule = DelaySchedule(2, warmup_steps=2, ramp_steps=4)
    assert [schedule.lr_scale_at(t) for t in range(8)] == [1, 1, 0.25, 0.5, 0.75, 1, 1, 1]
    assert DelaySchedule(1, ramp_steps=4).lr_scale_at(0) == 1.0  # synchronous: no ramp


@pytest.mark.parametrize("kwargs, message", [
    ({"staleness": 0}, "staleness must be an integer >= 1"),
    ({"staleness": 2.0}, "staleness must be an integer >= 1"),
    ({"staleness": 2, "warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"staleness": 2, "ramp_steps": 1.5}, "ramp_steps must be an integer >= 0"),
])
def test_bad_schedules_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelaySchedule(**kwargs)


def test_pushing_out_of_order_is_refused():
    queue: DelayedQueue[None] = DelayedQueue(DelaySchedule(2))
    queue.push(3, None)
    with pytest.raises(ValueError, match="queued in order"):
        queue.push(3, None)
