"""Waiting for MPI requests without taking a core from the ranks that compute.

MPI's own Wait spins, which takes a core from the ranks that compute when ranks share
cores; over TCP, Open MPI moves data only inside MPI calls, so a spinning rank also
holds up the peers whose transfers it waits for. These waits test, then sleep, as the
engine's comm thread does (csrc/comm_context.h). Used by the pipeline's point-to-point
exchange and by the network measurements of `pipesgd.timing`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

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
    polling = Polling.from_env() if polling is None else polling
    if isinstance(requests, MPI.Request):
        test = requests.Test
    else:
        pending = list(requests)

        def test() -> bool:
            return MPI.Request.Testall(pending)

    spin, poll = polling.spin_s, polling.poll_s
    deadline = time.perf_counter() + spin
    while not test():
        if time.perf_counter() > deadline:
            time.sleep(poll)
