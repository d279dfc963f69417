"""pipesgd.staging's helper thread, driven by slow stand-ins for CUDA events: each gate
opens only once its copy has completed, in submission order, and a copy already done
opens its gate at once; host buffers pinned where they lie, against a stand-in for CUDA's
registration calls. The staged path end to end: tests/mpi/optim_staging.py."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from pipesgd.staging import HostStaging, _GateOpener, _pin_in_place


class SlowEvent:
    def __init__(self, seconds: float, log: list[str], name: str) -> None:
        self.seconds, self.log, self.name = seconds, log, name
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        time.sleep(self.seconds)
        self.done = True
        self.log.append(f"copied {self.name}")


class Gate:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.opened = threading.Event()

    def open_gate(self) -> None:
        self.log.append(f"open {self.name}")
        self.opened.set()


def test_gates_open_after_their_copies_in_order() -> None:
    log: list[str] = []
    opener = _GateOpener()
    gates = [Gate(log, name) for name in "abc"]
    for gate, seconds in zip(gates, (0.05, 0.01, 0.03), strict=True):
        opener.open_when(SlowEvent(seconds, log, gate.name), gate)
    assert not any(g.opened.is_set() for g in gates)  # returned before any copy ended
    for gate in gates:
        assert gate.opened.wait(timeout=30)
    opener.close()
    assert log == ["copied a", "open a", "copied b", "open b", "copied c", "open c"]


def test_a_finished_copy_opens_its_gate_at_once() -> None:
    log: list[str] = []
    opener = _GateOpener()
    event = SlowEvent(0.0, log, "a")
    event.done = True
    gate = Gate(log, "a")
    opener.open_when(event, gate)
    assert gate.opened.is_set() and log == ["open a"]
    opener.close()


def test_copies_are_timed_and_land_where_asked() -> None:
    staging = HostStaging(torch.device("cpu"))
    source = torch.randn(1 << 20)
    host = staging.host_empty(source.shape, source.dtype)
    assert staging.copy_to_host(host, source).query()  # a CPU copy is done at once
    back = torch.empty_like(source)
    staging.copy_to_device(back, host)
    assert torch.equal(back, source) and not host.is_pinned()
    first = staging.copy_seconds
    assert first > 0
    staging.copy_to_host(host, source)
    assert staging.copy_seconds > first


class FakeCudart:
    """`torch.cuda.cudart()`'s registration calls, answering `result` (0: success)."""

    class cudaError:  # cudart's name
        success = 0

    def __init__(self, result: int) -> None:
        self.result = result
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.result

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_a_buffer_pinned_where_it_lies_is_unpinned_when_collected(monkeypatch) -> None:
    cudart = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = torch.zeros(1000)
    ptr = host.data_ptr()
    _pin_in_place(host)
    assert cudart.calls == [("register", ptr, 4000, 0)]
    del host
    gc.collect()
    assert cudart.calls == [("register", ptr, 4000, 0), ("unregister", ptr)]


def test_a_buffer_cuda_refuses_to_pin_warns_and_stays_usable(monkeypatch) -> None:
    cudart = FakeCudart(712)  # cudaErrorHostMemoryAlreadyRegistered, say
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = torch.zeros(10)
    with pytest.warns(UserWarning, match=r"could not pin .*\(712\).* wait for the device"):
        _pin_in_place(host)
    del host
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register"]  # nothing to unregister
