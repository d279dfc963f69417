"""One data-parallel training job: build, (resume,) train, evaluate, checkpoint, measure.

Each iteration is timed in three parts: compute (forward + backward), update (packing
and submitting gradients, applying the due one), and comm wait (blocked on the engine
for the gradient being applied). Gradient synchronization is pluggable (`Synchronizer`)
so benchmarks can run DDP or a parameter server through the same loop.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from pipesgd.broadcast import broadcast_parameters
from pipesgd.device import run_device
from pipesgd.durable import replace_file
from pipesgd.model_names import layer_model
from pipesgd.optim import DistributedOptimizer, StepTiming
from pipesgd.train.data import Dataset, ShardedBatches, load

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainConfig:
    """Everything that defines a run (what `--json` records as its configuration)."""

    model: str = "mlp"
    data: str = "digits"
    epochs: int = 5
    steps: int | None = None
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.5
    nesterov: bool = False
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    # linear ramp of the learning rate over the first iterations (Goyal et al.)
    lr_warmup_steps: int = 0
    staleness: int = 2
    compression: str = "none"
    warmup_steps: int = 0
    # linear ramp of the learning rate over the first stale updates after the warm-up
    ramp_steps: int = 0
    overlap: str = "sequential"
    bucket_mb: float = 25.0
    # NHWC activations and convolution weights: oneDNN's faster layout on CPU
    channels_last: bool = False
    # "cpu", or "cuda": each rank on the GPU of its node-local rank (pipesgd.device)
    device: str = "cpu"
    seed: int = 0
    checkpoint: str | None = None
    resume: bool = False
    name: str = ""


class Synchronizer(Protocol):
    """What the loop needs from gradient synchronization (DistributedOptimizer has it)."""

    timing: StepTiming

    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> Any: ...
    def synchronize(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# (model, inner optimizer, config) -> (module to call, synchronizer)
SynchronizerFactory = Callable[
    [nn.Module, torch.optim.Optimizer, TrainConfig], tuple[nn.Module, Synchronizer]
]


def pipesgd_synchronizer(
    model: nn.Module, inner: torch.optim.Optimizer, config: TrainConfig
) -> tuple[nn.Module, Synchronizer]:
    return model, DistributedOptimizer(
        inner, model.named_parameters(), staleness=config.staleness,
        compression=config.compression, bucket_mb=config.bucket_mb,
        warmup_steps=config.warmup_steps, overlap=config.overlap, ramp_steps=config.ramp_steps,
    )


@dataclass
class EpochRecord:
    epoch: int
    iterations: int
    train_loss: float
    test_loss: float
    accuracy: float
    wall_s: float  # training time since the start, evaluation excluded


@dataclass
class RunResult:
    """A finished run: configuration, timings and accuracy history."""

    config: TrainConfig
    ranks: int
    iterations: int
    wall_time_s: float
    iteration_time_s: float
    compute_s: float
    update_s: float
    comm_wait_s: float
    # Median of compute + update taken per iteration: the iteration less its wait. Not
    # compute_s + update_s: where the comm thread's CPU lands moves time between the two
    # from one iteration to the next, and a sum of medians misses that.
    compute_update_s: float
    final_accuracy: float
    final_test_loss: float
    history: list[EpochRecord] = field(default_factory=list)
    # `parameter_digest` of each rank's final model, in rank order
    parameter_digests: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        return out


def build_model(name: str, dataset: Dataset, seed: int) -> nn.Module:
    """The model `name` names (`pipesgd.model_names`: "mlp", "cnn" or MODULE:FUNCTION)
    for `dataset`'s samples and classes. The MLP gets flat samples; every other model
    gets images (N, C, 32, 32), as the CNN does.

    Raises:
        ValueError: an unknown or broken model name (the message says which).
    """
    return layer_model(name, dataset.input_shape, dataset.num_classes, seed).build(seed=seed)


def build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                               nesterov=config.nesterov, weight_decay=config.weight_decay)
    if config.nesterov:
        raise ValueError(f"nesterov applies to SGD only, not to {config.optimizer!r}")
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr,
                                weight_decay=config.weight_decay)
    raise ValueError(f"unknown optimizer {config.optimizer!r}: expected 'sgd' or 'adam'")


LR_SCHEDULES = ("constant", "cosine")


def lr_factor(schedule: str, iteration: int, total: int, warmup: int = 0) -> float:
    """Multiplier of the base learning rate at `iteration` of `total` (0-based).

    The first `warmup` iterations ramp linearly up to the base rate; the schedule then
    runs over the iterations that remain. "cosine" decays to 0 by the end; a small final
    learning rate also shrinks what a stale gradient can do, so Pipe-SGD ends where
    synchronous training ends.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}: expected one of {LR_SCHEDULES}")
    if warmup < 0:
        raise ValueError(f"lr warm-up must be >= 0 iterations, got {warmup}")
    if iteration < warmup:
        return (iteration + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (iteration - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def evaluate(model: nn.Module, dataset: Dataset, comm: MPI.Comm,
             batch: int = 512) -> tuple[float, float]:
    """(mean loss, accuracy) on the held-out split; each rank scores a slice of it."""
    n = len(dataset.test_x)
    lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    loss_sum, correct = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(lo, hi, batch):
            x = dataset.test_x[start : min(start + batch, hi)]
            y = dataset.test_y[start : min(start + batch, hi)]
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum())
    model.train()
    totals = np.array([loss_sum, correct], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    return float(totals[0]) / n, float(totals[1]) / n


def _median_after_warmup(values: list[float], skip: int) -> float:
    kept = values[skip:] if len(values) > skip else values[len(values) // 2 :]
    return statistics.median(kept) if kept else float("nan")


def prepare(config: TrainConfig) -> tuple[Dataset, nn.Module]:
    """The data set and the model `config` trains, built in this process as a run builds
    them: seeded, sized for the data, in the configured memory layout.

    Raises:
        ValueError, FileNotFoundError: bad configuration or data source.
    """
    torch.manual_seed(config.seed)
    dataset = load(config.data, config.model, seed=config.seed)
    model = build_model(config.model, dataset, config.seed)
    if config.channels_last:
        if len(dataset.input_shape) != 3:
            raise ValueError(f"channels_last needs image inputs (channels, height, width); "
                             f"the {config.model} on {config.data} takes {dataset.input_shape}")
        model = model.to(memory_format=torch.channels_last)
        # once, not per batch: indexing keeps the layout
        dataset = replace(dataset, train_x=dataset.train_x.contiguous(
            memory_format=torch.channels_last))
    return dataset, model


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters, in order: equal on two ranks exactly when their
    replicas are bitwise identical (buffers such as BatchNorm statistics are per rank)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def run(
    config: TrainConfig,
    comm: MPI.Comm | None = None,
    synchronizer: SynchronizerFactory = pipesgd_synchronizer,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train as `config` says on every rank of `comm`; return the measured result.

    Collective over `comm`. Rank 0 prints (through `log`) and draws the progress bar.

    Raises:
        ValueError, FileNotFoundError: bad configuration or data source.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.rank, comm.size
    dataset, model = prepare(config)
    device = run_device(config.device, comm)
    on_gpu = device.type == "cuda"
    if on_gpu:  # the data set is small: all of it on the device, once
        model = model.to(device)
        dataset = replace(dataset, train_x=dataset.train_x.to(device),
                          train_y=dataset.train_y.to(device),
                          test_x=dataset.test_x.to(device), test_y=dataset.test_y.to(device))
    broadcast_parameters(model, root=0, comm=comm)
    inner = build_optimizer(config, model)
    module, sync = synchronizer(model, inner, config)
    batches = ShardedBatches(len(dataset.train_x), config.batch_size, rank, size, config.seed)
    per_epoch = len(batches)
    total = config.steps if config.steps is not None else config.epochs * per_epoch
    if total < 1:
        raise ValueError("nothing to train: give --epochs >= 1 or --steps >= 1")
    # reject an unknown schedule or a negative warm-up before training
    lr_factor(config.lr_schedule, 0, total, config.lr_warmup_steps)

    start_iteration, history, wall_offset = 0, [], 0.0
    ckpt = Path(config.checkpoint) / CHECKPOINT_FILE if config.checkpoint else None
    if config.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        sync.load_state_dict(state["optimizer"])
        start_iteration = state["iteration"]
        history = [EpochRecord(**h) for h in state["history"]]
        wall_offset = state["wall_s"]
        if rank == 0:
            log(f"resumed from {ckpt} at iteration {start_iteration}")

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start_iteration, unit="it", leave=False,
                   desc=config.name or "train", dynamic_ncols=True)

    compute, update, wait, iteration_times = [], [], [], []
    epoch_loss, epoch_count = 0.0, 0
    train_time = 0.0
    it = start_iteration
    while it < total:
        epoch, step = divmod(it, per_epoch)
        begin = time.perf_counter()
        idx = batches.indices(epoch, step)
        x, y = dataset.train_x[idx], dataset.train_y[idx]
        for group in inner.param_groups:
            group["lr"] = config.lr * lr_factor(config.lr_schedule, it, total,
                                                config.lr_warmup_steps)
        sync.zero_grad()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        computed = time.perf_counter()
        sync.step()
        if on_gpu:  # the iteration's time, not the time to queue it
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        timing = sync.timing
        compute.append(computed - begin)
        wait.append(timing.wait_s)
        update.append(end - computed - timing.wait_s)
        iteration_times.append(end - begin)
        train_time += end - begin
        epoch_loss += loss.item()
        epoch_count += 1
        it += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if step == per_epoch - 1 or it == total:
            train_loss = comm.allreduce(epoch_loss / max(epoch_count, 1)) / size
            test_loss, accuracy = evaluate(model, dataset, comm)
            record = EpochRecord(epoch + 1, it, train_loss, test_loss, accuracy,
                                 wall_offset + train_time)
            history.append(record)
            epoch_loss, epoch_count = 0.0, 0
            if rank == 0:
                line = (f"epoch {record.epoch}: train loss {train_loss:.4f}, test loss "
                        f"{test_loss:.4f}, accuracy {100 * accuracy:.2f}%, "
                        f"{record.wall_s:.2f} s")
                if bar is not None:
                    bar.write(line)
                else:
                    log(line)
            if ckpt is not None:
                _save_checkpoint(ckpt, model, sync, it, history, wall_offset + train_time, comm)
    if bar is not None:
        bar.close()
    sync.synchronize()

    skip = config.warmup_steps + config.staleness + 2
    last = history[-1]
    return RunResult(
        config=config,
        ranks=size,
        iterations=it - start_iteration,
        wall_time_s=wall_offset + train_time,
        iteration_time_s=_median_after_warmup(iteration_times, skip),
        compute_s=_median_after_warmup(compute, skip),
        update_s=_median_after_warmup(update, skip),
        comm_wait_s=_median_after_warmup(wait, skip),
        compute_update_s=_median_after_warmup([c + u for c, u in zip(compute, update,
                                                                     strict=True)], skip),
        final_accuracy=last.accuracy,
        final_test_loss=last.test_loss,
        history=history,
        parameter_digests=comm.allgather(parameter_digest(model)),
    )


def _save_checkpoint(path: Path, model: nn.Module, sync: Synchronizer, iteration: int,
                     history: list[EpochRecord], wall_s: float, comm: MPI.Comm) -> None:
    """Rank 0 writes (atomically) what every rank holds identically."""
    state = {
        "model": model.state_dict(),
        "optimizer": sync.state_dict(),  # collective: waits for in-flight gradients
        "iteration": iteration,
        "history": [asdict(h) for h in history],
        "wall_s": wall_s,
    }
    if comm.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, state)
    comm.Barrier()
