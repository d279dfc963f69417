"""Two-level clusters: ranks on nodes, shared memory inside a node, a network between.

A ring-AllReduce is only as fast as its slowest edge: every step, each rank sends one
chunk to its right neighbour at once, and the step ends when the last chunk arrives.
With ranks numbered node by node (as `mpirun` places them), a ring over N nodes of R
ranks has R - 1 edges inside each node and one edge leaving it, so

    flat ring:  2(p-1) (max_e α_e + n/p max_e β_e)        p = N R

and the node's one network edge sets the pace whenever N > 1. A two-level allreduce
(reduce-scatter inside the node, R rings of n/R bytes between nodes sharing the node's
link, allgather inside the node) moves 2(N-1)/N n bytes over each node's link instead of
2(p-1)/p n:

    two-level:  2(R-1) (α_s + n/R β_s) + 2(N-1) (R α_n + n/N β_n)

with (α_s, β_s) the shared-memory link and (α_n, β_n) the network; the R rings between
nodes start their messages one after another on the node's link (R α_n per step) and
share its bandwidth (n/N bytes per step in all). With one rank per node both reduce to
eq. 5 on the network (`tests/test_timing_topology.py`). The engine runs the flat ring;
`two_level_gain` says what the two-level one would save.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """α (one-way latency of a message, s) and β (s per byte) of one kind of ring edge."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0:
            raise ValueError(f"alpha_s must be >= 0, got {self.alpha_s}")
        if not self.beta_s_per_byte > 0:
            raise ValueError(f"beta_s_per_byte must be > 0, got {self.beta_s_per_byte}")

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Topology:
    """N nodes of R ranks each; `node` joins ranks of one node, `network` the nodes."""

    nodes: int
    ranks_per_node: int
    node: Link
    network: Link

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def p(self) -> int:
        return self.nodes * self.ranks_per_node

    def ring_edges(self) -> list[Link]:
        """The links of the ring's p edges, rank r to r + 1, ranks numbered node by node."""
        R = self.ranks_per_node
        return [self.network if self.nodes > 1 and (r + 1) % R == 0 else self.node
                for r in range(self.p)]

    def ring_step(self, nbytes: float) -> float:
        """One step of the ring: every edge carries `nbytes`; the slowest sets the pace."""
        return max(edge.seconds(nbytes) for edge in self.ring_edges())

    def flat_ring(self, nbytes: float) -> float:
        """Seconds on the wire of the engine's ring-AllReduce of `nbytes` (no reduction)."""
        if self.p == 1:
            return 0.0
        return 2 * (self.p - 1) * self.ring_step(nbytes / self.p)

    def two_level(self, nbytes: float) -> float:
        """Seconds on the wire of reduce-scatter in nodes, rings between, allgather in."""
        R, N = self.ranks_per_node, self.nodes
        inside = 2 * (R - 1) * self.node.seconds(nbytes / R) if R > 1 else 0.0
        between = 0.0
        if N > 1:
            between = 2 * (N - 1) * (R * self.network.alpha_s
                                     + nbytes / N * self.network.beta_s_per_byte)
        return inside + between


def two_level_gain(topology: Topology, nbytes: float) -> float:
    """How many times faster the two-level allreduce of `nbytes` would be than the flat
    ring, on the wire (1.0 where they tie)."""
    two = topology.two_level(nbytes)
    return topology.flat_ring(nbytes) / two if two > 0 else 1.0
