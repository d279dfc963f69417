"""PipeMare (`../shared/papers/pipemare.txt` §3): asynchronous pipeline training without
weight stashing.

Each stage holds one copy of its weights. A micro-batch's forward runs on the live
weights and keeps its activations, as any forward does; its backward runs on the weights
current at that moment: wherever autograd saved a weight, the backward reads the current
one instead (`torch.autograd.graph.saved_tensors_hooks`), so the live weights can be
updated in place while micro-batches are in flight. With `recompute`, the forward keeps
only its input and the backward recomputes it on the current weights (activation
recomputation: less memory, a second forward). Stage i's gradient is thus computed at
weights up to tau_fwd,i steps newer than those its forward activations came from
(`schedule.delays`; 0 on the last stage, which runs each backward right after its
forward). Two techniques keep that stable:

- T1, learning-rate rescheduling: stage i steps with alpha_k / tau_i^(p_k), where
  p_k = 1 - min(k / K, 1) anneals from 1 to 0 over the first K steps (`t1_anneal_steps`).
- T2, discrepancy correction: the backward runs on u = w - (tau_fwd - tau_bkwd) * delta,
  the weights extrapolated back towards the forward's, with the velocity
  delta <- gamma delta + (1 - gamma)(w_{t+1} - w_t) and gamma_i = D^(1 / (tau_fwd,i -
  tau_bkwd,i)) (`t2_decay` = D). The live weights are never touched: u is a tensor of
  its own, kept up to date around each step (in the same compiled pass as the step under
  torch.optim.SGD, else one pass before it and one after), and delta is implicit in it.

Memory per stage: the weights once (WeightStash keeps up to NOAM - i copies), plus with T2
one more copy, u.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _C
from .stash import WeightPolicy


@dataclass(frozen=True)
class PipeMareOptions:
    """T1's annealing steps K (None: no rescheduling) and T2's decay D (None: no
    correction)."""

    t1_anneal_steps: int | None = None
    t2_decay: float | None = None

    def __post_init__(self) -> None:
        if self.t1_anneal_steps is not None and self.t1_anneal_steps < 1:
            raise ValueError(f"T1's annealing steps K must be >= 1, got {self.t1_anneal_steps}")
        if self.t2_decay is not None and not 0.0 <= self.t2_decay < 1.0:
            raise ValueError(f"T2's decay D must be in [0, 1), got {self.t2_decay}")


def scale_add(ys: list[Tensor], xs: list[Tensor], a: float, b: float) -> None:
    """y <- a * y + b * x for each pair, in place and without autograd: one pass of the
    compiled kernel for contiguous float32 tensors on the CPU (`csrc/pipeline/`), torch's
    multiply and add otherwise."""
    with torch.no_grad():
        for y, x in zip(ys, xs, strict=True):
            if _kernel_ready(y, x):
                _C.pipeline.scale_add(y.detach().numpy(), x.detach().numpy(), a, b)
            else:
                if a != 1.0:
                    y.mul_(a)
                y.add_(x, alpha=b)


def _kernel_ready(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in tensors)


def sgd_t2_step(optimizer: torch.optim.Optimizer, predicted_of: dict[Tensor, Tensor],
                u_scale: float, w_old_scale: float, w_new_scale: float) -> bool:
    """torch.optim.SGD's step and T2's u <- u_scale*u + w_old_scale*w_t +
    w_new_scale*w_{t+1}, in one compiled pass per parameter (`predicted_of` maps each
    parameter to its u). Returns False, having done nothing, where the kernel does not
    apply: another optimizer, nesterov, maximize, a tensor learning rate, or tensors
    that are not contiguous float32 on the CPU."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    work = []
    for group in optimizer.param_groups:
        if group["nesterov"] or group["maximize"] or isinstance(group["lr"], Tensor):
            return False
        for p in group["params"]:
            u = predicted_of.get(p)
            if p.grad is None or u is None or p.grad.is_sparse or not _kernel_ready(p, p.grad, u):
                return False
            buf = optimizer.state[p].get("momentum_buffer") if group["momentum"] else None
            if buf is not None and not _kernel_ready(buf):
                return False
            work.append((group, p, u, buf))
    with torch.no_grad():
        for group, p, u, buf in work:
            first = group["momentum"] != 0 and buf is None
            if first:  # as torch's SGD: the first step's buffer is the gradient itself
                buf = optimizer.state[p]["momentum_buffer"] = torch.empty_like(p.grad)
            _C.pipeline.sgd_t2_step(
                p.detach().numpy(), p.grad.numpy(), None if buf is None else buf.numpy(),
                u.detach().numpy(), lr=group["lr"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], dampening=group["dampening"], first=first,
                u_scale=u_scale, w_old_scale=w_old_scale, w_new_scale=w_new_scale)
    return True


