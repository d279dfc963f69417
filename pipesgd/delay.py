"""Applying a gradient K - 1 steps late: the one schedule every Pipe-SGD user shares.

The gradient of iteration t is applied at iteration t + K - 1 (Pipe-SGD §3.1; K = 1 is
synchronous). Iterations t < `warmup_steps` use K = 1. With `ramp_steps` = R the first R
stale updates scale the learning rate by 1/R, 2/R, ..., 1. Each gradient is applied once
and in order: `apply_at` strictly increases with t, so at most one is due per iteration,
and the K - 1 iterations right after the switch have nothing to apply.

`DelaySchedule` is the rule; `DelayedQueue` holds what is in flight under it. The
data-parallel optimizer (`pipesgd.optim`), the DDP hook (`pipesgd.hooks`) and replicated
pipeline stages (`pipesgd.pipeline.replicas`) all use these two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class DelaySchedule:
    """When the gradient of each iteration is applied, and at which learning-rate scale.

    Raises:
        ValueError: staleness < 1, or negative warm-up or ramp (the message names it).
    """

    staleness: int
    warmup_steps: int = 0
    ramp_steps: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or self.staleness < 1:
            raise ValueError(f"staleness must be an integer >= 1 (1 = synchronous, "
                             f"2 = Pipe-SGD), got {self.staleness!r}")
        for name in ("warmup_steps", "ramp_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    def staleness_at(self, iteration: int) -> int:
        """K used for the gradient of `iteration` (1 during warm-up)."""
        return 1 if iteration < self.warmup_steps else self.staleness

    def apply_at(self, iteration: int) -> int:
        """The iteration whose step applies the gradient of `iteration`."""
        return iteration + self.staleness_at(iteration) - 1

    def lr_scale_at(self, iteration: int) -> float:
        """Factor on the learning rate of the update that applies `iteration`'s gradient."""
        if self.ramp_steps == 0 or self.staleness_at(iteration) == 1:
            return 1.0
        return min(1.0, (iteration - self.warmup_steps + 1) / self.ramp_steps)


@dataclass
class Delayed(Generic[T]):
    """One iteration's gradient in flight: what it is, and when it is applied."""

    iteration: int
    apply_at: int
    item: T


class DelayedQueue(Generic[T]):
    """Gradients in flight, oldest first, each released at its `apply_at` iteration."""

    def __init__(self, schedule: DelaySchedule) -> None:
        self.schedule = schedule
        self._entries: deque[Delayed[T]] = deque()

    def push(self, iteration: int, item: T) -> None:
        """Queue the gradient of `iteration` (iterations must increase)."""
        if self._entries and iteration <= self._entries[-1].iteration:
            raise ValueError(f"iteration {iteration} pushed after iteration "
                             f"{self._entries[-1].iteration}: gradients are queued in order")
        self._entries.append(Delayed(iteration, self.schedule.apply_at(iteration), item))

    def restore(self, iteration: int, apply_at: int, item: T) -> None:
        """Queue an entry saved with its own `apply_at` (a checkpoint's in-flight gradient)."""
        self._entries.append(Delayed(iteration, apply_at, item))

    def pop_due(self, iteration: int) -> Delayed[T] | None:
        """The entry to apply at `iteration`, removed from the queue; None if none is due."""
        if self._entries and self._entries[0].apply_at == iteration:
            return self._entries.popleft()
        return None

    def drain(self) -> list[Delayed[T]]:
        """Everything still queued, oldest first; the queue is then empty."""
        out = list(self._entries)
        self._entries.clear()
        return out

    def clear(self) -> None:
        self._entries.clear()

    def __iter__(self) -> Iterator[Delayed[T]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
