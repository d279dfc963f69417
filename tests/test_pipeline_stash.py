"""Weight-version policies and a stage's forward/backward, in one process."""

import pytest
import torch
from torch import nn

from pipesgd.pipeline.p2p import TensorSpec
from pipesgd.pipeline.stage import Stage
from pipesgd.pipeline.stash import LatestWeights, StashError, VerticalSync, WeightStash


def make_stage(policy, module=None, lr=0.5):
    torch.manual_seed(0)
    module = module or nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    return Stage(module, 1, False, lambda p: torch.optim.SGD(p, lr=lr), policy,
                 nn.functional.mse_loss)


def test_backward_uses_the_weights_its_forward_used():
    stage = make_stage(WeightStash)
    x0, x1, g = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 2)
    before = [p.detach().clone() for p in stage.params]
    stage.forward(0, x0)
    stage.forward(1, x1)
    stage.backward(0, g)
    flat, count = stage.take_gradient()
    stage.step(flat / count)  # live weights change while micro-batch 1 is in flight
    grad_x1 = stage.backward(1, g)
    # Reference: micro-batch 1 through a copy holding the pre-update weights.
    ref = make_stage(WeightStash)
    with torch.no_grad():
        for p, w in zip(ref.params, before, strict=True):
            p.copy_(w)
    ref.forward(1, x1)
    want_x = ref.backward(1, g)
    assert torch.equal(grad_x1, want_x)
    assert torch.equal(stage.grad_sum, ref.grad_sum)
    assert stage.policy.versions == {} and stage.policy.peak_versions == 1


def test_versions_dropped_after_their_last_backward():
    stage = make_stage(WeightStash)
    g = torch.randn(2, 2)
    stage.forward(0, torch.randn(2, 4))
    stage.forward(1, torch.randn(2, 4))  # same version as 0: shared, not copied again
    assert len(stage.policy.versions) == 1
    stage.backward(0, g)
    stage.step(stage.take_gradient()[0])
    stage.forward(2, torch.randn(2, 4))
    assert sorted(stage.policy.versions) == [0, 1]
    stage.backward(1, g)
    assert sorted(stage.policy.versions) == [1]
    stage.backward(2, g)
    assert stage.policy.versions == {} and stage.policy.peak_versions == 2


def test_a_new_version_reuses_a_dropped_versions_memory_and_holds_the_live_weights():
    stage = make_stage(WeightStash)
    g = torch.randn(2, 2)
    stage.forward(0, torch.randn(2, 4))
    first = [t.data_ptr() for t in stage.policy.versions[0]]
    stage.backward(0, g)  # version 0 dropped
    stage.step(stage.take_gradient()[0])
    stage.forward(1, torch.randn(2, 4))
    again = stage.policy.versions[1]
    assert [t.data_ptr() for t in again] == first
    assert all(torch.equal(t, p.detach()) for t, p in zip(again, stage.params, strict=True))
    assert all(t.requires_grad and t.grad is None for t in again)


def test_gradients_accumulate_into_the_flat_buffer_over_a_round():
    stage = make_stage(WeightStash)
    xs, g = [torch.randn(3, 4) for _ in range(3)], torch.randn(3, 2)
    want = [torch.zeros_like(p) for p in stage.params]
    for i, x in enumerate(xs):
        stage.forward(i, x)
        stage.backward(i, g)
        out = stage.module(x)
        for w, d in zip(want, torch.autograd.grad(out, stage.params, g), strict=True):
            w += d
    flat, count = stage.take_gradient()
    assert count == 3
    assert torch.allclose(flat, torch.cat([w.flatten() for w in want]), atol=1e-6)
    assert all(p.grad is None for p in stage.params)  # the views are lent, not left behind
    stage.forward(3, xs[0])
    stage.backward(3, g)  # a new round starts from zero, not from the last sum
    flat, count = stage.take_gradient()
    first = torch.autograd.grad(stage.module(xs[0]), stage.params, g)
    assert count == 1
    assert torch.allclose(flat, torch.cat([d.flatten() for d in first]), atol=1e-6)


def test_latest_weights_refuse_a_step_between_forward_and_backward():
    stage = make_stage(LatestWeights)
    stage.forward(0, torch.randn(2, 4))
    with pytest.raises(StashError, match="weight_policy='stash'"):
        stage.step(torch.zeros_like(stage.grad_sum))


def test_vertical_sync_serves_an_older_version():
    stage = make_stage(VerticalSync)
    v0 = [p.detach().clone() for p in stage.params]
    for _ in range(2):
        stage.step(torch.ones_like(stage.grad_sum))
    used, weights = stage.policy.forward_weights(7, version=0)
    assert used == 0 and all(torch.equal(a, b) for a, b in zip(weights, v0, strict=True))
    stage.policy.release(7)
    used, _ = stage.policy.forward_weights(8, version=2)
    assert used == 2 and sorted(stage.policy.versions) == [2]
    with pytest.raises(StashError, match="in order"):
        stage.policy.forward_weights(9, version=0)


def test_batchnorm_running_stats_are_not_stashed():
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    stage = make_stage(WeightStash, bn)
    x = torch.randn(8, 4) * 3 + 1
    stage.forward(0, x)
    after_one = bn[1].running_mean.clone()
    assert not torch.equal(after_one, torch.zeros(3))
    stage.forward(1, x)  # the same live buffers keep updating
    assert not torch.equal(bn[1].running_mean, after_one)
    before = bn[1].running_mean.clone()
    spec = stage.probe(TensorSpec(torch.float32, (8, 4)))  # probing leaves them alone
    assert spec.shape == (8, 3)
    assert torch.equal(bn[1].running_mean, before)


def test_polite_wait_returns_on_completion_and_names_a_bad_setting(monkeypatch):
    from mpi4py import MPI

    from pipesgd.pipeline.p2p import wait_politely

    wait_politely(MPI.REQUEST_NULL)  # a completed request returns at once
    monkeypatch.setenv("PIPESGD_POLL_US", "fast")
    with pytest.raises(ValueError, match="PIPESGD_POLL_US"):
        wait_politely(MPI.REQUEST_NULL)


def test_a_stashed_version_runs_exactly_as_functional_call_runs_it_ties_included():
    # Two layers sharing one weight (a tie) and a frozen one: the forward on a stashed
    # version swaps that version into every place its tensors are registered, as
    # torch.func.functional_call does, and leaves the live parameters in place after.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    module[2].weight = module[0].weight
    module[3].requires_grad_(False)
    stage = make_stage(WeightStash, module=module)
    live = list(stage.params)
    version = [p.detach().clone().add_(0.25).requires_grad_(True) for p in stage.params]
    x = torch.randn(5, 4)
    out = stage._call(version, x)
    want = torch.func.functional_call(module, dict(zip(stage.names, version, strict=True)), (x,))
    assert torch.equal(out, want)
    got = torch.autograd.grad(out.square().sum(), version)
    ref = torch.autograd.grad(want.square().sum(), version)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert [p is q for p, q in zip(stage.params, live, strict=True)] == [True] * len(live)
    assert module[2].weight is module[0].weight and module[0].weight is live[0]
    # an exception inside the forward puts the live parameters back too
    with pytest.raises(RuntimeError):
        stage._call(version, torch.randn(5, 3))
    assert module[0].weight is live[0] and module[2].weight is live[0]
