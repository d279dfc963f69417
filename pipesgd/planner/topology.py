"""Hierarchical topologies (PipeDream Fig. 7): levels of components joined by one bandwidth.

Level k (k = 1..L) groups `count` components of level k-1 with links of `bandwidth`
bytes/s; level 0 is one worker. Written innermost level first:

    "4x[20GB/s], 2x[1Gbit]"        4 workers per node at 20 GB/s, 2 nodes at 1 Gbit/s
    "8x[100Gbit, 5us]"             one level: 8 workers, 100 Gbit/s, 5 us latency

Rates are read by `pipesgd.timing.cluster.parse_bandwidth` (a bare number is bits/s),
latencies by `parse_duration`. The memory of one worker is optional (MadPipe needs it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipesgd.json_files import load_json
from pipesgd.timing.cluster import parse_bandwidth, parse_duration

EXAMPLE = "4x[20GB/s], 2x[1Gbit]"

_LEVEL = re.compile(r"\s*(\d+)\s*[xX×]\s*\[([^\[\]]*)\]\s*")
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(i?)(b|byte|bytes)?\s*",
                    re.IGNORECASE)


def parse_bytes(text: str | float) -> float:
    """A memory size in bytes: `16GB` (10^9), `16GiB` (2^30), `512MB`, or a plain number.

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _BYTES.fullmatch(str(text))
        if not match:
            raise ValueError(
                f"bad memory size {text!r}: use bytes with a unit, e.g. 16GB, 16GiB, 512MB"
            )
        prefix = match.group(2).lower()
        base = 1024.0 if match.group(3) else 1000.0
        value = float(match.group(1)) * base ** " kmgt".index(prefix or " ")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"memory size must be positive, got {text!r}; e.g. 16GB")
    return value


