"""Bucket layouts and the pack / submit / unpack round trip (p = 1)."""

import warnings

import pytest
import torch

import pipesgd
from pipesgd.buckets import BucketLayout, GradientBuckets, dense_strides, engine_zeros


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (5,), (2, 3)])
def test_engine_zeros_gives_tensors_of_any_shape_and_dtype(shape: tuple[int, ...],
                                                            dtype: torch.dtype) -> None:
    # Empty ones too: a replicated stage without parameters has an empty gradient.
    engine = pipesgd.Engine()
    t = engine_zeros(engine, shape, dtype)
    assert t.shape == shape and t.dtype == dtype and not t.any()
    if t.numel():
        t.fill_(2)
        assert engine.allreduce(t, op="sum") is t and torch.all(t == 2 * engine.size)
    engine.shutdown()


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


def test_views_are_built_once_and_stay_on_the_buffer() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(5))]
    buckets = GradientBuckets(params, bucket_bytes=1 << 20, sets=2)
    for s in range(2):
        first = buckets.views(s, 0)
        assert buckets.views(s, 0) is first  # the step path does not slice them again
        buckets.buffers[s][0].copy_(torch.arange(11.0) + 100 * s)
        by_param = dict(first)
        flat = torch.cat([by_param[i].reshape(-1) for i in sorted(by_param)])
        assert torch.equal(torch.sort(flat).values, torch.arange(11.0) + 100 * s)


def test_dense_strides() -> None:
    t = torch.zeros(2, 3, 4, 5)
    assert dense_strides(t) == (60, 20, 5, 1)
    nhwc = t.contiguous(memory_format=torch.channels_last)
    assert dense_strides(nhwc) == nhwc.stride() == (60, 1, 15, 3)
    assert dense_strides(t.transpose(0, 3)) == (1, 20, 5, 60)
    assert dense_strides(t[:, :, ::2]) == (30, 10, 5, 1)  # holes: row-major of its shape
    assert dense_strides(torch.zeros(())) == ()


def test_views_follow_a_channels_last_parameter() -> None:
    # backward accumulates into a view laid out like the parameter: no copy, no warning
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    plain = torch.nn.Conv2d(3, 4, 3)
    plain.load_state_dict(conv.state_dict())
    params = list(conv.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1 << 20)
    views = buckets.param_views(0)
    assert views[0].stride() == params[0].stride() == (27, 1, 9, 3)
    for p, v in zip(params, views, strict=True):
        p.grad = v
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "grad and param do not obey the gradient layout"
        conv(x.contiguous(memory_format=torch.channels_last)).square().sum().backward()
    plain(x).square().sum().backward()
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(params, views, strict=True))
    for p, q in zip(params, plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)
    contiguous = BucketLayout.build(list(plain.parameters()), 1 << 20)
    assert buckets.layout.digest() != contiguous.digest()
