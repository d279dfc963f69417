"""Hand-given clusters: parse `10Gbit` / `20us`, and the named clusters of the projection.

A cluster is a `NetworkParams` whose α and β come from the user (latency, link rate)
instead of a measurement. The per-byte CPU costs (γ, the copy and the compression
kernels) are properties of the host CPU, not of the link; they default to
`HOST_CPU_DEFAULTS`, the values `pipesgd timing measure` found on one core of the 2-core
development machine (`bench/timing_suite.py`), or are taken from a measured network
file. `host_gbps` stands for another host: the rate at which one of its cores reduces
float32 (GB/s of input), every per-byte CPU cost scaled by the same factor.
`describe_host` says which host a cluster assumes, for the tables that use it.
"""

from __future__ import annotations

import dataclasses
import math
import re

from pipesgd.timing.network import KernelCosts, NetworkParams

_BIT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BYTE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str | float) -> float:
    """Link rate as bytes per second: `10Gbit`, `100gbit/s`, `200mbit`, `1.25GB/s`, or a
    plain number of bits per second.

    Raises:
        ValueError: not a rate, or not positive; the message shows accepted forms.
    """
    if isinstance(text, int | float):
        bits = float(text)
    else:
        match = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b|byte|B)?(?:/s|ps)?\s*",
            text,
            re.IGNORECASE,
        )
        if not match:
            raise ValueError(
                f"bad bandwidth {text!r}: use a rate with a unit, e.g. --bandwidth 10Gbit, "
                "--bandwidth 100gbit/s, --bandwidth 1.25GB/s"
            )
        value = float(match.group(1))
        prefix = match.group(2).lower()
        unit = match.group(3) or "bit"
        is_bytes = unit in ("B", "byte") or unit.lower() == "byte"
        bits = value * (_BYTE_UNITS if is_bytes else _BIT_UNITS)[prefix] * (8 if is_bytes else 1)
    if not bits > 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}; e.g. --bandwidth 10Gbit")
    return bits / 8


def parse_duration(text: str | float) -> float:
    """Duration in seconds: `20us`, `1.5ms`, `0`, `2e-5s`, or a plain number of seconds.

    Raises:
        ValueError: not a duration, or negative.
    """
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = re.fullmatch(
            r"\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*", text, re.IGNORECASE
        )
        if not match:
            raise ValueError(
                f"bad duration {text!r}: use a number with a unit, e.g. --latency 20us, "
                "--latency 1ms, --latency 0"
            )
        seconds = float(match.group(1)) * _TIME_UNITS[(match.group(2) or "s").lower()]
    if seconds < 0:
        raise ValueError(f"duration must be >= 0, got {text!r}")
    return seconds


# Per-byte CPU costs of the development machine (one core of the 2-core VM), seconds per
# byte of float32 input; refreshed by `pipesgd timing measure` and recorded in
# bench/results/timing_suite.json.
HOST_CPU_DEFAULTS = {
    "gamma_s_per_byte": 1.9e-10,
    "copy_s_per_byte": 6.8e-11,
    "kernels": {
        "trunc16": KernelCosts(encode=6.1e-11, decode_add_encode=8.4e-11, decode=1.24e-10,
                               decode_add_encode_decode=8.7e-11),
        "quant8": KernelCosts(encode=8.9e-11, decode_add_encode=1.48e-10, decode=1.10e-10,
                              decode_add_encode_decode=1.04e-10),
    },
}


HOST_CPU_ORIGIN = ("HOST_CPU_DEFAULTS: one core of the 2-core development VM, measured by "
                   "`pipesgd timing measure`")


def reduction_gbps(net: NetworkParams) -> float:
    """GB/s of float32 input one core of `net`'s host reduces: 1 / γ (inf for γ = 0)."""
    return math.inf if net.gamma_s_per_byte == 0 else 1e-9 / net.gamma_s_per_byte


def _check_host_gbps(value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                  and value > 0 and math.isfinite(value)):
        raise ValueError(f"host_gbps must be a positive number of GB/s (the rate one core "
                         f"reduces float32, e.g. --host-gbps 10), got {value!r}")


def scale_host(net: NetworkParams, host_gbps: float) -> NetworkParams:
    """`net` on a host whose cores reduce float32 at `host_gbps` GB/s: γ = 1 / host_gbps,
    and the copy and every kernel cost scaled by the same factor (the link is kept).

    Raises:
        ValueError: `host_gbps` is not a positive number, or `net` has no γ to scale.
    """
    _check_host_gbps(host_gbps)
    if net.gamma_s_per_byte <= 0:
        raise ValueError("cannot scale a host whose reduction costs nothing (γ = 0)")
    factor = 1e-9 / host_gbps / net.gamma_s_per_byte
    kernels = {mode: KernelCosts(*(factor * v for v in dataclasses.astuple(k)))
               for mode, k in net.kernels.items()}
    return dataclasses.replace(net, gamma_s_per_byte=net.gamma_s_per_byte * factor,
                               copy_s_per_byte=net.copy_s_per_byte * factor, kernels=kernels)


def device_copy_s_per_byte(device_gbps: float) -> float:
    """δ of a GPU whose copies to and from pinned host memory run at `device_gbps` GB/s.

    Raises:
        ValueError: `device_gbps` is not a positive number.
    """
    if not (isinstance(device_gbps, int | float) and not isinstance(device_gbps, bool)
            and device_gbps > 0 and math.isfinite(device_gbps)):
        raise ValueError(f"device_gbps must be a positive number of GB/s (a GPU's copy rate "
                         f"to pinned host memory, e.g. --device-gbps 25), got {device_gbps!r}")
    return 1e-9 / device_gbps


