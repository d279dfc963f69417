"""The mixed-precision backward the AMP tests run (tests/mpi/optim_amp.py and
optim_ddp_hook.py on the CPU, tests/gpu/test_hook_cuda.py on CUDA): autocast, a scaled
loss, and optionally one poisoned gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def scaled_backward(scaler: torch.amp.GradScaler, forward: Callable[[torch.Tensor], torch.Tensor],
                    x: torch.Tensor, y: torch.Tensor, poisoned: nn.Parameter | None = None,
                    bad: float = float("inf"), device: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Backward of the scaled cross-entropy of `forward(x)` under `device`'s autocast to
    `dtype`; with `poisoned`, element [0, 0] of that parameter's gradient becomes `bad`
    (this rank only)."""

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = bad
        return grad

    hook = poisoned.register_hook(poison) if poisoned is not None else None
    try:
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(forward(x).float(), y)
        scaler.scale(loss).backward()
    finally:
        if hook is not None:
            hook.remove()
