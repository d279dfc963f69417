"""The planners' per-layer profile: bytes by hand, saved activations, times, JSON."""

import dataclasses
import json

import pytest
import torch
from fakes import Asleep
from torch import nn

from pipesgd.planner import LayerProfile, ModelProfile, profile
from pipesgd.planner.profile import calibrate

F32 = 4


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_bytes_match_the_hand_count():
    model, x = small_model(), torch.randn(4, 6)
    prof = profile(model, x, warmup=1, repeats=3)
    assert prof.num_layers == 3 and prof.batch_size == 4
    assert prof.column("param_bytes") == [(6 * 5 + 5) * F32, 0, (5 * 3 + 3) * F32]
    assert prof.column("output_bytes") == [4 * 5 * F32, 4 * 5 * F32, 4 * 3 * F32]
    assert prof.column("optimizer_bytes") == [0, 0, 0]  # plain SGD keeps no state
    # A Linear keeps its input for the weight gradient; the parameters are not counted.
    saved = prof.column("saved_bytes")
    assert saved[0] >= 4 * 6 * F32 and saved[2] >= 4 * 5 * F32
    assert saved[1] >= 4 * 5 * F32  # ReLU keeps its output
    assert all(layer.forward_s > 0 for layer in prof.layers)
    # Layer 0's input is data (no gradient), but its weights need one.
    assert all(layer.backward_s > 0 for layer in prof.layers)
    assert [layer.name for layer in prof.layers] == ["0:Linear", "1:ReLU", "2:Linear"]


def test_optimizer_state_is_measured_without_touching_the_model():
    model, x = small_model(), torch.randn(4, 6)
    before = [p.detach().clone() for p in model.parameters()]
    momentum = profile(model, x, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                       warmup=0, repeats=1)
    assert momentum.column("optimizer_bytes") == momentum.column("param_bytes")
    adam = profile(model, x, lambda ps: torch.optim.Adam(ps), warmup=0, repeats=1)
    for layer in adam.layers:
        # exp_avg and exp_avg_sq, plus a scalar step counter per parameter tensor
        assert 2 * layer.param_bytes <= layer.optimizer_bytes <= 2 * layer.param_bytes + 64
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_steps_copies_and_the_loss_are_timed_where_they_exist():
    model, x = small_model(), torch.randn(4, 6)
    labels = torch.tensor([0, 1, 2, 0])
    before = [p.detach().clone() for p in model.parameters()]
    prof = profile(model, x, warmup=1, repeats=3,
                   loss_fn=lambda out: nn.functional.cross_entropy(out, labels))
    linear, relu = prof.layers[0], prof.layers[1]
    assert linear.update_s > 0 and linear.copy_s > 0
    assert relu.update_s == 0 and relu.copy_s == 0  # nothing to step or stash
    assert prof.loss_s > 0
    assert profile(model, x, warmup=0, repeats=1).loss_s == 0  # no loss given
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_calibration_scales_each_figure_to_the_measured_run():
    prof = dataclasses.replace(
        ModelProfile.from_columns([1.0, 3.0], [2.0, 2.0], [0, 0], [4, 4], batch_size=8),
        loss_s=0.5)
    prof = dataclasses.replace(prof, layers=tuple(
        dataclasses.replace(lp, update_s=0.25) for lp in prof.layers))
    # measured whole-model actions: F 9.5 (loss 0.5 and overhead 1 of it), B 3 (overhead
    # 1), U 2 (overhead 0.5)
    out = calibrate(prof, (9.5, 3.0, 2.0), (1.0, 1.0, 0.5))
    assert out.column("forward_s") == pytest.approx([2.0, 6.0])  # x2: 8 of 4
    assert out.column("backward_s") == pytest.approx([1.0, 1.0])  # x0.5: 2 of 4
    assert out.column("update_s") == pytest.approx([0.75, 0.75])  # x3: 1.5 of 0.5
    assert out.stage_overhead_s == pytest.approx(2.5)
    assert out.extra["calibration"] == pytest.approx(
        {"forward": 2.0, "backward": 0.5, "update": 3.0})
    # nothing to scale (no update time profiled) keeps the figure as it is
    bare = ModelProfile.from_columns([1.0], [1.0], [0], [0])
    assert calibrate(bare, (3.0, 1.0, 1.0), (0.0, 0.0, 0.0)).column("update_s") == [0.0]


def test_a_list_of_modules_works_like_a_sequential():
    layers = [nn.Linear(3, 2), nn.Tanh()]
    prof = profile(layers, torch.randn(2, 3), warmup=0, repeats=1)
    assert prof.column("output_bytes") == [2 * 2 * F32, 2 * 2 * F32]


