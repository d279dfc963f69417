"""`DistributedOptimizer`: Pipe-SGD data parallelism around any torch optimizer.

The gradient computed in iteration t, averaged over ranks, is applied by the `step()` of
iteration t + K - 1 (K = `staleness`; paper §3.1, Algorithm 1). So `step()` of iteration
t submits t's gradient to the engine's communication thread and waits only for iteration
t - K + 1's, and the allreduce of t overlaps the compute of t + 1 ... t + K - 1. K = 1 is
synchronous data parallelism (D-Sync).

The schedule (warm-up with K = 1, the learning-rate ramp of the first stale updates) is
`pipesgd.delay.DelaySchedule`, shared with the DDP hook and replicated pipeline stages.
Steps with nothing due leave weights and optimizer state untouched. The ramp exists
because a stale heavy ball is stable only at a much smaller step than a synchronous one
(docs/training.md, "Learning rate and momentum with K >= 2"): it lets the model settle where the
stale update is stable instead of diverging right after the switch.

Gradients travel in flat buckets (`pipesgd.buckets`), K sets of them allocated once.
With overlap="sequential" the buckets are the gradients (as DDP's gradient_as_bucket_view):
`zero_grad()` points every `.grad` at its zeroed view of the set the next backward fills,
and `step()` points them at the set being applied, so no gradient is copied in or out.
No Python runs per parameter during backward then: a lent gradient that nothing wrote
since it was lent (its version counter, `GradientBuckets.param_views`) is a missing one,
told apart from a zero gradient without a hook.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

from pipesgd.buckets import BucketLayout, GradientBuckets, dense_strides, is_view
from pipesgd.buffers import COMPRESSIONS
from pipesgd.delay import Delayed, DelayedQueue, DelaySchedule
from pipesgd.engine import Engine, Handle
from pipesgd.engine import init as init_default_engine
from pipesgd.errors import PipesgdError
from pipesgd.staging import HostStaging

OVERLAP_MODES = ("sequential", "backward")


@dataclass
class StepTiming:
    """Seconds spent in the last `step()`.

    Attributes:
        submit_s: packing gradients into buckets and queuing their allreduce.
        wait_s: blocked on the communication thread for the gradient being applied.
        update_s: copying the aggregated gradient out and running the inner optimizer.
    """

    submit_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0


@dataclass
class _InFlight:
    """One iteration's gradient: its bucket set, handles (None once reduced) and the loss
    scale it was computed under (1.0 without a grad scaler)."""

    set_index: int
    handles: list[Handle | None]
    loss_scale: float = 1.0


class DistributedOptimizer:
    """Wrap `optimizer` so that `step()` applies rank-averaged gradients K - 1 steps late.

    The training loop does not change: `zero_grad(); loss.backward(); step()`. Create LR
    schedulers on the wrapped optimizer; they keep working because this wrapper drives
    its `step()` and shares its `param_groups`.

    Args:
        optimizer: any torch optimizer over (a subset of) `named_parameters`.
        named_parameters: `(name, parameter)` pairs, e.g. `model.named_parameters()`;
            parameters with `requires_grad=False` are skipped. Same names, shapes and
            dtypes on every rank.
        staleness: K >= 1, the iteration dependency; 1 = synchronous, 2 = Pipe-SGD.
        compression: "none", "trunc16" or "quant8" (float32 parameters only).
        bucket_mb: target size of one flat gradient bucket in MiB.
        warmup_steps: number of first iterations run with K = 1.
        ramp_steps: scale the learning rate of the first `ramp_steps` stale updates by
            1/R, 2/R, ..., 1 (R = ramp_steps; 0: no ramp). It multiplies whatever rate
            the inner optimizer (and its LR scheduler) holds, for that update only.
        overlap: "sequential" submits all buckets in `step()`, and the gradients live in
            the buckets (see `zero_grad`); "backward" submits each bucket from a
            post-accumulate-grad hook as soon as its gradients are ready, copying them out
            (in flight they would race with code reading `.grad` before `step()`).
        engine: the engine to reduce on (default: `pipesgd.init(comm)`).
        comm: communicator of the ranks taking part (default COMM_WORLD); used for the
            construction-time check.
        staging: reduce through host copies of the buckets (`pipesgd.staging`): the
            only way for parameters on a GPU, and the default there; True on the CPU
            runs the same path (as a test of it).
        grad_scaler: a `torch.amp.GradScaler` whose scaled losses the backward passes
            use (mixed precision). `step()` then unscales the aggregated gradient it
            applies by the scale that gradient was computed under, skips it where any
            rank's gradient had an inf or NaN (its sum does, bitwise alike on every rank),
            and updates the scaler's scale by its rule, from the applied gradient: call
            `opt.step()`, not `scaler.step(opt)` and `scaler.update()`.

    Raises:
        ValueError: bad staleness, compression, overlap, bucket size or warm-up; a
            parameter of `optimizer` missing from `named_parameters`; duplicate names.
        PipesgdError: the ranks disagree on parameters or configuration (the message
            names the first differing parameter or setting and the rank).
    """

    # GradScaler.step() hands the step to an optimizer with this flag rather than
    # unscaling and maybe skipping it from the local gradients: step() then explains that
    # the scaler belongs in the constructor (a rank that skipped would stall the others).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        staleness: int = 2,
        compression: str = "none",
        bucket_mb: float = 25.0,
        warmup_steps: int = 0,
        overlap: str = "sequential",
        ramp_steps: int = 0,
        *,
        engine: Engine | None = None,
        comm: MPI.Comm | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        staging: bool | None = None,
    ) -> None:
        self.schedule = DelaySchedule(staleness, warmup_steps, ramp_steps)
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}: expected one of {COMPRESSIONS}")
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"unknown overlap {overlap!r}: expected one of {OVERLAP_MODES}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")

        self.optimizer = optimizer
        self.compression = compression
        self.overlap = overlap
        self.bucket_mb = float(bucket_mb)
        self.names, self.params = _check_named_parameters(optimizer, named_parameters)
        if compression != "none":
            for name, p in zip(self.names, self.params, strict=True):
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"compression {compression!r} works on float32 only, but parameter "
                        f"{name!r} is {p.dtype}; use compression='none' or a float32 model"
                    )

        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.engine = init_default_engine(comm) if engine is None else engine
        if self.engine.size != self.comm.size:
            raise ValueError(
                f"the engine spans {self.engine.size} ranks but comm has {self.comm.size}: "
                "pass the communicator the engine was built on as comm="
            )
        bucket_bytes = int(self.bucket_mb * 2**20)
        layout = BucketLayout.build(self.params, bucket_bytes)
        # Checked before the buckets, whose allocation is collective (Engine.zeros).
        _check_across_ranks(self.comm, self._describe(layout))
        self.buckets = GradientBuckets(self.params, bucket_bytes, sets=staleness,
                                       engine=self.engine, layout=layout)
        on_device = any(p.device.type != "cpu" for p in self.params)
        if on_device and staging is False:
            raise ValueError(
                f"the parameters are on {self.params[0].device}, and the engine reads host "
                "memory: leave staging=None (or True) to reduce through host copies"
            )
        self._staging: HostStaging | None = None
        self._host: list[list[Tensor]] = []  # staging: host twins of the buckets
        if staging or on_device:
            # the twins in the engine's memory, as the buckets are on the CPU
            self._staging = HostStaging(self.params[0].device if self.params else
                                        torch.device("cpu"), engine=self.engine)
            self._host = [[self._staging.host_like(b) for b in buffers]
                          for buffers in self.buckets.buffers]

        self.timing = StepTiming()
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() \
            else None
        self._growth_tracker = 0  # applied finite gradients since the scale last changed
        self._iteration = 0  # the iteration whose gradient the next step() submits
        self._inflight: DelayedQueue[_InFlight] = DelayedQueue(self.schedule)
        self._current: list[Handle | None] | None = None  # backward mode: this iteration
        self._next_bucket = 0
        self._remaining: list[int] = []
        self._seen = [False] * len(self.params)  # overlap="backward": accumulated this step
        self._hooks: list[Any] = []
        # [set][parameter]: gradients lent out as views of the buckets (sequential only),
        # and each one's version counter when it was last lent.
        self._grad_views: list[list[Tensor]] = []
        self._lent_versions: list[list[int]] = []
        if overlap == "backward":
            self._reset_backward_state()
            for index, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))
        else:
            self._grad_views = [self.buckets.param_views(s) for s in range(staleness)]
            self._lent_versions = [[v._version for v in views] for views in self._grad_views]

    # The delay schedule is the one source of these settings.
    @property
    def staleness(self) -> int:
        return self.schedule.staleness

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    @property
    def ramp_steps(self) -> int:
        return self.schedule.ramp_steps

    # -- the torch.optim.Optimizer surface -------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def iteration(self) -> int:
        """Number of `step()` calls so far (the index of the next iteration)."""
        return self._iteration

    @property
    def staging_seconds(self) -> float:
        """Seconds the host staging's copies (device to host and back) have taken since
        construction; 0 without staging. Never waits for the device."""
        return self._staging.copy_seconds if self._staging is not None else 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients before the next backward.

        With overlap="sequential" every `.grad` becomes a zeroed view of the bucket the
        next backward fills, whatever `set_to_none` says: backward accumulates straight
        into the buffer the allreduce sends. `model.zero_grad()` also works (the
        gradients are then copied into the buckets in `step()`).
        """
        if not self._grad_views:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        fill = self._iteration % self.staleness  # never in flight: see step()
        for flat in self.buckets.buffers[fill]:
            flat.zero_()
        self._lend(fill)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "the gradient buckets are fixed at construction: add the parameter group to the "
            "inner optimizer first, then build a new DistributedOptimizer"
        )

    def staleness_at(self, iteration: int) -> int:
        """K used for the gradient of `iteration` (1 during warm-up)."""
        return self.schedule.staleness_at(iteration)

    def lr_scale_at(self, iteration: int) -> float:
        """Factor on the learning rate that applies the gradient of `iteration`."""
        return self.schedule.lr_scale_at(iteration)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Submit this iteration's gradient; apply the one due now, if any.

        Args:
            closure: optional; evaluated first (with grad enabled), its result returned.

        Raises:
            PipesgdError: a parameter has no gradient (named in the message), or the
                allreduce failed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if hasattr(self, "grad_scale"):  # set by GradScaler.step(), which then calls this
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise PipesgdError(
                "DistributedOptimizer applies its gradients K - 1 steps late, so a GradScaler "
                "cannot judge them from the local .grad: pass it as "
                "DistributedOptimizer(..., grad_scaler=scaler) and call opt.step() instead of "
                "scaler.step(opt) and scaler.update()"
            )
        t = self._iteration
        set_index = t % self.staleness
        start = time.perf_counter()
        loss_scale = 1.0 if self.grad_scaler is None else float(self.grad_scaler.get_scale())
        self._inflight.push(t, _InFlight(set_index, self._submit_all(t, set_index), loss_scale))
        submitted = time.perf_counter()
        wait_s = update_s = 0.0
        due = self._inflight.pop_due(t)
        if due is not None:
            wait_s = self._wait(due)
            begin = time.perf_counter()
            applied = due.item.set_index
            finite = self._unscale(applied, due.item.loss_scale)
            if self._staging is not None:
                for host, device in zip(self._host[applied], self.buckets.buffers[applied],
                                        strict=True):
                    self._staging.copy_to_device(device, host)
            if self._grad_views:
                # The applied set is the one the next iteration fills ((t + 1) mod K),
                # so these views stay valid until zero_grad() zeroes them.
                self._lend(applied)
            else:
                for bucket in range(self.buckets.num_buckets):
                    self.buckets.unpack(applied, bucket)
            if finite:
                self._inner_step(self.lr_scale_at(due.iteration))
            else:
                self._note_step_skipped()
            self._update_loss_scale(finite)
            update_s = time.perf_counter() - begin
        else:
            self._lend_no_inflight_gradient(set_index)
            self._note_step_skipped()
        self._iteration = t + 1
        if self.overlap == "backward":
            self._reset_backward_state()
        self.timing = StepTiming(submitted - start, wait_s, update_s)
        return loss

    def synchronize(self) -> None:
        """Wait until every submitted gradient is reduced (none is applied by this)."""
        for entry in self._inflight:
            self._wait(entry)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, iteration counter and the reduced in-flight gradients.

        Collective: it waits for the in-flight allreduces. Call it between `step()` and
        the next backward pass.
        """
        self._check_between_iterations("state_dict()")
        self.synchronize()
        return {
            "optimizer": self.optimizer.state_dict(),
            "pipesgd": {
                "iteration": self._iteration,
                "staleness": self.staleness,
                "warmup_steps": self.warmup_steps,
                "ramp_steps": self.ramp_steps,
                "compression": self.compression,
                "names": list(self.names),
                "layout": self.buckets.layout.digest(),
                "inflight": [
                    {
                        "iteration": e.iteration,
                        "apply_at": e.apply_at,
                        "buckets": [b.clone() for b in self._reduced(e.item.set_index)],
                        "loss_scale": e.item.loss_scale,
                    }
                    for e in self._inflight
                ],
                "growth_tracker": self._growth_tracker,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the run then continues exactly where it was saved.

        Raises:
            ValueError: the checkpoint was written with other parameters, staleness,
                warm-up or bucket layout (the message says which and what to pass).
        """
        self._check_between_iterations("load_state_dict()")
        saved = state_dict["pipesgd"]
        if saved["names"] != self.names:
            first = next(
                (i for i, (a, b) in enumerate(zip(saved["names"], self.names, strict=False))
                 if a != b),
                min(len(saved["names"]), len(self.names)),
            )
            raise ValueError(
                f"checkpoint parameters differ from this model's at position {first} "
                f"(checkpoint has {len(saved['names'])} parameters, model {len(self.names)})"
            )
        for key, mine in (("staleness", self.staleness), ("warmup_steps", self.warmup_steps),
                          ("ramp_steps", self.ramp_steps)):
            theirs = saved.get(key, 0)  # written before ramp_steps existed: no ramp
            if theirs != mine:
                raise ValueError(
                    f"checkpoint was written with {key}={theirs}, this optimizer has "
                    f"{key}={mine}: construct it with {key}={theirs} to resume"
                )
        if saved["layout"] != self.buckets.layout.digest():
            raise ValueError(
                "bucket layout mismatch: the checkpoint's in-flight gradients were bucketed "
                f"differently than with bucket_mb={self.bucket_mb}; construct the optimizer "
                "with the bucket_mb used when the checkpoint was written"
            )
        self.synchronize()
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._iteration = int(saved["iteration"])
        self._inflight.clear()
        for entry in saved["inflight"]:
            set_index = entry["iteration"] % self.staleness
            for buffer, value in zip(self._reduced(set_index), entry["buckets"],
                                     strict=True):
                buffer.copy_(value)
            self._inflight.restore(entry["iteration"], entry["apply_at"],
                                   _InFlight(set_index, [None] * self.buckets.num_buckets,
                                             entry.get("loss_scale", 1.0)))
        self._growth_tracker = int(saved.get("growth_tracker", 0))

    def remove_hooks(self) -> None:
        """Detach the backward hooks (overlap="backward") and stop lending the buckets
        out as gradients, e.g. before dropping this optimizer.

        Later steps copy gradients in and out of the buckets instead of lending them, so
        the `.grad`s that are views of the buckets become copies of them.
        """
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for s in range(len(self._grad_views)):
            for i in self._lent(s):
                self.params[i].grad = self.params[i].grad.clone()
        self._grad_views = []
        self._lent_versions = []

    # -- internals --------------------------------------------------------------------------

    def _describe(self, layout: BucketLayout) -> dict[str, Any]:
        return {
            "params": [
                (n, tuple(p.shape), str(p.dtype).removeprefix("torch."), dense_strides(p))
                for n, p in zip(self.names, self.params, strict=True)
            ],
            "config": {
                "staleness": self.staleness,
                "compression": self.compression,
                "warmup_steps": self.warmup_steps,
                "ramp_steps": self.ramp_steps,
            },
            "layout": layout.describe(),
            "bucket_mb": self.bucket_mb,
        }

    def _note_step_skipped(self) -> None:
        if hasattr(self.optimizer.step, "_wrapped_by_lr_sched"):
            # An LR scheduler tracks whether the optimizer stepped this iteration; a step
            # that applied nothing still is one, so do not let it warn about the order.
            self.optimizer._opt_called = True

    def _unscale(self, set_index: int, loss_scale: float) -> bool:
        """With a grad scaler: whether the reduced set `set_index` is finite, and if so
        divide it by the loss scale it was computed under. Every rank holds the same
        bits, so every rank decides alike without communicating. When staging, this
        reads the host buckets, before they go back: no wait for the device."""
        if self.grad_scaler is None:
            return True
        buffers = self._reduced(set_index)
        if not all(bool(torch.isfinite(b).all()) for b in buffers):
            return False
        for b in buffers:
            b.mul_(1.0 / loss_scale)
        return True

    def _update_loss_scale(self, finite: bool) -> None:
        """GradScaler's rule, driven by the gradient just applied (or skipped)."""
        scaler = self.grad_scaler
        if scaler is None:
            return
        scale = float(scaler.get_scale())
        if not finite:
            scale *= scaler.get_backoff_factor()
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == scaler.get_growth_interval():
                scale *= scaler.get_growth_factor()
                self._growth_tracker = 0
        scaler.update(scale)

    def _inner_step(self, lr_scale: float) -> None:
        if lr_scale == 1.0:
            self.optimizer.step()
            return
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr * lr_scale
        try:
            self.optimizer.step()
        finally:
            # the scheduler's rate, not the scaled one, is what the next step starts from
            for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = lr

    def _missing_error(self, t: int, missing: list[int]) -> PipesgdError:
        missing = sorted(missing)
        names = ", ".join(repr(self.names[i]) for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        return PipesgdError(
            f"step() of iteration {t}: {names}{more} has no gradient. Every rank "
            "must reduce the same buckets, so each parameter given to DistributedOptimizer "
            "needs a gradient every iteration (from backward(), or assigned to .grad): run "
            "backward() before step(), or leave unused parameters out of named_parameters "
            "(or set requires_grad=False on them)"
        )

    def _submit_all(self, t: int, set_index: int) -> list[Handle | None]:
        if self.overlap == "backward":
            handles = self._current
            assert handles is not None
            start = self._next_bucket
        else:
            handles = [None] * self.buckets.num_buckets
            start = 0
        missing = [
            i for b in range(start, self.buckets.num_buckets) for i in self.buckets.missing_grads(b)
        ]
        lent: set[int] = set()
        if self._grad_views:
            # A view that nothing wrote since it was lent (backward never reached it) is a
            # missing gradient too.
            versions = self._lent_versions[set_index]
            in_place = self._lent(set_index)
            missing += [i for i in in_place if self.params[i].grad._version == versions[i]]
            lent = set(in_place)
        if missing:
            raise self._missing_error(t, missing)
        for bucket in range(start, self.buckets.num_buckets):
            if not lent.issuperset(self.buckets.bucket_params[bucket]):
                self.buckets.pack(set_index, bucket)  # some gradient is not in place
            handles[bucket] = self._submit_bucket(set_index, bucket)
        return handles

    def _submit_bucket(self, set_index: int, bucket: int) -> Handle:
        if self._staging is None:
            return self.buckets.submit(self.engine, set_index, bucket,
                                       compression=self.compression)
        return self._staging.submit(self.engine, self.buckets.buffers[set_index][bucket],
                                    self._host[set_index][bucket],
                                    compression=self.compression)

    def _reduced(self, set_index: int) -> list[Tensor]:
        """Where the reduced gradients of set `set_index` land: the host buckets when
        staging (copied to the device ones when applied), else the buckets themselves."""
        return self._host[set_index] if self._staging is not None \
            else self.buckets.buffers[set_index]

    def _wait(self, entry: Delayed[_InFlight]) -> float:
        begin = time.perf_counter()
        handles = entry.item.handles
        for bucket, handle in enumerate(handles):
            if handle is not None:
                handle.wait()
                handles[bucket] = None
        return time.perf_counter() - begin

    def _reset_backward_state(self) -> None:
        self._current = [None] * self.buckets.num_buckets
        self._next_bucket = 0
        self._remaining = [len(b.slots) for b in self.buckets.layout.buckets]
        self._seen = [False] * len(self.params)

    def _lend_no_inflight_gradient(self, set_index: int) -> None:
        """Drop `.grad`s that are views of set `set_index`, which was just submitted.

        After a step that applied nothing, the gradients just submitted are in flight on
        the communication thread; nobody may read or zero them until they are reduced.
        """
        if not self._grad_views:
            return
        for i in self._lent(set_index):
            self.params[i].grad = None

    def _lend(self, set_index: int) -> None:
        """Point every `.grad` at its view of set `set_index`, noting each view's version."""
        views = self._grad_views[set_index]
        for p, view in zip(self.params, views, strict=True):
            p.grad = view
        self._lent_versions[set_index] = [view._version for view in views]

    def _lent(self, set_index: int) -> list[int]:
        """Indices of the parameters whose `.grad` is their view of set `set_index`."""
        return [
            i for i, (p, view) in enumerate(zip(self.params, self._grad_views[set_index],
                                                strict=True))
            if p.grad is view or (p.grad is not None and is_view(p.grad, view))
        ]

    def _make_hook(self, index: int) -> Callable[[Tensor], None]:
        owner = weakref.ref(self)  # the parameters' hooks must not keep the optimizer alive

        def hook(_: Tensor) -> None:
            optimizer = owner()
            if optimizer is not None:
                optimizer._on_grad_ready(index)

        return hook

    def _on_grad_ready(self, index: int) -> None:
        if self._seen[index]:
            raise PipesgdError(
                f"the gradient of {self.names[index]!r} was accumulated twice before step(): "
                "overlap='backward' submits each bucket once per iteration, so call step() "
                "after every backward(), or use overlap='sequential' to accumulate gradients"
            )
        self._seen[index] = True
        bucket = self.buckets.layout.bucket_of[index]
        self._remaining[bucket] -= 1
        set_index = self._iteration % self.staleness
        assert self._current is not None
        # Submit in bucket order only, so every rank queues the same sequence.
        while (
            self._next_bucket < self.buckets.num_buckets
            and self._remaining[self._next_bucket] == 0
        ):
            b = self._next_bucket
            self.buckets.pack(set_index, b)
            self._current[b] = self._submit_bucket(set_index, b)
            self._next_bucket += 1

    def _check_between_iterations(self, what: str) -> None:
        if self.overlap == "backward" and any(self._seen):
            raise PipesgdError(
                f"{what} was called after backward() and before step(): call it between "
                "step() and the next backward()"
            )


def _check_named_parameters(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, nn.Parameter]]
) -> tuple[list[str], list[nn.Parameter]]:
    pairs = list(named_parameters)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor)):
            raise ValueError(
                "named_parameters must be (name, parameter) pairs, e.g. "
                "DistributedOptimizer(opt, model.named_parameters())"
            )
    names: list[str] = []
    params: list[nn.Parameter] = []
    seen: set[str] = set()
    ids: set[int] = set()
    for name, p in pairs:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in named_parameters")
        seen.add(name)
        if p.requires_grad and id(p) not in ids:
            ids.add(id(p))
            names.append(name)
            params.append(p)
    unnamed = [
        p for group in optimizer.param_groups for p in group["params"]
        if p.requires_grad and id(p) not in ids
    ]
    if unnamed:
        raise ValueError(
            f"{len(unnamed)} parameter(s) of the optimizer (first of shape "
            f"{tuple(unnamed[0].shape)}) are not in named_parameters: pass all of them, e.g. "
            "DistributedOptimizer(opt, model.named_parameters())"
        )
    if not params:
        raise ValueError("named_parameters holds no parameter that requires a gradient")
    return names, params


