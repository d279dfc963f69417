"""Replicas of a stage: they start from one state, and average gradients through the
engine's ring all-reduce.

At construction, every replica receives the parameters and buffers of the stage's first
replica (`broadcast_from_first_replica`), so a model built differently on each rank (a
user's function that does not seed, or another seed) cannot make the replicas diverge.

Each replicated stage has its own sub-communicator and `pipesgd.Engine`. Every update
round, each replica contributes the sum of its micro-batch gradients (a flat buffer,
all-reduced in buckets) and how many micro-batches it summed; the stage then applies
sum / count. A replica without a micro-batch in the last round (uneven counts) joins
with zeros and count 0, so the average stays exact.

Wait-free, as PipeDream's replicas: during the backward that closes a round (the last one
before its all-reduce), each bucket's all-reduce starts as soon as autograd has made the
gradients it holds (`open_round`), and the update waits for them; the rest leave at the
all-reduce action. Buckets go from the last to the first, the order the backward makes
them, one after another, so every replica submits the same operations in the same order
whenever each became ready, and the sums are bitwise those of an all-reduce after the
backward.

Staleness K follows the Pipe-SGD optimizer's schedule (`pipesgd.delay`): round t applies
the aggregate launched K-1 rounds earlier (K = 1 is synchronous); the rest is applied when
the epoch drains. A stage on a GPU reduces through host staging (`pipesgd.staging`): a
device copy of each bucket of the round's sum (the next backward overwrites the stage's
buffer) goes to a pinned host buffer on a side stream, each bucket's all-reduce opens
when its copy has completed, and the aggregate returns to the device ahead of the update.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

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
        self._open: _OpenRound | None = None  # the round whose buckets are leaving
        self.early_buckets = 0  # buckets whose all-reduce started inside a backward

    @property
    def staleness(self) -> int:
        return self.schedule.staleness

    def open_round(self, flat_sum: Tensor,
                   param_ranges: Sequence[tuple[int, int]]) -> Callable[[int], None] | None:
        """Before the backward that closes a round: returns `made(i)`, to call once
        parameter i's gradient (elements `param_ranges[i]` of `flat_sum`) is final; each
        bucket's all-reduce starts as soon as every gradient in it is. None where this
        round's host buffer would have to be allocated: on one node that allocation is a
        collective of the replicas, which must not wait inside a backward (a replica
        there holds back the sends its neighbours wait for); the buckets then leave at
        `submit`."""
        self._reclaim()
        if self.staging is None and self._free_index(flat_sum, "cpu") is None:
            return None
        self._open = _OpenRound(self, flat_sum, param_ranges)
        return self._open.made

    def submit(self, flat_sum: Tensor, count: float) -> None:
        """The round's summed gradient and its micro-batch count: the buckets not yet
        leaving, then the count (every replica, even one without a micro-batch)."""
        if self._open is None:
            self._reclaim()
            self._open = _OpenRound(self, flat_sum, ())
        opened, self._open = self._open, None
        self.early_buckets += opened.finish()
        counter = torch.tensor([float(count)], dtype=torch.float64)
        handles = [*opened.handles,
                   self.engine.allreduce_async(counter, op="sum", compression="none")]
        self._pending.push(self._round, (handles, opened.buf, counter, opened.staged))
        self._round += 1

    def _allocate(self, flat_sum: Tensor) -> tuple[Tensor, Tensor | None]:
        """(the host buffer the round is reduced in, its device copy where staged)."""
        if self.staging is None:
            return self._buffer(flat_sum, "cpu", lambda: self._host_zeros(flat_sum)), None
        staged = self._buffer(flat_sum, flat_sum.device, lambda: torch.empty_like(flat_sum))
        buf = self._buffer(flat_sum, "cpu", lambda: self.staging.host_empty(
            flat_sum.shape, flat_sum.dtype))
        return buf, staged

    def _send(self, flat_sum: Tensor, buf: Tensor, staged: Tensor | None, span: slice):
        """Start the all-reduce of one bucket of the round's gradient."""
        if staged is None:
            buf[span].copy_(flat_sum[span].detach())
            return self.engine.allreduce_async(buf[span], op="sum",
                                               compression=self.compression)
        staged[span].copy_(flat_sum[span].detach())
        return self.staging.submit(self.engine, staged[span], buf[span], op="sum",
                                   compression=self.compression)

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
        i = self._free_index(like, device)
        return allocate() if i is None else self._free.pop(i)

    def _free_index(self, like: Tensor, device: torch.device | str) -> int | None:
        want = (like.shape, like.dtype, torch.device(device))
        return next((i for i, buf in enumerate(self._free)
                     if (buf.shape, buf.dtype, buf.device) == want), None)

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


class _OpenRound:
    """One round's buckets leaving one after another, from the last to the first."""

    def __init__(self, sync: ReplicaGradientSync, flat_sum: Tensor,
                 param_ranges: Sequence[tuple[int, int]]) -> None:
        self.sync, self.flat_sum = sync, flat_sum
        self.buf, self.staged = sync._allocate(flat_sum)
        step = max(1, sync.bucket_bytes // max(1, flat_sum.element_size()))
        self.spans = [slice(i, i + step) for i in range(0, flat_sum.numel(), step)]
        # bucket -> gradients still to be made in it; parameter -> its buckets
        self.waiting = [0] * len(self.spans)
        self.buckets: list[range] = []
        for start, end in param_ranges:
            mine = range(start // step, (end - 1) // step + 1) if end > start else range(0)
            self.buckets.append(mine)
            for k in mine:
                self.waiting[k] += 1
        self.next = len(self.spans) - 1  # the next bucket to leave
        self.handles: list = []
        self.early = 0  # buckets sent from `made`, inside the backward

    def made(self, param: int) -> None:
        """Parameter `param`'s gradient is final: send every bucket now complete, in
        order."""
        for k in self.buckets[param]:
            self.waiting[k] -= 1
        while self.next >= 0 and self.waiting[self.next] == 0:
            self._send_next()
            self.early += 1

    def finish(self) -> int:
        """Send the buckets left; the number sent early."""
        while self.next >= 0:
            self._send_next()
        return self.early

    def _send_next(self) -> None:
        self.handles.append(self.sync._send(self.flat_sum, self.buf, self.staged,
                                            self.spans[self.next]))
        self.next -= 1
