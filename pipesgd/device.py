"""Which accelerator a rank uses: the node-local rank picks it.

`mpirun` starts one rank per GPU on each node; rank r of a node takes GPU r (modulo the
GPUs it sees), so the ranks of a node spread over its GPUs whatever their global ranks:

    device = pipesgd.device()            # cuda:<local rank> where CUDA is, else cpu
    model = build_model().to(device)

On the CPU, `torch_threads(n)` runs a block with torch's intra-op threads set to n (the
profilers time what one rank's compute thread costs with one).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mpi4py import MPI

from pipesgd.agreement import failure_anywhere

if TYPE_CHECKING:
    import torch


def _node(comm: MPI.Comm | None) -> MPI.Comm:
    return (MPI.COMM_WORLD if comm is None else comm).Split_type(MPI.COMM_TYPE_SHARED)


def local_rank(comm: MPI.Comm | None = None) -> int:
    """This rank's position among the ranks of `comm` (default COMM_WORLD) on its node.
    Collective over `comm`."""
    node = _node(comm)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def local_size(comm: MPI.Comm | None = None) -> int:
    """How many ranks of `comm` (default COMM_WORLD) share this rank's node. Collective."""
    node = _node(comm)
    try:
        return node.Get_size()
    finally:
        node.Free()


def device(comm: MPI.Comm | None = None) -> torch.device:
    """The device this rank should compute on: `cuda:<local rank mod GPUs>`, made the
    current CUDA device, where CUDA is available; else the CPU. Collective over `comm`."""
    import torch

    rank = local_rank(comm)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    chosen = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(chosen)
    return chosen


DEVICES = ("cpu", "cuda")


def run_device(name: str, comm: MPI.Comm | None = None) -> torch.device:
    """The device a run asked for by name computes on: the CPU, or this rank's GPU
    (`device`). Collective over `comm` (default COMM_WORLD) for "cuda": every rank
    learns whether CUDA is available on every node, so a node without it stops them all
    alike instead of leaving the others waiting in `device`'s collective.

    Raises:
        ValueError: an unknown name, or "cuda" where CUDA is not available on some rank
            (naming it).
    """
    import torch

    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}: expected one of {DEVICES}")
    if name == "cpu":
        return torch.device("cpu")
    require_cuda_everywhere(MPI.COMM_WORLD if comm is None else comm, True,
                            "--device cuda", "use --device cpu")
    return device(comm)


def require_cuda_everywhere(comm: MPI.Comm, needed: bool, asked: str, instead: str) -> None:
    """Where a rank that `needed` CUDA has none, raise on every rank of `comm` (collective):
    ValueError("[rank R: ]{asked}, but CUDA is not available on this machine (HOST):
    {instead}"), so none goes on into a collective the failing rank never reaches."""
    def check() -> None:
        import torch

        if needed and not torch.cuda.is_available():
            raise ValueError(f"{asked}, but CUDA is not available on this machine "
                             f"({socket.gethostname()}): {instead}")

    if (why := failure_anywhere(comm, check, errors=(ValueError,))) is not None:
        raise ValueError(why)


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda`, cuda by default where available (the CLIs' one rule)."""
    import torch

    parser.add_argument("--device", choices=DEVICES,
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: each rank on the GPU of its node-local rank "
                             "(default: cuda where available)")


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `torch.set_num_threads(threads)` (None: as it is), and give
    the count back after it, whatever the block raises."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


__all__ = ["DEVICES", "add_device_argument", "device", "local_rank", "local_size",
           "run_device", "torch_threads"]