@dataclass(frozen=True)
class Level:
    """One level: `count` components of the level below, joined at `bandwidth` bytes/s.

    Attributes:
        count: m_k, components of level k-1 in one component of level k (>= 1).
        bandwidth: B_k, bytes per second of the links between them.
        latency: seconds per message on those links (0: not given).
        eager_bytes: bytes of a message that move as soon as it is sent, before its
            receiver posts the receive (the transport's eager limit,
            `NetworkParams.eager_bytes`); the rest moves once the receiver asks.
            0: none (every byte waits for the receiver); inf: every byte (between
            nodes the pipeline sends its payloads in eager pieces,
            `pipesgd.pipeline.pieces`).
        burst_bytes: each sender's token bucket on these links (`NetworkParams.burst_bytes`,
            measured): it refills at `bandwidth` up to this many bytes, and bytes it
            covers leave at once. 0: every byte goes at `bandwidth`.
        in_place_s_per_byte: where the level's workers share one node's memory, seconds
            per byte of the engine's all-reduce of its own buffers in place
            (`NetworkParams.in_place_s_per_byte`), which a replicated stage's round
            takes. 0: rounds go around the ring over the links.
        flow_bandwidth: bytes per second one flow reaches alone on these links
            (`NetworkParams.flow_beta_s_per_byte`, measured). Above `bandwidth`, the
            level's `count` workers sending at once are bound by what their hosts move in
            all, not by each link (TCP on shared cores), so fewer flows go faster: each
            of the r flows of an all-reduce among r workers at
            min(flow_bandwidth, bandwidth x count / r) (`round_bandwidth`). 0: every
            flow at `bandwidth`.
    """

    count: int
    bandwidth: float
    latency: float = 0.0
    eager_bytes: float = 0.0
    burst_bytes: float = 0.0
    in_place_s_per_byte: float = 0.0
    flow_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ValueError(f"a level's count must be an integer >= 1, got {self.count!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"a level's bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"a level's latency must be >= 0 s, got {self.latency!r}")
        if not self.eager_bytes >= 0:
            raise ValueError(f"a level's eager_bytes must be >= 0, got {self.eager_bytes!r}")
        for key in ("burst_bytes", "in_place_s_per_byte", "flow_bandwidth"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"a level's {key} must be >= 0, got {value!r}")

    def round_bandwidth(self, replicas: int) -> float:
        """Bytes per second each link carries in an all-reduce among `replicas` of the
        level's workers, while the others' links idle: the hosts' total over the level
        (`bandwidth` x `count`, as measured with every worker sending) shared by its
        flows, at most one flow's rate alone; `bandwidth` where that is not faster."""
        shared = self.bandwidth * self.count / max(1, replicas)
        return max(self.bandwidth, min(self.flow_bandwidth, shared))

    def __str__(self) -> str:
        inner = f"{self.bandwidth / 1e9:g}GB/s"
        if self.latency:
            inner += f", {self.latency * 1e6:g}us"
        return f"{self.count}x[{inner}]"


@dataclass(frozen=True)
class SharedCores:
    """Workers that share a host's CPU cores (training on CPUs), as the simulation runs
    them: every busy thread of a host (a worker's compute, its share of communication)
    progresses at min(1, cores / busy threads).

    Attributes:
        cores: CPU cores of one host.
        workers_per_host: consecutive workers on one host.
        cpu_s_per_byte: CPU seconds communication burns per byte moved
            (`NetworkParams.beta_cpu_s_per_byte`; on shared memory the copy itself).
        reduce_s_per_byte: CPU seconds per byte an all-reduce sums (γ).
        load_latency_s: seconds a step of an all-reduce waits for a core while the
            workers compute (`NetworkParams.load_latency_s`, λ_load).
    """

    cores: int
    workers_per_host: int
    cpu_s_per_byte: float = 0.0
    reduce_s_per_byte: float = 0.0
    load_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("cores", "workers_per_host"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        for key in ("cpu_s_per_byte", "reduce_s_per_byte", "load_latency_s"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class HierarchicalTopology:
    """Levels innermost first (levels[0] is PipeDream's level 1), and one worker's memory.

    Attributes:
        levels: level k = levels[k-1]; a component of the top level is the whole cluster.
        memory_per_worker: bytes of memory of one worker, or None when not given.
        shared_cores: workers sharing CPU cores (`SharedCores`); None: every worker
            computes on a processor of its own (one accelerator per worker).
        device_copy_s_per_byte: δ, seconds per byte of a copy between a worker's GPU and
            pinned host memory (`NetworkParams.device_copy_s_per_byte`): activations,
            gradients and replicas' all-reduces are staged through the host at this rate
            (`pipesgd.staging`). 0: workers compute on the host, nothing is staged.
    """

    levels: tuple[Level, ...]
    memory_per_worker: float | None = None
    shared_cores: SharedCores | None = None
    device_copy_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise ValueError(f"a topology needs at least one level, e.g. {EXAMPLE!r}")
        if self.memory_per_worker is not None:
            object.__setattr__(self, "memory_per_worker", parse_bytes(self.memory_per_worker))
        if not (self.device_copy_s_per_byte >= 0 and math.isfinite(self.device_copy_s_per_byte)):
            raise ValueError("device_copy_s_per_byte must be a finite number >= 0, got "
                             f"{self.device_copy_s_per_byte!r}")

    @classmethod
    def parse(cls, text: str, memory_per_worker: str | float | None = None) -> HierarchicalTopology:
        """Read `"4x[20GB/s], 2x[1Gbit]"`: comma-separated `COUNTx[BANDWIDTH(, LATENCY)]`,
        innermost level first. A word before the bandwidth names the level for the
        reader and is not kept: `"4x[shm 20GB/s], 2x[ib 100Gbit, 2us]"`.

        Raises:
            ValueError: malformed text; the message names the position and shows an example.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"empty topology {text!r}; write levels innermost first, "
                             f"e.g. {EXAMPLE!r}")
        levels: list[Level] = []
        pos = 0
        while True:
            match = _LEVEL.match(text, pos)
            if not match:
                raise ValueError(
                    f"bad topology {text!r}: expected COUNTx[BANDWIDTH] at position {pos} "
                    f"({text[pos:]!r}); write levels innermost first, e.g. {EXAMPLE!r} "
                    "(4 workers per node at 20 GB/s, 2 nodes at 1 Gbit/s)"
                )
            count, inside = int(match.group(1)), match.group(2)
            parts = [p.strip() for p in inside.split(",")]
            if len(parts) > 2 or not parts[0]:
                raise ValueError(
                    f"bad level {match.group(0).strip()!r} in {text!r}: inside the brackets "
                    "give a bandwidth and optionally a latency, e.g. 4x[20GB/s] or "
                    "4x[20GB/s, 5us]"
                )
            name, _, rate = parts[0].partition(" ")
            if name.isalpha() and rate.strip():  # a name for the reader: 4x[shm 20GB/s]
                parts[0] = rate.strip()
            try:
                bandwidth = parse_bandwidth(parts[0])
                latency = parse_duration(parts[1]) if len(parts) == 2 else 0.0
            except ValueError as err:
                raise ValueError(f"bad level {match.group(0).strip()!r} in {text!r}: {err}") \
                    from None
            if count < 1:
                raise ValueError(f"bad level {match.group(0).strip()!r} in {text!r}: a level "
                                 f"holds at least 1 component, e.g. {EXAMPLE!r}")
            levels.append(Level(count, bandwidth, latency))
            pos = match.end()
            if pos == len(text):
                break
            if text[pos] != ",":
                raise ValueError(
                    f"bad topology {text!r}: expected ',' between levels at position {pos} "
                    f"({text[pos:]!r}), e.g. {EXAMPLE!r}"
                )
            pos += 1
        return cls(tuple(levels), memory_per_worker)

    # ----------------------------------------------------------------- shape
    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def num_workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    def component_size(self, k: int) -> int:
        """Workers in one component of level k (1 at level 0)."""
        return math.prod(level.count for level in self.levels[:k])

    def __str__(self) -> str:
        return ", ".join(str(level) for level in self.levels)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": [
                {"count": lv.count, "bandwidth": lv.bandwidth, "latency": lv.latency,
                 "eager_bytes": lv.eager_bytes, "burst_bytes": lv.burst_bytes,
                 "in_place_s_per_byte": lv.in_place_s_per_byte,
                 "flow_bandwidth": lv.flow_bandwidth}
                for lv in self.levels
            ],
            "memory_per_worker": self.memory_per_worker,
            "shared_cores": (None if self.shared_cores is None
                             else asdict(self.shared_cores)),
            "device_copy_s_per_byte": self.device_copy_s_per_byte,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HierarchicalTopology:
        try:
            levels = tuple(
                Level(int(lv["count"]), float(lv["bandwidth"]), float(lv.get("latency", 0.0)),
                      float(lv.get("eager_bytes", 0.0)), float(lv.get("burst_bytes", 0.0)),
                      float(lv.get("in_place_s_per_byte", 0.0)),
                      float(lv.get("flow_bandwidth", 0.0)))
                for lv in data["levels"]
            )
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"a topology is {{'levels': [{{'count': 4, 'bandwidth': 2e10}}, ...], "
                f"'memory_per_worker': null}}; missing or bad {err}"
            ) from None
        shared = data.get("shared_cores")
        try:
            cores = None if shared is None else SharedCores(**shared)
        except TypeError as err:
            raise ValueError(f"bad shared_cores {shared!r}: {err}; e.g. {{'cores': 16, "
                             f"'workers_per_host': 4}}") from None
        return cls(levels, data.get("memory_per_worker"), cores,
                   float(data.get("device_copy_s_per_byte", 0.0)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HierarchicalTopology:
        """The topology a JSON file holds (`save`).

        Raises:
            ValueError: the file is missing or holds no topology; the message names it.
        """
        return load_json(path, "a topology (`HierarchicalTopology.save`)", cls.from_dict)


def from_network(net: Any, workers: int) -> HierarchicalTopology:
    """`workers` on a measured network's links (`NetworkParams`), with the cores they
    share where it says (`cores`, `ranks_per_host`), communication's CPU cost (β_cpu, γ,
    λ_load), the links' token bucket, the in-place all-reduce on one node and, measured
    on GPUs, the copy rate between a GPU and the host (δ). Its messages move as the
    pipeline sends them: every byte at once between nodes, where it cuts payloads into
    eager pieces; within a node the transport's eager bytes, the rest when the receiver
    asks.

    One level at the network's β and α; where the measurement spanned nodes of R ranks
    each (`ranks_per_node`, with the link inside a node measured: `node_beta_s_per_byte`)
    and R divides `workers`, two: R workers on the node's link, `workers` / R nodes on
    the network (PipeDream's hierarchy), the node's messages every byte on the
    receiver's request (the shared-memory transport pulls them)."""
    shared = None
    if net.cores:
        shared = SharedCores(int(net.cores), int(net.ranks_per_host or workers),
                             net.beta_cpu_s_per_byte, net.gamma_s_per_byte,
                             net.load_latency_s)
    from pipesgd.pipeline.pieces import SMALLEST

    cut = net.ranks_per_node is not None and net.eager_bytes >= SMALLEST
    flow = net.flow_beta_s_per_byte
    per_node = net.ranks_per_node or 1
    nodes = workers // per_node
    two_levels = (per_node > 1 and nodes > 1 and workers % per_node == 0
                  and net.node_beta_s_per_byte)
    levels: tuple[Level, ...] = ()
    if two_levels:
        levels = (Level(per_node, 1.0 / net.node_beta_s_per_byte, net.node_alpha_s or 0.0),)
    levels += (Level(nodes if two_levels else workers, 1.0 / net.beta_s_per_byte,
                     net.alpha_s, math.inf if cut else net.eager_bytes, net.burst_bytes,
                     net.in_place_s_per_byte, 1.0 / flow if flow > 0 else 0.0),)
    return HierarchicalTopology(levels, shared_cores=shared,
                                device_copy_s_per_byte=net.device_copy_s_per_byte)


def as_topology(topology: HierarchicalTopology | str) -> HierarchicalTopology:
    """A topology from itself or its text form."""
    if isinstance(topology, HierarchicalTopology):
        return topology
    if isinstance(topology, str):
        return HierarchicalTopology.parse(topology)
    raise TypeError(
        f"expected a HierarchicalTopology or its text, e.g. {EXAMPLE!r}; got {type(topology)}"
    )
