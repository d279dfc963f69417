"""A DDP communication hook running Pipe-SGD on the pipesgd engine.

For users who keep `torch.nn.parallel.DistributedDataParallel`::

    state = pipesgd.hooks.PipeSGDState(staleness=2, compression="quant8")
    ddp.register_comm_hook(state, pipesgd.hooks.pipe_sgd_hook)
    ...
    loss.backward()
    if state.has_update:      # False for the K - 1 iterations while the pipe fills
        optimizer.step()

Iteration 0 is synchronous: DDP rebuilds its buckets after the first iteration, so a
gradient bucketed before the rebuild could not be handed back to a bucket after it.
From iteration 1 on, bucket i of iteration t is submitted and the future returns bucket
i of iteration t - K + 1 (all zeros, with `has_update` False, while there is none yet).
This is `DistributedOptimizer(..., warmup_steps=1)` exactly: both follow
`pipesgd.delay.DelaySchedule`.

Mixed precision: give the `GradScaler` to the state (`PipeSGDState(..., grad_scaler=
scaler)`) and keep `scaler.step(optimizer); scaler.update()` where `optimizer.step()`
was. A bucket handed back was scaled by the loss scale of its own iteration; the hook
rescales it to the current one, which `scaler.step` divides by. The scaler's inf check
then sees the aggregated gradient, the same bits on every rank, so every rank skips the
same steps and keeps the same scale.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import torch
import torch.distributed as dist
from torch import Tensor

from pipesgd.buffers import COMPRESSIONS
from pipesgd.delay import DelayedQueue, DelaySchedule
from pipesgd.engine import Engine, Handle
from pipesgd.engine import init as init_default_engine
from pipesgd.errors import PipesgdError
from pipesgd.staging import HostStaging


class PipeSGDState:
    """State of `pipe_sgd_hook`, one per DDP model.

    Args:
        engine: engine to reduce on (default: `pipesgd.init()`, over COMM_WORLD, which
            must hold the same ranks as DDP's process group).
        staleness: K >= 1; 1 = synchronous.
        compression: "none", "trunc16" or "quant8".
        grad_scaler: the `torch.amp.GradScaler` whose scaled losses the backward passes
            use, if any (see the module).
        staging: reduce through host copies of the buckets (`pipesgd.staging`): how
            buckets on a GPU are reduced, and the default for them; True on the CPU runs
            the same path.

    Raises:
        ValueError: staleness < 1 or unknown compression.
    """

    __slots__ = (
        "buffers",  # bucket index -> K flat buffers, reused round-robin
        "compression",  # engine compression of every bucket
        "engine",  # the pipesgd engine the buckets are reduced on
        "grad_scaler",  # the GradScaler of the backward passes, or None
        "has_update",  # did the last finished iteration hand back an aggregated gradient?
        "host_buffers",  # staging: bucket index -> K host twins of `buffers`
        "iteration",  # DDP iterations completed (backward passes seen)
        "queues",  # bucket index -> (buffer, handle, loss scale) in flight under `schedule`
        "schedule",  # K, with iteration 0 synchronous (DDP rebuilds its buckets after it)
        "stager",  # the HostStaging of the buckets, once staging
        "staging",  # True, False, or None: decided by the first bucket's device
    )

    def __init__(self, engine: Engine | None = None, staleness: int = 2,
                 compression: str = "none",
                 grad_scaler: torch.amp.GradScaler | None = None,
                 staging: bool | None = None) -> None:
        self.schedule = DelaySchedule(staleness, warmup_steps=1)
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}: expected one of {COMPRESSIONS}")
        self.engine = init_default_engine() if engine is None else engine
        self.compression = compression
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() \
            else None
        self.iteration = 0
        self.has_update = True
        self.buffers: dict[int, list[Tensor]] = {}
        self.host_buffers: dict[int, list[Tensor]] = {}
        self.staging = staging
        self.stager: HostStaging | None = None
        self.queues: dict[int, DelayedQueue[tuple[Tensor, Handle, float]]] = {}

    @property
    def staleness(self) -> int:
        """K: the gradient of iteration t is applied at iteration t + K - 1."""
        return self.schedule.staleness

    @property
    def staging_seconds(self) -> float:
        """Seconds the host staging's copies have taken so far (0 without staging)."""
        return self.stager.copy_seconds if self.stager is not None else 0.0

    def loss_scale(self) -> float:
        """The loss scale the current backward runs under (1.0 without a scaler)."""
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.get_scale())

    def synchronize(self) -> None:
        """Wait for every submitted bucket (e.g. before checkpointing or exiting)."""
        for queue in self.queues.values():
            for entry in queue:
                entry.item[1].wait()

    def _buffers_for(self, index: int, grad: Tensor) -> list[Tensor]:
        buffers = self.buffers.get(index)
        if buffers is None or buffers[0].numel() != grad.numel():
            if self.queues.get(index):
                raise PipesgdError(
                    f"DDP bucket {index} changed size from {buffers[0].numel()} to "
                    f"{grad.numel()} elements while its gradients were in flight (DDP rebuilt "
                    "its buckets after iteration 0): construct DDP with static_graph=False "
                    "and the same bucket_cap_mb on every rank"
                )
            buffers = [torch.empty_like(grad) for _ in range(self.staleness)]
            self.buffers[index] = buffers
        return buffers

    def _stager_for(self, grad: Tensor) -> HostStaging | None:
        """The host staging of the buckets, if they take it (decided at the first one)."""
        if self.staging is None:
            self.staging = grad.device.type != "cpu"
        if self.staging and self.stager is None:
            self.stager = HostStaging(grad.device)
        return self.stager

    def _submit(self, index: int, slot: int, grad: Tensor) -> tuple[Tensor, Handle]:
        """Queue the allreduce of `grad`, through host twin `slot` of bucket `index` when
        staging; return where the result lands and the handle."""
        if self.stager is None:
            return grad, self.engine.allreduce_async(grad, compression=self.compression)
        hosts = self.host_buffers.get(index)
        if hosts is None or hosts[0].numel() != grad.numel():  # allocated once per size
            hosts = [self.stager.host_like(grad) for _ in range(self.staleness)]
            self.host_buffers[index] = hosts
        handle = self.stager.submit(self.engine, grad, hosts[slot],
                                    compression=self.compression)
        return hosts[slot], handle

    def _collect(self, reduced: Tensor, handle: Handle, into: Tensor) -> None:
        """Wait for `handle`; put its result (`reduced`) into `into`."""
        handle.wait()
        if self.stager is not None:
            self.stager.copy_to_device(into, reduced)
        elif reduced is not into:
            into.copy_(reduced)


