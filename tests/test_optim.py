"""Single-process (p = 1) checks of DistributedOptimizer: argument errors, the step
schedule, state that is left alone, LR schedulers, state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipesgd
from pipesgd.optim import DistributedOptimizer


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))


def sgd(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, **kwargs)


def backward(model: nn.Module, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(4, 5, generator=g), torch.randint(0, 2, (4,), generator=g)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staleness": 0}, "staleness must be an integer >= 1"),
        ({"staleness": 1.5}, "staleness must be an integer >= 1"),
        ({"compression": "zip"}, "unknown compression 'zip'"),
        ({"overlap": "eager"}, "unknown overlap 'eager'"),
        ({"bucket_mb": 0}, "bucket_mb must be positive"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"ramp_steps": -1}, "ramp_steps must be an integer >= 0"),
        ({"ramp_steps": 2.5}, "ramp_steps must be an integer >= 0"),
    ],
)
def test_argument_errors(engine, kwargs: dict, message: str) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=message):
        DistributedOptimizer(sgd(model), model.named_parameters(), engine=engine, **kwargs)


def test_compression_needs_float32(engine) -> None:
    model = make_model().double()
    with pytest.raises(ValueError, match=r"float32 only.*'0.weight'"):
        DistributedOptimizer(sgd(model), model.named_parameters(), compression="quant8",
                             engine=engine)


def test_parameters_off_the_host_need_staging(engine) -> None:
    model = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match=r"engine reads host memory.*staging=None"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             model.named_parameters(), staging=False, engine=engine)


def test_optimizer_parameters_must_be_named(engine) -> None:
    model = make_model()
    with pytest.raises(ValueError, match="not in named_parameters"):
        DistributedOptimizer(sgd(model), list(model.named_parameters())[:2], engine=engine)
    with pytest.raises(ValueError, match=r"\(name, parameter\) pairs"):
        DistributedOptimizer(sgd(model), list(model.parameters()), engine=engine)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="appears twice"):
        DistributedOptimizer(sgd(model), [*params, params[0]], engine=engine)


def test_missing_gradient_names_the_parameter(engine) -> None:
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), engine=engine)
    names = r"'0.weight', '0.bias', '2.weight', '2.bias' has no gradient"
    with pytest.raises(pipesgd.PipesgdError, match=names):
        opt.step()


def test_add_param_group_is_refused(engine) -> None:
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), engine=engine)
    with pytest.raises(NotImplementedError, match="new DistributedOptimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_backward_overlap_refuses_accumulation(engine) -> None:
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), overlap="backward",
                               engine=engine)
    backward(model, 0)
    with pytest.raises(RuntimeError, match="accumulated twice"):
        backward(model, 1)
    opt.remove_hooks()


@pytest.mark.parametrize(("staleness", "warmup", "applies"), [
    (1, 0, [0, 1, 2, 3, 4, 5]),
    (2, 0, [None, 0, 1, 2, 3, 4]),
    (3, 0, [None, None, 0, 1, 2, 3]),
    (3, 2, [0, 1, None, None, 2, 3]),
])
def test_schedule_applies_each_gradient_once(engine, staleness, warmup, applies) -> None:
    """With p = 1 the aggregated gradient is the local one: feed gradient t = t + 1
    (constant) and read which one each step applied from plain SGD's update."""
    w = nn.Parameter(torch.zeros(1))
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), [("w", w)], staleness=staleness,
                               warmup_steps=warmup, engine=engine)
    seen = []
    for t in range(len(applies)):
        before = w.detach().clone()
        w.grad = torch.full((1,), float(t + 1))
        opt.step()
        delta = (before - w.detach()).item()
        seen.append(None if delta == 0 else int(delta) - 1)
    assert seen == applies


