"""Picking a configuration for a run: `pipesgd train --config auto`.

Before training, the job measures its own network (`measure_network` on its ranks),
profiles the model it is about to train on every rank at once (ranks sharing a host slow
each other's passes as they will in training; rank 0's profile is kept), predicts every
configuration with the timing model (K x compression x overlap; overlap during backward
at each of `BUCKET_MB`) and trains the one predicted fastest. Rank 0 decides and
broadcasts the decision, so every rank trains the same configuration and the replicas
stay bitwise identical.

    choice = choose_for_run(config, comm)       # collective
    config = choice.apply(config)               # staleness, compression, overlap, bucket
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI

from pipesgd.device import run_device
from pipesgd.polling import decided_on_root
from pipesgd.timing.measure import measure_network
from pipesgd.timing.model import (
    DEFAULT_BUCKET_BYTES,
    TIE_TOLERANCE,
    Config,
    Prediction,
    all_configs,
    predict,
    ranking_key,
)
from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile, profile
from pipesgd.timing.report import format_ranking
from pipesgd.train.loop import TrainConfig, build_optimizer, prepare

# Bucket sizes tried for overlap during backward (MiB): small buckets start communicating
# early in backward, and each pays the ring's latency and a synchronisation.
BUCKET_MB: tuple[float, ...] = (1.0, 4.0, 25.0)
# Sequential communication submits every bucket after backward, one allreduce each, back
# to back: the fewest buckets cost least.
SEQUENTIAL_BUCKET_MB = DEFAULT_BUCKET_BYTES / (1 << 20)
# measure_network's repetitions, as bench/timing_suite.py measures: 1.3-1.5 s on 2 ranks
# sharing a 2-core VM over shared memory; it grows with slower links and busy cores.
NETWORK_REPEATS = 10


@dataclass(frozen=True)
class Candidate:
    """One configuration, predicted at the bucket size it would train with."""

    prediction: Prediction
    bucket_mb: float

    @property
    def config(self) -> Config:
        return self.prediction.config

    def to_dict(self) -> dict[str, Any]:
        return {**self.prediction.to_dict(), "bucket_mb": self.bucket_mb}


@dataclass(frozen=True)
class AutoChoice:
    """What `--config auto` decided and what it decided from.

    Attributes:
        ranking: every configuration, fastest predicted first; `ranking[0]` is trained.
        network: the job's network, as measured on its ranks.
        profile: the run's model, profiled on rank 0 while every rank profiled it.
        measure_s, profile_s: seconds spent measuring the network and profiling.
    """

    ranking: list[Candidate]
    network: NetworkParams
    profile: Profile
    measure_s: float
    profile_s: float

    @property
    def best(self) -> Candidate:
        return self.ranking[0]

    def apply(self, config: TrainConfig) -> TrainConfig:
        """`config` with the chosen staleness, compression, overlap and bucket size."""
        best = self.best
        return dataclasses.replace(
            config, staleness=best.config.staleness, compression=best.config.compression,
            overlap=best.config.overlap, bucket_mb=best.bucket_mb,
            name=f"auto {best.config.label}",
        )

    def describe(self) -> str:
        """One line: what is trained and why."""
        best, c = self.best, self.best.config
        return (f"auto: training {c.label} (K={c.staleness}, compression {c.compression}, "
                f"overlap {c.overlap}, {best.bucket_mb:g} MiB buckets), predicted "
                f"{best.prediction.predicted_s * 1e3:.2f} ms per iteration; "
                f"{best.prediction.reason}")

    def to_dict(self, measured_s: float | None = None) -> dict[str, Any]:
        """The ranking, network and profile (as `pipesgd timing predict --json` writes
        them, each configuration with its `bucket_mb`), beside the measured iteration."""
        predicted = self.best.prediction.predicted_s
        out: dict[str, Any] = {
            "p": self.best.prediction.p,
            "bucket_mb_tried": list(BUCKET_MB),
            "choice": self.best.to_dict(),
            "configs": [c.to_dict() for c in self.ranking],
            "network": self.network.to_dict(),
            "profile": self.profile.to_dict(),
            "measure_network_s": self.measure_s,
            "profile_s": self.profile_s,
            "predicted_s": predicted,
        }
        if measured_s is not None:
            out["measured_s"] = measured_s
            out["rel_error"] = (predicted - measured_s) / measured_s if measured_s else None
        return out


# ------------------------------------------------------------------------------------
# The decision (one process, no MPI)


def rank_configurations(
    profile: Profile,
    network: NetworkParams,
    p: int,
    bucket_mb: Sequence[float] = BUCKET_MB,
) -> list[Candidate]:
    """Every configuration (`all_configs`), fastest predicted first.

    A configuration that overlaps with backward is predicted at each of `bucket_mb` and
    keeps the largest bucket predicted within `TIE_TOLERANCE` of its fastest (fewer
    allreduces; a tie as `pipesgd.timing.choose` reads one); a sequential one at
    `SEQUENTIAL_BUCKET_MB`. The ranking breaks ties as `choose` does.

    Raises:
        ValueError: no bucket size, or what `predict` rejects.
    """
    if not bucket_mb or any(not mb > 0 for mb in bucket_mb):
        raise ValueError(f"bucket sizes must be a non-empty list of MiB > 0, got {bucket_mb}")
    best = []
    for config in all_configs():
        sizes = bucket_mb if config.overlap == "backward" else [SEQUENTIAL_BUCKET_MB]
        tried = [Candidate(predict(profile, network, p, config.staleness, config.compression,
                                   config.overlap, bucket_bytes=int(mb * (1 << 20))), mb)
                 for mb in sizes]
        fastest = min(c.prediction.predicted_s for c in tried)
        best.append(max((c for c in tried
                         if c.prediction.predicted_s <= fastest * (1 + TIE_TOLERANCE)),
                        key=lambda c: c.bucket_mb))
    return _ranked(best)


def _ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first, in `choose`'s order among ties (`ranking_key`)."""
    fastest = min(c.prediction.predicted_s for c in candidates)
    return sorted(candidates, key=lambda c: ranking_key(c.prediction, fastest))


