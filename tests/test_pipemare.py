"""PipeMare's asynchronous weights (pipesgd/pipeline/pipemare.py), in one process: the
delays the schedule implies, Lemma 1 against a simulation, T1's factors, T2's velocity
against a hand-written recursion, and the recomputing backward against the stored one."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from pipesgd import _C
from pipesgd.pipeline import Plan
from pipesgd.pipeline import schedule as sched
from pipesgd.pipeline.pipemare import (
    AsyncWeights,
    PipeMareOptions,
    lemma1_bound,
    scale_add,
    t1_scale,
)
from pipesgd.pipeline.plan import PlanError
from pipesgd.pipeline.stage import Stage
from pipesgd.pipeline.stash import LatestWeights


def test_delays_follow_the_1f1b_order():
    # Stage i of a straight pipeline runs NOAM - i forwards ahead: its gradient lands
    # NOAM - 1 - i steps after the weights its forward used.
    assert sched.delays(Plan.even(8, 4, schedule="async")) == [(3, 0), (2, 0), (1, 0), (0, 0)]
    assert sched.delays(Plan.even(8, 3, schedule="async", stage_in_flight=[2, 2, 1])) == \
        [(1, 0), (1, 0), (0, 0)]
    # accumulating two micro-batches per step halves the delay in steps (rounded up)
    assert sched.delays(Plan.even(8, 4, schedule="async", micro_batches_per_step=2)) == \
        [(2, 0), (1, 0), (1, 0), (0, 0)]


def delayed_descent(alpha: float, curvature: float, tau: int, steps: int = 3000) -> float:
    """|w| after gradient descent on curvature/2 w^2 whose gradient is `tau` steps old."""
    w = [1.0] * (tau + 1)
    for _ in range(steps):
        w.append(w[-1] - alpha * curvature * w[-1 - tau])
        if abs(w[-1]) > 1e12:
            break
    return abs(w[-1])


@pytest.mark.parametrize("tau", [tau for tau, _ in
                                 sched.delays(Plan.even(8, 4, schedule="async"))])
def test_lemma1_bound_separates_convergence_from_divergence(tau):
    # PipeMare §3.1: with the delays the runtime's schedule has, below the bound the
    # delayed iteration converges, above it diverges.
    lam = 2.0
    bound = lemma1_bound(tau, lam)
    assert delayed_descent(0.97 * bound, lam, tau) < 1e-3
    assert delayed_descent(1.03 * bound, lam, tau) > 1e3
    if tau == 0:
        assert bound == pytest.approx(2.0 / lam)


def test_t1_divides_the_step_by_the_delay_to_an_annealed_power():
    assert t1_scale(0, 4, 100) == pytest.approx(1 / 4)
    assert t1_scale(50, 4, 100) == pytest.approx(1 / 2)
    assert t1_scale(100, 4, 100) == 1.0 and t1_scale(10**6, 4, 100) == 1.0
    assert t1_scale(0, 1, 100) == 1.0 and t1_scale(0, 0, 100) == 1.0  # no delay, no change
    assert t1_scale(0, 4, None) == 1.0


class RandomStep:
    """Any optimizer's step: the velocity sees only w_t -> w_t+1."""

    def __init__(self, params, rng):
        self.params, self.rng = params, rng

    def step(self):
        with torch.no_grad():
            for p in self.params:
                p.add_(torch.from_numpy(self.rng.standard_normal(p.shape)).to(p.dtype))


def toy_params(values, dtype=torch.float64):
    return [nn.Parameter(torch.tensor(v, dtype=dtype)) for v in values]


# float64 takes torch's multiply and add, float32 the compiled kernel (scale_add); a
# backward that does not read the weights after every step leaves the second half of
# T2's update to the next step.
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("read_every", [1, 2])
def test_t2_velocity_and_extrapolation_match_the_recursion(dtype, atol, read_every):
    params = toy_params([[1.0, -2.0, 0.25] * 7, [0.5]], dtype)
    decay, tau = 0.25, 2
    policy = AsyncWeights(params, tau_fwd=tau, options=PipeMareOptions(t2_decay=decay))
    gamma = decay ** (1 / tau)
    delta = [np.zeros(21), np.zeros(1)]
    rng = np.random.default_rng(0)
    for step in range(6):
        before = [p.detach().numpy().astype(np.float64) for p in params]
        policy.step(RandomStep(params, rng))
        policy.after_update()
        after = [p.detach().numpy().astype(np.float64) for p in params]
        delta = [gamma * d + (1 - gamma) * (a - b)
                 for d, a, b in zip(delta, after, before, strict=True)]
        if step % read_every:
            continue
        live = [p.detach().clone() for p in params]
        used = policy.backward_weights()
        for u, w, d in zip(used, params, delta, strict=True):
            np.testing.assert_allclose(u.detach().numpy(), w.detach().numpy() - tau * d,
                                       rtol=0, atol=atol)
        # the live weights are untouched: the backward runs on a separate tensor
        assert all(torch.equal(a, b) for a, b in zip(live, params, strict=True))
        assert all(u is not w for u, w in zip(used, params, strict=True))
    assert policy.extra_bytes == 22 * params[0].element_size()  # the velocity is implicit


