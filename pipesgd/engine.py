"""The Python face of the compiled engine: `Engine`, `Handle`, and the
module-level API (`init`, `allreduce`, ...) on a default engine over COMM_WORLD.

Data flows one way: Python hands a buffer to the engine, the engine's comm
thread owns MPI for it, Python waits on the handle. The buffer stays referenced
here until its operation finishes, even if the caller drops array and handle.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from pipesgd import _C
from pipesgd.buffers import (
    COMPRESSIONS,
    REDUCE_OPS,
    BufferView,
    as_buffer,
    check_compression,
    check_op,
)
from pipesgd.errors import CollectiveMismatchError, PipesgdError
from pipesgd.host_memory import keep_freed_memory

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class Handle:
    """An operation in flight. `wait()` returns the reduced buffer."""

    __slots__ = ("_buffer", "_op", "_rank")

    def __init__(self, op: _C.Operation, buffer: BufferView, rank: int) -> None:
        self._op = op
        self._buffer = buffer
        self._rank = rank

    @property
    def seq(self) -> int:
        """Sequence number: the n-th operation submitted to this engine."""
        return int(self._op.seq)

    def done(self) -> bool:
        """True once the operation has finished (successfully or not)."""
        return bool(self._op.done())

    def open_gate(self) -> None:
        """Let a gated operation (`allreduce_async(..., gated=True)`) start: its buffer
        is filled. Any thread may call it; a second call does nothing."""
        self._op.open_gate()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes, releasing the GIL.

        Raises:
            TimeoutError: not finished within `timeout` seconds; names the rank waited on.
            CollectiveMismatchError: ranks submitted different operations.
            PipesgdError: the engine was shut down or MPI failed.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        if not self._op.wait(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(self._timeout_message(timeout))
        if self._op.failed():
            kind = self._op.failure()
            if kind == _C.FailureKind.MISMATCH:
                raise CollectiveMismatchError(self._op.error())
            if kind == _C.FailureKind.INVALID:
                raise ValueError(self._op.error())
            raise PipesgdError(self._op.error())
        return self._buffer.owner

    def _timeout_message(self, timeout: float | None) -> str:
        what = f"{self._op.describe()} on rank {self._rank} did not complete within {timeout} s"
        peer, phase = self._op.waiting_on, self._op.phase
        if phase == "queued":
            return f"{what}: it is still queued behind earlier operations that have not completed"
        return f"{what}: waiting for rank {peer} ({phase})"


def _checked_buffer(tensor: Any, op: str, compression: str) -> BufferView:
    """`tensor` as a buffer the engine can reduce in place; ValueError otherwise."""
    buffer = as_buffer(tensor)
    if op not in REDUCE_OPS or (compression != "none"
                                and (compression not in COMPRESSIONS
                                     or buffer.dtype != "float32")):
        check_op(op)  # raise, naming the problem
        check_compression(compression, buffer.dtype)
    return buffer


class Engine:
    """A ring-AllReduce engine on a duplicate of `comm`, with its own comm thread.

    Construction is collective over `comm`. Every rank must submit the same
    operations in the same order.

    Args:
        comm: an mpi4py communicator (default `MPI.COMM_WORLD`).
        segment_bytes: bytes per ring segment, the same on every rank (default: 256 KiB
            over shared-memory links, 60 KiB over a network and, with MPI messages over
            shared memory, L2 / window within [256 KiB, 1 MiB] with a core per rank,
            1 MiB without).
        window: ring receives posted ahead of the one being reduced, or slots of a
            shared-memory inbox (default: 4 over shared-memory links, 2 with MPI
            messages on shared memory and 8 over a network).
        comm_nice: nice value of the comm thread (0: the process's own). Below 0 it
            gets its core back from a compute thread sooner where ranks share cores;
            that needs root or CAP_SYS_NICE, and is ignored without.
        comm_slice_us: scheduler slice the comm thread asks for (Linux 6.12+'s EEVDF;
            0: the kernel's default).
        poll_max_us: while segments stream in over a slow link, the comm thread's sleep
            between tests doubles from PIPESGD_POLL_US up to this.
        poll_while_waited: while a thread waits on an operation, poll without sleeping
            (over shared memory spin with a core per rank, else test and `sched_yield`;
            over a network test and `sched_yield`); False always sleeps between tests.
        board_bytes: when three ranks or more are all on one node, uncompressed
            operations up to this many bytes (the smallest over the ranks) skip the ring:
            each rank posts its data on a shared-memory board, sums its chunk of
            everyone's and copies the others' sums (two waits instead of the ring's
            2(p - 1)); larger ones on one node are timed around the ring and staged
            through the board, and take the fastest (`operation_paths`). 0 sends every
            operation on the caller's arrays around the ring, at any p. Default (None)
            256 KiB (`csrc/engine_config.h`).
    """

    def __init__(self, comm: MPI.Comm | None = None, segment_bytes: int | None = None,
                 window: int | None = None, *, comm_nice: int = 0, comm_slice_us: int = 100,
                 poll_max_us: int = 200, poll_while_waited: bool = True,
                 board_bytes: int | None = None) -> None:
        keep_freed_memory()  # training's tensors reuse the heap instead of page-faulting
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise ValueError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        if segment_bytes is not None and segment_bytes < 64:
            raise ValueError(f"segment_bytes must be at least 64, got {segment_bytes}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if board_bytes is not None and (not isinstance(board_bytes, int) or board_bytes < 0):
            raise ValueError(f"board_bytes must be an integer >= 0, got {board_bytes!r}")
        board = {} if board_bytes is None else {"board_bytes": board_bytes}
        self._engine = _C.Engine(comm, int(segment_bytes or 0), int(window or 0),
                                 comm_nice=comm_nice, comm_slice_us=comm_slice_us,
                                 poll_max_us=poll_max_us,
                                 poll_while_waited=bool(poll_while_waited), **board)
        self._inflight: dict[int, tuple[_C.Operation, BufferView]] = {}
        self._lock = threading.Lock()
        _live_engines.add(self)

    @property
    def rank(self) -> int:
        return int(self._engine.rank)

    @property
    def size(self) -> int:
        return int(self._engine.size)

    @property
    def segment_bytes(self) -> int:
        return int(self._engine.segment_bytes)

    @property
    def window(self) -> int:
        """Ring receives posted ahead of the one being reduced, or inbox slots."""
        return int(self._engine.window)

    @property
    def shm_links(self) -> bool:
        """Whether segments travel through shared-memory inboxes between ranks on one node
        (a user-space copy) rather than MPI messages (PIPESGD_SHM_LINKS=0 turns them off)."""
        return bool(self._engine.shm_links)

    @property
    def shares_memory(self) -> bool:
        """Whether `zeros` lends memory every rank maps (all ranks on one node, with
        shared-memory links), which allreduce reduces in place."""
        return bool(self._engine.shares_memory)

    @property
    def board_bytes(self) -> int:
        """Uncompressed operations up to this many bytes go through the shared-memory
        board instead of the ring; 0 when there is none (two ranks, ranks on several
        nodes, no shared-memory links, or `board_bytes=0`)."""
        return int(self._engine.board_bytes)

    @property
    def linked_edges(self) -> tuple[bool, bool]:
        """Which of this rank's ring edges, (from the left, to the right), go through
        shared-memory links: those whose neighbour shares this rank's node."""
        left, right = self._engine.linked_edges
        return bool(left), bool(right)

    @property
    def operation_paths(self) -> dict[int, str]:
        """How uncompressed operations on the caller's arrays travel, per size class
        decided so far: the class's smallest size in bytes (a power of two, from 64 KiB)
        and "links", "messages" or "staged". Where every rank shares one node the engine
        times the first few operations of each class every way and keeps the fastest
        (docs/engine.md, "Links or messages", "The caller's arrays, staged");
        PIPESGD_SHM_LINKS=1 or 0 fixes one way and leaves this empty. Waits for an
        operation that is running."""
        return {int(b): str(path) for b, path in self._engine.tuned_paths().items()}

    @property
    def operation_trials(self) -> dict[int, dict[str, list[float]]]:
        """The trials behind `operation_paths`: per size class decided so far, the
        seconds of its last timed trials on each path it tried, in the order they ran,
        from the last rank's start to the last rank's end (the same on every rank). Waits
        for an operation that is running."""
        return {int(b): {str(path): [float(t) for t in runs] for path, runs in paths.items()}
                for b, paths in self._engine.tuned_trials().items()}

    @property
    def path_retrials(self) -> int:
        """How often the watch over a size class's kept path found it behind another
        path's last trials and ran the trials again early (csrc/path_tuner.h). Waits for
        an operation that is running."""
        return int(self._engine.path_watch_retrials())

    @property
    def config(self) -> dict[str, float]:
        """The configuration in force (a copy): the constructor's options and the PIPESGD_*
        environment variables as read when the engine started, with the segment size and
        window chosen for its transport filled in."""
        return dict(self._engine.config)

    @property
    def comm_cpu(self) -> int:
        """The CPU the communication thread is bound to, or -1 if it is not.

        On one node with a core per rank and ranks the launcher did not bind apart, each
        rank's thread is bound to a different CPU, so two ranks' threads never queue on
        one CPU while the other idles (docs/engine.md)."""
        return int(self._engine.comm_cpu)

    @property
    def polling_while_waited(self) -> str:
        """How the comm thread polls MPI messages while a thread of this process is blocked
        in `Handle.wait` (`poll_while_waited=False` turns both off). Over shared-memory
        links (`shm_links`) waits sleep on the inbox's doorbell instead (docs/engine.md).

        - ``"spin"``: over shared memory with a core per rank on the node. The waiting
          thread's core is idle, and a nap only adds a descheduled peer's lateness.
        - ``"yield"``: over shared memory with more ranks than cores, and over a
          network: test, then ``sched_yield``, so a peer or the kernel's network work
          sharing the core runs at once (as Open MPI does when oversubscribed). A link
          that bursts after idling (a token bucket) delivers faster than naps follow.
          A peer that has not started the operation for twenty naps' time is late:
          the wait naps from then on, leaving the cores to the ranks that compute.
        - ``"sleep"``: ``poll_while_waited=False``: nap between tests as at any other
          time.
        """
        return str(self._engine.polling_while_waited)

    def allreduce_async(
        self, tensor: Any, op: str = "average", compression: str = "none", gated: bool = False
    ) -> Handle:
        """Queue an in-place allreduce of `tensor` and return its handle at once.

        `gated=True`: `tensor` is still being filled (a device-to-host copy in flight).
        The operation keeps its place in the order every rank submits in, but the
        communication thread does not read `tensor` before `handle.open_gate()`.
        """
        return self._submit(tensor, op, compression, caller_waits=False, gated=gated)

    def _submit(self, tensor: Any, op: str, compression: str, caller_waits: bool,
                gated: bool = False) -> Handle:
        buffer = _checked_buffer(tensor, op, compression)
        operation = self._engine.allreduce(
            buffer.address, buffer.count, buffer.dtype, op, compression, caller_waits, gated
        )
        self._keep_alive(operation, buffer)
        return Handle(operation, buffer, self.rank)

    def _keep_alive(self, operation: _C.Operation, buffer: BufferView) -> None:
        """Hold `buffer` until `operation` has finished, even if the caller drops it."""
        with self._lock:
            self._forget_finished()
            self._inflight[int(operation.seq)] = (operation, buffer)

    def allreduce(
        self,
        tensor: Any,
        op: str = "average",
        compression: str = "none",
        timeout: float | None = None,
    ) -> Any:
        """In-place allreduce of `tensor`; returns it once every rank has contributed.

        Without a timeout and with nothing queued, this thread runs the operation itself
        instead of handing it to the communication thread and back (same order, same
        bits; small operations are mostly those two hand-offs)."""
        if timeout is not None:
            # Declared at submission: the comm thread polls as for a waited operation even
            # if this thread loses its core on the way into wait().
            return self._submit(tensor, op, compression, caller_waits=True).wait(timeout)
        buffer = _checked_buffer(tensor, op, compression)
        failed = self._engine.allreduce_now(
            buffer.address, buffer.count, buffer.dtype, op, compression
        )
        if failed is not None:
            Handle(failed, buffer, self.rank).wait()  # raises, naming the problem
        return buffer.owner

    def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A zero-filled array that `allreduce` reduces in place across the node's ranks.

        Collective: every rank calls it in the same order with the same shape and dtype.
        Where all ranks are on one node with shared memory (`shm_links`), the array lies
        in memory every rank maps. An uncompressed allreduce of it, or of a contiguous
        slice of it (the same slice on every rank), then sums each rank's data where it
        lies and writes the sums into every rank's array: no copies, less than half the
        memory traffic of a ring (docs/engine.md, "Buffers in shared memory"). Elsewhere
        it is an ordinary array. Either way it stays valid after the engine shuts down.

        Raises:
            ValueError: ranks asked for different sizes.
        """
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        raw = self._engine.shared_buffer(count * dtype.itemsize)
        if raw is None:
            return np.zeros(shape, dtype)
        return raw.view(dtype).reshape(shape)

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish queued operations (up to `timeout` s, default `PIPESGD_SHUTDOWN_SECONDS`),
        fail the rest, stop the comm thread. Idempotent."""
        self._engine.shutdown(-1.0 if timeout is None else float(timeout))
        with self._lock:
            self._inflight.clear()

    def _forget_finished(self) -> None:
        done = [seq for seq, (operation, _) in self._inflight.items() if operation.done()]
        for seq in done:
            del self._inflight[seq]


_default: Engine | None = None


def init(comm: MPI.Comm | None = None, segment_bytes: int | None = None,
         **options: Any) -> Engine:
    """Start the default engine on `comm` (default COMM_WORLD), with `Engine`'s keyword
    options (`window`, `comm_nice`, ...). Idempotent."""
    global _default
    if _default is not None and not _default._engine.is_shut_down:
        if comm is not None and _default_comm is not comm:
            raise PipesgdError(
                "pipesgd is already initialized on another communicator; "
                "call pipesgd.shutdown() first"
            )
        return _default
    _set_default_comm(comm)
    _default = Engine(comm, segment_bytes, **options)
    return _default


_default_comm: MPI.Comm | None = None


def _set_default_comm(comm: MPI.Comm | None) -> None:
    global _default_comm
    _default_comm = comm


def is_initialized() -> bool:
    return _default is not None and not _default._engine.is_shut_down


def default_engine() -> Engine:
    """The engine started by `init()`."""
    if not is_initialized():
        raise PipesgdError("pipesgd is not initialized: call pipesgd.init() first")
    assert _default is not None
    return _default


def rank() -> int:
    return default_engine().rank


def size() -> int:
    return default_engine().size


def allreduce_async(tensor: Any, op: str = "average", compression: str = "none") -> Handle:
    """Queue an in-place allreduce on the default engine; see `Engine.allreduce_async`."""
    return default_engine().allreduce_async(tensor, op=op, compression=compression)


def allreduce(
    tensor: Any, op: str = "average", compression: str = "none", timeout: float | None = None
) -> Any:
    """In-place allreduce on the default engine; returns `tensor`."""
    return default_engine().allreduce(tensor, op=op, compression=compression, timeout=timeout)


def shutdown(timeout: float | None = None) -> None:
    """Shut the default engine down (see `Engine.shutdown`). Safe to call twice."""
    global _default
    if _default is not None:
        _default.shutdown(timeout)
        _default = None


@atexit.register
def _shutdown_all_at_exit() -> None:
    # Registered after mpi4py's own exit handler, so it runs before MPI_Finalize.
    for engine in list(_live_engines):
        engine.shutdown()
