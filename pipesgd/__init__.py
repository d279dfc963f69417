"""pipesgd: pipelined SGD and pipeline parallelism over MPI.

The compiled engine runs a ring-AllReduce on its own communication thread:
hand it a buffer, keep computing, wait on the handle when you need the sum.
"""

# Training API (imports torch): the delayed-gradient optimizer and its helpers.
from pipesgd import hooks
from pipesgd.broadcast import broadcast_optimizer_state, broadcast_parameters
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
from pipesgd.optim import DistributedOptimizer

__version__ = "0.1.0"

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
