"""Start every rank from the same state: broadcast parameters and optimizer state from a root.

Parameters go tensor by tensor with MPI `Bcast` into the tensors' own memory; optimizer
state (small, nested, lazily created) is pickled once with `bcast`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def broadcast_parameters(
    params: nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    root: int = 0,
    comm: MPI.Comm | None = None,
    what: str = "pass",
) -> None:
    """Overwrite every rank's tensors with the root's, in place.

    Args:
        params: a module (its `state_dict()`, so buffers too), a state dict, or
            `(name, tensor)` pairs such as `model.named_parameters()`. The same names
            in the same order on every rank.
        root: rank whose values everyone receives.
        comm: communicator (default COMM_WORLD).
        what: the verb of the mismatch message ("every rank must pass the same model").

    Raises:
        ValueError: `root` is not a rank of `comm`, or the ranks' tensors differ in
            names, shapes or dtypes (on every rank).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not 0 <= root < comm.size:
        raise ValueError(f"root must be a rank in [0, {comm.size}), got {root}")
    if isinstance(params, nn.Module):
        items = list(params.state_dict().items())
    elif isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = list(params)
    # Every rank checks every layout, so a mismatch raises everywhere (the root too)
    # instead of leaving some ranks waiting in a Bcast.
    layouts = comm.allgather([(n, tuple(t.shape), str(t.dtype)) for n, t in items])
    for rank, layout in enumerate(layouts):
        if layout != layouts[root]:
            diff = next((f"{a} vs {b}" for a, b in zip(layouts[root], layout, strict=False)
                         if a != b), f"{len(layouts[root])} vs {len(layout)} tensors")
            raise ValueError(f"rank {rank} has other tensors than the root (first difference: "
                             f"{diff}): every rank must {what} the same model")
    with torch.no_grad():
        for _name, tensor in items:
            target = tensor.detach()
            # an accelerator's tensor travels through a CPU copy
            work = target if target.is_contiguous() and target.device.type == "cpu" \
                else target.contiguous().cpu()
            if work.numel():
                raw = work.view(-1).view(_BITS[work.element_size()]) if work.is_floating_point() \
                    or work.is_complex() else work.view(-1)
                comm.Bcast(raw.numpy(), root=root)
            if work is not target:
                target.copy_(work)


def broadcast_optimizer_state(optimizer: Any, root: int = 0, comm: MPI.Comm | None = None) -> None:
    """Give every rank the root's optimizer state (momentum buffers, Adam moments, step).

    Args:
        optimizer: a torch optimizer or a `pipesgd.DistributedOptimizer` (its inner
            optimizer's state is broadcast; its in-flight gradients are not touched).
        root: rank whose state everyone receives.
        comm: communicator (default COMM_WORLD).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    inner = getattr(optimizer, "optimizer", optimizer)
    state = comm.bcast(inner.state_dict() if comm.rank == root else None, root=root)
    if comm.rank != root:
        inner.load_state_dict(state)
