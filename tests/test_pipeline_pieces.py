"""`pipesgd.pipeline.pieces.cut`: the pieces a payload travels in between nodes (the
multi-rank side, training bitwise as with whole messages, is tests/mpi/pipeline_pieces.py;
the piece size over emulated TCP links, tests/test_netem.py)."""

import numpy as np
import pytest

from pipesgd.pipeline.pieces import cut


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
@pytest.mark.parametrize(("count", "piece"), [(1000, 1024), (1024, 1024), (4096, 1000),
                                              (1, 4), (3, 2)])
def test_pieces_are_views_that_tile_the_payload_in_order(dtype, count, piece):
    payload = np.arange(count, dtype=dtype).reshape(-1, 1) if count % 2 else \
        np.arange(count, dtype=dtype).reshape(2, -1)
    parts = cut(payload, piece)
    raw = payload.reshape(-1).view(np.uint8)
    assert b"".join(p.tobytes() for p in parts) == raw.tobytes()
    assert all(p.nbytes <= max(piece, 0) or len(parts) == 1 for p in parts)
    assert all(np.shares_memory(p, payload) for p in parts)
    expected = 1 if payload.nbytes <= piece else -(-payload.nbytes // piece)
    assert len(parts) == expected
    parts[-1][...] = 0  # writing a piece writes the payload (receives land in place)
    assert not raw[-1]


@pytest.mark.parametrize("piece", [0, -1])
def test_no_piece_size_keeps_the_payload_whole(piece):
    payload = np.ones(10_000, dtype=np.float32)
    assert len(cut(payload, piece)) == 1 and cut(payload, piece)[0] is payload


def test_an_empty_payload_is_one_empty_message():
    payload = np.zeros(0, dtype=np.float32)
    assert [p.nbytes for p in cut(payload, 1024)] == [0]
