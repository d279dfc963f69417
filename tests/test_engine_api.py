"""Single-process checks of the Python API: validation before queueing, handles,
the default engine. (p = 1: MPI is initialized as a singleton in this process.)"""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch

import pipesgd

T = TypeVar("T")


def test_single_rank_is_identity(engine) -> None:
    x = np.arange(10, dtype=np.float32)
    assert engine.allreduce(x, op="sum") is x
    assert np.array_equal(x, np.arange(10, dtype=np.float32))
    assert engine.rank == 0 and engine.size == 1


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.ones((4, 4), np.float32)[:, 1], "not C-contiguous"),
        (np.ones(4, np.int32), "dtype int32 is not supported"),
        (torch.ones(4, 4).t(), "not contiguous"),
        (torch.ones(4, dtype=torch.int64), "not supported"),
        (torch.ones(4).to_sparse(), "layout torch.sparse_coo is not supported"),
        (torch.ones(4)._neg_view(), "lazy conjugate/negative bit"),
        (torch.ones(4, device="meta"), "tensor is on meta"),
        ([1.0, 2.0], "expected a numpy array or a torch tensor"),
    ],
)
def test_bad_buffers_raise_value_error(engine, bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.allreduce_async(bad)


def test_read_only_array_rejected(engine) -> None:
    x = np.ones(4, np.float32)
    x.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        engine.allreduce(x)


def test_unknown_op_and_compression(engine) -> None:
    with pytest.raises(ValueError, match="unknown op 'max'"):
        engine.allreduce(np.ones(4, np.float32), op="max")
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        engine.allreduce(np.ones(4, np.float32), compression="zip")
    with pytest.raises(ValueError, match="float32 only, got float64"):
        engine.allreduce(np.ones(4, np.float64), compression="quant8")


def test_single_rank_async_finishes_at_once_unless_something_is_ahead(engine) -> None:
    # One rank has nothing to exchange: with nothing queued the handle comes back done...
    x = np.arange(8, dtype=np.float32)
    assert engine.allreduce_async(x, op="average").done()
    assert np.array_equal(x, np.arange(8, dtype=np.float32))
    # ...but an operation behind a gated one keeps its place in the order.
    gated = engine.allreduce_async(np.ones(4, np.float32), gated=True)
    behind = engine.allreduce_async(np.ones(4, np.float32))
    assert not gated.done() and not behind.done()
    gated.open_gate()
    behind.wait(timeout=10)
    assert gated.done()


def test_handle_and_negative_timeout(engine) -> None:
    t = torch.ones(100)
    h = engine.allreduce_async(t)
    assert h.wait(timeout=10) is t
    assert h.done()
    with pytest.raises(ValueError, match="timeout"):
        h.wait(timeout=-1)


def test_the_engine_alone_does_not_import_torch() -> None:
    # torch costs every process about 1.2 s; a numpy-only user of the engine need not
    # pay it, and the training API still loads on first use.
    probe = (
        "import sys, numpy as np, pipesgd\n"
        "pipesgd.init(); a = np.arange(4, dtype=np.float32); pipesgd.allreduce(a)\n"
        "print('torch' in sys.modules)\n"
        "from pipesgd import DistributedOptimizer, hooks\n"
        "print('torch' in sys.modules, DistributedOptimizer.__name__, hooks.__name__,\n"
        "      pipesgd.broadcast_parameters.__name__, 'hooks' in dir(pipesgd))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMPI_MCA_btl": "^ofi"}).stdout
    assert out.split("\n")[:2] == [
        "False", "True DistributedOptimizer pipesgd.hooks broadcast_parameters True"], out
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        pipesgd.nonesuch  # noqa: B018


def test_segment_bytes_validated() -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        pipesgd.Engine(segment_bytes=8)


@pytest.mark.parametrize("window", [0, -2, 1.5])
def test_window_validated(window) -> None:
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        pipesgd.Engine(window=window)


