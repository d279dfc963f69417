"""Exceptions raised by pipesgd."""


class PipesgdError(RuntimeError):
    """An operation failed: the engine was shut down, MPI failed, or a peer failed first."""


class CollectiveMismatchError(PipesgdError):
    """Ranks submitted different operations (count, dtype, op or compression) for one
    sequence number. Every rank raises it; the message names the sequence number, both
    shapes and the ranks involved."""
