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

On the CPU both copies are immediate, so each gate opens as soon as its operation is
queued, without the helper thread; the path is otherwise the same (host buckets, gated
operations): `DistributedOptimizer(staging=True)` forces it, which is how it is tested
without a GPU (`tests/test_staging.py` drives the helper thread with slow events).
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import torch
from torch import Tensor

from pipesgd.engine import Engine, Handle


class _Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    """A copy that has already happened (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Copies:
    """Copies between a device bucket and its host bucket, ordered as the module says."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, host: Tensor, device: Tensor) -> _Event:
        if self.stream is None:
            host.copy_(device)
            return _Done()
        filled = torch.cuda.current_stream(device.device).record_event()
        self.stream.wait_event(filled)
        with torch.cuda.stream(self.stream):
            host.copy_(device, non_blocking=True)
            return self.stream.record_event()

    def to_device(self, device: Tensor, host: Tensor) -> None:
        if self.stream is None:
            device.copy_(host)
            return
        with torch.cuda.stream(self.stream):
            device.copy_(host, non_blocking=True)
            copied = self.stream.record_event()
        torch.cuda.current_stream(device.device).wait_event(copied)


class _GateOpener:
    """Opens each gated operation's gate once its copy has completed: at once when it
    already has, else from one helper thread, in submission order."""

    def __init__(self) -> None:
        self._pending: queue.Queue[tuple[_Event, Handle] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def open_when(self, copied: _Event, handle: Handle) -> None:
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
    """

    def __init__(self, device: torch.device) -> None:
        self._pin = device.type == "cuda"
        self._copies = _Copies(device)
        self._opener = _GateOpener()

    def host_like(self, tensor: Tensor) -> Tensor:
        """A flat host buffer (pinned beside a GPU) for `tensor`'s elements."""
        return torch.zeros(tensor.numel(), dtype=tensor.dtype, pin_memory=self._pin)

    def submit(self, engine: Engine, device: Tensor, host: Tensor, *, op: str = "average",
               compression: str = "none") -> Handle:
        """Copy `device` into `host` and queue `host`'s allreduce, gated on the copy."""
        copied = self._copies.to_host(host, device)
        handle = engine.allreduce_async(host, op=op, compression=compression, gated=True)
        self._opener.open_when(copied, handle)
        return handle

    def fetch(self, host: Tensor, device: Tensor) -> None:
        """Copy the reduced `host` into `device`, ahead of the compute stream's next work."""
        self._copies.to_device(device, host)

    def close(self) -> None:
        """Stop the helper thread (after every submitted operation's gate is open)."""
        self._opener.close()


__all__ = ["HostStaging"]
