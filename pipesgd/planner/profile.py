"""Per-layer profiles for the planners: `LayerProfile`, `ModelProfile` and `profile`.

A layer's figures are what PipeDream's partitioner reads (§3.1: compute time T_l, output
activation bytes a_l, weight bytes w_l) plus what a memory-aware planner needs (MadPipe):
the optimizer's state and the bytes autograd keeps from the forward for the backward.
`profile(layers, sample_input)` measures them in this process; a `ModelProfile` can as
well be written by hand (`ModelProfile.from_columns`) or loaded from JSON.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, astuple, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pipesgd.json_files import load_json

EXAMPLE_CALL = "profile(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(32, 4))"


def _check_figures(owner: Any, keys: tuple[str, ...], where: str = "") -> None:
    """Each of `keys` of `owner` a finite number >= 0, else a ValueError naming it."""
    for key in keys:
        value = getattr(owner, key)
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{where}{key} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class LayerProfile:
    """One layer on one micro-batch.

    Attributes:
        forward_s: forward time (s).
        backward_s: backward time (s): gradients of the layer's input and parameters.
        output_bytes: a_l, bytes of the layer's output (= of the gradient sent back).
        param_bytes: w_l, bytes of the layer's parameters (what its replicas all-reduce).
        optimizer_bytes: bytes of the optimizer's state for those parameters.
        saved_bytes: bytes autograd keeps from the forward until the backward, parameters
            excluded (they are in `param_bytes`): one micro-batch's stored activations.
        update_s: one optimizer step of its parameters (s).
        copy_s: one copy of its parameters (s): a version weight stashing keeps.
        name: for tables.
    """

    forward_s: float
    backward_s: float
    output_bytes: float
    param_bytes: float
    optimizer_bytes: float = 0.0
    saved_bytes: float = 0.0
    update_s: float = 0.0
    copy_s: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        _check_figures(self, ("forward_s", "backward_s", "output_bytes", "param_bytes",
                              "optimizer_bytes", "saved_bytes", "update_s", "copy_s"),
                       f"layer {self.name or '?'}: ")

    @property
    def compute_s(self) -> float:
        """T_l = forward + backward."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class ModelProfile:
    """The layers of a model in order, as a planner partitions them.

    Attributes:
        layers: one LayerProfile per layer (at least one).
        batch_size: samples of the micro-batch the figures are for (0: not known).
        source: where the figures come from.
        loss_s: the loss's forward and backward on the last layer's output (s), which
            the last stage runs after its forward.
        stage_overhead_s: the pipeline runtime's own time per micro-batch on a stage, its
            layers' work apart (dispatching the forward, backward and step; measured by
            `pipesgd.pipeline.runtime.runtime_overhead`).
        receive_delay_s: how long after a message is in a rank that slept waiting for it
            resumes (`pipesgd.polling.notice_delay_s`).
        cold_s_per_byte: what an action costs more, per byte of its stage's weights, when
            its worker slept before it (waiting for a message or an all-reduce) and the
            caches lost its data meanwhile (`cold_cache_s_per_byte`; 0 on a GPU).
        replica_s_per_byte: what a replica's update round costs beyond its stage's
            actions and its ring's bytes, in CPU seconds per byte of the stage's
            weights (fitted to a real round by `planner.fit_replica_overhead`; 0: none
            measured).
        step_excess_s: what a data-parallel iteration costs each worker beyond the
            timing model's account of it, in seconds of CPU work per iteration (fitted to
            a real run by `planner.fit_data_parallel_overhead`; 0: none measured).
        step_compute_factor: the factor of the layers' times in a data-parallel
            iteration, where a real run of it took less than the timing model predicted
            from them (fitted by `planner.fit_data_parallel_overhead`; 1: none).
        stage_excess_s: what a pipeline stage's micro-batch costs beyond its layers, the
            runtime's own time and its messages, in seconds of CPU work per micro-batch
            (fitted to a real run of a pipeline by `planner.fit_pipeline_overhead`; 0:
            none measured).
    """

    layers: tuple[LayerProfile, ...]
    batch_size: int = 0
    source: str = ""
    loss_s: float = 0.0
    stage_overhead_s: float = 0.0
    receive_delay_s: float = 0.0
    cold_s_per_byte: float = 0.0
    replica_s_per_byte: float = 0.0
    step_excess_s: float = 0.0
    step_compute_factor: float = 1.0
    stage_excess_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError(f"a profile needs at least one layer, e.g. {EXAMPLE_CALL}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not a LayerProfile")
        if not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise ValueError(f"batch_size must be an integer >= 0, got {self.batch_size!r}")
        _check_figures(self, _MODEL_FIGURES)
        if not self.step_compute_factor > 0:
            raise ValueError("step_compute_factor must be a number > 0, got "
                             f"{self.step_compute_factor!r}")

    @classmethod
    def from_columns(
        cls,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        output_bytes: Sequence[float],
        param_bytes: Sequence[float],
        optimizer_bytes: Sequence[float] | None = None,
        saved_bytes: Sequence[float] | None = None,
        *,
        batch_size: int = 0,
        source: str = "by hand",
    ) -> ModelProfile:
        """A profile written by hand, one list per figure (all of one length).

        Example: `ModelProfile.from_columns([1, 2], [2, 4], [400, 40], [4e6, 4e3])`.
        """
        n = len(forward_s)
        columns = {"backward_s": backward_s, "output_bytes": output_bytes,
                   "param_bytes": param_bytes,
                   "optimizer_bytes": [0.0] * n if optimizer_bytes is None else optimizer_bytes,
                   "saved_bytes": [0.0] * n if saved_bytes is None else saved_bytes}
        for key, column in columns.items():
            if len(column) != n:
                raise ValueError(f"{key} has {len(column)} entries but forward_s has {n}; "
                                 "give one entry per layer in every column")
        return cls(
            tuple(
                LayerProfile(float(forward_s[i]), *(float(c[i]) for c in columns.values()),
                             name=f"layer{i}")
                for i in range(n)
            ),
            batch_size=batch_size,
            source=source,
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check(self, num_layers: int | None) -> None:
        """Raise ValueError when the profile is not of a model with `num_layers` layers."""
        if num_layers is not None and num_layers != self.num_layers:
            raise ValueError(
                f"the profile has {self.num_layers} layers but the model has {num_layers}; "
                f"profile the model that will run, e.g. {EXAMPLE_CALL}"
            )

    def column(self, key: str) -> list[float]:
        """One figure of every layer, e.g. `column("compute_s")`."""
        return [float(getattr(layer, key)) for layer in self.layers]

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [asdict(layer) for layer in self.layers],
            "batch_size": self.batch_size,
            "source": self.source,
            **{key: getattr(self, key) for key in _MODEL_FIGURES},
            **self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ValueError(
                "a model profile is {'layers': [{'forward_s': ..., 'backward_s': ..., "
                "'output_bytes': ..., 'param_bytes': ...}, ...], 'batch_size': ...}"
            )
        known = {"layers", "batch_size", "source", *_MODEL_FIGURES}
        try:
            layers = tuple(LayerProfile(**layer) for layer in data["layers"])
        except TypeError as err:
            raise ValueError(f"bad layer in profile: {err}") from None
        return cls(
            layers,
            batch_size=int(data.get("batch_size", 0)),
            source=str(data.get("source", "")),
            **{key: float(data.get(key, _DEFAULTS[key])) for key in _MODEL_FIGURES},
            extra={k: v for k, v in data.items() if k not in known},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        """The profile a JSON file holds (`save`, `pipesgd plan --profile-only`).

        Raises:
            ValueError: the file is missing or holds no profile; the message names it.
        """
        return load_json(path, "a per-layer profile (`pipesgd plan --profile-only`)",
                         cls.from_dict)


def scaled_compute(profile: ModelProfile, factor: float) -> ModelProfile:
    """`profile` with every layer's forward, backward and update times times `factor`."""
    if factor == 1.0:
        return profile
    return replace(profile, layers=tuple(
        replace(lp, forward_s=lp.forward_s * factor, backward_s=lp.backward_s * factor,
                update_s=lp.update_s * factor) for lp in profile.layers))


# The model-wide figures (floats; 0, or the factor 1, where not measured), as named in
# the JSON too; a field's type reads "float" under postponed annotations, `float`
# without them.
_MODEL_FIGURES = tuple(f.name for f in fields(ModelProfile) if f.type in ("float", float))
_DEFAULTS = {f.name: f.default for f in fields(ModelProfile)}  # what older profiles lack


# --------------------------------------------------------------------- measuring
def profile(
    layers: Any,
    sample_input: Any,
    optimizer_factory: Callable[[list[Any]], Any] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    loss_fn: Callable[[Any], Any] | None = None,
) -> ModelProfile:
    """Measure every layer of `layers` on `sample_input` (one micro-batch).

    Each layer runs alone on the output of the layer before it (computed once, detached),
    so its figures do not depend on where the planner cuts:

    - forward_s: the median over `repeats` (after `warmup`) of the layer's forward with
      autograd recording, as in training.
    - backward_s: the median of `torch.autograd.grad(output, [input] + params, g)` with a
      random `g` of the output's shape: the layer's own backward, nothing upstream. The
      first layer's input is data and needs no gradient, as in a pipeline's first stage.
    - output_bytes, param_bytes: sizes of the output tensor and of the parameters.
    - optimizer_bytes: the state of `optimizer_factory(params)` after one step on a copy
      of the layer (zero gradients): SGD with momentum keeps 1x the parameters, Adam 2x.
      None: plain SGD, which keeps none.
    - saved_bytes: the storages `torch.autograd.graph.saved_tensors_hooks` sees packed
      during one forward, each storage once, the layer's parameters and buffers excluded.
      A tensor that two adjacent layers both save (a ReLU's output is the next Linear's
      input) counts in both, so the sum over a stage is an upper bound, exact at the
      stage's first layer (whose input the stage keeps as received).
    - update_s: the median of `optimizer_factory(params).step()` (plain SGD when None)
      on a copy of the layer; copy_s: of copying its parameters (a stashed version).
    - loss_s (of the model): the median of `loss_fn(output).backward()` on the last
      layer's output (0 without `loss_fn`).

    Forward passes run in the layers' current mode (call `model.train()` first for
    training figures), and they move BatchNorm running statistics as training would.
    On CUDA the device is synchronized around every timed region.

    Args:
        layers: an nn.Sequential or a list of modules, each taking the previous output.
        sample_input: a tensor of one micro-batch (its first dimension is the batch).
        optimizer_factory: params -> optimizer, e.g. `lambda p: torch.optim.Adam(p)`.
        warmup, repeats: untimed and timed runs of each measurement.
        loss_fn: output -> scalar loss, e.g. `lambda y: F.cross_entropy(y, labels)`.

    Raises:
        ValueError: no layers, repeats < 1, or warmup < 0.
        TypeError: a layer that is not a module or does not return one tensor.
    """
    import torch

    modules = list(layers.children() if isinstance(layers, torch.nn.Sequential) else layers)
    if not modules:
        raise ValueError(f"profile() needs at least one layer, e.g. {EXAMPLE_CALL}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"sample_input must be one tensor (a micro-batch), e.g. {EXAMPLE_CALL}")
    sync = (torch.cuda.synchronize if sample_input.device.type == "cuda"
            else (lambda: None))

    out: list[LayerProfile] = []
    x = sample_input.detach()
    for i, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"layer {i} is a {type(module).__name__}, not an nn.Module")
        name = f"{i}:{type(module).__name__}"
        x_in = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        params = [p for p in module.parameters() if p.requires_grad]
        y = module(x_in)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"layer {name} returns {type(y).__name__}; every layer must "
                            "return one tensor (wrap it in a module that does)")
        inputs = ([x_in] if x_in.requires_grad else []) + params

        def forward(module=module, x_in=x_in):
            return module(x_in)

        def backward(module=module, x_in=x_in, inputs=inputs):
            y = module(x_in)
            g = torch.randn_like(y)
            sync()
            t0 = time.perf_counter()
            torch.autograd.grad(y, inputs, g, allow_unused=True)
            sync()
            return time.perf_counter() - t0

        forward_s = _median(_timed(forward, sync), warmup, repeats)
        backward_s = 0.0
        if inputs and y.requires_grad:
            backward_s = _median(backward, warmup, repeats)
        update_s, copy_s = _update_times(module, optimizer_factory, sync, warmup, repeats)
        out.append(LayerProfile(
            forward_s=forward_s,
            backward_s=backward_s,
            output_bytes=float(_nbytes(y)),
            param_bytes=float(sum(_nbytes(p) for p in module.parameters())),
            optimizer_bytes=float(_optimizer_bytes(module, optimizer_factory)),
            saved_bytes=float(_saved_bytes(module, x_in)),
            update_s=update_s,
            copy_s=copy_s,
            name=name,
        ))
        x = y.detach()
    batch = int(sample_input.shape[0]) if sample_input.dim() else 0
    loss_s = 0.0
    if loss_fn is not None:
        out_leaf = x.detach().requires_grad_(True)

        def loss() -> None:
            loss_fn(out_leaf).backward()

        loss_s = _median(_timed(loss, sync), warmup, repeats)
    return ModelProfile(
        tuple(out),
        batch_size=batch,
        loss_s=loss_s,
        source=f"profiled on {sample_input.device}: median of {repeats} after {warmup} "
               f"warm-up, {torch.get_num_threads()} thread(s)",
    )


def profile_layer_model(spec: Any, model: str, batch: int, threads: int = 1,
                        device: Any = None, whole: Any = None) -> ModelProfile:
    """Profile a `LayerModel` layer by layer on `batch` random samples with `threads`
    torch threads and the cross-entropy loss on random labels, on `device` (default the
    CPU), then scale the layers' times to a real run of the whole model as one stage of
    the pipeline runtime there, less the runtime's own time per micro-batch
    (`calibrate`, `runtime.action_times`; unscaled, saying why, where the whole model
    cannot run in one process), with the delay of a receive that slept
    (`polling.notice_delay_s`) and the cost of cold caches (`cold_cache_s_per_byte`);
    the profile's `extra` names the model and its shape.

    `whole`: that run's times measured already (`runtime.action_times_beside_others`:
    on every rank of a job at once, as it will train); None runs it here, alone."""
    import torch

    from pipesgd.device import torch_threads
    from pipesgd.pipeline.runtime import action_times, runtime_overhead
    from pipesgd.polling import notice_delay_s

    with torch_threads(threads):
        net = spec.build(seed=0).train().to(device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, *spec.input_shape, generator=g).to(device)
        labels = torch.randint(spec.num_classes, (batch,), generator=g).to(device)

        def loss_fn(out: Any) -> Any:
            return torch.nn.functional.cross_entropy(out, labels)

        prof = profile(net, x, loss_fn=loss_fn)
        cold = cold_cache_s_per_byte(net, x, loss_fn)
        runtime = runtime_overhead(device)
        beside = whole is not None
        if not beside:
            try:
                whole = action_times(spec, batch, device=device)
            except RuntimeError as err:  # out of memory: the model does not fit one worker
                whole, unscaled = None, str(err).splitlines()[0]
    prof = replace(prof, extra={"model": model, "input_shape": list(spec.input_shape),
                                "num_classes": spec.num_classes})
    if whole is None:
        prof = replace(prof, stage_overhead_s=runtime.total_s, source=prof.source
                       + f"; not scaled to a run (the whole model did not run: {unscaled})")
    else:
        prof = calibrate(prof, astuple(whole), astuple(runtime))
        if beside:
            prof = replace(prof, source=prof.source + ", run beside the job's other ranks")
    return replace(prof, receive_delay_s=notice_delay_s(), cold_s_per_byte=cold)


def cold_cache_s_per_byte(model: Any, sample_input: Any, loss_fn: Callable[[Any], Any],
                          repeats: int = 15, budget_s: float = 0.5) -> float:
    """Seconds per byte of `model`'s weights that its forward, backward and optimizer step
    (plain SGD) each take longer when the caches have lost their data.

    A worker that sleeps while it waits (a message, an all-reduce) finds its data gone
    when it wakes: other ranks on its cores ran meanwhile, and a virtual CPU left idle
    may resume on another core. Each action is timed in thread CPU time straight after
    the one before it (warm) and after streaming a buffer twice the size of the
    last-level cache (cold); the result is the median over the three actions of the
    median difference, over the weights' bytes (each `bench/planner.py` scenario
    records the figure, `cold_s_per_byte`, in its JSON).
    0 for a model on a GPU (its actions do not read through the host's caches) and for
    one without parameters. Up to `repeats` pairs, fewer (at least 5) where they would
    take longer than `budget_s`: a large model's passes cost seconds, and its few weight
    bytes per second of compute make the figure small anyway. Changes `model`'s weights
    (one SGD step per repeat)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    weight_bytes = sum(_nbytes(p) for p in params)
    if sample_input.device.type != "cpu" or weight_bytes == 0:
        return 0.0
    opt = torch.optim.SGD(params, lr=1e-6)
    flush = torch.ones(_last_level_cache_bytes() // 2, dtype=torch.float32)  # 2x the cache

    def actions(cold: bool) -> list[float]:
        spent = []
        for act in ("forward", "backward", "update"):
            if cold:
                flush.sum()
            t0 = time.thread_time()
            if act == "forward":
                opt.zero_grad()
                loss = loss_fn(model(sample_input))
            elif act == "backward":
                loss.backward()
            else:
                opt.step()
            spent.append(time.thread_time() - t0)
        return spent

    actions(cold=False)
    start = time.perf_counter()
    actions(cold=False)
    actions(cold=True)
    pair_s = time.perf_counter() - start
    repeats = max(5, min(repeats, int(budget_s / pair_s))) if pair_s > 0 else repeats
    warm, cold = zip(*((actions(False), actions(True)) for _ in range(repeats)), strict=True)
    extra = [statistics.median(c[i] for c in cold) - statistics.median(w[i] for w in warm)
             for i in range(3)]
    return max(0.0, statistics.median(extra)) / weight_bytes


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of this machine (Linux sysfs), else `default`."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


def calibrate(profile: ModelProfile, run: tuple[float, float, float],
              overhead: tuple[float, float, float]) -> ModelProfile:
    """`profile` with its layers' forward, backward and update times scaled, each figure
    by one factor, so that they sum to what a real run of the whole model measured on
    one stage (`run`: forward with the loss, backward, update, per micro-batch), less
    the runtime's own share of each (`overhead`, the same three); the overhead becomes
    `stage_overhead_s`. Isolated layers run with warm caches and no
    runtime around them: a real pass costs more, an optimizer step after a backward
    several times more. Factors go in `extra["calibration"]`."""
    sums = [sum(profile.column(key)) for key in ("forward_s", "backward_s", "update_s")]
    wanted = [run[0] - overhead[0] - profile.loss_s, run[1] - overhead[1],
              run[2] - overhead[2]]
    factors = [w / s if s > 0 and w > 0 else 1.0 for w, s in zip(wanted, sums, strict=True)]
    layers = tuple(replace(lp, forward_s=lp.forward_s * factors[0],
                           backward_s=lp.backward_s * factors[1],
                           update_s=lp.update_s * factors[2]) for lp in profile.layers)
    return replace(profile, layers=layers, stage_overhead_s=sum(overhead),
                   source=profile.source + "; scaled to a one-stage run",
                   extra={**profile.extra, "calibration": dict(zip(
                       ("forward", "backward", "update"), factors, strict=True))})


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> Callable[[], float]:
    def run() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return run


def _median(run: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(repeats))


def _unique_storage_bytes(tensors: Iterable[Any], skip: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            seen[ptr] = storage.nbytes()
    return sum(seen.values())


def _saved_bytes(module: Any, x_in: Any) -> int:
    import torch

    packed: list[Any] = []

    def pack(t: Any) -> Any:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x_in)
    own = {t.untyped_storage().data_ptr()
           for t in [*module.parameters(), *module.buffers()]}
    return _unique_storage_bytes(packed, own)


def _update_times(module: Any, factory: Callable[[list[Any]], Any] | None,
                  sync: Callable[[], None], warmup: int, repeats: int) -> tuple[float, float]:
    """(one optimizer step, one copy) of the layer's trainable parameters, on a twin."""
    import torch

    if not any(p.requires_grad for p in module.parameters()):
        return 0.0, 0.0
    twin = copy.deepcopy(module)  # stepping must not change the caller's weights
    params = [p for p in twin.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-6
    opt = factory(params) if factory is not None else torch.optim.SGD(params, lr=1e-3)
    copies = [p.detach().clone() for p in params]

    def copy_all() -> None:
        with torch.no_grad():
            for c, p in zip(copies, params, strict=True):
                c.copy_(p)

    return (_median(_timed(opt.step, sync), warmup, repeats),
            _median(_timed(copy_all, sync), warmup, repeats))


def _optimizer_bytes(module: Any, factory: Callable[[list[Any]], Any] | None) -> int:
    import torch

    if factory is None or not any(p.requires_grad for p in module.parameters()):
        return 0
    twin = copy.deepcopy(module)  # stepping must not change the caller's weights
    params = [p for p in twin.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = factory(params)
    opt.step()
    tensors = [v for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    return _unique_storage_bytes(tensors, set())