def profile_run(config: TrainConfig, device: torch.device | None = None) -> Profile:
    """Profile the model `config` trains as the run trains it: built for its data, in its
    memory layout, with its optimizer, on a batch of `batch_size` samples of its data, on
    the threads this process has, on `device` (default: the CPU).

    Raises:
        ValueError, FileNotFoundError: bad configuration or data source.
    """
    dataset, model = prepare(config)
    batch = (dataset.train_x[: config.batch_size], dataset.train_y[: config.batch_size])
    if device is not None:
        model = model.to(device)
        batch = (batch[0].to(device), batch[1].to(device))
    return profile(model, batch, build_optimizer(config, model), name=config.model)


def format_choice(choice: AutoChoice) -> str:
    """What was measured, the ranked table, and the line saying what is trained and why."""
    net, prof = choice.network, choice.profile
    head = (f"auto: network {net.source} in {choice.measure_s:.2f} s: alpha "
            f"{net.alpha_s * 1e6:.2f} us, {net.bandwidth_bytes_per_s / 1e9:.2f} GB/s per ring "
            f"step\nauto: profiled {prof.model} on every rank in {choice.profile_s:.2f} s "
            f"(rank 0's), batch "
            f"{prof.batch_size}/rank, {prof.threads} thread(s): l_for "
            f"{prof.forward_s * 1e3:.2f} ms, l_back {prof.backward_s * 1e3:.2f} ms, l_up "
            f"{prof.update_s * 1e3:.2f} ms, n {prof.gradient_bytes / 1e6:.2f} MB")
    table = format_ranking([c.prediction for c in choice.ranking]).splitlines()
    if table[-1].startswith("choice:"):
        table.pop()  # the last line below says it, with the bucket size
    tried = ", ".join(f"{mb:g}" for mb in BUCKET_MB)
    buckets = ", ".join(f"{c.config.label} {c.bucket_mb:g}" for c in choice.ranking
                        if c.config.overlap == "backward")
    noisy = [f"auto: {warning}"] if (warning := net.noisy()) else []
    return "\n".join([head, *noisy, *table, f"bucket MiB (best of {tried}): {buckets}",
                      choice.describe()])


def format_outcome(choice: AutoChoice, measured_s: float) -> str:
    """Predicted against measured iteration time of the configuration trained."""
    predicted = choice.best.prediction.predicted_s
    error = ""
    if measured_s > 0:
        gap = (predicted - measured_s) / measured_s
        error = f" (prediction {abs(gap):.1%} {'low' if gap < 0 else 'high'})"
    return (f"auto: {choice.best.config.label} predicted {predicted * 1e3:.2f} ms per "
            f"iteration, measured {measured_s * 1e3:.2f} ms{error}")


# ------------------------------------------------------------------------------------
# Collective


def choose_for_run(config: TrainConfig, comm: MPI.Comm) -> AutoChoice:
    """Measure the network on `comm`'s ranks, profile the run's model on every rank at
    once and rank every configuration from rank 0's profile; every rank returns rank 0's
    decision. Collective over `comm`.

    Raises:
        ValueError, FileNotFoundError: on every rank, when rank 0 cannot build the run's
            model or data (the message says why).
    """
    start = time.perf_counter()
    device = run_device(config.device, comm)  # on a GPU: staging's copy rate measured too
    network = measure_network(comm, repeats=NETWORK_REPEATS, device=device)
    measured = time.perf_counter()

    # Every rank profiles at once, as they will train: ranks that share a host's cores and
    # memory slow each other's passes (docs/timing_model.md, "The profile beside the other
    # ranks").
    failure: Exception | None = None
    try:
        prof = profile_run(config, device)
    except (ValueError, FileNotFoundError) as exc:  # rank 0's is raised on every rank
        failure = exc
    profiled = time.perf_counter()

    def decide() -> AutoChoice:
        if failure is not None:
            raise failure
        return AutoChoice(rank_configurations(prof, network, comm.size), network, prof,
                          measure_s=measured - start, profile_s=profiled - measured)

    return decided_on_root(comm, decide, errors=(ValueError, FileNotFoundError))