def pipe_sgd_hook(
    state: PipeSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` over ranks on the pipesgd engine; return the result due now.

    Iteration 0 waits for its own average. Later iterations submit theirs and return the
    average of K - 1 iterations earlier (zeros while the pipe fills).
    """
    grad, index, t = bucket.buffer(), bucket.index(), state.iteration
    state._stager_for(grad)
    if state.schedule.staleness_at(t) == 1:
        state._collect(*state._submit(index, 0, grad), into=grad)  # due at once
        state.has_update = True
    else:
        slot = t % state.staleness
        buffer = state._buffers_for(index, grad)[slot]
        buffer.copy_(grad)  # DDP refills grad next iteration; this stays until reduced
        queue = state.queues.setdefault(index, DelayedQueue(state.schedule))
        scale = state.loss_scale()
        queue.push(t, (*state._submit(index, slot, buffer), scale))
        due = queue.pop_due(t)
        if due is not None:
            reduced, handle, scaled_by = due.item
            state._collect(reduced, handle, into=grad)
            if scaled_by != scale:  # powers of two under GradScaler's defaults: exact
                grad.mul_(scale / scaled_by)
            state.has_update = True
        else:
            grad.zero_()
            state.has_update = False
    if bucket.is_last():
        state.iteration += 1
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(grad)
    return future
