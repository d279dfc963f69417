"""Single-process checks of the DDP comm hook's state and schedule (p = 1, fake buckets)."""

import pytest
import torch

import pipesgd
from pipesgd.hooks import PipeSGDState, pipe_sgd_hook


class FakeBucket:
    """The part of `dist.GradBucket` the hook uses."""

    def __init__(self, index: int, last: bool, values: torch.Tensor) -> None:
        self._index, self._last, self._buffer = index, last, values

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"staleness": 0}, "staleness must be an integer >= 1"),
    ({"compression": "zip"}, "unknown compression 'zip'"),
])
def test_state_errors(engine, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PipeSGDState(engine, **kwargs)


def test_state_uses_slots(engine) -> None:
    state = PipeSGDState(engine)
    with pytest.raises(AttributeError):
        state.unknown = 1


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_future_holds_the_gradient_of_k_minus_1_iterations_earlier(engine, staleness) -> None:
    state = PipeSGDState(engine, staleness=staleness)
    for t in range(6):
        got = []
        for index in range(2):
            bucket = FakeBucket(index, index == 1, torch.full((3 + index,), float(t + 1)))
            got.append(pipe_sgd_hook(state, bucket).wait()[0].item())
        # Iteration 0 is synchronous; later ones get iteration t - K + 1 >= 1, else zeros.
        due = 0 if t == 0 else t - staleness + 1
        expected = float(due + 1) if t == 0 or due >= 1 else 0.0
        assert got == [expected, expected], (t, got)
        assert state.has_update == (expected != 0.0)
    state.synchronize()


def test_bucket_size_change_in_flight_is_an_error(engine) -> None:
    state = PipeSGDState(engine, staleness=2)
    pipe_sgd_hook(state, FakeBucket(0, True, torch.ones(4))).wait()  # iteration 0
    pipe_sgd_hook(state, FakeBucket(0, True, torch.ones(4))).wait()  # in flight
    with pytest.raises(pipesgd.PipesgdError, match="changed size from 4 to 5"):
        pipe_sgd_hook(state, FakeBucket(0, True, torch.ones(5)))
    state.synchronize()