def test_ramp_scales_the_first_stale_updates_only(engine) -> None:
    """K = 2 after two synchronous steps, ramp over 4: gradient t (= 1 everywhere) moves
    w by lr times the ramp's factor; the inner optimizer's own rate is left as it was."""
    w = nn.Parameter(torch.zeros(1))
    inner = torch.optim.SGD([w], lr=0.5)
    opt = DistributedOptimizer(inner, [("w", w)], staleness=2, warmup_steps=2, ramp_steps=4,
                               engine=engine)
    moves = []
    for _ in range(8):
        before = w.item()
        w.grad = torch.ones(1)
        opt.step()
        moves.append(before - w.item())
        assert inner.param_groups[0]["lr"] == 0.5
    # steps 0, 1: synchronous; 2: nothing due after the switch; 3-6: gradients 2-5 at
    # 1/4, 2/4, 3/4, 4/4 of the rate; 7: gradient 6 at the full rate
    assert moves == pytest.approx([0.5, 0.5, 0.0, 0.125, 0.25, 0.375, 0.5, 0.5])
    assert [opt.lr_scale_at(t) for t in range(8)] == [1, 1, 0.25, 0.5, 0.75, 1, 1, 1]


def test_step_without_a_due_gradient_leaves_state_untouched(engine) -> None:
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    opt = DistributedOptimizer(inner, model.named_parameters(), staleness=3, engine=engine)
    before = copy.deepcopy(model.state_dict())
    for t in range(2):
        opt.zero_grad()
        backward(model, t)
        opt.step()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert inner.state == {}
    opt.zero_grad()
    backward(model, 2)
    opt.step()
    assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])
    assert len(inner.state) == 4


def test_lr_scheduler_on_inner_optimizer(engine) -> None:
    model = make_model()
    inner = sgd(model)
    opt = DistributedOptimizer(inner, model.named_parameters(), staleness=2, engine=engine)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
    for t in range(4):
        opt.zero_grad()
        backward(model, t)
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_state_dict_round_trip_continues_exactly(engine, kind: str) -> None:
    def make_optimizer(model):
        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=0.01)
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def run(model, opt, steps):
        for t in steps:
            opt.zero_grad()
            backward(model, t)
            opt.step()

    straight = make_model()
    opt = DistributedOptimizer(make_optimizer(straight), straight.named_parameters(), staleness=3,
                               bucket_mb=1e-4, engine=engine)
    run(straight, opt, range(8))

    first = make_model()
    opt1 = DistributedOptimizer(make_optimizer(first), first.named_parameters(), staleness=3,
                                bucket_mb=1e-4, engine=engine)
    run(first, opt1, range(4))
    state = copy.deepcopy({"model": first.state_dict(), "opt": opt1.state_dict()})
    assert state["opt"]["pipesgd"]["iteration"] == 4
    assert len(state["opt"]["pipesgd"]["inflight"]) == 2

    second = make_model()
    opt2 = DistributedOptimizer(make_optimizer(second), second.named_parameters(), staleness=3,
                                bucket_mb=1e-4, engine=engine)
    second.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    run(second, opt2, range(4, 8))
    for k, v in straight.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k

    third = make_model()
    other = DistributedOptimizer(make_optimizer(third), third.named_parameters(), staleness=2,
                                 bucket_mb=1e-4, engine=engine)
    with pytest.raises(ValueError, match="staleness=3"):
        other.load_state_dict(state["opt"])
    ramped = DistributedOptimizer(make_optimizer(third), third.named_parameters(), staleness=3,
                                  ramp_steps=10, bucket_mb=1e-4, engine=engine)
    with pytest.raises(ValueError, match="ramp_steps=0"):
        ramped.load_state_dict(state["opt"])


def test_timing_is_reported(engine) -> None:
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), staleness=1, engine=engine)
    backward(model, 0)
    opt.step()
    assert opt.timing.submit_s > 0 and opt.timing.update_s > 0 and opt.timing.wait_s >= 0


def bucket_of(opt: DistributedOptimizer, grad: torch.Tensor) -> tuple[int, int] | None:
    """(set, bucket) whose flat buffer holds `grad`'s memory, or None."""
    for s, buffers in enumerate(opt.buckets.buffers):
        for b, flat in enumerate(buffers):
            start = flat.data_ptr()
            if start <= grad.data_ptr() < start + flat.numel() * flat.element_size():
                return s, b
    return None


