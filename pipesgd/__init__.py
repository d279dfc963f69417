"""pipesgd: pipelined SGD and pipeline parallelism over MPI.

The compiled engine runs a ring-AllReduce on its own communication thread:
hand it a buffer, keep computing, wait on the handle when you need the sum.
"""

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

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "Engine",
    "Handle",
    "PipesgdError",
    "allreduce",
    "allreduce_async",
    "default_engine",
    "init",
    "is_initialized",
    "rank",
    "shutdown",
    "size",
]
