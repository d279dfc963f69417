"""`pipesgd train --config auto`: the decision without MPI, then end to end under mpirun."""

import argparse
import itertools
import json
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

from pipesgd.timing import (
    KernelCosts,
    NetworkParams,
    Profile,
    all_configs,
    choose,
    describe_cluster,
    predict,
)
from pipesgd.timing.model import TIE_TOLERANCE
from pipesgd.train import auto, cli
from pipesgd.train.loop import TrainConfig

PIPESGD = Path(sys.executable).parent / "pipesgd"
MIB = 1 << 20


def layered_profile(layers: int = 40, layer_bytes: float = 2.5e6, backward_s: float = 0.05,
                    threads: int = 1) -> Profile:
    """A model whose gradients become ready evenly through backward, as a deep net's do."""
    ready = [(layer_bytes, (i + 1) / layers) for i in range(layers)]
    return Profile(forward_s=backward_s / 2, backward_s=backward_s, update_s=0.004,
                   gradient_bytes=layers * layer_bytes, gradient_ready=ready, threads=threads,
                   batch_size=32, model="hand")


def shared_host() -> NetworkParams:
    """Two ranks on a two-core host: contention, load latency and a link burst."""
    kernels = {mode: KernelCosts(encode=0.2e-9, decode_add_encode=0.5e-9, decode=0.2e-9,
                                 decode_add_encode_decode=0.8e-9)
               for mode in ("trunc16", "quant8")}
    return NetworkParams(alpha_s=2e-6, beta_s_per_byte=0.1e-9, gamma_s_per_byte=0.1e-9,
                         sync_s=5e-6, kernels=kernels, copy_s_per_byte=0.05e-9,
                         beta_cpu_s_per_byte=0.08e-9, burst_bytes=1e5, load_latency_s=15e-6,
                         cores=2, ranks_per_host=None, measured_p=2)


SCENARIOS = {
    "10Gbit, p=4": (layered_profile(), describe_cluster("10Gbit", "20us"), 4),
    "1Gbit, p=8": (layered_profile(layer_bytes=0.5e6), describe_cluster("1Gbit", "50us"), 8),
    "100Gbit, p=16, small model": (layered_profile(layers=6, layer_bytes=1e5, backward_s=2e-3),
                                   describe_cluster("100Gbit", "5us"), 16),
    "shared cores, p=2": (layered_profile(layers=10, layer_bytes=2.6e5, backward_s=1e-3),
                          shared_host(), 2),
    # a ring step waits 2 ms for a core while compute runs (a host far busier than
    # the others): Pipe-SGD's overlapped communication pays it at every step while
    # compute runs, D-Sync overlapped with backward once, so the bucket size decides
    "busy cores, p=8": (layered_profile(layers=20, layer_bytes=6.4e5, backward_s=2e-3),
                        NetworkParams(alpha_s=2e-6, beta_s_per_byte=0.08e-9,
                                      gamma_s_per_byte=0.1e-9, sync_s=80e-6,
                                      kernels=shared_host().kernels, copy_s_per_byte=0.05e-9,
                                      load_latency_s=2e-3, cores=2, ranks_per_host=1), 8),
}


def brute_force(prof: Profile, net: NetworkParams, p: int) -> dict[tuple, float]:
    """(K, compression, overlap, bucket MiB) -> predicted seconds, for every combination."""
    return {
        (c.staleness, c.compression, c.overlap, mb): predict(
            prof, net, p, c.staleness, c.compression, c.overlap, bucket_bytes=int(mb * MIB)
        ).predicted_s
        for c in all_configs() for mb in auto.BUCKET_MB
    }


def key(candidate: auto.Candidate) -> tuple:
    c = candidate.config
    return c.staleness, c.compression, c.overlap, candidate.bucket_mb


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_choice_is_the_brute_force_minimum(scenario: str) -> None:
    prof, net, p = SCENARIOS[scenario]
    ranking = auto.rank_configurations(prof, net, p)
    times = brute_force(prof, net, p)
    fastest = min(times.values())
    winner = key(ranking[0])
    # within the model's resolution of the fastest (a tie goes to the simpler one), twice:
    # a tied larger bucket, then a tied simpler configuration
    within = 1 + TIE_TOLERANCE
    assert times[winner] == ranking[0].prediction.predicted_s
    assert times[winner] <= fastest * within ** 2
    # where one configuration alone is fastest beyond that, it is the one chosen
    fastest_configs = {k[:3] for k, t in times.items() if t <= fastest * within ** 2}
    if len(fastest_configs) == 1:
        assert winner[:3] in fastest_configs
    # every configuration once, each at its fastest bucket size or at a larger one (fewer
    # operations) within the resolution of it, faster than any larger one
    assert sorted(key(c)[:3] for c in ranking) == sorted(
        (c.staleness, c.compression, c.overlap) for c in all_configs())
    for cand in ranking:
        own = {k[3]: t for k, t in times.items() if k[:3] == key(cand)[:3]}
        assert times[key(cand)] == cand.prediction.predicted_s <= min(own.values()) * within
        assert all(t > cand.prediction.predicted_s
                   for mb, t in own.items() if mb > key(cand)[3]), key(cand)
    # the ties first, in choose's order, then the rest fastest first
    preds = [c.prediction.predicted_s for c in ranking]
    tied = [t <= min(preds) * (1 + TIE_TOLERANCE) for t in preds]
    assert tied == sorted(tied, reverse=True)
    rest = [t for t, tie in zip(preds, tied, strict=True) if not tie]
    assert all(a <= b * (1 + 1e-6) for a, b in itertools.pairwise(rest))