def test_sequential_gradients_live_in_the_buckets(engine) -> None:
    """zero_grad() lends each parameter its zeroed slot of the set the next backward fills;
    step() points .grad at the set it applies, and at nothing while the set is in flight."""
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), staleness=2,
                               bucket_mb=5e-5, engine=engine)
    assert opt.buckets.num_buckets > 1
    reference = make_model()
    local = []
    for t in range(3):
        reference.zero_grad()
        backward(reference, t)
        local.append([p.grad.clone() for p in reference.parameters()])

        opt.zero_grad()
        for p in model.parameters():
            assert bucket_of(opt, p.grad)[0] == t % 2
            assert not p.grad.any()
        backward(model, t)
        opt.step()
        if t == 0:  # nothing due: the gradient just submitted is not lent out
            assert all(p.grad is None for p in model.parameters())
            continue
        for p, applied in zip(model.parameters(), local[t - 1], strict=True):
            assert bucket_of(opt, p.grad)[0] == (t - 1) % 2
            # p = 1: the average is the local gradient, taken at the weights of t - 1.
            assert torch.equal(p.grad, applied)
        reference.load_state_dict(model.state_dict())


def test_unused_parameter_is_missing_although_its_gradient_is_a_zeroed_view(engine) -> None:
    model = nn.Module()
    model.net, model.unused = make_model(), nn.Linear(3, 3)
    extra = model.unused
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), engine=engine)
    opt.zero_grad()
    backward(model.net, 0)
    assert extra.weight.grad is not None and not extra.weight.grad.any()
    with pytest.raises(pipesgd.PipesgdError, match=r"'unused.weight', 'unused.bias' has no"):
        opt.step()


def test_sequential_overlap_runs_no_python_per_parameter_in_backward(engine) -> None:
    """Missing gradients are found from the lent views' version counters, not hooks."""
    model = make_model()
    opt = DistributedOptimizer(sgd(model), model.named_parameters(), staleness=2,
                               engine=engine)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert all(not p._backward_hooks for p in model.parameters())
    for t in range(3):  # a reduced gradient lent back by step() counts as lent too
        opt.zero_grad()
        backward(model, t)
        backward(model, t + 10)  # accumulating over two backwards is no missing gradient
        opt.step()


@pytest.mark.parametrize("style", ["model.zero_grad", "assigned", "hooks removed"])
def test_gradients_outside_the_buckets_give_the_same_training(engine, style: str) -> None:
    """Gradients made elsewhere than in the lent views are copied in: same parameters."""
    def train(style: str) -> nn.Module:
        model = make_model()
        opt = DistributedOptimizer(sgd(model), model.named_parameters(), staleness=3,
                                   bucket_mb=1e-4, engine=engine)
        for t in range(7):
            if style == "hooks removed" and t == 3:
                opt.remove_hooks()
            if style == "model.zero_grad":
                model.zero_grad()
            elif style == "assigned":
                probe = make_model()
                probe.load_state_dict(model.state_dict())
                backward(probe, t)
                for p, q in zip(model.parameters(), probe.parameters(), strict=True):
                    p.grad = q.grad
            else:
                opt.zero_grad()
            if style != "assigned":
                backward(model, t)
            opt.step()
        opt.synchronize()
        return model

    lent, other = train("lent"), train(style)
    for (name, a), b in zip(lent.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name


def _quadratic_distance(engine, staleness: int, momentum: float, step_times_curvature: float,
                        steps: int = 500) -> float:
    """|w| after `steps` of f(w) = h w^2 / 2 from w = 1, h = 1, lr = eta h."""
    w = nn.Parameter(torch.ones(1, dtype=torch.float64))
    inner = torch.optim.SGD([w], lr=step_times_curvature, momentum=momentum)
    opt = DistributedOptimizer(inner, [("w", w)], staleness=staleness, engine=engine)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * w.pow(2).sum()).backward()
        opt.step()
    opt.synchronize()
    return abs(w.item())


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_staleness_two_is_stable_exactly_below_the_documented_bound(engine, momentum) -> None:
    """docs/training.md ("Learning rate and momentum with K >= 2"): heavy ball applying
    the gradient of the iteration before is stable iff eta h < 1 - momentum, where
    synchronous training is stable up to eta h < 2 (1 + momentum)."""
    bound = 1.0 - momentum
    assert _quadratic_distance(engine, 2, momentum, 0.5 * bound) < 1e-3
    assert _quadratic_distance(engine, 2, momentum, 1.2 * bound) > 10.0
    # the same step is stable without the delay
    assert _quadratic_distance(engine, 1, momentum, 1.2 * bound) < 1e-3
