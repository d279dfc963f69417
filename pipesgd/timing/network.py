"""The network and host side of the timing model, as `predict` reads it: `NetworkParams`.

Symbols follow Pipe-SGD eq. 5: α (latency of one message), β (seconds per byte on the
link), γ (seconds per byte of float32 reduction), S (global synchronisation). Added for
compression and for hosts whose cores are shared (see `pipesgd.timing.model`):

* per-byte costs of each compression kernel (`KernelCosts`), per byte of float32 input;
* β_cpu, the CPU seconds a rank's communication costs the host per byte it moves (≈ β
  over shared memory, where the copy *is* the transfer; small over a NIC that moves bytes
  by DMA; on shared cores it includes the kernel's network stack, measured as the compute
  it takes from a busy rank);
* the burst of a token-bucket link (tc's htb/tbf, a cloud VM's shaping): bytes it sends
  at line rate after idling, before the rate limit bites (0 for a plain link);
* the load latency: how much longer a ring step takes while every rank's compute thread
  keeps the shared cores busy (the comm thread waits to be scheduled); 0 on free cores;
* the host: `cores` and `ranks_per_host` (None = all ranks on this one host).

`measure_network(comm)` (`pipesgd.timing.measure`) measures all of them on the ranks of
`comm` with the transport they actually use; every figure is the median of repetitions,
with its spread. `describe_cluster` (`pipesgd.timing.cluster`) writes them by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipesgd.json_files import dataclass_from_dict, load_json

if TYPE_CHECKING:
    from pipesgd.timing.topology import Topology

COMPRESSED_MODES = ("trunc16", "quant8")


@dataclass(frozen=True)
class KernelCosts:
    """Seconds per byte of float32 input of the four kernels a compressed ring runs.

    Attributes:
        encode: float32 -> wire (first hop of a chunk).
        decode_add_encode: one reduce-scatter hop (decode, add local block, re-encode).
        decode: allgather: every rank decodes every chunk it does not own.
        decode_add_encode_decode: the owner's last reduce-scatter hop, fused: decode, add
            the local block, encode for the allgather and decode those bytes for itself.
    """

    encode: float
    decode_add_encode: float
    decode: float
    decode_add_encode_decode: float

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> KernelCosts:
        """Also reads descriptions written before the owner's hop was fused, where it was
        decode_add, then encode and decode: the three kernels it replaces."""
        if "decode_add" in data and "decode_add_encode_decode" not in data:
            data = dict(data)
            data["decode_add_encode_decode"] = (data.pop("decode_add") + data["encode"]
                                                + data["decode"])
        return cls(**data)

    def check(self, mode: str) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not value >= 0:
                raise ValueError(f"kernel cost {mode}.{name} must be >= 0 s/byte, got {value}")


# The network's own figures, whose spread moves every prediction of communication: in
# 34 measured networks β's spread stayed under 16 %, except once at 35 %, a third below
# the rate training then ran at (4 ranks on 2 cores, links without a token bucket). The
# wait for a core (`load_latency`) moves every prediction on shared cores.
_NETWORK_FIGURES = ("alpha", "beta", "burst", "load_latency")
NOISY_SPREAD = 0.25


def default_cores() -> int:
    return os.cpu_count() or 1


@dataclass
class NetworkParams:
    """α, β, γ, S, the kernel costs and the host, as `predict` needs them.

    Attributes:
        alpha_s: α, one-way latency of a small message (s).
        beta_s_per_byte: β, link time per byte (s/B) as the ring uses it (all ranks
            sending to the right and receiving from the left at once).
        gamma_s_per_byte: γ, float32 reduction per byte (s/B), one core.
        sync_s: S, one global synchronisation (barrier), s.
        kernels: compression mode -> `KernelCosts` (s per float32 byte), one core.
        copy_s_per_byte: memcpy per byte (packing gradients into a flat buffer), one core.
        beta_cpu_s_per_byte: CPU seconds a rank burns per byte moved on the link.
        burst_bytes: bytes a link sends at once after idling long enough to refill
            (a token bucket's burst); they cost no β time.
        flow_beta_s_per_byte: link time per byte of one flow while every other link
            idles (the burst probe's rate beyond the bucket, between nodes). Below β
            where what the hosts move in all, not each link, bounds the ring (TCP on
            shared cores): fewer flows at once each go faster. 0: not measured.
        load_latency_s: extra seconds per ring step while compute threads keep the
            shared cores busy (0 where ranks and comm threads have cores of their own).
        cores: cores per host shared by ranks, their comm threads and the network stack.
        ranks_per_host: ranks per host; None = all p ranks on one host.
        node_alpha_s, node_beta_s_per_byte: α and β between two ranks of one node, where
            the ranks span several nodes (α and β are then those of the network between
            nodes, the ring's slowest edges); None: not measured (one node).
        ranks_per_node: ranks per node where the ranks span several nodes; None otherwise.
        device_copy_s_per_byte: δ, seconds per byte of a copy between a rank's GPU and
            pinned host memory (the mean of both directions); each bucket crosses twice
            when gradients are staged through the host (`pipesgd.staging`). 0: the
            gradients live on the host (no staging).
        in_place_s_per_byte: seconds per gradient byte of the engine's uncompressed
            allreduce of its own buffers, reduced in place where every rank shares one
            node's memory (`Engine.zeros`), reductions included. 0: not available
            (ranks on several nodes, no shared memory, a described cluster); the
            optimizer's buckets then go around the ring.
        eager_bytes: the largest message whose send completes before its receive is
            posted (the transport's eager limit), between rank 0 and α's peer: the
            bytes a message moves before its receiver asks (a larger one's first
            fragment carries as many). 0: not measured.
        measured_p: number of ranks the figures were measured with (None: given by hand).
        spread: figure -> relative spread (IQR / median) of the repetitions.
        source: where the figures come from.
    """

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    sync_s: float
    kernels: dict[str, KernelCosts] = field(default_factory=dict)
    copy_s_per_byte: float = 0.0
    beta_cpu_s_per_byte: float = 0.0
    burst_bytes: float = 0.0
    flow_beta_s_per_byte: float = 0.0
    load_latency_s: float = 0.0
    cores: int | None = None
    ranks_per_host: int | None = None
    node_alpha_s: float | None = None
    node_beta_s_per_byte: float | None = None
    ranks_per_node: int | None = None
    device_copy_s_per_byte: float = 0.0
    in_place_s_per_byte: float = 0.0
    eager_bytes: int = 0
    measured_p: int | None = None
    spread: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if self.cores is None:
            self.cores = default_cores()
        self.kernels = {
            mode: k if isinstance(k, KernelCosts) else KernelCosts.from_dict(k)
            for mode, k in self.kernels.items()
        }
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first impossible figure."""
        if not self.beta_s_per_byte > 0:
            raise ValueError(
                f"beta must be > 0 s/byte (a link of finite, non-zero bandwidth), got "
                f"{self.beta_s_per_byte}; e.g. describe_cluster('10Gbit', '20us')"
            )
        for name in ("alpha_s", "gamma_s_per_byte", "sync_s", "copy_s_per_byte",
                     "beta_cpu_s_per_byte", "burst_bytes", "flow_beta_s_per_byte",
                     "load_latency_s", "eager_bytes",
                     "device_copy_s_per_byte", "in_place_s_per_byte"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if self.ranks_per_host is not None and self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1 or None, got {self.ranks_per_host}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")
        if (self.node_alpha_s is None) != (self.node_beta_s_per_byte is None):
            raise ValueError("give both node_alpha_s and node_beta_s_per_byte, or neither")
        for mode, costs in self.kernels.items():
            costs.check(mode)

    def noisy(self) -> str:
        """A warning naming the network's own figures (α, β, burst, load latency) whose
        repetitions spread by more than `NOISY_SPREAD`, or "" when none did."""
        figures = [f"{k} {v:.0%}" for k, v in self.spread.items()
                   if k in _NETWORK_FIGURES and v > NOISY_SPREAD]
        if not figures:
            return ""
        return (f"noisy: {', '.join(figures)} between repetitions; predictions that lean on "
                "them are as uncertain (measure again: pipesgd timing measure --repeats N)")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    def topology(self, p: int) -> Topology | None:
        """p ranks on nodes of `ranks_per_node`, joined by this network; None where the
        node link is unknown or p is not a whole number of nodes."""
        from pipesgd.timing.topology import Link, Topology

        rpn = self.ranks_per_node
        if rpn is None or self.node_beta_s_per_byte is None or p % rpn:
            return None
        return Topology(p // rpn, rpn, Link(self.node_alpha_s or 0.0, self.node_beta_s_per_byte),
                        Link(self.alpha_s, self.beta_s_per_byte))

    def kernel(self, mode: str) -> KernelCosts:
        if mode not in self.kernels:
            raise ValueError(
                f"no kernel costs for compression {mode!r} in this network description "
                f"(have {sorted(self.kernels)}); measure them with `pipesgd timing measure`"
            )
        return self.kernels[mode]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NetworkParams:
        return dataclass_from_dict(cls, data, "a network description")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NetworkParams:
        """The network a JSON file holds (`save`, `pipesgd timing measure --json`, or a
        prediction's JSON, under "network").

        Raises:
            ValueError: the file is missing or holds no network; the message names it.
        """
        return load_json(path, "a network description (`pipesgd timing measure --json`)",
                         lambda data: cls.from_dict(data.get("network", data)))
