"""`pipesgd train` pieces that need one process: options, presets, data, sharding, models."""

import argparse

import pytest
import torch

from pipesgd.device import run_device
from pipesgd.train import cli, data, loop


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_options_reach_the_config() -> None:
    args = parse("--model", "cnn", "--steps", "7", "--staleness", "3", "--compression",
                 "quant8", "--warmup-steps", "4", "--overlap", "backward", "--optimizer", "adam",
                 "--ramp-steps", "9")
    config = cli.config_from_args(args)
    assert (config.model, config.steps, config.staleness, config.compression) == (
        "cnn", 7, 3, "quant8")
    assert (config.warmup_steps, config.overlap, config.optimizer) == (4, "backward", "adam")
    assert config.ramp_steps == 9
    assert not config.channels_last and cli.config_from_args(
        parse("--model", "cnn", "--channels-last")).channels_last


def test_epochs_and_steps_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        parse("--epochs", "2", "--steps", "3")


def test_compare_presets() -> None:
    assert parse("--compare").compare == "dsync,pipesgd+q"
    assert cli.parse_presets("DSync, pipesgd+t") == ["dsync", "pipesgd+t"]
    with pytest.raises(ValueError, match="choose from"):
        cli.parse_presets("dsync,fast")


def test_digits_shapes_for_each_model() -> None:
    mlp, cnn = data.load("digits", "mlp"), data.load("digits", "cnn")
    assert mlp.input_shape == (64,) and cnn.input_shape == (1, 32, 32)
    assert len(mlp.train_x) + len(mlp.test_x) == 1797
    assert torch.equal(mlp.test_y, cnn.test_y)


def test_digits_are_scikit_learns_read_without_importing_its_datasets() -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from pipesgd.pipeline import data as pipeline_data

    reference = load_digits()
    table = pipeline_data._digits_table()
    assert (table[:, :-1] == reference.data).all() and (table[:, -1] == reference.target).all()
    # in a fresh process the file is read without the 0.9 s import of sklearn.datasets
    probe = ("import sys; from pipesgd.pipeline import data; data.digits(); "
             "print(any(m.startswith('sklearn') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_unknown_data_source(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="digits"):
        data.load("no-such-thing", "mlp")
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        data.load(str(tmp_path), "mlp")


def test_mnist_idx_folder(tmp_path) -> None:
    def write(name: str, array) -> None:
        header = bytes([0, 0, 8, array.ndim]) + b"".join(
            int(d).to_bytes(4, "big") for d in array.shape)
        (tmp_path / name).write_bytes(header + array.astype("uint8").tobytes())

    images = torch.randint(0, 256, (6, 28, 28)).numpy()
    labels = torch.arange(6).numpy()
    for prefix in ("train", "t10k"):
        write(f"{prefix}-images-idx3-ubyte", images)
        write(f"{prefix}-labels-idx1-ubyte", labels)
    mnist = data.load(str(tmp_path), "cnn")
    assert mnist.input_shape == (1, 32, 32) and mnist.train_y.tolist() == list(range(6))
    assert data.load(str(tmp_path), "mlp").input_shape == (784,)


def test_shards_are_disjoint_and_cover_each_global_batch() -> None:
    shards = [data.ShardedBatches(100, 8, r, 3, seed=5) for r in range(3)]
    assert len(shards[0]) == 4
    for epoch in range(2):
        for step in range(4):
            parts = [set(s.indices(epoch, step).tolist()) for s in shards]
            assert sum(map(len, parts)) == len(set().union(*parts)) == 24
    assert not torch.equal(shards[0].indices(0, 0), shards[0].indices(1, 0))
    with pytest.raises(ValueError, match="lower --batch-size"):
        data.ShardedBatches(10, 8, 0, 2)


def test_models_fit_the_data() -> None:
    for name in ("mlp", "cnn"):
        dataset = data.load("digits", name)
        model = loop.build_model(name, dataset, seed=0)
        assert model(dataset.test_x[:2]).shape == (2, 10)
    sizes = [p.numel() for p in loop.build_model("mlp", data.load("digits", "mlp"), 0)
             .parameters()]
    assert sizes == [64 * 500, 500, 500 * 500, 500, 500 * 10, 10]


def test_cosine_schedule_decays_from_base_to_zero() -> None:
    import itertools
    import math

    total = 40
    factors = [loop.lr_factor("cosine", i, total) for i in range(total + 1)]
    assert factors[0] == 1.0 and abs(factors[total]) < 1e-12
    assert abs(factors[total // 2] - 0.5) < 1e-12
    assert all(a > b for a, b in itertools.pairwise(factors))
    assert factors[10] == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert loop.lr_factor("constant", 17, total) == 1.0
    assert cli.config_from_args(parse("--lr-schedule", "cosine")).lr_schedule == "cosine"


def test_lr_warmup_ramps_linearly_then_runs_the_schedule_over_the_rest() -> None:
    import math

    total, warmup = 40, 8
    ramp = [loop.lr_factor("cosine", i, total, warmup) for i in range(warmup)]
    assert ramp == pytest.approx([(i + 1) / warmup for i in range(warmup)])
    # after the ramp, cosine runs from 1 to 0 over the 32 iterations left
    assert loop.lr_factor("cosine", warmup, total, warmup) == 1.0
    assert loop.lr_factor("cosine", warmup + 16, total, warmup) == pytest.approx(0.5)
    assert loop.lr_factor("cosine", warmup + 8, total, warmup) == pytest.approx(
        (1 + math.cos(math.pi / 4)) / 2)
    assert abs(loop.lr_factor("cosine", total, total, warmup)) < 1e-12
    assert loop.lr_factor("constant", 3, total, warmup) == 0.5
    assert loop.lr_factor("constant", warmup, total, warmup) == 1.0
    config = cli.config_from_args(parse("--lr-warmup-steps", "12"))
    assert config.lr_warmup_steps == 12
    with pytest.raises(ValueError, match="lr warm-up must be >= 0 iterations, got -1"):
        loop.lr_factor("constant", 0, total, -1)


def test_unknown_schedule_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        loop.lr_factor("step", 0, 10)
    with pytest.raises(SystemExit):
        parse("--lr-schedule", "step")


def test_nesterov_reaches_sgd_and_is_refused_elsewhere() -> None:
    model = torch.nn.Linear(3, 2)
    config = cli.config_from_args(parse("--momentum", "0.9", "--nesterov"))
    sgd = loop.build_optimizer(config, model)
    assert sgd.param_groups[0]["nesterov"] is True and sgd.param_groups[0]["momentum"] == 0.9
    plain = loop.build_optimizer(cli.config_from_args(parse("--momentum", "0.9")), model)
    assert plain.param_groups[0]["nesterov"] is False
    with pytest.raises(ValueError, match="nesterov applies to SGD only, not to 'adam'"):
        loop.build_optimizer(cli.config_from_args(parse("--optimizer", "adam", "--nesterov")),
                             model)


def test_device_defaults_to_cuda_where_it_is_and_is_checked() -> None:
    from mpi4py import MPI

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert cli.config_from_args(parse()).device == expected
    assert cli.config_from_args(parse("--device", "cpu")).device == "cpu"
    assert run_device("cpu", MPI.COMM_SELF) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        run_device("tpu", MPI.COMM_SELF)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            run_device("cuda", MPI.COMM_SELF)
    with pytest.raises(SystemExit):
        parse("--device", "tpu")
