"""`measure_network(comm)`: every figure of `NetworkParams` measured on the ranks of
`comm`, with the transport they actually use (the probes: `link_probes`, `token_bucket`,
`host_costs`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pipesgd.polling import idle_barrier
from pipesgd.timing.host_costs import (
    engine_costs,
    measure_device_copy,
    measure_in_place,
    measure_kernels,
)
from pipesgd.timing.link_probes import (
    measure_alpha,
    measure_beta,
    measure_eager,
    measure_node_link,
    measure_ring_beta,
    node_key,
)
from pipesgd.timing.network import NetworkParams, default_cores
from pipesgd.timing.token_bucket import measure_burst


def measure_network(
    comm: Any = None,
    *,
    small_bytes: int = 8,
    large_bytes: tuple[int, int] = (4 << 20, 16 << 20),
    repeats: int = 20,
    kernel_bytes: int = 32 << 20,
    device: Any = None,
) -> NetworkParams:
    """Measure α, β, β_cpu, γ, S and the kernel costs on the ranks of `comm` (collective).

    * α: half the round trip of a `small_bytes` ping-pong between rank 0 and the first
      rank on another node (`node_key`), or rank 1 on one node. Where ranks span nodes
      and rank 0 shares its node, the node link's α and β too (`measure_node_link`).
    * β: the slope of the slowest rank's time between two sizes, each a link carrying one
      of the `large_bytes` sizes, so latency drops out. Where ranks span nodes, of the
      engine's own uncompressed allreduce, less its reductions (γ): the ring paces itself
      by its slowest edge and keeps the links busy through a rank's scheduling stalls,
      which a bare exchange of MPI requests does not (4 ranks on 2 cores over 200 Mbit/s
      links with a 1 MiB bucket: 150-187 Mbit/s for the bare ring step, 171-191 for the
      engine, and training ran its allreduces at about 190). Within one node (shared memory,
      where the planner's messages and MPI's own collectives go through MPI), every rank
      sends `m` bytes to its right neighbour while receiving `m` from its left (one ring
      step, in the engine's segments). Never one large `Sendrecv`: over TCP, Open MPI's
      rendezvous for a message above its eager limit ran at half the link's rate in some
      repetitions and at full rate in others (16 MiB on 1 Gbit/s links: 147 or 291 ms).
    * burst: transfers of doubling size from rank 0 to α's peer, each after an idle
      spell long enough to refill a bucket that large, until the saving stops growing;
      the token bucket that explains their times (`measure_burst`, `fit_token_bucket`);
      0 unless it clearly saves time. The fit's slope is flow β, that one flow's rate
      while every other link idles (the planner's all-reduces among fewer ranks than
      the ring's: `Level.round_bandwidth`). Only between nodes: ranks on one node share
      no shaped link, and there the caches' sizes bend the times like a bucket would (a
      2-core host once read a 216 KiB "bucket" between two ranks on shared memory).
    * β_cpu: the CPU time (user + system) the engine's comm thread burns per byte it moves,
      from engine allreduces at the two `large_bytes` sizes, less the reduction (γ). Not
      from the blocking `Sendrecv`: MPI busy-polls there, the engine sleeps between polls.
      Where ranks and their comm threads outnumber the cores, the larger of that and the
      compute the allreduces take from a rank spinning beside them (the network stack's
      softirqs and context switches are charged to whoever they interrupt).
    * load latency (there too): a small engine allreduce with every rank spinning beside
      it, against one alone, per ring step (`host_costs.engine_costs`).
    * γ, copy and kernels: `measure_kernels` on rank 0 alone (one core, the others
      sleeping); the model stretches them itself when ranks share cores.
    * β_in_place: within one node, where the engine lends memory every rank maps, the
      time per buffer byte of its uncompressed allreduce of such a buffer of the larger
      `large_bytes` size, sums included (`measure_in_place`): how the optimizer's
      buckets are reduced there.
    * eager: the largest message rank 0 sends to α's peer before the peer posts its
      receive (`measure_eager`): the transport's eager limit (64 KiB less a header for
      Open MPI over TCP).
    * S: one `Barrier`.
    * δ, where `device` is a GPU: every rank times copies between its GPU and pinned host
      memory at once (as staging runs them, ranks sharing a bus), the slowest rank's
      figure (`measure_device_copy`).

    Each figure is the median of `repeats`, taken after a warm-up; `spread` holds the
    relative interquartile range. With one rank, α, β and S cannot be measured: they are
    set from a 2-rank-free default (α = S = 0, β = the copy cost) and `source` says so.

    Returns:
        NetworkParams, with `measured_p` = comm size and `ranks_per_host` = ranks sharing
        this node (None when that is all of them).
    """
    from mpi4py import MPI

    from pipesgd.engine import Engine

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    spread: dict[str, float] = {}
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = node.Get_size()
    node.Free()
    max_on_node = comm.allreduce(on_node, op=MPI.MAX)
    # more ranks than cores: a rank busy-polling for a transfer holds up its peers
    oversubscribed = max_on_node > default_cores()

    # Nodes: the probes between two ranks cross between nodes where the ring does.
    keys = comm.allgather(node_key())
    peer = next((r for r in range(1, size) if keys[r] != keys[0]), 1)
    node_peer = next((r for r in range(1, size) if keys[r] == keys[0]), None)
    spans_nodes = len(set(keys)) > 1

    # alpha: ping-pong between 0 and its peer on another node, if any
    alpha, eager = 0.0, 0
    if size > 1:
        alpha, spread["alpha"] = measure_alpha(comm, small_bytes, repeats, peer)
        eager = measure_eager(comm, peer)
    node_link = None
    if spans_nodes and node_peer is not None:
        node_link = measure_node_link(comm, small_bytes, repeats, node_peer)

    device_copy = 0.0
    if device is not None:
        device_copy = comm.allreduce(measure_device_copy(device), op=MPI.MAX)

    # One engine for the whole measurement: its segment size shapes the probes; its comm
    # thread sleeps until the probes that use it, last. Without the board: the probes
    # time the ring's steps, which the model counts (a small probe on one node would
    # take the board's two waits instead).
    engine = Engine(comm, board_bytes=0) if size > 1 else None
    try:
        # S: barrier
        samples = []
        for _ in range(repeats * 5 + 10):
            start = time.perf_counter()
            comm.Barrier()
            samples.append(time.perf_counter() - start)
        sync_local = statistics.median(samples[10:])
        sync = statistics.median(comm.allgather(sync_local)) if size > 1 else 0.0

        # gamma, copy, kernels: on one core of an otherwise idle host. Only rank 0 measures;
        # the others wait without spinning (an MPI barrier busy-polls and would take the
        # cores that ranks share).
        if rank == 0:
            gamma, copy, kernels, kernel_spread = measure_kernels(kernel_bytes, repeats)
        idle_barrier(comm)
        gamma, copy, kernels, kernel_spread = comm.bcast(
            (gamma, copy, kernels, kernel_spread) if rank == 0 else None, root=0
        )
        spread.update(kernel_spread)

        # beta: a ring at two sizes; then the burst, beta_cpu and the load latency
        beta = beta_cpu = burst = flow_beta = load_latency = in_place = 0.0
        if size > 1:
            segment = engine.segment_bytes
            if spans_nodes:
                beta, spread["beta"] = measure_ring_beta(comm, engine, large_bytes, repeats,
                                                          gamma)
                # a token bucket shapes a network link, never shared memory
                burst, flow_beta, spread["burst"] = measure_burst(
                    comm, beta, max(5, repeats // 3), segment, oversubscribed, peer)
            else:
                beta, spread["beta"] = measure_beta(comm, large_bytes, repeats, segment,
                                                     oversubscribed)
                in_place, spread["in_place"] = measure_in_place(comm, engine,
                                                                 max(large_bytes), repeats)
            beta_cpu, load_latency, spread["load_latency"] = engine_costs(
                comm, engine, large_bytes, min(repeats, 5), gamma, max_on_node)
            beta_cpu = min(beta_cpu, beta)
    finally:
        if engine is not None:
            engine.shutdown()
    if size == 1:
        beta = copy
        source = "measured on 1 rank: alpha, S not measurable, beta = memcpy"
    else:
        library = MPI.Get_library_version().replace("\x00", "").split(",")[0].strip()
        source = f"measured on {size} ranks ({library})"
    return NetworkParams(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        sync_s=sync,
        kernels=kernels,
        copy_s_per_byte=copy,
        beta_cpu_s_per_byte=beta_cpu,
        burst_bytes=burst,
        flow_beta_s_per_byte=flow_beta,
        load_latency_s=load_latency,
        cores=default_cores(),
        ranks_per_host=None if max_on_node == size else max_on_node,
        node_alpha_s=None if node_link is None else node_link[0],
        node_beta_s_per_byte=None if node_link is None else node_link[1],
        ranks_per_node=keys.count(keys[0]) if spans_nodes else None,
        device_copy_s_per_byte=device_copy,
        in_place_s_per_byte=in_place,
        eager_bytes=eager,
        measured_p=size,
        spread={k: round(v, 4) for k, v in spread.items()},
        source=source,
    )