def test_bucket_search_can_decide_the_winner() -> None:
    # Smaller buckets let an overlapped configuration start its allreduce earlier in
    # backward; where that wins, the search finds a winner one bucket size cannot.
    prof, net, p = SCENARIOS["busy cores, p=8"]
    best = auto.rank_configurations(prof, net, p)[0]
    one_size = choose(prof, net, p)[0]  # every configuration at 25 MiB
    assert best.config.overlap == "backward" and best.bucket_mb != auto.SEQUENTIAL_BUCKET_MB
    assert best.config != one_size.config
    assert best.prediction.predicted_s < one_size.predicted_s
    # its bucket size is what makes it win: at 25 MiB it is 5 % slower and loses
    at_25 = predict(prof, net, p, best.config.staleness, best.config.compression,
                    best.config.overlap, bucket_bytes=25 * MIB)
    assert best.prediction.predicted_s < 0.95 * at_25.predicted_s
    assert at_25.predicted_s > one_size.predicted_s


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_bucket_size_ranks_as_choose_does(scenario: str) -> None:
    prof, net, p = SCENARIOS[scenario]
    ours = auto.rank_configurations(prof, net, p, bucket_mb=[auto.SEQUENTIAL_BUCKET_MB])
    theirs = choose(prof, net, p)
    assert [c.config for c in ours] == [pr.config for pr in theirs]


def test_choice_applies_to_the_run_and_serializes() -> None:
    prof, net, p = SCENARIOS["shared cores, p=2"]
    choice = auto.AutoChoice(auto.rank_configurations(prof, net, p), net, prof, 1.0, 0.5)
    best = choice.best
    config = choice.apply(TrainConfig(model="cnn", steps=7))
    assert (config.staleness, config.compression, config.overlap, config.bucket_mb) == (
        best.config.staleness, best.config.compression, best.config.overlap, best.bucket_mb)
    assert (config.model, config.steps) == ("cnn", 7)
    assert best.prediction.reason in choice.describe()
    data = json.loads(json.dumps(choice.to_dict(measured_s=0.01)))
    assert data["choice"] == data["configs"][0] and len(data["configs"]) == 12
    assert NetworkParams.from_dict(data["network"]) == net
    assert Profile.from_dict(data["profile"]) == prof
    assert data["measured_s"] == 0.01
    assert "bucket MiB" in auto.format_choice(choice)


# ------------------------------------------------------------------------------------
# Options


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_unchanged_when_options_are_not_given() -> None:
    default = TrainConfig()
    config = cli.config_from_args(parse())
    assert (config.staleness, config.compression, config.overlap, config.bucket_mb) == (
        default.staleness, default.compression, default.overlap, default.bucket_mb)
    given = cli.config_from_args(parse("--staleness", "1", "--bucket-mb", "4"))
    assert (given.staleness, given.bucket_mb) == (1, 4.0)


@pytest.mark.parametrize("argv, fix", [
    (("--staleness", "2"), "drop --staleness"),
    (("--compression", "none", "--bucket-mb", "25"), "drop --compression and --bucket-mb"),
    (("--overlap", "sequential"), "drop --overlap"),
    (("--compare",), "one or the other"),
    (("--resume", "--checkpoint", "ckpt"), "resume with the staleness"),
])
def test_auto_rejects_what_it_would_override(argv: tuple[str, ...], fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        cli.check_auto_options(parse("--config", "auto", *argv))
    cli.check_auto_options(parse(*argv))  # fine without --config auto


def test_config_takes_only_auto() -> None:
    assert parse("--config", "auto").config == "auto"
    with pytest.raises(SystemExit) as exc:
        parse("--config", "fast")
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------
# Under mpirun


def train(*args: str, expect_success: bool = True, timeout: float = 60):
    return run_mpi(2, PIPESGD, "train", "--quiet", *args, python=False, timeout=timeout,
                   expect_success=expect_success)


def test_auto_run_trains_the_predicted_winner(tmp_path: Path) -> None:
    summary = tmp_path / "out.json"
    out = train("--config", "auto", "--steps", "20", "--data", "synthetic",
                "--json", str(summary)).stdout
    assert "auto: training" in out and "pred ms" in out, out
    run = json.loads(summary.read_text())
    pred = run["prediction"]
    assert pred["p"] == 2 and len(pred["configs"]) == 12
    assert pred["choice"] == pred["configs"][0]
    assert pred["measured_s"] == run["iteration_time_s"] > 0
    # The JSON's network and profile give the same winner again.
    net, prof = NetworkParams.from_dict(pred["network"]), Profile.from_dict(pred["profile"])
    again = auto.rank_configurations(prof, net, 2)
    assert again[0].to_dict() == pred["choice"]
    assert prof.batch_size == 32 and prof.model == "mlp"
    # The run trained the winner.
    cfg, choice = run["config"], pred["choice"]
    assert (cfg["staleness"], cfg["compression"], cfg["overlap"], cfg["bucket_mb"]) == (
        choice["staleness"], choice["compression"], choice["overlap"], choice["bucket_mb"])
    # Both replicas end bitwise identical.
    digests = run["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests


@pytest.mark.parametrize("argv, message", [
    (("--config", "auto", "--staleness", "2"), "--config auto chooses --staleness itself"),
    (("--config", "fast"), "invalid choice: 'fast'"),
    (("--config", "auto", "--data", "/no/such/data"), "expected 'digits', 'synthetic'"),
])
def test_bad_input_exits_2(argv: tuple[str, ...], message: str) -> None:
    proc = train(*argv, "--steps", "2", expect_success=False)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stdout, proc.stdout


def test_auto_profiles_on_every_rank_at_once() -> None:
    out = run_mpi(3, "auto_profiles_every_rank.py", timeout=60).stdout
    assert "auto profiles on every rank: ok on 3 ranks" in out, out
