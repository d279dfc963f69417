"""pipesgd: pipelined SGD and pipeline parallelism over MPI.

The compiled engine runs a ring-AllReduce on its own communication thread:
hand it a buffer, keep computing, wait on the handle when you need the sum.
"""

import importlib
from typing import TYPE_CHECKING, Any

from pipesgd.device import device, local_rank, local_size
from pipesgd.engine import (
    Engine,
    Handle,
    allreduce,
    allreduce_async,
    default_engine,
    init,
    is_initialized,
    rank,
    shutdown,
    size,
)
from pipesgd.errors import CollectiveMismatchError, PipesgdError

if TYPE_CHECKING:
    from pipesgd import hooks
    from pipesgd.broadcast import broadcast_optimizer_state, broadcast_parameters
    from pipesgd.optim import DistributedOptimizer

__version__ = "0.1.0"

# The training API imports torch, about 1.2 s of every process; the engine needs only
# numpy and mpi4py. So these load on first use: `pipesgd.DistributedOptimizer`,
# `from pipesgd import hooks`.
_TRAINING_API = {
    "hooks": ("pipesgd.hooks", None),
    "DistributedOptimizer": ("pipesgd.optim", "DistributedOptimizer"),
    "broadcast_optimizer_state": ("pipesgd.broadcast", "broadcast_optimizer_state"),
    "broadcast_parameters": ("pipesgd.broadcast", "broadcast_parameters"),
}


def __getattr__(name: str) -> Any:
    if name not in _TRAINING_API:
        raise AttributeError(f"module 'pipesgd' has no attribute {name!r}")
    module, attribute = _TRAINING_API[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_TRAINING_API})


__all__ = [
    "CollectiveMismatchError",
    "DistributedOptimizer",
    "Engine",
    "Handle",
    "PipesgdError",
    "allreduce",
    "allreduce_async",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "default_engine",
    "device",
    "hooks",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
