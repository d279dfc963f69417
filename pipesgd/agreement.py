"""Ranks agreeing on a check that each makes alone, before they go on together.

A check that reads a rank's own files or imports (a model's module, a data folder) can
fail on one node only. A rank that stops there while the others go on leaves them
waiting in their next collective for a rank that never comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def failure_anywhere(comm: Any, check: Callable[[], None],
                     errors: tuple[type[Exception], ...] = (ValueError, OSError)) -> str | None:
    """Run `check()` on every rank of `comm` (collective) and return the same on all of
    them: None where it passed everywhere, else the message of the first rank it failed
    on, naming that rank unless every rank failed alike.

    Exceptions other than `errors` propagate on the rank that raised them.
    """
    mine: str | None = None
    try:
        check()
    except errors as exc:
        mine = str(exc)
    every = comm.allgather(mine)
    failed = [(rank, message) for rank, message in enumerate(every) if message is not None]
    if not failed:
        return None
    if len(failed) == len(every) and len({message for _, message in failed}) == 1:
        return failed[0][1]
    rank, message = failed[0]
    return f"rank {rank}: {message}"
