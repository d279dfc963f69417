"""Waiting for MPI requests without taking a core from the ranks that compute.

MPI's own Wait spins, which takes a core from the ranks that compute when ranks share
cores; over TCP, Open MPI moves data only inside MPI calls, so a spinning rank also
holds up the peers whose transfers it waits for. These waits test, then sleep, by the
comm thread's own rule and loop (csrc/poller.h, through the binding). Used by the
pipeline's point-to-point exchange and by the network measurements of
`pipesgd.timing`; `decided_on_root` lets rank 0 work (profile, choose) while the others
sleep.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mpi4py import MPI


@dataclass(frozen=True)
class Polling:
    """How long a wait tests without pause, then how long it sleeps between tests."""

    spin_s: float
    poll_s: float

    @classmethod
    def from_env(cls) -> Polling:
        """PIPESGD_SPIN_US (default 100 µs) and PIPESGD_POLL_US (50 µs), read by the
        engine's own parser, so a value means the same here as on the comm thread.

        Raises:
            ValueError: a PIPESGD_* variable is malformed (the message names it).
        """
        from pipesgd import _C

        config = _C.env_config()
        return cls(config["spin_us"] * 1e-6, config["poll_us"] * 1e-6)


def wait_politely(requests: MPI.Request | Sequence[MPI.Request],
                  polling: Polling | None = None) -> None:
    """Wait for one request, or all of a list, as the engine's comm thread does on shared
    memory: test without pause for `polling.spin_s`, then test and sleep `polling.poll_s`
    (None: from the environment).
    """
    if isinstance(requests, MPI.Request):
        wait_until(requests.Test, polling)
    else:
        pending = list(requests)
        wait_until(lambda: MPI.Request.Testall(pending), polling)


def wait_until(test: Callable[[], bool], polling: Polling | None = None,
               timeout_s: float | None = None) -> bool:
    """Call `test` (which may drive MPI: a request's Test, an Iprobe) as `wait_politely`
    does until it returns True; False if `timeout_s` passed first. The loop is the comm
    thread's own (`csrc/poller.h`), run through the binding."""
    from pipesgd import _C

    polling = Polling.from_env() if polling is None else polling
    return _C.polite_wait(test, round(polling.spin_s * 1e6), round(polling.poll_s * 1e6),
                          -1.0 if timeout_s is None else timeout_s)


def wait_unwatched(handle: Any, poll_s: float = 1e-3) -> None:
    """Wait for an engine operation without blocking in `Handle.wait`: look every
    `poll_s`, asleep between looks, then collect it (raising what it raised).

    A thread blocked in `wait` makes the comm thread poll without napping; measuring
    what communication costs the compute beside it (as Pipe-SGD runs) needs it not to."""
    wait_until(handle.done, Polling(spin_s=0.0, poll_s=poll_s))
    handle.wait()


def notice_delay_s(polling: Polling | None = None, samples: int = 40) -> float:
    """Mean time from a request completing to a waiter in its sleeping phase noticing:
    half of one sleep-and-test step, timed here (a sleep lasts longer than asked, by the
    timer's slack)."""
    polling = Polling.from_env() if polling is None else polling
    steps = []
    for _ in range(samples):
        start = time.perf_counter()
        time.sleep(polling.poll_s)
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) / 2


def idle_barrier(comm: MPI.Comm, poll_s: float = 1e-3) -> None:
    """A barrier that sleeps while it waits, leaving the cores to the ranks that work."""
    wait_politely(comm.Ibarrier(), Polling(spin_s=0.0, poll_s=poll_s))


T = TypeVar("T")


def decided_on_root(comm: MPI.Comm, decide: Callable[[], T],
                    errors: tuple[type[Exception], ...] = (ValueError,)) -> T:
    """`decide()` on rank 0 while the other ranks wait asleep (a spinning barrier would
    take a core it needs), its result on every rank (collective).

    Raises:
        One of `errors`: on every rank, the exception `decide()` raised on rank 0, so no
            rank waits for a decision that never comes.
    """
    outcome: tuple[T | None, Exception | None] = (None, None)
    if comm.Get_rank() == 0:
        try:
            outcome = (decide(), None)
        except errors as exc:
            outcome = (None, exc)
    idle_barrier(comm)
    value, error = comm.bcast(outcome, root=0)
    if error is not None:
        raise error
    return value  # type: ignore[return-value]