def with_device_copy(net: NetworkParams, device_gbps: float | None) -> NetworkParams:
    """`net` with ranks on GPUs whose copies to and from pinned host memory run at
    `device_gbps` GB/s (δ = 1 / device_gbps), so predictions count host staging; None:
    `net` as it is.

    Raises:
        ValueError: `device_gbps` is not a positive number.
    """
    if device_gbps is None:
        return net
    return dataclasses.replace(net, device_copy_s_per_byte=device_copy_s_per_byte(device_gbps))


def describe_host(net: NetworkParams, host_gbps: float | None = None,
                  cpu_from: NetworkParams | None = None) -> str:
    """One line: the host CPU rates a described cluster uses and where they come from
    (`host_gbps` and `cpu_from` as given to `describe_cluster`)."""
    rates = [f"reduction {reduction_gbps(net):.1f} GB/s per core"]
    if net.copy_s_per_byte:
        rates.append(f"memcpy {1e-9 / net.copy_s_per_byte:.1f} GB/s")
    for mode, k in net.kernels.items():
        if k.decode_add_encode:
            rates.append(f"{mode} reduce hop {1e-9 / k.decode_add_encode:.1f} GB/s")
    base = f"measured: {cpu_from.source}" if cpu_from is not None else HOST_CPU_ORIGIN
    if host_gbps is None:
        origin = f"{base}; --host-gbps sets another host's"
    else:
        origin = f"--host-gbps {host_gbps:g}; the other rates scaled alike from {base}"
    return f"host: {', '.join(rates)} ({origin})"


def describe_cluster(
    bandwidth: str | float,
    latency: str | float,
    *,
    cores: int | None = None,
    ranks_per_host: int | None = 1,
    sync: str | float | None = None,
    cpu_from: NetworkParams | None = None,
    host_gbps: float | None = None,
    device_gbps: float | None = None,
    name: str = "",
) -> NetworkParams:
    """A cluster given by hand: link rate, one-way latency α, and the host.

    Args:
        bandwidth: link rate (`"10Gbit"`, or bits/s).
        latency: α, the one-way latency of one message (`"20us"`, or seconds).
        cores: CPU cores per host available to ranks and their comm threads (None: this
            machine's `os.cpu_count()`).
        ranks_per_host: ranks sharing one host's cores (1: one GPU worker per host; None:
            all p ranks on one host, as under `mpirun` on one machine).
        sync: S, the global synchronisation time (None: 2 α, one small round trip).
        cpu_from: take γ, the copy cost and the kernel costs from this measured network
            instead of `HOST_CPU_DEFAULTS`.
        host_gbps: GB/s of float32 input one core of the host reduces; γ becomes
            1 / host_gbps and the copy and kernel costs scale by the same factor from
            `HOST_CPU_DEFAULTS` (or `cpu_from`). None: those figures as they are.
        device_gbps: GB/s of a copy between each rank's GPU and pinned host memory
            (PCIe); gradients are then staged through the host and predictions count
            it (`with_device_copy`). None: the gradients live on the host.
        name: label shown in tables.

    Raises:
        ValueError: a malformed rate or latency, or host_gbps or device_gbps not a
            positive number.

    Example:
        >>> net = describe_cluster("10Gbit", "20us")
        >>> round(1 / net.beta_s_per_byte / 1e9, 2)   # GB/s
        1.25
    """
    _check_host_gbps(host_gbps)
    beta = 1.0 / parse_bandwidth(bandwidth)
    alpha = parse_duration(latency)
    if cpu_from is not None:
        gamma, copy, kernels = cpu_from.gamma_s_per_byte, cpu_from.copy_s_per_byte, cpu_from.kernels
    else:
        gamma = float(HOST_CPU_DEFAULTS["gamma_s_per_byte"])  # type: ignore[arg-type]
        copy = float(HOST_CPU_DEFAULTS["copy_s_per_byte"])  # type: ignore[arg-type]
        kernels = dict(HOST_CPU_DEFAULTS["kernels"])  # type: ignore[arg-type]
    net = NetworkParams(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        sync_s=2 * alpha if sync is None else parse_duration(sync),
        kernels=kernels,
        copy_s_per_byte=copy,
        # A NIC moves the bytes by DMA: the host CPU pays little per byte on the wire.
        beta_cpu_s_per_byte=0.0,
        cores=cores,
        ranks_per_host=ranks_per_host,
        source=name or f"given: {bandwidth} link, {latency} latency",
    )
    if host_gbps is not None:
        net = scale_host(net, host_gbps)
    return with_device_copy(net, device_gbps)


# Clusters of the projection table (docs/timing_model.md): one worker per host, a GPU computing.
CLUSTERS = {
    "10GbE": dict(bandwidth="10Gbit", latency="20us", cores=16, ranks_per_host=1),
    "100Gbit": dict(bandwidth="100Gbit", latency="5us", cores=16, ranks_per_host=1),
}


def named_cluster(name: str, cpu_from: NetworkParams | None = None,
                  host_gbps: float | None = None) -> NetworkParams:
    """One of `CLUSTERS` by name (case-insensitive); `cpu_from` and `host_gbps` as for
    `describe_cluster`."""
    for key, spec in CLUSTERS.items():
        if key.lower() == name.lower():
            return describe_cluster(**spec, cpu_from=cpu_from, host_gbps=host_gbps,  # type: ignore[arg-type]
                                    name=key)
    raise ValueError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}")