def lemma1_bound(tau: int, curvature: float) -> float:
    """The largest step size for which gradient descent with delay `tau` on the quadratic
    curvature/2 * w^2 converges (PipeMare Lemma 1): (2 / lambda) sin(pi / (4 tau + 2))."""
    if tau < 0 or curvature <= 0:
        raise ValueError(f"need tau >= 0 and curvature > 0, got {tau}, {curvature}")
    return 2.0 / curvature * math.sin(math.pi / (4 * tau + 2))


def t1_scale(step: int, tau: int, anneal_steps: int | None) -> float:
    """T1's factor on the learning rate at optimizer step `step`: 1 / tau^(p_k)."""
    if anneal_steps is None or tau <= 1:
        return 1.0
    p = 1.0 - min(step / anneal_steps, 1.0)
    return 1.0 / tau**p


class AsyncWeights(WeightPolicy):
    """One copy of the weights; the backward runs on the weights current then, or with
    `recompute` recomputes the forward on them (see the module).

    Args:
        params: the stage's live parameters.
        tau_fwd, tau_bkwd: the stage's delays in optimizer steps (`schedule.delays`).
        options: T1 and T2.
        recompute: keep only the input and recompute the forward in the backward.
    """

    name = "async"
    # The backward reads the current weights where autograd saved the forward's.
    backward_on_current_weights = True

    def __init__(self, params: list[nn.Parameter], tau_fwd: int, tau_bkwd: int = 0,
                 options: PipeMareOptions | None = None, recompute: bool = False) -> None:
        super().__init__(params)
        self.tau_fwd, self.tau_bkwd = tau_fwd, tau_bkwd
        self.options = options or PipeMareOptions()
        # A stage whose backward follows its forward with no step between needs neither.
        self.recompute = recompute and tau_fwd > 0
        shift = tau_fwd - tau_bkwd
        self.shift = shift
        # T2 keeps u = w - shift * delta itself, not delta: one buffer, updated in place
        # around each step (see step), which the backward reads as it is.
        self._predicted: list[Tensor] | None = None
        self._predicted_of: dict[Tensor, Tensor] = {}
        if self.options.t2_decay is not None and shift > 0 and self.params:
            self.gamma = self.options.t2_decay ** (1.0 / shift)
            # u_{t+1} = gamma u_t + w_old_scale w_t + w_new_scale w_{t+1} (see step)
            self._w_old_scale = shift * (1.0 - self.gamma) - self.gamma
            self._w_new_scale = 1.0 - shift * (1.0 - self.gamma)
            self._predicted = [p.detach().clone().requires_grad_(p.requires_grad)
                               for p in self.params]
            self._predicted_of = dict(zip(self.params, self._predicted, strict=True))
        self._step_unfinished = False  # the w_{t+1} half of the last step is still to apply
        self._in_flight: set[int] = set()

    @property
    def uses_live_parameters(self) -> bool:
        return True

    def forward_weights(
        self, mb: int, version: int | None = None, live_ok: bool = False
    ) -> tuple[int, list[Tensor]]:
        self._in_flight.add(mb)
        self.peak_versions = 1
        # the live parameters are no copy; T2's extrapolated weights are
        self.peak_bytes = max(self.peak_bytes, self.extra_bytes)
        return self.version, self.params

    def release(self, mb: int) -> None:
        self._in_flight.discard(mb)

    def backward_weights(self) -> list[Tensor]:
        if self._predicted is None:
            return self.params
        self._finish_step()
        return self._predicted

    # With delta_t = (w_t - u_t) / s, PipeMare's delta_{t+1} = gamma delta_t +
    # (1 - gamma)(w_{t+1} - w_t) gives u_{t+1} = gamma u_t + (s(1 - gamma) - gamma) w_t
    # + (1 - s(1 - gamma)) w_{t+1}, so neither delta nor a copy of w_t is kept. Under
    # torch.optim.SGD one compiled pass takes the step and updates u (sgd_t2_step);
    # around any other optimizer, one pass takes the w_t half before the step and one
    # the w_{t+1} half after it, deferred to the next backward that reads u (or the next
    # step) so u is fresh in the cache then: the live weights do not change in between.
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._predicted is None:
            optimizer.step()
            return
        self._finish_step()
        if sgd_t2_step(optimizer, self._predicted_of, self.gamma, self._w_old_scale,
                       self._w_new_scale):
            return
        scale_add(self._predicted, self.params, self.gamma, self._w_old_scale)
        optimizer.step()
        self._step_unfinished = True

    def _finish_step(self) -> None:
        if self._step_unfinished:
            self._step_unfinished = False
            scale_add(self._predicted or [], self.params, 1.0, self._w_new_scale)

    def resume_steps(self, steps: int) -> None:
        self.version = steps

    def lr_scale(self, stage: int) -> float:
        return t1_scale(self.version, self.tau_fwd, self.options.t1_anneal_steps)

    @property
    def extra_bytes(self) -> int:
        """What T2 holds besides the weights: the extrapolated copy (the velocity is
        implicit in it)."""
        return 0 if self._predicted is None else self._param_bytes


__all__ = ["AsyncWeights", "PipeMareOptions", "lemma1_bound", "scale_add", "sgd_t2_step",
           "t1_scale"]