@pytest.mark.parametrize("board_bytes", [-1, 4096.0, "64KiB"])
def test_board_bytes_validated(board_bytes) -> None:
    with pytest.raises(ValueError, match="board_bytes must be an integer >= 0"):
        pipesgd.Engine(board_bytes=board_bytes)


def test_one_rank_has_no_board() -> None:
    # Nothing to exchange with one rank; the default is what the constructor documents.
    e = pipesgd.Engine()
    try:
        assert e.board_bytes == 0 and e.config["board_bytes"] == 0
    finally:
        e.shutdown()


def test_segment_and_window_are_arguments_not_environment(monkeypatch) -> None:
    # Only five PIPESGD_* variables are read (engine_config.h); these are not among them.
    monkeypatch.setenv("PIPESGD_RING_WINDOW", "5")
    monkeypatch.setenv("PIPESGD_SEGMENT_BYTES", "4096")
    e = pipesgd.Engine(window=3)
    try:
        assert e.window == 3 and e.segment_bytes != 4096
    finally:
        e.shutdown()


def l2_share(window: int) -> int:
    """The documented shared-memory segment with a core per rank: L2 / window, whole
    pages, within [256 KiB, 1 MiB]; 1 MiB when the L2 size is unknown."""
    try:  # the C library's answer, as the engine asks it (sysconf)
        out = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True,
                             check=True).stdout.strip()
        l2 = int(out) if out.isdigit() else 0
    except (OSError, subprocess.CalledProcessError):
        l2 = 0
    if l2 <= 0:
        return 1 << 20
    return min(max(l2 // window // 4096 * 4096, 256 << 10), 1 << 20)


@pytest.mark.parametrize(
    ("env", "args", "segment_bytes", "window"),
    [
        ({}, {}, l2_share(2), 2),                             # ring neighbours share memory
        ({}, {"window": 4}, l2_share(4), 4),
        ({"OMPI_MCA_btl": "self,tcp"}, {}, 60 * 1024, 8),     # MPI told to use the network
        ({"OMPI_MCA_btl": "^sm"}, {"window": 3}, 60 * 1024, 3),
        ({}, {"segment_bytes": 4096}, 4096, 2),
    ],
)
def test_segment_and_window_follow_the_transport(monkeypatch, env, args, segment_bytes,
                                                 window) -> None:
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    e = pipesgd.Engine(**args)
    try:
        assert (e.segment_bytes, e.window) == (segment_bytes, window)
    finally:
        e.shutdown()


@pytest.mark.parametrize(
    ("env", "args", "polling"),
    [
        ({}, {}, "spin"),                                # one rank, shared memory
        ({}, {"poll_while_waited": False}, "sleep"),
        ({"OMPI_MCA_btl": "self,tcp"}, {}, "yield"),     # a network: test and yield
    ],
)
def test_polling_while_waited_follows_transport_and_argument(monkeypatch, env, args,
                                                             polling) -> None:
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    e = pipesgd.Engine(**args)
    try:
        assert e.polling_while_waited == polling
        t = np.arange(10, dtype=np.float32)
        assert e.allreduce_async(t, op="sum").wait(timeout=10) is t
        np.testing.assert_array_equal(t, np.arange(10, dtype=np.float32))
    finally:
        e.shutdown()


def test_default_engine_lifecycle() -> None:
    pipesgd.shutdown()
    with pytest.raises(pipesgd.PipesgdError, match=r"pipesgd.init\(\)"):
        pipesgd.rank()
    first = pipesgd.init()
    assert pipesgd.init() is first  # idempotent
    assert pipesgd.rank() == 0 and pipesgd.size() == 1
    x = np.ones(3, np.float32)
    assert pipesgd.allreduce(x) is x
    pipesgd.shutdown()
    pipesgd.shutdown()  # twice is fine
    assert not pipesgd.is_initialized()


def _slice_ns(task: Path) -> int | None:
    """se.slice (ns) from a task's /proc sched file; None without EEVDF slices."""
    sched = task / "sched"
    lines = sched.read_text().splitlines() if sched.exists() else []
    return next((int(ln.split(":")[1]) for ln in lines if ln.startswith("se.slice")), None)


def _comm_threads() -> list[Path]:
    """/proc task folders of every thread named pipesgd-comm in this process."""
    return [task for task in Path("/proc/self/task").iterdir()
            if _thread_name(task) == "pipesgd-comm"]


def _thread_name(task: Path) -> str | None:
    """The thread's name, or None where it ended since its folder was listed (a comm
    thread of an engine shut down just before)."""
    try:
        return (task / "comm").read_text().strip()
    except FileNotFoundError:
        return None


def _new_comm_thread(read: Callable[[Path], T], **options: int) -> T:
    """`read` of the task folder of a new engine's comm thread, while it runs."""
    before = {task.name for task in _comm_threads()}
    e = pipesgd.Engine(**options)
    try:
        e.allreduce(np.ones(4, np.float32))  # the thread has started and tuned itself
        new = {task.name: read(task) for task in _comm_threads() if task.name not in before}
    finally:
        e.shutdown()
    assert len(new) == 1, f"expected one new pipesgd-comm thread, found {new}"
    return next(iter(new.values()))


def _new_comm_thread_slice(**options: int) -> int | None:
    return _new_comm_thread(_slice_ns, **options)


def _new_comm_thread_nice(**options: int) -> int:
    return _new_comm_thread(lambda task: os.getpriority(os.PRIO_PROCESS, int(task.name)),
                            **options)


def _own_slice() -> int | None:
    return _slice_ns(Path("/proc/thread-self"))


@pytest.mark.skipif(_own_slice() is None, reason="no EEVDF slices here (Linux < 6.6)")
def test_comm_thread_asks_for_a_short_slice() -> None:
    kernel_default = _own_slice()
    assert kernel_default != 100_000
    assert _new_comm_thread_slice() == 100_000
    assert _new_comm_thread_slice(comm_slice_us=250) == 250_000
    assert _new_comm_thread_slice(comm_slice_us=0) == kernel_default


def test_comm_thread_nice() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert _new_comm_thread_nice() == own  # 0: the process's nice
    raised = 5 if own < 5 else 19  # raising nice needs no privilege
    assert _new_comm_thread_nice(comm_nice=raised) == raised
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the calling thread keeps its own
    if os.geteuid() == 0:  # lowering it needs the privilege
        assert _new_comm_thread_nice(comm_nice=-5) == -5
    with pytest.raises(ValueError, match=r"comm_nice=20 is not in \[-20, 19\]"):
        pipesgd.Engine(comm_nice=20)


@pytest.mark.parametrize(
    ("name", "value"),
    [("PIPESGD_SPIN_US", "-3"), ("PIPESGD_POLL_US", "fast"), ("PIPESGD_SHM_LINKS", "2"),
     ("PIPESGD_STALL_SECONDS", "")],
)
def test_a_bad_variable_gets_the_same_message_from_the_engine_and_python(
        monkeypatch, name, value) -> None:
    from pipesgd.polling import Polling

    monkeypatch.setenv(name, value)
    if value == "":
        # An empty variable is unset, for the engine and for Python alike.
        polling = Polling.from_env()
        assert (polling.spin_s, polling.poll_s) == pytest.approx((100e-6, 50e-6))
        e = pipesgd.Engine()
        assert e.config["stall_seconds"] == 60.0
        e.shutdown()
        return
    with pytest.raises(ValueError) as from_engine:
        pipesgd.Engine()
    with pytest.raises(ValueError) as from_python:
        Polling.from_env()
    assert name in str(from_engine.value)
    assert str(from_engine.value) == str(from_python.value)


def test_config_shows_what_the_engine_resolved(monkeypatch) -> None:
    monkeypatch.setenv("PIPESGD_SPIN_US", "7")
    e = pipesgd.Engine(window=3)
    try:
        config = e.config
        assert config["spin_us"] == 7 and config["window"] == 3
        assert config["segment_bytes"] == e.segment_bytes > 0  # chosen for the transport
        config["window"] = 99  # a copy: the engine's own is read-only
        assert e.config["window"] == 3
    finally:
        e.shutdown()
