"""Host staging: gradient buckets on an accelerator reduced through host copies.

The engine's ring reads and writes host memory, so a bucket that lives on the GPU is
copied into a host bucket (pinned, allocated once) before its allreduce and back after
it. Neither copy makes the compute thread wait for the device:

- to the host: an event recorded on the compute stream orders the copy, on a side
  stream, after the backward that filled the bucket; the allreduce is queued at once,
  gated (`Engine.allreduce_async(gated=True)`), keeping its place in every rank's order,
  and a helper thread opens its gate when the copy's own event has completed;
- back to the device: the copy runs on the side stream and the compute stream waits for
  its event, so the update that reads the bucket is ordered after it.

Given an engine whose ranks share a node, `host_like` buffers lie in its memory
(`Engine.zeros`), so its allreduce sums them in place instead of copying them through the
ring, as it does the unstaged buckets. Beside a GPU that memory is pinned where it lies
(`cudaHostRegister`), so the copies stay asynchronous; where CUDA refuses, a warning says
so and the copies wait for the device.

On the CPU both copies are immediate, so each gate opens as soon as its operation is
queued, without the helper thread; the path is otherwise the same (host buckets, gated
operations): `DistributedOptimizer(staging=True)` forces it, which is how it is tested
without a GPU (`tests/test_staging.py` drives the helper thread with slow events).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Protocol

import torch
from torch import Tensor

from pipesgd.buckets import engine_zeros
from pipesgd.engine import Engine, Handle


class CopyEvent(Protocol):
    """A copy's completion: a CUDA event, or one that has already happened (CPU)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    """A copy that has already happened (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Copies:
    """Copies between device tensors and their host twins, ordered as the module says,
    and the time they took (CUDA events with timing; the wall clock on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._seconds = 0.0

    def to_host(self, host: Tensor, device: Tensor) -> CopyEvent:
        if self.stream is None:
            begin = time.perf_counter()
            host.copy_(device)
            self._seconds += time.perf_counter() - begin
            return _Done()
        filled = torch.cuda.current_stream(device.device).record_event()
        self.stream.wait_event(filled)
        with torch.cuda.stream(self.stream):
            start = self._event()
            host.copy_(device, non_blocking=True)
            return self._finish(start)

    def to_device(self, device: Tensor, host: Tensor) -> None:
        if self.stream is None:
            begin = time.perf_counter()
            device.copy_(host)
            self._seconds += time.perf_counter() - begin
            return
        with torch.cuda.stream(self.stream):
            start = self._event()
            device.copy_(host, non_blocking=True)
            copied = self._finish(start)
        torch.cuda.current_stream(device.device).wait_event(copied)

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def _finish(self, start: torch.cuda.Event) -> torch.cuda.Event:
        end = self._event()
        self.seconds()  # fold the copies that have completed: the list stays short
        self._timed.append((start, end))
        return end

    def seconds(self) -> float:
        """Seconds spent copying so far (copies still running on the device not counted
        yet); reading it never waits for the device."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            self._seconds += start.elapsed_time(end) / 1e3
        return self._seconds


class _GateOpener:
    """Opens each gated operation's gate once its copy has completed: at once when it
    already has, else from one helper thread, in submission order."""

    def __init__(self) -> None:
        self._pending: queue.Queue[tuple[CopyEvent, Handle] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def open_when(self, copied: CopyEvent, handle: Handle) -> None:
        if copied.query():  # the engine runs operations in order whenever gates open
            handle.open_gate()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pipesgd-staging",
                                            daemon=True)
            self._thread.start()
        self._pending.put((copied, handle))

    def close(self) -> None:
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._pending.get()) is not None:
            copied, handle = item
            copied.synchronize()  # releases the GIL while the device copies
            handle.open_gate()


class HostStaging:
    """Host twins of device tensors, the copies between them and the gates those copies
    open (see the module).

    Args:
        device: where the device tensors live; a CPU device runs the same path without a
            GPU.
        engine: where `host_like` buffers lie, when given and its ranks share memory
            (`Engine.shares_memory`); `host_like` is then collective.
    """

    def __init__(self, device: torch.device, engine: Engine | None = None) -> None:
        self._pin = device.type == "cuda"
        self._engine = engine if engine is not None and engine.shares_memory else None
        self._copies = _Copies(device)
        self._opener = _GateOpener()

    def host_like(self, tensor: Tensor) -> Tensor:
        """A flat host buffer (pinned beside a GPU) for `tensor`'s elements: in the
        engine's memory, when it shares memory (collective then: every rank asks for the
        same sizes in the same order), else in torch's."""
        if self._engine is None:
            return torch.zeros(tensor.numel(), dtype=tensor.dtype, pin_memory=self._pin)
        host = engine_zeros(self._engine, (tensor.numel(),), tensor.dtype)
        if self._pin:
            _pin_in_place(host)
        return host

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
        """An uninitialised host tensor (pinned beside a GPU) of `shape` and `dtype`."""
        return torch.empty(shape, dtype=dtype, pin_memory=self._pin)

    def copy_to_host(self, host: Tensor, device: Tensor) -> CopyEvent:
        """Start copying `device` into `host` after the compute stream's work so far;
        returns the copy's event (already complete on the CPU)."""
        return self._copies.to_host(host, device)

    def copy_to_device(self, device: Tensor, host: Tensor) -> None:
        """Copy `host` into `device`, ahead of the compute stream's next work."""
        self._copies.to_device(device, host)

    def submit(self, engine: Engine, device: Tensor, host: Tensor, *, op: str = "average",
               compression: str = "none") -> Handle:
        """Copy `device` into `host` and queue `host`'s allreduce, gated on the copy."""
        copied = self._copies.to_host(host, device)
        handle = engine.allreduce_async(host, op=op, compression=compression, gated=True)
        self._opener.open_when(copied, handle)
        return handle

    @property
    def copy_seconds(self) -> float:
        """Seconds the copies between device and host have taken so far, both ways (the
        cost staging adds; on a GPU it runs beside compute). Never waits for the device."""
        return self._copies.seconds()

    def close(self) -> None:
        """Stop the helper thread (after every submitted operation's gate is open)."""
        self._opener.close()


def _pin_in_place(host: Tensor) -> None:
    """Page-lock `host` for the GPU's copy engines where it lies, until it is collected;
    where CUDA refuses, warn: its copies then wait for the device."""
    cudart = torch.cuda.cudart()
    ptr = host.data_ptr()
    error = cudart.cudaHostRegister(ptr, host.numel() * host.element_size(), 0)
    if error != cudart.cudaError.success:
        warnings.warn(f"pipesgd: CUDA could not pin the engine's shared buffer ({error}): "
                      "its copies to and from the GPU will wait for the device", stacklevel=3)
        return
    # before the memory is unmapped (the storage outlives this tensor object); not at exit,
    # when CUDA may be gone already
    weakref.finalize(host, cudart.cudaHostUnregister, ptr).atexit = False


__all__ = ["CopyEvent", "HostStaging"]
