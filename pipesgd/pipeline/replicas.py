"""Gradient synchronization of a replicated stage through the engine's ring all-reduce.

Each replicated stage has its own sub-communicator and `pipesgd.Engine`. Every update
round, each replica contributes the sum of its micro-batch gradients (a flat buffer,
all-reduced in buckets) and how many micro-batches it summed; the stage then applies
sum / count. A replica without a micro-batch in the last round (uneven counts) joins
with zeros and count 0, so the average stays exact. Staleness K follows the Pipe-SGD
optimizer: round t applies the aggregate launched K-1 rounds earlier (K = 1 is
synchronous); the rest is applied when the epoch drains.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

DEFAULT_BUCKET_BYTES = 4 << 20


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
    """

    def __init__(
        self,
        comm,
        *,
        compression: str = "none",
        staleness: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        try:
            import pipesgd

            engine_cls = pipesgd.Engine
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(
                "replicated pipeline stages synchronize with the pipesgd engine, which is "
                "not built: run `make build` (or use a plan with replicas 1 everywhere)"
            ) from exc
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 (1 = synchronous), got {staleness}")
        self.engine = engine_cls(comm)
        self.compression = compression
        self.staleness = staleness
        self.bucket_bytes = bucket_bytes
        self._pending: deque[tuple[list, Tensor, Tensor]] = deque()

    def submit(self, flat_sum: Tensor, count: float) -> None:
        buf = flat_sum.detach().to("cpu", copy=True).contiguous()
        counter = torch.tensor([float(count)], dtype=torch.float64)
        step = max(1, self.bucket_bytes // max(1, buf.element_size()))
        handles = [
            self.engine.allreduce_async(buf[i : i + step], op="sum", compression=self.compression)
            for i in range(0, buf.numel(), step)
        ]
        handles.append(self.engine.allreduce_async(counter, op="sum", compression="none"))
        self._pending.append((handles, buf, counter))

    def _finish(self) -> Tensor | None:
        handles, buf, counter = self._pending.popleft()
        for h in handles:
            h.wait()
        count = float(counter.item())
        return buf / count if count > 0 else None

    def ready(self) -> list[Tensor]:
        out = []
        while len(self._pending) > self.staleness - 1:
            g = self._finish()
            if g is not None:
                out.append(g)
        return out

    def flush(self) -> list[Tensor]:
        out = []
        while self._pending:
            g = self._finish()
            if g is not None:
                out.append(g)
        return out

    def shutdown(self) -> None:
        self.flush()
        self.engine.shutdown()
