"""Ranks agreeing on a step that each runs alone, before they go on together.

A step that reads or writes a rank's own files or imports (a model's module, a data
folder, a checkpoint's part) can fail on one node only. A rank that stops there while
the others go on leaves them waiting in their next collective for a rank that never
comes: each rank runs the step, then one collective tells every rank how it went
everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """How a step went on every rank (the same on all of them, but `error`).

    Attributes:
        result: what the step returned on rank 0 (None where it failed there).
        failures: (rank, exception type name, message) of each rank it failed on, in
            rank order.
        error: the exception it raised on this rank, if any.
    """

    result: Any
    failures: list[tuple[int, str, str]]
    error: Exception | None


def on_every_rank(comm: Any, step: Callable[[], Any],
                  errors: tuple[type[Exception], ...] = (Exception,)) -> Outcome:
    """Run `step()` on every rank of `comm` and gather how it went (collective: one
    all-gather). Exceptions other than `errors` propagate on the rank that raised them."""
    error: Exception | None = None
    result = None
    try:
        result = step()
    except errors as exc:
        error = exc
    mine = None if error is None else (type(error).__name__, str(error))
    every = comm.allgather((mine, result if comm.Get_rank() == 0 else None))
    failures = [(rank, *failed) for rank, (failed, _) in enumerate(every) if failed]
    return Outcome(every[0][1], failures, error)


def failure_anywhere(comm: Any, check: Callable[[], None],
                     errors: tuple[type[Exception], ...] = (ValueError, OSError)) -> str | None:
    """Run `check()` on every rank of `comm` (collective) and return the same on all of
    them: None where it passed everywhere, else the message of the first rank it failed
    on, naming that rank unless every rank failed alike.

    Exceptions other than `errors` propagate on the rank that raised them.
    """
    failures = on_every_rank(comm, check, errors).failures
    if not failures:
        return None
    if len(failures) == comm.Get_size() and len({m for *_, m in failures}) == 1:
        return failures[0][2]
    rank, _, message = failures[0]
    return f"rank {rank}: {message}"