def _check_across_ranks(comm: MPI.Comm, description: dict[str, Any]) -> None:
    """Compare a digest of `description` across ranks; explain the first difference."""
    digest = hashlib.sha256(repr(description).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) == 1:
        return
    everyone = comm.allgather(description)
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    mine, theirs = everyone[0], everyone[rank]
    for i in range(max(len(mine["params"]), len(theirs["params"]))):
        a = mine["params"][i] if i < len(mine["params"]) else None
        b = theirs["params"][i] if i < len(theirs["params"]) else None
        if a != b:
            name = (a or b)[0]
            raise PipesgdError(
                f"parameter #{i} {name!r} differs between ranks: rank 0 has {_fmt(a)}, rank "
                f"{rank} has {_fmt(b)}; every rank must build the same model"
            )
    for key, value in mine["config"].items():
        if theirs["config"][key] != value:
            raise PipesgdError(
                f"{key} differs between ranks: rank 0 uses {value!r}, rank {rank} uses "
                f"{theirs['config'][key]!r}; pass the same {key} on every rank"
            )
    raise PipesgdError(
        f"bucket layout mismatch: rank 0 has {mine['layout']} (bucket_mb={mine['bucket_mb']}), "
        f"rank {rank} has {theirs['layout']} (bucket_mb={theirs['bucket_mb']}); pass the "
        "same bucket_mb on every rank"
    )


def _fmt(entry: tuple[str, tuple[int, ...], str, tuple[int, ...]] | None) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, strides = entry
    # strides tell memory layouts apart (contiguous vs channels_last): they order the bucket
    return f"{name!r} of shape {shape}, dtype {dtype} and strides {strides}"
