"""Python's polite waits run the comm thread's polling rule (csrc/poller.h) through the
binding: spin for spin_us, then sleep poll_us between tests, with an optional timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from pipesgd import _C
from pipesgd.polling import Polling, wait_until


def counting(true_on: int) -> tuple[list[int], Callable[[], bool]]:
    calls = [0]

    def test() -> bool:
        calls[0] += 1
        return calls[0] >= true_on

    return calls, test


def test_spins_without_sleeping_within_spin_us() -> None:
    calls, test = counting(500)
    start = time.perf_counter()
    assert wait_until(test, Polling(spin_s=30.0, poll_s=1.0))
    assert calls[0] == 500
    assert time.perf_counter() - start < 1.0  # not one sleep of poll_s


def test_sleeps_poll_us_after_each_failed_test_once_spin_us_passed() -> None:
    calls, test = counting(4)
    start = time.perf_counter()
    assert wait_until(test, Polling(spin_s=0.0, poll_s=0.02))
    assert calls[0] == 4
    assert time.perf_counter() - start >= 0.06  # three sleeps (a sleep never ends early)


def test_timeout_returns_false_after_testing() -> None:
    calls, test = counting(10**9)
    start = time.perf_counter()
    assert not wait_until(test, Polling(spin_s=0.0, poll_s=0.005), timeout_s=0.05)
    assert time.perf_counter() - start >= 0.05
    assert calls[0] >= 2


def test_an_exception_in_the_test_leaves_the_wait() -> None:
    def test() -> bool:
        raise KeyError("peer gone")

    with pytest.raises(KeyError, match="peer gone"):
        wait_until(test, Polling(spin_s=0.0, poll_s=0.001))


def test_other_python_threads_run_while_it_sleeps() -> None:
    # the GIL is released while asleep: a thread that needs it sets the flag waited for
    flag = threading.Event()
    worker = threading.Thread(target=lambda: (time.sleep(0.01), flag.set()))
    worker.start()
    assert wait_until(flag.is_set, Polling(spin_s=0.0, poll_s=0.001), timeout_s=30)
    worker.join()


def test_negative_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="spin_us and poll_us"):
        _C.polite_wait(lambda: True, -1, 50)


def test_wait_unwatched_looks_until_done_then_collects_the_result():
    from pipesgd.polling import wait_unwatched

    class Handle:
        looks, waits = 0, 0

        def done(self) -> bool:
            self.looks += 1
            return self.looks >= 3

        def wait(self) -> None:
            assert self.looks >= 3, "collected before it was done"
            self.waits += 1

    handle = Handle()
    wait_unwatched(handle, poll_s=1e-4)
    assert (handle.looks, handle.waits) == (3, 1)