def test_json_round_trip(tmp_path):
    prof = profile(small_model(), torch.randn(4, 6), warmup=0, repeats=2,
                   loss_fn=lambda out: out.square().mean())
    prof = dataclasses.replace(prof, stage_overhead_s=2e-4)
    prof.save(tmp_path / "profile.json")
    again = ModelProfile.load(tmp_path / "profile.json")
    assert again == prof
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_hand_made_profiles():
    prof = ModelProfile.from_columns([1, 2], [2, 4], [400, 40], [4e6, 4e3], batch_size=8)
    assert prof.column("compute_s") == [3.0, 6.0]
    assert prof.layers[1].saved_bytes == 0.0 and prof.batch_size == 8
    assert ModelProfile.from_dict(prof.to_dict()) == prof


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="at least one layer"):
        profile(nn.Sequential(), torch.randn(2, 3))
    with pytest.raises(ValueError, match="at least one layer"):
        profile([], torch.randn(2, 3))
    with pytest.raises(TypeError, match="one tensor"):
        profile([nn.LSTM(3, 2)], torch.randn(2, 4, 3), warmup=0, repeats=1)
    with pytest.raises(TypeError, match=r"not an nn\.Module"):
        profile([torch.relu], torch.randn(2, 3))
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile(small_model(), torch.randn(4, 6), repeats=0)
    with pytest.raises(ValueError, match="at least one layer"):
        ModelProfile(())
    with pytest.raises(ValueError, match="backward_s has 1 entries but forward_s has 2"):
        ModelProfile.from_columns([1, 2], [1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="forward_s must be a finite number >= 0"):
        LayerProfile(-1.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="'layers'"):
        ModelProfile.from_dict({"stages": []})
    with pytest.raises(ValueError, match="bad layer"):
        ModelProfile.from_dict({"layers": [{"forward_s": 1.0}]})
    prof = ModelProfile.from_columns([1, 2], [1, 1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="2 layers but the model has 3"):
        prof.check(3)
    prof.check(2)


def test_a_layer_model_profile_carries_the_runtime_s_costs():
    from pipesgd.pipeline import models
    from pipesgd.planner import profile_layer_model
    from pipesgd.polling import Polling, notice_delay_s

    prof = profile_layer_model(models.mlp((8, 16, 4)), "mlp", 4)
    assert prof.num_layers == 3 and prof.batch_size == 4
    assert prof.loss_s > 0 and prof.stage_overhead_s > 0 and prof.receive_delay_s > 0
    assert set(prof.extra["calibration"]) == {"forward", "backward", "update"}
    assert all(f > 0 for f in prof.extra["calibration"].values())
    assert 0 <= prof.cold_s_per_byte < 1e-6  # a second per MB would be no cache effect
    # a sleep of 2 ms between tests: noticed 1 ms late on average, never sooner
    assert 1e-3 <= notice_delay_s(Polling(spin_s=0.0, poll_s=2e-3), samples=5) < 5e-3


def test_a_model_that_cannot_run_in_one_process_keeps_its_layer_times(monkeypatch):
    from pipesgd.pipeline import models, runtime
    from pipesgd.planner import profile_layer_model

    real = runtime.action_times

    def too_big(model, micro_batch, *args, **kwargs):
        if micro_batch == 1:  # the runtime's overhead, on its one-weight model
            return real(model, micro_batch, *args, **kwargs)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(runtime, "action_times", too_big)
    prof = profile_layer_model(models.mlp((8, 16, 4)), "mlp", 4)
    assert "calibration" not in prof.extra
    assert "did not run: CUDA out of memory. Tried to allocate 2.00 GiB)" in prof.source
    assert prof.stage_overhead_s > 0 and prof.loss_s > 0


def test_action_times_count_cpu_time_not_time_asleep():
    # A layer that sleeps 5 ms per forward costs no CPU: on the CPU the calibration run
    # counts what a pass costs, not how long it waited (for a core it shares, or here
    # for nothing).
    from pipesgd.device import torch_threads
    from pipesgd.pipeline import runtime
    from pipesgd.pipeline.models import from_modules

    model = from_modules([nn.Linear(4, 4), Asleep()], input_shape=(4,), num_classes=4)
    with torch_threads(1):  # as the profiler runs it
        times = runtime.action_times(model, 2, micro_batches=8)
    assert 0 < times.forward_s < 2e-3 and times.backward_s > 0


def test_a_profile_takes_the_whole_models_run_it_is_given(monkeypatch):
    from pipesgd.pipeline import models, runtime
    from pipesgd.planner import profile_layer_model

    spec = models.mlp((8, 16, 4))
    alone = profile_layer_model(spec, "mlp", 4)
    given = runtime.ActionTimes(*(3 * x for x in (
        alone.extra["calibration"]["forward"], 1.0, 1.0)))  # any positive figures
    real = runtime.action_times
    monkeypatch.setattr(runtime, "action_times", lambda model, micro_batch, *a, **k: (
        real(model, micro_batch, *a, **k) if micro_batch == 1 else pytest.fail("ran")))
    beside = profile_layer_model(spec, "mlp", 4, whole=given)
    assert "run beside the job's other ranks" in beside.source
    # its layers now sum to the given run, less the runtime's own share
    backward = sum(lp.backward_s for lp in beside.layers)
    assert backward == pytest.approx(given.backward_s - runtime.runtime_overhead().backward_s,
                                     rel=0.5)


def test_a_model_without_weights_has_nothing_to_bring_back_to_the_caches():
    from pipesgd.planner.profile import cold_cache_s_per_byte

    x = torch.randn(4, 8, requires_grad=True)
    assert cold_cache_s_per_byte(nn.Sequential(nn.ReLU()), x, lambda y: y.sum()) == 0.0
