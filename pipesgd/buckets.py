"""Flat gradient buckets: a fixed layout of parameters into flat buffers, reused every step.

A `BucketLayout` assigns each parameter (by position in the list it was built from) to a
bucket and an offset. Buckets hold one dtype each and close once they reach
`bucket_bytes`; they are filled in reverse parameter order, which is roughly the order in
which backward produces gradients, so the first bucket is the first one ready.

`GradientBuckets` owns `sets` copies of every bucket's flat buffer, allocated once. A
caller packs the parameters' gradients into set `s`, submits bucket by bucket to an
engine, and later unpacks the reduced buffers back into the gradients. A caller may also
lend the buffers out as the gradients themselves (`param_views`, DDP's
gradient-as-bucket-view): backward then accumulates straight into them and packing one
is free. Nothing here knows about staleness or optimizers (that is `pipesgd.delay`):
the data-parallel optimizer uses it, with its buffers in the engine's shared memory
where the ranks share a node; the DDP hook reduces DDP's own buckets.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipesgd.engine import Engine, Handle


@dataclass(frozen=True)
class BucketSlot:
    """Where one parameter's gradient lives in its bucket.

    Attributes:
        param: index of the parameter in the list the layout was built from.
        offset: first element of the gradient in the bucket's flat buffer.
        numel: number of elements.
        strides: strides of the gradient's view into the buffer: the parameter's own
            when its elements are dense in some order (contiguous, channels_last), so
            backward accumulates into the view without a layout change; else row-major.
    """

    param: int
    offset: int
    numel: int
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    """One flat buffer's worth of gradients, all of one dtype."""

    dtype: torch.dtype
    numel: int
    slots: tuple[BucketSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketLayout:
    """The assignment of parameters to buckets; identical on every rank for equal inputs."""

    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]  # parameter index -> bucket index

    @classmethod
    def build(cls, params: Sequence[Tensor], bucket_bytes: int) -> BucketLayout:
        """Assign `params` to buckets of about `bucket_bytes` bytes each.

        Args:
            params: parameters (or any tensors shaped like their gradients).
            bucket_bytes: a bucket closes once it holds at least this many bytes; a
                single larger parameter gets a bucket of its own.

        Raises:
            ValueError: `bucket_bytes` is not positive.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        buckets: list[Bucket] = []
        bucket_of = [0] * len(params)
        open_: dict[torch.dtype, list[BucketSlot]] = {}
        sizes: dict[torch.dtype, int] = {}

        def close(dtype: torch.dtype) -> None:
            slots = open_.pop(dtype)
            for slot in slots:
                bucket_of[slot.param] = len(buckets)
            buckets.append(Bucket(dtype, sizes.pop(dtype), tuple(slots)))

        for index in reversed(range(len(params))):
            p = params[index]
            slots = open_.setdefault(p.dtype, [])
            offset = sizes.get(p.dtype, 0)
            slots.append(BucketSlot(index, offset, p.numel(), dense_strides(p)))
            sizes[p.dtype] = offset + p.numel()
            if sizes[p.dtype] * p.element_size() >= bucket_bytes:
                close(p.dtype)
        for dtype in list(open_):
            close(dtype)
        return cls(tuple(buckets), tuple(bucket_of))

    def describe(self) -> str:
        """A short text for error messages (`digest` tells layouts apart)."""
        return ", ".join(
            f"[{str(b.dtype).removeprefix('torch.')} x{b.numel}: {len(b.slots)} tensors]"
            for b in self.buckets
        )

    def digest(self) -> str:
        text = ";".join(
            f"{b.dtype}:" + ",".join(f"{s.param}@{s.offset}+{s.numel}/{s.strides}" for s in b.slots)
            for b in self.buckets
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class GradientBuckets:
    """`sets` preallocated copies of every bucket of a layout, on the parameters' device,
    and the copies in and out.

    Args:
        params: the parameters whose `.grad` is packed and unpacked, in layout order.
        bucket_bytes: target bucket size in bytes (see `BucketLayout.build`).
        sets: how many independent copies of the buckets to keep (one per gradient in
            flight at once).
        engine: on the CPU, the buffers come from `engine.zeros` (collective: every
            rank builds the same buckets in the same order). Where the ranks share a
            node's memory the engine then reduces them in place, without copies.
        layout: the layout of `params` and `bucket_bytes` when the caller has built it
            already (to check it across ranks first); None: built here.

    Raises:
        ValueError: `sets` < 1 or `bucket_bytes` <= 0.
    """

    def __init__(self, params: Sequence[Tensor], bucket_bytes: int, sets: int = 1,
                 engine: Engine | None = None, layout: BucketLayout | None = None) -> None:
        if sets < 1:
            raise ValueError(f"need at least one set of buckets, got sets={sets}")
        self.params = list(params)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"the parameters are on several devices ({sorted(map(str, devices))}):"
                             " move the model to one device first")
        device = devices.pop() if devices else torch.device("cpu")
        self.layout = BucketLayout.build(self.params, bucket_bytes) if layout is None \
            else layout

        def zeros(bucket: Bucket) -> Tensor:
            if engine is None or device.type != "cpu":
                return torch.zeros(bucket.numel, dtype=bucket.dtype, device=device)
            return engine_zeros(engine, (bucket.numel,), bucket.dtype)

        self.buffers: list[list[Tensor]] = [
            [zeros(b) for b in self.layout.buckets] for _ in range(sets)
        ]
        # built once: slicing a view per parameter on every step costs microseconds each
        self._views = [[self._make_views(s, b) for b in range(self.num_buckets)]
                       for s in range(sets)]
        # each bucket's parameter indices
        self.bucket_params = [frozenset(s.param for s in b.slots) for b in self.layout.buckets]

    @property
    def num_buckets(self) -> int:
        return len(self.layout.buckets)

    @property
    def num_sets(self) -> int:
        return len(self.buffers)

    def views(self, set_index: int, bucket: int) -> list[tuple[int, Tensor]]:
        """(parameter index, view of its gradient's place in the flat buffer) pairs."""
        return self._views[set_index][bucket]

    def _make_views(self, set_index: int, bucket: int) -> list[tuple[int, Tensor]]:
        flat = self.buffers[set_index][bucket]
        return [
            (s.param, flat[s.offset : s.offset + s.numel].as_strided(
                self.params[s.param].shape, s.strides))
            for s in self.layout.buckets[bucket].slots
        ]

    def param_views(self, set_index: int) -> list[Tensor]:
        """Every parameter's gradient-shaped place in set `set_index`, by parameter index,
        to lend out as its `.grad`.

        Each is an alias of the buffer's memory with a version counter of its own (a view
        would share the buffer's), so `_version` tells whether anything, such as backward
        accumulating into it, wrote that one gradient since a given moment.
        """
        views = dict(pair for b in range(self.num_buckets) for pair in self.views(set_index, b))
        return [_alias(views[i]) for i in range(len(self.params))]

    def missing_grads(self, bucket: int | None = None) -> list[int]:
        """Indices of parameters (of one bucket, or all) whose `.grad` is None."""
        if bucket is None:
            return [i for i, p in enumerate(self.params) if p.grad is None]
        return [
            s.param for s in self.layout.buckets[bucket].slots if self.params[s.param].grad is None
        ]

    def pack(self, set_index: int, bucket: int) -> Tensor:
        """Copy the bucket's parameters' gradients into its flat buffer; return the buffer.

        A gradient that already is its view of the buffer (`param_views`) is not copied.

        Raises:
            ValueError: a parameter of the bucket has no gradient.
        """
        for param, view in self.views(set_index, bucket):
            grad = self.params[param].grad
            if grad is None:
                raise ValueError(f"parameter {param} has no gradient to pack")
            if not is_view(grad, view):
                view.copy_(grad)
        return self.buffers[set_index][bucket]

    def unpack(self, set_index: int, bucket: int) -> None:
        """Copy the bucket's flat buffer into its parameters' gradients (allocated if None)."""
        for param, view in self.views(set_index, bucket):
            p = self.params[param]
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def submit(
        self,
        engine: Engine,
        set_index: int,
        bucket: int,
        *,
        op: str = "average",
        compression: str = "none",
    ) -> Handle:
        """Queue the in-place allreduce of one bucket's flat buffer on `engine`."""
        return engine.allreduce_async(
            self.buffers[set_index][bucket], op=op, compression=compression
        )


def engine_zeros(engine: Engine, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero-filled CPU tensor in `engine`'s memory (`Engine.zeros`, collective): where
    the ranks share a node, the engine reduces it in place."""
    numel = math.prod(shape)
    raw = engine.zeros(numel * torch.empty((), dtype=dtype).element_size(), np.uint8)
    if numel == 0:  # torch cannot view an empty byte array as another dtype
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).view(shape)


def dense_strides(tensor: Tensor) -> tuple[int, ...]:
    """`tensor`'s strides if its elements fill numel() consecutive places in some dimension
    order (contiguous, channels_last, a transpose), else the row-major strides of its shape:
    torch's `preserve_format` rule, read off a tensor on the meta device (no memory)."""
    return tuple(torch.empty_like(tensor, device="meta").stride())


def _alias(view: Tensor) -> Tensor:
    """`view`'s memory, seen the same way, as a tensor that is no autograd view of it."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def is_view(tensor: Tensor, view: Tensor) -> bool:
    """True when `tensor` is `view`'s memory seen the same way (so a copy would be a no-op)."""
    return tensor.data_ptr() == view.data_ptr() and tensor.stride() == view.stride()