class NotPlainSGD(torch.optim.SGD):
    """torch's SGD under another type: the policy takes its generic path around it."""


@pytest.mark.parametrize("momentum, dampening, weight_decay",
                         [(0.0, 0.0, 0.0), (0.9, 0.0, 0.0), (0.9, 0.1, 1e-3)])
def test_fused_sgd_step_equals_torch_sgd_with_t2_around_it(momentum, dampening, weight_decay):
    # The one-pass kernel against torch's own SGD with T2's two passes around it: the
    # same weights, momentum buffers and extrapolated weights, step after step, with T1's
    # learning-rate scale applied through the group as Stage.step does.
    torch.manual_seed(0)
    start = [torch.randn(37, 5), torch.randn(5)]
    runs = []
    for kind in (torch.optim.SGD, NotPlainSGD):
        params = [nn.Parameter(t.clone()) for t in start]
        opt = kind(params, lr=0.05, momentum=momentum, dampening=dampening,
                   weight_decay=weight_decay)
        policy = AsyncWeights(params, tau_fwd=3, options=PipeMareOptions(t2_decay=0.2))
        gen = torch.Generator().manual_seed(1)
        for k in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.param_groups[0]["lr"] = 0.05 / (k + 1)
            policy.step(opt)
            policy.after_update()
        runs.append((params, [opt.state[p].get("momentum_buffer") for p in params],
                     [u.detach().clone() for u in policy.backward_weights()]))
    (fused_w, fused_buf, fused_u), (plain_w, plain_buf, plain_u) = runs
    for a, b in zip(fused_w + fused_u, plain_w + plain_u, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    if momentum:
        for a, b in zip(fused_buf, plain_buf, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert fused_buf == [None, None]
    assert all(u is not w for u, w in zip(fused_u, fused_w, strict=True))


def test_scale_add_matches_numpy_and_rejects_bad_arrays():
    rng = np.random.default_rng(1)
    y0 = rng.standard_normal(1000).astype(np.float32)
    x = rng.standard_normal(1000).astype(np.float32)
    y = torch.from_numpy(y0.copy())
    scale_add([y], [torch.from_numpy(x)], 0.75, -1.5)
    # each product rounded to float32, then the sum: no fused multiply-add
    want = (np.float32(0.75) * y0) + (np.float32(-1.5) * x)
    assert np.array_equal(y.numpy(), want)
    kernel = _C.pipeline.scale_add
    with pytest.raises(ValueError, match="overlap"):
        kernel(y0[1:], y0[:-1], 1.0, 1.0)
    with pytest.raises(ValueError, match="differ in length"):
        kernel(y0, x[:10], 1.0, 1.0)
    with pytest.raises(ValueError, match="float32"):
        kernel(y0.astype(np.float64), x.astype(np.float64), 1.0, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernel(y0[::2], x[::2], 1.0, 1.0)
    read_only = y0.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernel(read_only, x, 1.0, 1.0)
    # a strided tensor takes torch's ops, with the same result
    strided = torch.from_numpy(y0.copy())[::2]
    scale_add([strided], [torch.from_numpy(x)[::2]], 0.75, -1.5)
    np.testing.assert_allclose(strided.numpy(), want[::2], rtol=1e-6, atol=1e-6)


def test_without_t2_the_backward_runs_on_the_live_weights():
    params = toy_params([[1.0]])
    policy = AsyncWeights(params, tau_fwd=3)
    assert policy.backward_weights() is policy.params and policy.extra_bytes == 0
    assert not policy.recompute and AsyncWeights(params, tau_fwd=3, recompute=True).recompute
    assert not AsyncWeights(params, tau_fwd=0, recompute=True).recompute


def make_stage(policy_factory, seed=0):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 4))
    return Stage(module, 1, False, lambda ps: torch.optim.SGD(ps, lr=0.1), policy_factory,
                 nn.CrossEntropyLoss())


def test_recomputed_backward_equals_the_stored_one_dropout_included():
    stored = make_stage(LatestWeights)
    again = make_stage(lambda ps: AsyncWeights(ps, tau_fwd=2, recompute=True))
    assert again.recomputes and not stored.recomputes
    x = torch.randn(5, 6)
    grad_out = torch.randn(5, 4)
    outs, grads = [], []
    for stage in (stored, again):
        torch.manual_seed(7)  # the runtime seeds each micro-batch's forward ...
        out, _ = stage.forward(0, x)
        torch.manual_seed(7)  # ... and, for a recomputing stage, its backward alike
        grad_x = stage.backward(0, grad_out)
        outs.append(out.detach())
        grads.append((grad_x, stage.take_gradient()[0].clone()))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    assert grads[0][1].abs().sum() > 0
    # without the same RNG state the dropout masks differ, and so would the gradient
    torch.manual_seed(7)
    again.forward(1, x)
    torch.manual_seed(8)
    again.backward(1, grad_out)
    assert not torch.allclose(again.take_gradient()[0], grads[1][1])


def test_backward_reads_the_current_weights_and_the_forwards_activations():
    # PipeMare's backward: the ReLU mask and saved inputs from the forward, the weights
    # from after the steps taken while the micro-batch was in flight (T2: extrapolated).
    for t2 in (None, 0.5):
        stage = make_stage(lambda ps, t2=t2: AsyncWeights(
            ps, tau_fwd=2, options=PipeMareOptions(t2_decay=t2)), seed=1)
        stage.module.eval()  # no dropout: the reference below has none
        w1, b1 = (p.detach().clone() for p in stage.params[:2])  # the forward's layer 1
        x = torch.randn(5, 6)
        stage.forward(0, x)
        stage.forward(1, x)  # in flight across the steps
        for _ in range(2):
            stage.step(torch.randn_like(stage.grad_sum))
        used = [u.detach().clone() for u in stage.policy.backward_weights()]
        grad_out = torch.randn(5, 4)
        stage.backward(0, grad_out)
        grad = stage.take_gradient()[0]
        # reference: activations of the forward's weights, the backward's weights after
        h = x @ w1.T + b1
        mask = (h > 0).to(h.dtype)
        relu = h * mask
        g_relu = (grad_out @ used[2]) * mask
        want = torch.cat([(g_relu.T @ x).flatten(), g_relu.sum(0),
                          (grad_out.T @ relu).flatten(), grad_out.sum(0)])
        torch.testing.assert_close(grad, want)
        if t2 is None:
            assert all(torch.equal(u, p) for u, p in zip(used, stage.params, strict=True))
        else:
            assert not torch.equal(used[2], stage.params[2].detach())


def test_async_holds_one_copy_of_the_weights_and_keeps_only_inputs():
    stage = make_stage(lambda ps: AsyncWeights(ps, tau_fwd=3, recompute=True))
    x = torch.randn(5, 6)
    for mb in range(3):  # three micro-batches in flight, an update between them
        stage.forward(mb, x)
        stage.step(torch.zeros_like(stage.grad_sum))
    assert stage.policy.peak_versions == 1 and stage.policy.peak_bytes == 0
    assert stage.peak_activation_bytes == 3 * x.numel() * x.element_size()
    for mb in range(3):
        stage.backward(mb, torch.ones(5, 4))
    assert stage.in_flight == 0


def test_bad_pipemare_settings_are_refused():
    with pytest.raises(ValueError, match="T1's annealing steps"):
        PipeMareOptions(t1_anneal_steps=0)
    with pytest.raises(ValueError, match=r"T2's decay D must be in \[0, 1\)"):
        PipeMareOptions(t2_decay=1.0)
    with pytest.raises(PlanError, match="one rank per stage"):
        Plan.even(4, 2, schedule="async", replicas=(2, 1))
    with pytest.raises(ValueError, match="tau >= 0"):
        lemma1_bound(-1, 1.0)
    assert math.isfinite(lemma1_bound(0, 1.0))


def test_a_stage_without_parameters_runs_t2_as_a_no_op():
    policy = AsyncWeights([], tau_fwd=2, options=PipeMareOptions(t2_decay=0.1))
    policy.step(RandomStep([], None))
    policy.after_update()
    assert policy.backward_weights() == [] and policy.extra_bytes == 0


def test_digits_as_images_scale_the_digits_up_for_an_image_model():
    from pipesgd.pipeline import data

    (x, y), (xt, yt) = data.digits(seed=3)
    (ix, iy), (ixt, iyt) = data.digits_as_images((3, 32, 32), seed=3)
    assert ix.shape == (len(x), 3, 32, 32) and ixt.shape == (len(xt), 3, 32, 32)
    assert torch.equal(iy, y) and torch.equal(iyt, yt)
    assert torch.equal(ix[:, 0], ix[:, 2])  # every channel the same picture
    # bilinear scaling keeps the mean brightness of each picture (up to the border)
    np.testing.assert_allclose(ix[:, 0].mean(dim=(1, 2)).numpy(), x.mean(dim=1).numpy(),
                               atol=0.03)
    with pytest.raises(ValueError, match="channels, height, width"):
        data.digits_as_images((64,))
