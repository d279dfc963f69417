"""Replicas of a stage: they start from one state, and average gradients through the
engine's ring all-reduce.

At construction, every replica receives the parameters and buffers of the stage's first
replica (`broadcast_from_first_replica`), so a model built differently on each rank (a
user's function that does not seed, or another seed) cannot make the replicas diverge.

Each replicated stage has its own sub-communicator and `pipesgd.Engine`. Every update
round, each replica contributes the sum of its micro-batch gradients (a flat buffer,
all-reduced in buckets) and how many micro-batches it summed; the stage then applies
sum / count. A replica without a micro-batch in the last round (uneven counts) joins
with zeros and count 0, so the average stays exact. Staleness K follows the Pipe-SGD
optimizer's schedule (`pipesgd.delay`): round t applies the aggregate launched K-1 rounds
earlier (K = 1 is synchronous); the rest is applied when the epoch drains. A stage on a
GPU reduces through host staging (`pipesgd.staging`): a device copy of the round's sum
(the next backward overwrites the stage's buffer) goes to a pinned host buffer on a side
stream, each bucket's all-reduce opens when its copy has completed, and the aggregate
returns to the device ahead of the update.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor, nn

from pipesgd.broadcast import broadcast_parameters
from pipesgd.delay import DelayedQueue, DelaySchedule
from pipesgd.staging import HostStaging

DEFAULT_BUCKET_BYTES = 4 << 20


def broadcast_from_first_replica(module: nn.Module, comm) -> None:
    """Overwrite this replica's parameters and buffers with replica 0's, in place
    (collective over `comm`, the stage's replica communicator).

    Raises:
        ValueError: on every replica, when the replicas' stages have different tensor
            names, shapes or dtypes.
    """
    broadcast_parameters(module, root=0, comm=comm, what="build")


class LocalGradients:
    """An unreplicated stage: the round's gradient is its own sum / count."""

    def __init__(self) -> None:
        self._pending: deque[Tensor] = deque()

    def submit(self, flat_sum: Tensor, count: float) -> None:
        # The stage's buffer is consumed by ready() before the next backward overwrites it.
        if count > 0:
            self._pending.append(flat_sum if count == 1 else flat_sum.div_(count))

    def ready(self) -> list[Tensor]:
        out = list(self._pending)
        self._pending.clear()
        return out

    def flush(self) -> list[Tensor]:
        return self.ready()

    def shutdown(self) -> None:
        pass


class ReplicaGradientSync:
    """Averages a replicated stage's gradients over its sub-communicator with the engine.

    Args:
        comm: sub-communicator of this stage's replicas.
        compression: "none", "trunc16" or "quant8" (engine compression of the gradient).
        staleness: 1 = synchronous; K = apply the aggregate of K-1 rounds ago.
        bucket_bytes: size of each all-reduce of the flat gradient.
        staging: reduce through host copies (None: the gradient is on the host).
    """

    def __init__(
        self,
        comm,
        *,
        compression: str = "none",
        staleness: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        staging: HostStaging | None = None,
    ) -> None:
        try:
            import pipesgd

            engine_cls = pipesgd.Engine
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(
                "replicated pipeline stages synchronize with the pipesgd engine, which is "
                "not built: run `make build` (or use a plan with replicas 1 everywhere)"
            ) from exc
        self.schedule = DelaySchedule(staleness)
        self.engine = engine_cls(comm)
        self.compression = compression
        self.bucket_bytes = bucket_bytes
        self.staging = staging
        # (handles, host sum, host count, the device copy being staged or None)
        self._pending: DelayedQueue[tuple[list, Tensor, Tensor, Tensor | None]] = \
            DelayedQueue(self.schedule)
        self._round = 0  # update rounds submitted
        self._free: list[Tensor] = []  # buffers of rounds applied, to be reused
        self._lent: list[Tensor] = []  # buffers ready() or flush() handed out last

    @property
    def staleness(self) -> int:
        return self.schedule.staleness

    def submit(self, flat_sum: Tensor, count: float) -> None:
        self._reclaim()
        counter = torch.tensor([float(count)], dtype=torch.float64)
        step = max(1, self.bucket_bytes // max(1, flat_sum.element_size()))
        spans = [slice(i, i + step) for i in range(0, flat_sum.numel(), step)]
        staged: Tensor | None = None
        if self.staging is None:
            buf = self._buffer(flat_sum, "cpu", lambda: self._host_zeros(flat_sum))
            buf.copy_(flat_sum.detach())
            handles = [self.engine.allreduce_async(buf[s], op="sum",
                                                   compression=self.compression)
                       for s in spans]
        else:
            staged = self._buffer(flat_sum, flat_sum.device,
                                  lambda: torch.empty_like(flat_sum))
            staged.copy_(flat_sum.detach())
            buf = self._buffer(flat_sum, "cpu", lambda: self.staging.host_empty(
                flat_sum.shape, flat_sum.dtype))
            handles = [self.staging.submit(self.engine, staged[s], buf[s], op="sum",
                                           compression=self.compression)
                       for s in spans]
        handles.append(self.engine.allreduce_async(counter, op="sum", compression="none"))
        self._pending.push(self._round, (handles, buf, counter, staged))
        self._round += 1

    def _host_zeros(self, like: Tensor) -> Tensor:
        """A host buffer like `like` in the engine's memory: where the replicas share a
        node, the engine reduces it in place. Every replica allocates at the same rounds
        (the free list follows the schedule alone), as that collective needs."""
        from pipesgd.buckets import engine_zeros  # this module imports without the engine

        return engine_zeros(self.engine, tuple(like.shape), like.dtype)

    def _buffer(self, like: Tensor, device: torch.device | str,
                allocate: Callable[[], Tensor]) -> Tensor:
        """A free buffer of `like`'s shape and dtype on `device`, or `allocate()`: a fresh
        buffer of a big stage's gradient costs a page fault per 4 KiB on every round."""
        device = torch.device(device)
        for i, buf in enumerate(self._free):
            if (buf.shape, buf.dtype, buf.device) == (like.shape, like.dtype, device):
                return self._free.pop(i)
        return allocate()

    def _reclaim(self) -> None:
        """Buffers handed out by ready() and flush() are free again: the stage applied
        them before its next round's gradient came in."""
        self._free.extend(self._lent)
        self._lent.clear()

    def _finish(self, entry: tuple[list, Tensor, Tensor, Tensor | None]) -> list[Tensor]:
        handles, buf, counter, staged = entry
        for h in handles:
            h.wait()
        count = float(counter.item())
        if staged is None or self.staging is None:
            self._lent.append(buf)
            return [buf.div_(count)] if count > 0 else []
        # the host buffer is free once copied back; the device copy once applied
        self._lent += [buf, staged]
        if count <= 0:
            return []
        self.staging.copy_to_device(staged, buf)
        return [staged.div_(count)]

    def ready(self) -> list[Tensor]:
        """The aggregate due in the round just submitted, if any (and if any replica
        contributed to it)."""
        due = self._pending.pop_due(self._round - 1)
        return self._finish(due.item) if due is not None else []

    def flush(self) -> list[Tensor]:
        """Every aggregate still in flight, oldest first (the epoch drains)."""
        return [g for entry in self._pending.drain() for g in self._finish(entry.item)]

    def shutdown(self) -> None:
        self.flush()
        self.engine.shutdown()
