"""Weight-version policies: which parameter tensors a micro-batch's forward runs with.

The stage runs every forward on the tensors a policy hands out (in the module's
parameter slots for the call, as `torch.func.functional_call` does), so autograd keeps
exactly that version alive for the backward and the optimizer's in-place update of the
live parameters never touches it. No state dict is copied in or out. A version is a
list of tensors (one per parameter) after `k` optimizer steps; it is freed when the
last micro-batch that used it has run its backward. Buffers (BatchNorm running
statistics) are not versioned: they live in the module and are updated in place by
every forward.

Policies:
    LatestWeights  -- forward on the live parameters (GPipe: no update happens between a
                      micro-batch's forward and backward; checked, not assumed).
    WeightStash    -- PipeDream weight stashing (§3.3): the latest version at forward time.
    VerticalSync   -- every stage uses the version the micro-batch entered the pipeline
                      with (stage 0's version, carried in the message header).

PipeMare's asynchronous policy (one copy of the weights, the backward on the weights
current then) is `pipesgd.pipeline.pipemare.AsyncWeights`; it sets
`backward_on_current_weights` (and `recompute` on request) and overrides
`backward_weights`, `step` and `lr_scale`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import Tensor, nn


class StashError(RuntimeError):
    """A micro-batch asked for a weight version the policy cannot give."""


class WeightPolicy(ABC):
    """Hands out the parameter tensors of each forward and keeps them until its backward.

    Attributes:
        version: optimizer steps applied to the live parameters so far.
        peak_versions: most distinct stashed versions held at once (measured).
        peak_bytes: bytes of those versions at that moment.
    """

    name = "policy"
    # The forward keeps no graph; the backward recomputes it on `backward_weights()`.
    recompute = False
    # The backward reads `backward_weights()` wherever autograd saved a weight.
    backward_on_current_weights = False

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = list(params)
        self.version = 0
        self.peak_versions = 0
        self.peak_bytes = 0
        self._param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._spare: list[Tensor] | None = None

    @abstractmethod
    def forward_weights(
        self, mb: int, version: int | None = None, live_ok: bool = False
    ) -> tuple[int, list[Tensor]]:
        """(version used, tensors) for the forward of micro-batch `mb`.

        Args:
            mb: micro-batch id.
            version: the version requested by the upstream stage (vertical sync); None
                means "the policy decides".
            live_ok: the schedule runs no optimizer step before this micro-batch's
                backward, so the live parameters may serve as its version (no copy).
        """

    @abstractmethod
    def release(self, mb: int) -> None:
        """The backward of `mb` is done: drop what only it needed."""

    def backward_weights(self) -> list[Tensor]:
        """The tensors the backward runs on where it does not use the forward's own
        (policies with `recompute` or `backward_on_current_weights`)."""
        return self.params

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step of the live parameters (their `.grad` set); policies that
        keep something in step with them (PipeMare's T2) do it around the step."""
        optimizer.step()

    def resume_steps(self, steps: int) -> None:  # noqa: B027 (a hook: most need nothing)
        """The live parameters have had `steps` optimizer steps before this policy (a
        resumed run, a switch of schedule). Version-keyed policies start their own count
        at 0; PipeMare's T1 anneals by it."""

    def after_update(self) -> None:
        """Called after every optimizer step of the live parameters."""
        self.version += 1

    def lr_scale(self, stage: int) -> float:
        """Learning-rate factor of the next step (1.0; PipeMare's T1 rescales it)."""
        return 1.0

    @property
    def uses_live_parameters(self) -> bool:
        return False

    def _record(self, held: int) -> None:
        if held > self.peak_versions:
            self.peak_versions = held
            self.peak_bytes = held * self._param_bytes

    def _snapshot(self) -> list[Tensor]:
        """A copy of the live parameters, in a dropped version's memory when there is one
        (fresh memory costs a page fault per 4 KiB on every version)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return [p.detach().clone().requires_grad_(p.requires_grad) for p in self.params]
        with torch.no_grad():
            for copy, p in zip(spare, self.params, strict=True):
                copy.copy_(p)
        return spare

    def _drop(self, tensors: list[Tensor]) -> None:
        """Keep one dropped version for the next snapshot: copies never exceed the peak."""
        self._spare = tensors


class LatestWeights(WeightPolicy):
    """Forward on the live parameters; valid only if no step falls between F and B."""

    name = "latest"

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self._in_flight: dict[int, int] = {}

    @property
    def uses_live_parameters(self) -> bool:
        return True

    def forward_weights(
        self, mb: int, version: int | None = None, live_ok: bool = False
    ) -> tuple[int, list[Tensor]]:
        self._in_flight[mb] = self.version
        self._record(1)
        self.peak_bytes = 0  # the live parameters are no copy
        return self.version, self.params

    def release(self, mb: int) -> None:
        self._in_flight.pop(mb)

    def after_update(self) -> None:
        if self._in_flight:
            raise StashError(
                f"an optimizer step ran while micro-batches {sorted(self._in_flight)} were "
                f"between forward and backward: their gradients would be invalid. Use "
                f"weight_policy='stash' (PipeDream) for 1f1b schedules"
            )
        super().after_update()


class WeightStash(WeightPolicy):
    """PipeDream weight stashing: the forward takes the latest version and keeps it.

    When the schedule guarantees no step before the micro-batch's backward (`live_ok`,
    e.g. every micro-batch of the last stage), the live parameters serve as the version
    and nothing is copied; a step while such a micro-batch is in flight raises.
    """

    name = "stash"

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.versions: dict[int, list[Tensor]] = {}
        self.users: dict[int, set[int]] = {}
        self.of_mb: dict[int, int] = {}
        self.live_users: set[int] = set()

    def forward_weights(
        self, mb: int, version: int | None = None, live_ok: bool = False
    ) -> tuple[int, list[Tensor]]:
        v = self.version
        if live_ok and v not in self.versions:
            self.live_users.add(mb)
            self.of_mb[mb] = v
            self._record(self._held())
            return v, self.params
        if v not in self.versions:
            self.versions[v] = self._snapshot()
        return v, self._use(mb, v)

    def _use(self, mb: int, v: int) -> list[Tensor]:
        self.users.setdefault(v, set()).add(mb)
        self.of_mb[mb] = v
        self._record(self._held())
        return self.versions[v]

    def _held(self) -> int:
        """Distinct versions in use: the copies, plus the live one unless also copied."""
        # Live users always hold the current version (a step while they exist raises).
        live = bool(self.live_users) and self.version not in self.versions
        return len(self.versions) + int(live)

    def release(self, mb: int) -> None:
        v = self.of_mb.pop(mb)
        if mb in self.live_users:
            self.live_users.discard(mb)
            return
        users = self.users[v]
        users.discard(mb)
        if not users and self._droppable(v):
            del self.users[v]
            self._drop(self.versions.pop(v))

    def _droppable(self, v: int) -> bool:
        return True

    def after_update(self) -> None:
        if self.live_users:
            raise StashError(
                f"an optimizer step ran while micro-batches {sorted(self.live_users)} used "
                f"the live parameters: the schedule promised no step before their backward"
            )
        super().after_update()

    def _record(self, held: int) -> None:
        if held > self.peak_versions:
            self.peak_versions = held
            self.peak_bytes = len(self.versions) * self._param_bytes


class VerticalSync(WeightStash):
    """Every stage runs a micro-batch on the version it entered the pipeline with.

    Stage 0 takes its latest version and the header carries it downstream. A later stage
    has already applied more steps, so it snapshots every version after each step and
    drops a version once it is older than the newest one requested and unused (versions
    are requested in non-decreasing order because micro-batches arrive in order).
    """

    name = "vertical"

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.newest_requested = 0
        self.versions[0] = self._snapshot()

    def forward_weights(
        self, mb: int, version: int | None = None, live_ok: bool = False
    ) -> tuple[int, list[Tensor]]:
        v = self.version if version is None else version
        if v not in self.versions:
            raise StashError(
                f"micro-batch {mb} asks for weight version {v} but this stage holds "
                f"{sorted(self.versions)} (latest {self.version}); vertical sync needs "
                f"micro-batches to arrive in order"
            )
        if v > self.newest_requested:
            self.newest_requested = v
            for old in [k for k in self.versions if k < v and not self.users.get(k)]:
                self.users.pop(old, None)
                self._drop(self.versions.pop(old))
        return v, self._use(mb, v)

    def _droppable(self, v: int) -> bool:
        return v < self.newest_requested

    def after_update(self) -> None:
        WeightPolicy.after_update(self)
        self.versions[self.version] = self._snapshot()
        self._record(len(self.versions))


POLICIES: dict[str, type[WeightPolicy]] = {
    "latest": LatestWeights,
    "stash": WeightStash,
    "vertical": VerticalSync,
}


def make_policy(name: str | type[WeightPolicy], params: list[nn.Parameter]) -> WeightPolicy:
    if isinstance(name, type) and issubclass(name, WeightPolicy):
        return name(params)
    if name not in POLICIES:
        raise ValueError(
            f"unknown weight policy {name!r}; choose one of {', '.join(POLICIES)} "
            f"or pass a WeightPolicy subclass"
        )
    return POLICIES[name](params)


def tensors_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = [
    "POLICIES",
    "LatestWeights",
    "StashError",
    "VerticalSync",
    "WeightPolicy",
    "WeightStash",
    "make_policy",
    "tensors_bytes",
]
