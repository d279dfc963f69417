"""Bucket layouts and the pack / submit / unpack round trip (p = 1)."""

import pytest
import torch

import pipesgd
from pipesgd.buckets import BucketLayout, GradientBuckets


def tensors(*shapes, dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def test_layout_is_reverse_order_and_closes_at_the_size() -> None:
    layout = BucketLayout.build(tensors(10, 10, 10, 30), bucket_bytes=80)
    assert [[s.param for s in b.slots] for b in layout.buckets] == [[3], [2, 1], [0]]
    assert layout.bucket_of == (2, 1, 1, 0)
    assert [s.offset for s in layout.buckets[1].slots] == [0, 10]


def test_layout_keeps_dtypes_apart() -> None:
    params = [*tensors(4), *tensors(4, dtype=torch.float64), *tensors(4)]
    layout = BucketLayout.build(params, bucket_bytes=1 << 20)
    assert sorted(str(b.dtype) for b in layout.buckets) == ["torch.float32", "torch.float64"]
    assert layout.digest() != BucketLayout.build(params, bucket_bytes=16).digest()


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        BucketLayout.build(tensors(3), 0)
    with pytest.raises(ValueError, match="at least one set"):
        GradientBuckets(tensors(3), 64, sets=0)


def test_pack_submit_unpack_round_trip() -> None:
    engine = pipesgd.Engine()
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(5))]
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 10 * i
    expected = [p.grad.clone() for p in params]
    buckets = GradientBuckets(params, bucket_bytes=8, sets=2)
    assert buckets.num_buckets == 2
    buffers_before = [b.data_ptr() for s in buckets.buffers for b in s]
    handles = []
    for b in range(buckets.num_buckets):
        buckets.pack(1, b)
        handles.append(buckets.submit(engine, 1, b, op="sum"))
    for h in handles:
        h.wait()
    for p in params:
        p.grad.zero_()
    for b in range(buckets.num_buckets):
        buckets.unpack(1, b)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))
    assert [b.data_ptr() for s in buckets.buffers for b in s] == buffers_before
    params[0].grad = None
    assert buckets.missing_grads() == [0]
    engine.shutdown()
