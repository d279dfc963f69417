"""Payloads between nodes, cut into pieces the transport sends the moment they are posted.

Over TCP, Open MPI sends a message up to its eager limit (64 KiB) as soon as `Isend`
posts it. Of a larger message only the first fragment leaves; the rest moves once the
receiver has answered *and the sender next enters MPI*. A stage that sends an activation
and then computes a backward holds its neighbour up for that backward. Cut into pieces
no larger than the eager limit, every byte leaves at once: the MLP's pipeline over
emulated 1 Gbit/s links runs 1.36x as fast on four stages and 1.16x on three (median
launch, `bench/pipeline_pieces.py`).

Within a node Open MPI's receiver copies a large message out of the sender's memory
itself (CMA), so messages stay whole there. Ranks are on one node when they share a
host name and a network namespace (`pipesgd.timing.link_probes.node_key`, as
`bench/netem.py --nodes` emulates them).

Each link decides at the pipeline's handshake, in 20-30 ms: whether a message four
times the transport's eager limit waits for its sender (`link_probes.waits_for_sender`;
where the receiver pulls, as over RDMA, it does not, and small pieces would only add
messages), and the eager limit itself (`link_probes.eager_limit`, to 1 KiB).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from pipesgd.timing import link_probes

SMALLEST = 1024  # below this a piece costs more in messages than it saves
LARGEST = 1 << 20  # a transport this eager needs no pieces
EAGER_WAIT_S = 2e-3  # an eager send completes in microseconds; 2 ms covers a busy host


def piece_bytes(comm: MPI.Comm, node_keys: Sequence[str], peer: int, sender: bool) -> int:
    """The piece size for payloads between this rank and `peer`: 0 (whole messages)
    where `node_keys` (every rank's `node_key()`) put both on one node, where the eager
    limit is too small to help, or where a larger message does not wait for its sender;
    else the eager limit. Pairwise: one rank calls it with
    `sender=True`, `peer` with `sender=False`; both get the same size."""
    if node_keys[peer] == node_keys[comm.Get_rank()]:
        return 0
    limit = link_probes.eager_limit(comm, peer, sender, smallest=SMALLEST, largest=LARGEST,
                                    resolution=SMALLEST, wait_s=EAGER_WAIT_S)
    if not SMALLEST <= limit < LARGEST:
        return 0
    return limit if link_probes.waits_for_sender(comm, peer, sender, 4 * limit) else 0


def cut(payload: np.ndarray, piece: int) -> list[np.ndarray]:
    """`payload`'s bytes in consecutive pieces of at most `piece` bytes (one piece, the
    whole payload, where `piece` is 0 or the payload fits)."""
    if piece <= 0 or payload.nbytes <= piece:
        return [payload]
    flat = payload.reshape(-1).view(np.uint8)
    return [flat[o : o + piece] for o in range(0, flat.size, piece)]


__all__ = ["cut", "piece_bytes"]
