"""The ranks' side of a link, probed with MPI point-to-point: α (a small ping-pong),
β (a ring step, or the engine's own allreduce between nodes), the transport's eager
limit, and the link inside a node where ranks span several. `measure_network` runs them;
`pipesgd.timing.token_bucket` times its transfers with `ping_pong`.

Every probe is collective over its communicator: each rank calls it, and each returns
the same figures on every rank.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from pipesgd.timing.spread import median_spread

_POLITE_POLL_S = 50e-6  # the engine's PIPESGD_POLL_US default


def _wait(requests: list[Any], polite: bool) -> None:
    """Wait for every request; politely (test, then sleep) where ranks share cores, since
    a rank spinning in MPI's Waitall takes the core from the ranks whose transfers it
    waits for."""
    from mpi4py import MPI

    from pipesgd.polling import Polling, wait_politely

    if polite:
        wait_politely(requests, Polling(spin_s=0.0, poll_s=_POLITE_POLL_S))
    else:
        MPI.Request.Waitall(requests)


def _segments(buf: Any, segment: int) -> list[Any]:
    return [buf[o : o + segment] for o in range(0, len(buf), segment)]


def node_key() -> str:
    """What identifies this process's node: ranks that share a host name and a network
    namespace share a network stack and its links (`bench/netem.py --nodes` gives each
    emulated node a namespace of its own on one host)."""
    import socket

    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


def ping_pong(comm: Any, out: Any, back: Any, segment: int | None = None,
               polite: bool = False, peer: int = 1) -> float:
    """Rank 0 sends `out` to rank `peer` (in `segment`-byte messages, as the engine does,
    if given), which answers with `back`; the time this rank spent."""
    rank = comm.Get_rank()
    pieces = _segments(out, segment) if segment else [out]
    start = time.perf_counter()
    if rank == 0:
        _wait([comm.Isend(piece, dest=peer, tag=1) for piece in pieces], polite)
        comm.Recv(back, source=peer, tag=2)
    elif rank == peer:
        _wait([comm.Irecv(piece, source=0, tag=1) for piece in pieces], polite)
        comm.Send(back, dest=0, tag=2)
    return time.perf_counter() - start


def measure_alpha(comm: Any, small_bytes: int, repeats: int, peer: int) -> tuple[float, float]:
    """α and its spread: half the round trip of a small ping-pong, rank 0 and `peer`."""
    import numpy as np

    buf = np.zeros(small_bytes, dtype=np.uint8)
    samples = []
    for i in range(repeats * 10 + 20):
        comm.Barrier()
        round_trip = ping_pong(comm, buf, buf, peer=peer)
        if i >= 20:
            samples.append(round_trip / 2)
    return median_spread(comm.bcast(samples, root=0))


_EAGER_TAG = 7301
_EAGER_WAIT_S = 7.5e-3  # how long an eager probe's send may take to complete alone


def _sends_alone(comm: Any, peer: int, nbytes: int, sender: bool, wait_s: float) -> bool:
    """Whether the sender's `Isend` of `nbytes` to `peer` completes within `wait_s` while
    the receiver has not posted its receive. Pairwise: the sender and `peer` call it,
    one with `sender=True`; both get the answer."""
    import numpy as np

    from pipesgd.polling import Polling, wait_until

    buf = np.zeros(nbytes, dtype=np.uint8)
    if sender:
        request = comm.Isend(buf, dest=peer, tag=_EAGER_TAG)
        alone = wait_until(request.Test, Polling(spin_s=0.0, poll_s=1e-4), timeout_s=wait_s)
        comm.send(alone, dest=peer, tag=_EAGER_TAG + 1)  # then the receiver posts
        request.Wait()
        return alone
    alone = comm.recv(source=peer, tag=_EAGER_TAG + 1)
    comm.Recv(buf, source=peer, tag=_EAGER_TAG)
    return bool(alone)


def _sends_alone_twice_checked(comm: Any, peer: int, nbytes: int, sender: bool,
                               wait_s: float) -> bool:
    """`_sends_alone`, asked again when it says no: a sender descheduled for `wait_s`
    (ranks sharing cores) reads as a message that waits, and twice in a row it hardly
    happens. Both ranks get the same answers, so they ask alike. For the doubling, whose
    first no ends it (a false no at the smallest size would leave no eager limit at
    all); a false no in the bisection only lowers the limit a little."""
    return (_sends_alone(comm, peer, nbytes, sender, wait_s)
            or _sends_alone(comm, peer, nbytes, sender, wait_s))


def eager_limit(comm: Any, peer: int, sender: bool, *, smallest: int = 256,
                largest: int = 1 << 20, resolution: int = 64, tries: int = 1,
                wait_s: float = _EAGER_WAIT_S) -> int:
    """The largest message (to `resolution` bytes) whose send completes before its
    receiver posts the receive, between this rank and `peer`; `largest` if that one
    does, 0 if not even `smallest` does. Doubling sizes from `smallest` while `tries`
    probes in a row complete, then a bisection. Pairwise: one rank calls it with
    `sender=True`, `peer` with `sender=False`; both get the result."""
    # The first message between two ranks waits for their connection (60 ms over TCP)
    comm.sendrecv(None, dest=peer, sendtag=_EAGER_TAG + 2, source=peer, recvtag=_EAGER_TAG + 2)
    size, ok = smallest, 0
    while size <= largest and all(_sends_alone_twice_checked(comm, peer, size, sender, wait_s)
                                  for _ in range(tries)):
        ok, size = size, size * 2
    if size > largest:
        return largest
    failed = size
    while failed - ok > resolution:
        mid = (ok + failed) // 2
        if _sends_alone(comm, peer, mid, sender, wait_s):  # a false no costs a little
            ok = mid
        else:
            failed = mid
    return ok


def waits_for_sender(comm: Any, peer: int, sender: bool, nbytes: int,
                     hold_s: float = 0.02) -> bool:
    """Whether a message of `nbytes` whose receive is already posted waits for its
    sender's next MPI call: the sender posts it and computes for `hold_s` without calling
    MPI. Over TCP Open MPI moves the rest of a message beyond its eager limit only then;
    where the receiver pulls (shared memory's single copy, RDMA) it arrives at once.
    Pairwise, like `eager_limit`; both get the answer."""
    import numpy as np

    from pipesgd.polling import wait_politely

    buf = np.zeros(nbytes, dtype=np.uint8)
    if sender:
        comm.recv(source=peer, tag=_EAGER_TAG + 3)  # the receive is posted
        request = comm.Isend(buf, dest=peer, tag=_EAGER_TAG + 4)
        time.sleep(hold_s)  # computing: no MPI call from this thread
        request.Wait()
        return bool(comm.recv(source=peer, tag=_EAGER_TAG + 5))
    request = comm.Irecv(buf, source=peer, tag=_EAGER_TAG + 4)
    comm.send(None, dest=peer, tag=_EAGER_TAG + 3)
    start = time.perf_counter()
    wait_politely(request)
    waited = time.perf_counter() - start > hold_s / 2
    comm.send(waited, dest=peer, tag=_EAGER_TAG + 5)
    return waited


def measure_eager(comm: Any, peer: int, most: int = 1 << 20) -> int:
    """The largest message rank 0 sends to `peer` before `peer` posts its receive, to 64
    bytes (collective): `eager_limit` from 256 bytes, three probes in a row per doubling.
    A transport whose small sends wait for the receiver (shared memory's, at times)
    measures small, where the eager part hardly counts."""
    rank = comm.Get_rank()
    found = 0
    if rank in (0, peer):
        found = eager_limit(comm, peer if rank == 0 else 0, rank == 0, largest=most, tries=3)
    return int(comm.bcast(found, root=0))


def measure_node_link(comm: Any, small_bytes: int, repeats: int,
                       peer: int) -> tuple[float, float]:
    """(α, β) between rank 0 and `peer` on its node: a small ping-pong, and the slope of
    one-way transfers of 1 and 4 MiB (collective)."""
    import numpy as np

    alpha, _ = measure_alpha(comm, small_bytes, repeats, peer)
    ack = np.zeros(1, dtype=np.uint8)
    medians = []
    for nbytes in (1 << 20, 4 << 20):
        buf = np.ones(nbytes, dtype=np.uint8)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            took = ping_pong(comm, buf, ack, peer=peer)
            if i >= 2:
                samples.append(took)
        medians.append(statistics.median(comm.bcast(samples, root=0)))
    beta = max(medians[1] - medians[0], 1e-15) / (3 << 20)
    return alpha, beta


def per_wire_byte(cost: dict[int, float], sizes: tuple[int, int], p: int,
                   gamma: float) -> float:
    """Slope of a per-allreduce cost between two sizes, per wire byte, less the reduction."""
    small, large = sizes
    extra = large - small
    reduction = (p - 1) / p * extra * gamma
    return max(cost[large] - cost[small] - reduction, 0.0) / (2 * (p - 1) / p * extra)


def _ring_step(comm: Any, send: Any, recv: Any, segment: int, polite: bool) -> None:
    """`send` to the right neighbour while `recv` arrives from the left, in segments."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    requests = [comm.Irecv(piece, source=left, tag=3) for piece in _segments(recv, segment)]
    requests += [comm.Isend(piece, dest=right, tag=3) for piece in _segments(send, segment)]
    _wait(requests, polite)


def slowest_seconds(comm: Any, run: Callable[[], object], repeats: int,
                    warmups: int, before: Callable[[], object] | None = None) -> list[float]:
    """The slowest rank's seconds of `run` (started together after a barrier, then
    `before`, untimed, if given), each of `repeats` timed calls after `warmups` untimed
    ones (collective)."""
    from mpi4py import MPI

    walls = []
    for i in range(warmups + repeats):
        comm.Barrier()
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        slowest = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmups:
            walls.append(slowest)
    return walls


def measure_beta(comm: Any, sizes: tuple[int, int], repeats: int, segment: int,
                  polite: bool) -> tuple[float, float]:
    """β and its spread: the slope of the slowest rank's ring step between two sizes
    (collective)."""
    import numpy as np

    step_times: dict[int, list[float]] = {}
    for m in sizes:
        send = np.ones(m, dtype=np.uint8)
        recv = np.empty(m, dtype=np.uint8)
        step = functools.partial(_ring_step, comm, send, recv, segment, polite)
        step_times[m] = slowest_seconds(comm, step, repeats, warmups=3)
    small, large = sizes
    t_small, _ = median_spread(step_times[small])
    t_large, spread = median_spread(step_times[large])
    return max(t_large - t_small, 1e-15) / (large - small), spread


def allreduce_bytes_for_wire(wire_bytes: int, p: int) -> int:
    """The float32 bytes whose ring allreduce among `p` ranks puts `wire_bytes` on each
    link (2(p-1)/p of them), in whole elements for every rank's chunk."""
    quantum = 4 * p
    return max(quantum, wire_bytes * p // (2 * (p - 1)) // quantum * quantum)


def measure_ring_beta(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                       gamma: float) -> tuple[float, float]:
    """β and its spread over a network: the slope of the slowest rank's uncompressed engine
    allreduce between two sizes, per wire byte, less its reductions (collective). Each
    allreduce is sized so that a link carries `sizes` bytes, as in `measure_beta`."""
    import numpy as np

    p = comm.Get_size()
    n_sizes = tuple(allreduce_bytes_for_wire(m, p) for m in sizes)
    medians: dict[int, float] = {}
    spread = 0.0
    for n in n_sizes:
        buf = np.ones(n // 4, dtype=np.float32)
        run = functools.partial(engine.allreduce, buf, op="average")
        walls = slowest_seconds(comm, run, repeats, warmups=1)
        medians[n], spread = median_spread(walls)
    return max(per_wire_byte(medians, n_sizes, p, gamma), 1e-15), spread
