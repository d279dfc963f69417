"""The compute side of the timing model: `Profile` (l_for, l_back, l_up, n) and `profile`.

`profile(model, sample_batch, optimizer)` times forward, backward and the optimizer step
of one batch in this process (warm-up, then the median of repetitions), counts the
gradient bytes n, and records when each gradient becomes ready during backward (the
fraction of the backward pass elapsed), which is what overlapping communication with
backward can exploit (eq. 6). A `Profile` can also be written by hand or loaded from JSON
to predict for a model or accelerator you do not have (`Profile.scaled`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipesgd.json_files import dataclass_from_dict, load_json
from pipesgd.timing.spread import median_spread


@dataclass
class Profile:
    """Per-iteration compute figures of one rank.

    Attributes:
        forward_s: l_for, forward pass and loss (s).
        backward_s: l_back, backward pass (s).
        update_s: l_up, optimizer step (s).
        gradient_bytes: n, bytes of all gradients (float32).
        gradient_ready: (bytes, fraction of backward elapsed) per parameter, in the order
            backward produces them; empty = all at the end.
        threads: compute threads of one rank while profiled (torch intra-op threads).
        batch_size: samples per rank per iteration.
        model: a name for tables.
        spread: figure -> relative spread (IQR / median) of the repetitions.
        source: where the figures come from.
    """

    forward_s: float
    backward_s: float
    update_s: float
    gradient_bytes: float
    gradient_ready: list[tuple[float, float]] = field(default_factory=list)
    threads: int = 1
    batch_size: int = 0
    model: str = ""
    spread: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        self.gradient_ready = [(float(b), float(f)) for b, f in self.gradient_ready]
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first impossible figure."""
        for name in ("forward_s", "backward_s", "update_s", "gradient_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"profile.{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"profile.threads must be an integer >= 1, got {self.threads!r}")
        for nbytes, fraction in self.gradient_ready:
            if nbytes < 0 or not 0 <= fraction <= 1:
                raise ValueError(
                    f"profile.gradient_ready entries are (bytes >= 0, fraction in [0, 1]); "
                    f"got {(nbytes, fraction)}"
                )

    @property
    def compute_s(self) -> float:
        """l_comp = l_for + l_back."""
        return self.forward_s + self.backward_s

    def scaled(self, speedup: float, model: str | None = None) -> Profile:
        """The same model on a device `speedup` times faster (times divided, n kept).

        Example: `Profile.load("cnn.json").scaled(50)` for a GPU 50x faster than one core.
        """
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        return dataclasses.replace(
            self,
            forward_s=self.forward_s / speedup,
            backward_s=self.backward_s / speedup,
            update_s=self.update_s / speedup,
            model=model or self.model,
            source=f"{self.source} scaled by 1/{speedup:g}",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        return dataclass_from_dict(cls, data, "a model profile")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """The profile a JSON file holds (`save`, or the JSON of `pipesgd timing predict`,
        under "profile").

        Raises:
            ValueError: the file is missing or holds no profile; the message names it.
        """
        return load_json(path, "a model profile (`Profile.save`, or the JSON of `pipesgd "
                         "timing predict`)", lambda data: cls.from_dict(data.get("profile", data)))


def times_cpu_work(on_gpu: bool) -> bool:
    """Whether a profile times its passes in the thread's CPU time: on the CPU with one
    torch thread, what the work costs, not the time it waited for a core that ranks share
    (the timing model stretches compute for that itself); else wall time (a GPU computes
    apart from the thread, and idle intra-op threads spin). The pipeline's `action_times`
    follows this rule too."""
    import torch

    return not on_gpu and torch.get_num_threads() == 1


def profile(
    model: Any,
    sample_batch: tuple[Any, Any],
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    *,
    warmup: int = 3,
    repeats: int = 10,
    name: str = "",
) -> Profile:
    """Time forward, backward and the optimizer step of `model` on one batch, as a run
    pays them: the forward includes zeroing the gradients in place, and the backward
    adds into them (`bench/profile_fidelity.py` sets this beside the training loop).

    Args:
        model: a torch.nn.Module.
        sample_batch: (inputs, targets) of one rank's batch.
        optimizer: a torch optimizer over `model`'s parameters (a plain one: the
            communication is what the timing model adds).
        loss_fn: loss(outputs, targets); default cross-entropy.
        warmup: untimed iterations first (allocator, caches, lazy init).
        repeats: timed iterations; each figure is their median.

    On a GPU the device is synchronized around each timed region, so each figure is the
    device's time, not the time to queue its kernels; gradient-ready times stay when the
    backward queued each gradient. On the CPU with one torch thread each figure is the
    thread's CPU time (a pass that waited for a shared core costs no more); with more
    threads, wall time.

    Returns:
        Profile with `threads` = torch.get_num_threads() at the time.
    """
    import torch

    inputs, targets = sample_batch
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: nothing to communicate")
    n_bytes = sum(p.numel() * 4 for p in params)  # gradients travel as float32
    on_gpu = any(p.is_cuda for p in params)

    tick = time.thread_time if times_cpu_work(on_gpu) else time.perf_counter

    def now() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        return tick()

    ready: list[tuple[int, float]] = []
    clock = {"start": 0.0}
    hooks = []
    for p in params:
        def hook(param: Any, _bytes: int = p.numel() * 4) -> None:
            ready.append((_bytes, tick() - clock["start"]))
        hooks.append(p.register_post_accumulate_grad_hook(hook))

    fwd, bwd, upd, readies = [], [], [], []
    model.train()
    try:
        for i in range(warmup + repeats):
            ready.clear()
            t0 = now()
            # As a run does it: the gradients are zeroed in place and the backward adds
            # into them (`DistributedOptimizer` lends views of its buckets as `.grad`);
            # fresh ones cost less (BENCHMARKS.md, "Profile against the training loop").
            optimizer.zero_grad(set_to_none=False)
            loss = loss_fn(model(inputs), targets)
            t1 = now()
            clock["start"] = t1
            loss.backward()
            t2 = now()
            optimizer.step()
            t3 = now()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                upd.append(t3 - t2)
                readies.append([(b, min(1.0, at / (t2 - t1))) for b, at in ready])
    finally:
        for h in hooks:
            h.remove()
    forward_s, fwd_spread = median_spread(fwd)
    backward_s, bwd_spread = median_spread(bwd)
    update_s, upd_spread = median_spread(upd)
    # Ready fractions: per parameter (same order every iteration), median over repeats.
    gradient_ready = [
        (float(readies[0][j][0]), statistics.median(r[j][1] for r in readies))
        for j in range(len(readies[0]))
    ]
    return Profile(
        forward_s=forward_s,
        backward_s=backward_s,
        update_s=update_s,
        gradient_bytes=float(n_bytes),
        gradient_ready=gradient_ready,
        threads=torch.get_num_threads(),
        batch_size=int(inputs.shape[0]),
        model=name or type(model).__name__,
        spread={"forward": round(fwd_spread, 4), "backward": round(bwd_spread, 4),
                "update": round(upd_spread, 4)},
        source=f"profiled: median of {repeats} after {warmup} warm-up, "
               f"{torch.get_num_threads()} thread(s)",
    )


def profile_named(
    model: str,
    batch_size: int,
    *,
    lr: float = 0.01,
    threads: int | None = None,
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int = 10,
    last_layer_only: bool = False,
    name: str | None = None,
) -> Profile:
    """`profile` of a named model (`pipesgd.model_names`: "mlp", "cnn", a network of the
    paper such as "alexnet", or MODULE:FUNCTION) with SGD on a random batch, as
    `pipesgd train --data synthetic` runs it.

    Args:
        threads: torch intra-op threads while profiling (None: leave as set). Profile with
            the threads each rank will use (one, when ranks share the cores).
        input_shape, num_classes: the samples the model is sized for (as `pipesgd train`
            sizes it for its data); None: the built-in models' defaults (the 64-input MLP
            of the digits, the 3-channel CNN, the paper's networks as published).
        last_layer_only: train only the last layer (the others frozen), as the paper's
            CIFAR100-Convex benchmark does.
        name: the profile's model name (default: `model`).

    Raises:
        ValueError: an unknown model, a MODULE:FUNCTION without `input_shape`, or a batch
            size below 1.
    """
    import torch

    from pipesgd.device import torch_threads
    from pipesgd.model_names import layer_model
    from pipesgd.pipeline.models import MODELS

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if input_shape is None and model not in MODELS:
        raise ValueError(f"unknown model {model!r}: known are {sorted(MODELS)}, or give "
                         "MODULE:FUNCTION with an input shape")
    with torch_threads(threads):
        spec = (MODELS[model]() if input_shape is None
                else layer_model(model, input_shape, num_classes, seed))
        net = spec.build(seed=seed)
        if last_layer_only:
            for layer in list(net)[:-1]:
                layer.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, *spec.input_shape, generator=gen)
        y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
        opt = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=lr)
        return profile(net, (x, y), opt, warmup=warmup, repeats=repeats, name=name or model)
