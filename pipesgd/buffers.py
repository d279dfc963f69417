"""Turn numpy arrays and torch tensors into what the engine reads: an address,
an element count and a dtype name, without copying.

Every check happens here, before anything is queued, so bad input raises
`ValueError` in the caller's thread instead of failing on the comm thread.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, NoReturn

import numpy as np

from pipesgd import _C

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
REDUCE_OPS = ("average", "sum")
COMPRESSIONS = ("none", "trunc16", "quant8")

_NUMPY_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.float16): "float16",
}


class BufferView(NamedTuple):
    """A contiguous, writable buffer as the engine sees it."""

    address: int
    count: int
    dtype: str
    owner: Any  # the array or tensor; kept referenced while an operation uses it


# Every operation passes through here, so the accepted case costs a few attribute reads
# (an allreduce of a few bytes is mostly this and the binding's calls); what is rejected
# goes the long way, for its message.


def _numpy_view(array: np.ndarray) -> BufferView:
    name = _NUMPY_DTYPES.get(array.dtype)
    flags = array.flags
    if name is None or not flags.c_contiguous or not flags.writeable:
        _reject_numpy(array)
    return BufferView(_C.buffer_address(array), array.size, name, array)


def _reject_numpy(array: np.ndarray) -> NoReturn:
    if array.dtype not in _NUMPY_DTYPES:
        raise ValueError(
            f"array dtype {array.dtype} is not supported; expected one of "
            f"{tuple(_NUMPY_DTYPES.values())} (bfloat16 through torch tensors)"
        )
    if not array.flags.c_contiguous:
        raise ValueError("array is not C-contiguous; pass np.ascontiguousarray(a) and copy back")
    raise ValueError("array is read-only; the allreduce writes its result in place")


@functools.cache
def _torch_kinds() -> tuple[dict[Any, str], Any]:
    """The torch dtypes the engine reduces, by name, and the dense layout."""
    import torch

    return ({torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
             torch.bfloat16: "bfloat16"}, torch.strided)


def _torch_view(tensor: Any) -> BufferView:
    names, strided = _torch_kinds()
    name = names.get(tensor.dtype)
    if (name is None or tensor.layout is not strided or not tensor.is_cpu
            or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg()):
        _reject_torch(tensor)
    return BufferView(tensor.data_ptr(), tensor.numel(), name, tensor)


def _reject_torch(tensor: Any) -> NoReturn:
    names, strided = _torch_kinds()
    if tensor.device.type != "cpu":
        raise ValueError(
            f"tensor is on {tensor.device}; the engine reduces host memory: copy it with "
            "t_cpu = t.cpu(), reduce t_cpu, then t.copy_(t_cpu)"
        )
    if tensor.layout != strided:
        raise ValueError(f"tensor layout {tensor.layout} is not supported; use a dense tensor")
    if tensor.dtype not in names:
        raise ValueError(
            f"tensor dtype {tensor.dtype} is not supported; expected one of {SUPPORTED_DTYPES}"
        )
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous; pass t.contiguous() and copy the result back")
    raise ValueError("tensor has a lazy conjugate/negative bit; call t.resolve_conj() first")


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def as_buffer(obj: Any) -> BufferView:
    """Validate `obj` (numpy array or torch tensor) and describe its memory."""
    if isinstance(obj, np.ndarray):
        return _numpy_view(obj)
    if _is_torch_tensor(obj):
        return _torch_view(obj)
    raise ValueError(f"expected a numpy array or a torch tensor, got {type(obj).__name__}")


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown op {op!r}: expected one of {REDUCE_OPS}")
    return op


def check_compression(compression: str, dtype: str | None = None) -> str:
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}: expected one of {COMPRESSIONS}")
    if dtype is not None and compression != "none" and dtype != "float32":
        raise ValueError(
            f"compression {compression!r} works on float32 only, got {dtype}; "
            "use compression='none' or convert the buffer to float32"
        )
    return compression
