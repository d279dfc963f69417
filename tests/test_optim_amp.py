"""Mixed precision with DistributedOptimizer (p = 1): the loss scale a GradScaler keeps,
the aggregated gradient unscaled by the scale it was computed under, a gradient with an
inf skipped, against a hand-written reference of GradScaler's rule applied K - 1 steps
late. Across ranks: tests/mpi/optim_amp.py."""

from __future__ import annotations

import math

import pytest
import torch
from test_optim import make_model
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3
STEPS = 10


def loss_at(model: nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(4, 5, generator=g), torch.randint(0, 2, (4,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x).float(), y)


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def scaled_optimizer(engine, model: nn.Module, amp: torch.amp.GradScaler,
                     momentum: float = 0.9, **kwargs) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                model.named_parameters(), engine=engine, grad_scaler=amp,
                                **kwargs)


def scaled_steps(model: nn.Module, opt: DistributedOptimizer, amp: torch.amp.GradScaler,
                 steps: range) -> list[float]:
    """Train `steps` iterations; the loss scale after each."""
    scales = []
    for t in steps:
        opt.zero_grad()
        amp.scale(loss_at(model, t)).backward()
        opt.step()
        scales.append(float(amp.get_scale()))
    return scales


def reference(staleness: int, poisoned: set[int]) -> tuple[list[torch.Tensor], list[float]]:
    """Gradient of iteration t (scaled by the scale at t, an inf in it when t is poisoned)
    applied at t + K - 1, unscaled, unless it is not finite; the scale halves on a skipped
    gradient and doubles after GROWTH_INTERVAL applied ones in a row."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scale, tracker, scales, pending = INIT_SCALE, 0, [], {}
    for t in range(STEPS):
        scales.append(scale)
        grads = torch.autograd.grad(loss_at(model, t) * scale, list(model.parameters()))
        if t in poisoned:
            grads[0][0, 0] = math.inf
        pending[t] = (grads, scale)
        if t - staleness + 1 < 0:
            continue
        grads, at_scale = pending.pop(t - staleness + 1)
        if all(torch.isfinite(g).all() for g in grads):
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g * (1.0 / at_scale)
            opt.step()
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = scale * 2.0, 0
        else:
            scale, tracker = scale * 0.5, 0
    return [p.detach().clone() for p in model.parameters()], scales


def poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0, 0] = math.inf
    return grad


def train(engine, staleness: int, poisoned: set[int], overlap: str = "sequential",
          staging: bool = False) -> tuple[list[torch.Tensor], list[float]]:
    model = make_model()
    amp = scaler()
    opt = scaled_optimizer(engine, model, amp, staleness=staleness, overlap=overlap,
                           staging=staging)
    scales = []
    for t in range(STEPS):
        opt.zero_grad()
        # the inf enters during backward, before overlap="backward" packs the gradient
        hook = model[0].weight.register_hook(poison) if t in poisoned else None
        amp.scale(loss_at(model, t)).backward()
        if hook is not None:
            hook.remove()
        scales.append(float(amp.get_scale()))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], scales


@pytest.mark.parametrize(("overlap", "staging"),
                         [("sequential", False), ("backward", False), ("sequential", True)])
@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_matches_the_reference_with_an_inf(engine, staleness: int, overlap: str,
                                           staging: bool) -> None:
    poisoned = {3}
    params, scales = train(engine, staleness, poisoned, overlap, staging)
    ref_params, ref_scales = reference(staleness, poisoned)
    assert scales == ref_scales
    # the scale halved exactly once, at the step that met the poisoned gradient
    skipped = 3 + staleness - 1
    assert scales[skipped + 1] == scales[skipped] / 2
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_skipped_gradient_leaves_weights_and_state_alone(engine) -> None:
    model = make_model()
    amp = scaler()
    opt = scaled_optimizer(engine, model, amp, staleness=1)
    scaled_steps(model, opt, amp, range(2))
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.zero_grad()
    amp.scale(loss_at(model, 2)).backward()
    with torch.no_grad():
        model[2].bias.grad[1] = math.nan
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum, strict=True))


def test_resume_continues_the_scale_schedule(engine) -> None:
    model = make_model()
    amp = scaler()
    opt = scaled_optimizer(engine, model, amp, momentum=0.0, staleness=2)
    scaled_steps(model, opt, amp, range(4))
    saved_opt, saved_amp = opt.state_dict(), amp.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}

    straight = scaled_steps(model, opt, amp, range(4, 9))
    resumed_model = make_model()
    resumed_model.load_state_dict(saved_model)
    resumed_amp = scaler()
    resumed_amp.load_state_dict(saved_amp)
    resumed = scaled_optimizer(engine, resumed_model, resumed_amp, momentum=0.0, staleness=2)
    resumed.load_state_dict(saved_opt)
    assert scaled_steps(resumed_model, resumed, resumed_amp, range(4, 9)) == straight
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                 resumed_model.parameters(), strict=True))


def test_gradscaler_step_is_refused_with_what_to_do(engine) -> None:
    model = make_model()
    amp = scaler()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), engine=engine)
    amp.scale(loss_at(model, 0)).backward()
    with pytest.raises(pipesgd.PipesgdError, match=r"grad_scaler=scaler\) and call opt.step"):
        amp.step(opt)
    opt.step()  # the refused call left nothing behind
