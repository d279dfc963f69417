"""Run an `mpirun` job over an emulated switched network: one shaped full-duplex link per rank.

Topology (all names start with `psgd-`, nothing is routed outside the namespaces made here):

    netns psgd-<pid>-<n>-r0          netns psgd-<pid>-<n>-sw          netns psgd-<pid>-<n>-r1
    psgd0 10.131.0.1/24 ──veth──  psgd-p0 ─┐                ┌─ psgd-p1  ──veth── psgd0 10.131.0.2/24
      egress: HTB <rate>  (upload)          └── psgd-br ────┘  egress: HTB <rate>  (download of r1)

Every rank has its own namespace and one veth to a bridge in a switch namespace. The
rank-side egress qdisc caps what the rank sends (upload); the switch-side egress qdisc caps
what it receives (download). So the network is a switch, not a hub: a 2-rank exchange in
both directions runs at the full rate each way, while a rank sending to two peers at once
shares its one uplink. Each shaping class is a token bucket: after idling, a link sends
`--burst` bytes at once before the rate bites (default: 64 KiB + MTU or 1 ms of the rate,
the smallest that shapes smoothly; a smaller bucket keeps packets one MTU long). Added
latency, when asked for, is a netem qdisc on the rank-side egress (one-way delay per
packet a rank sends; round trip between two ranks = 2x).

MPI is forced onto TCP over the rank's link (`pml ob1`, `btl tcp,self`,
`btl_tcp_if_include psgd0`, no `osc sm`); gloo gets GLOO_SOCKET_IFNAME, MASTER_ADDR (rank 0)
and MASTER_PORT. Each rank is started through `netem_rank.py`, which relays the rank's
PMIx connection to the daemon into the namespace (see that file for why).

Command line (root only):

    python bench/netem.py --np 4 --rate 1gbit -- python bench/allreduce.py --sizes 64MiB
    python bench/netem.py --rate 200mbit --burst 1MiB -- pipesgd timing measure
    python bench/netem.py --cleanup

Python:

    from netem import mpirun_over_netem
    run = mpirun_over_netem(["python", "tests/mpi/netem_probe.py", "ring", "8388608"], np=2)
    print(run.format_table())

Everything created is removed on exit, on failure and on SIGINT/SIGTERM/SIGHUP; a run killed
with SIGKILL leaves namespaces that `--cleanup` removes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_size

PREFIX = "psgd"
IFNAME = "psgd0"
BRIDGE = "psgd-br"
SUBNET = "10.131.0"
MAX_RANKS = 250
DEFAULT_MASTER_PORT = 29500
EXIT_UNAVAILABLE = 77  # the automake "skipped" status: no root or no network namespaces
EXIT_BYPASSED = 3
GSO_PACKET = 64 * 1024  # the largest packet TCP hands a veth unless told otherwise
ETHERNET_HEADER = 14

RANK_WRAPPER = Path(__file__).resolve().with_name("netem_rank.py")

# Open MPI must not take shared memory between ranks that share this machine.
MPI_TCP_ONLY = (
    ("pml", "ob1"),
    ("btl", "tcp,self"),
    ("btl_tcp_if_include", IFNAME),
    ("osc", "^sm"),
)

_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_run_counter = 0


class NetemError(RuntimeError):
    """Setting up, running over or removing the emulated network failed."""


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_rate(text: str) -> int:
    """Parse a link rate such as `1gbit`, `200mbit`, `10Gbit` or `500kbit` into bits/s.

    Raises:
        ValueError: the text is not a rate; the message shows accepted forms.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)bit(?:/s)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(
            f"bad rate {text!r}: use a number of bits per second with a unit, "
            "e.g. --rate 1gbit, --rate 200mbit, --rate 10Gbit"
        )
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s; e.g. --rate 100mbit")
    return int(bits)


def parse_latency(text: str) -> float:
    """Parse a one-way added latency such as `0`, `20us`, `1ms` or `0.5s` into seconds.

    Raises:
        ValueError: the text is not a duration; the message shows accepted forms.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?\s*", text, re.IGNORECASE)
    if not match or (match.group(2) is None and float(match.group(1)) != 0):
        raise ValueError(
            f"bad latency {text!r}: use a duration with a unit, e.g. --latency 20us, "
            "--latency 1ms, --latency 0"
        )
    return float(match.group(1)) * _TIME_UNITS[(match.group(2) or "s").lower()]


def parse_burst(text: str) -> int:
    """Parse a token-bucket size such as `0`, `64KiB`, `1MiB` or `125kB` into bytes.

    Raises:
        ValueError: the text is not a size; the message shows accepted forms.
    """
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(f"bad burst {text!r}: use a size in bytes, e.g. --burst 0, "
                         "--burst 128KiB, --burst 1MiB") from None


def format_rate(bits_per_s: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


# ---------------------------------------------------------------------------------------------
# Small wrappers around iproute2


def _ip_command(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of network namespaces that start with `<prefix>-`."""
    proc = _ip_command(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(f"{prefix}-"))


def _namespace_pids(namespace: str) -> list[int]:
    proc = _ip_command(["ip", "netns", "pids", namespace], check=False)
    return [int(pid) for pid in proc.stdout.split() if pid.isdigit()]


def _owner_alive(namespace: str) -> bool:
    # Names are <prefix>-<owner pid>-<n>-<role>; the owner is the netem process.
    parts = namespace.split("-")
    return len(parts) >= 3 and parts[1].isdigit() and Path(f"/proc/{parts[1]}").exists()


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill every process in the namespaces, then delete them; returns names that remain.

    Deleting a namespace also destroys the veth ends in it, and with them their peers.
    """
    for name in names:
        for pid in _namespace_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for name in names:
        while _namespace_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip_command(["ip", "netns", "delete", name], check=False)
    remaining = set(list_namespaces(""))
    return [name for name in names if name in remaining]


def cleanup(prefix: str = PREFIX, include_live: bool = False) -> tuple[list[str], list[str]]:
    """Remove namespaces left by netem runs whose owner process is gone.

    Args:
        prefix: only namespaces named `<prefix>-...` are considered.
        include_live: also remove those of netem processes that are still running.

    Returns:
        (removed, skipped): namespace names removed, and live ones left alone.
    """
    names = list_namespaces(prefix)
    skipped = [] if include_live else [name for name in names if _owner_alive(name)]
    doomed = [name for name in names if name not in skipped]
    remaining = remove_namespaces(doomed)
    if remaining:
        raise NetemError(f"could not remove namespaces: {', '.join(remaining)}")
    return doomed, skipped


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (not root, no `ip`, no namespaces), or None."""
    if os.geteuid() != 0:
        return "bench/netem.py needs root (network namespaces and tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed: apt-get install iproute2"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    proc = _ip_command(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return f"`ip netns add` does not work here: {proc.stderr.strip()}"
    _ip_command(["ip", "netns", "delete", probe], check=False)
    return None


# ---------------------------------------------------------------------------------------------
# The network


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes and packets one node's link carried: tx = node to switch, rx = switch to node
    (with one rank per node, the default, node = rank)."""

    node: int
    address: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, before: LinkBytes) -> LinkBytes:
        return LinkBytes(
            self.node,
            self.address,
            self.tx_bytes - before.tx_bytes,
            self.rx_bytes - before.rx_bytes,
            self.tx_packets - before.tx_packets,
            self.rx_packets - before.rx_packets,
        )


@dataclasses.dataclass
class NetemRun:
    """Result of one command run over the emulated network.

    Fields:
        command: the full `mpirun ...` command that ran.
        returncode: its exit status (negative: killed by that signal).
        elapsed_s: wall time of the mpirun command, including MPI start-up.
        links: per-node bytes the links carried during the run.
        rate_bps, latency_s: the emulated link's rate (bits/s) and added one-way latency.
        output: stdout+stderr when captured, else None.
    """

    command: list[str]
    returncode: int
    elapsed_s: float
    links: list[LinkBytes]
    rate_bps: int
    latency_s: float
    output: str | None = None

    def link_bound_s(self) -> float:
        """Least time the busiest link direction needed to carry its bytes at the rate."""
        busiest = max((max(link.tx_bytes, link.rx_bytes) for link in self.links), default=0)
        return busiest * 8 / self.rate_bps

    def format_table(self) -> str:
        """The per-node table of bytes each link sent and received."""
        mib = 1 << 20
        lines = [
            f"netem: {len(self.links)} nodes, {format_rate(self.rate_bps)} per link each way, "
            f"added latency {self.latency_s * 1e6:g} us, exit status {self.returncode}",
            f"{'node':>4}  {'address':<12} {'sent bytes':>14} {'(MiB)':>9} "
            f"{'received bytes':>14} {'(MiB)':>9} {'tx pkts':>9} {'rx pkts':>9}",
        ]
        for link in self.links:
            lines.append(
                f"{link.node:>4}  {link.address:<12} {link.tx_bytes:>14,} "
                f"{link.tx_bytes / mib:>9.2f} {link.rx_bytes:>14,} {link.rx_bytes / mib:>9.2f} "
                f"{link.tx_packets:>9,} {link.rx_packets:>9,}"
            )
        total = sum(link.tx_bytes for link in self.links)
        lines.append(
            f"total sent {total:,} B; busiest link direction needs {self.link_bound_s():.3f} s "
            f"at {format_rate(self.rate_bps)}; mpirun took {self.elapsed_s:.3f} s"
        )
        return "\n".join(lines)


class EmulatedNetwork:
    """A switch with one shaped full-duplex link per rank; see the module docstring.

    Use through `emulated_network()`, which calls `setup()` and always `teardown()`.
    """

    __slots__ = ("burst", "latency_s", "mtu", "name", "nodes", "np", "rate_bps", "switch")

    def __init__(self, np: int, rate_bps: int, latency_s: float = 0.0, mtu: int = 1500,
                 burst: int | None = None, nodes: int | None = None) -> None:
        global _run_counter
        if not 1 <= np <= MAX_RANKS:
            raise ValueError(f"np={np}: the emulated network holds 1..{MAX_RANKS} ranks")
        nodes = np if nodes is None else nodes
        if not 1 <= nodes <= np or np % nodes:
            raise ValueError(f"nodes={nodes}: use a divisor of np={np} (ranks are spread "
                             "evenly, consecutive ranks on one node)")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu={mtu}: use 576..65535, e.g. 1500 or 9000")
        if burst is not None and burst < 0:
            raise ValueError(f"burst={burst}: a token bucket holds >= 0 bytes, e.g. 512KiB")
        self.np = np
        #: Nodes: each is one namespace with one link; its ranks share its network stack.
        self.nodes = nodes
        self.rate_bps = rate_bps
        self.latency_s = latency_s
        self.mtu = mtu
        #: Token-bucket size asked for (bytes); None: the smallest that shapes smoothly.
        self.burst = burst
        _run_counter += 1
        #: Prefix of every namespace of this network: psgd-<owner pid>-<n>.
        self.name = f"{PREFIX}-{os.getpid()}-{_run_counter}"
        #: Namespace holding the bridge.
        self.switch = f"{self.name}-sw"

    @property
    def ranks_per_node(self) -> int:
        return self.np // self.nodes

    def node_of(self, rank: int) -> int:
        """The node of `rank`: consecutive ranks share one, as mpirun fills nodes."""
        return rank // self.ranks_per_node

    def namespace(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def namespaces(self) -> list[str]:
        return [*(self.namespace(node) for node in range(self.nodes)), self.switch]

    # -- setup / teardown ----------------------------------------------------------------------

    def setup(self) -> None:
        """Create the namespaces, the bridge, the veths and the qdiscs.

        Raises:
            NetemError: a step failed (everything created so far is removed first).
        """
        try:
            self._new_namespace(self.switch)
            self._ip(self.switch, "link", "add", BRIDGE, "type", "bridge")
            self._ip(self.switch, "link", "set", BRIDGE, "up")
            # Where br_netfilter is loaded (Docker loads it) every bridged packet would
            # also pass iptables, CPU that a real switch does not take from the ranks.
            # The keys exist only with that module, hence check=False.
            _ip_command(
                [
                    "ip", "netns", "exec", self.switch, "sysctl", "-q", "-w",
                    "net.bridge.bridge-nf-call-iptables=0",
                    "net.bridge.bridge-nf-call-ip6tables=0",
                    "net.bridge.bridge-nf-call-arptables=0",
                ],
                check=False,
            )  # fmt: skip
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            self.teardown()
            raise

    def _new_namespace(self, namespace: str) -> None:
        _ip_command(["ip", "netns", "add", namespace])
        # No IPv6: its router solicitations and DAD would add bytes to the link counters.
        _ip_command(
            [
                "ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
            ]
        )  # fmt: skip
        self._ip(namespace, "link", "set", "lo", "up")

    def _add_node(self, node: int) -> None:
        namespace, port = self.namespace(node), f"{PREFIX}-p{node}"
        self._new_namespace(namespace)
        # Both ends are created directly inside their namespaces: nothing appears on the host.
        self._ip(
            namespace, "link", "add", IFNAME, "type", "veth", "peer", "name", port,
            "netns", self.switch,
        )  # fmt: skip
        self._ip(namespace, "addr", "add", f"{self.address(node)}/24", "dev", IFNAME)
        self._ip(namespace, "link", "set", IFNAME, "mtu", str(self.mtu), "up")
        self._ip(self.switch, "link", "set", port, "mtu", str(self.mtu), "master", BRIDGE, "up")
        if self._unsegmented:
            self._ip(namespace, "link", "set", IFNAME, "gso_max_size", str(self.mtu))
            self._ip(self.switch, "link", "set", port, "gso_max_size", str(self.mtu))
        self._shape(namespace, IFNAME, self.latency_s)  # upload
        self._shape(self.switch, port, 0.0)  # download

    @property
    def burst_bytes(self) -> int:
        """Bytes each shaped link sends at line rate after idling (htb's burst).

        By default it holds one 64 KiB GSO packet (htb lets a whole packet through on any
        token left, so a smaller bucket would not shape smaller) and a millisecond of the
        rate. A smaller `burst` asked for is honoured by capping the links' GSO packets at
        one MTU (`_unsegmented`). The timing model measures it (`measure_network`).
        """
        if self.burst is None:
            return max(GSO_PACKET + self.mtu, self.rate_bps // 8 // 1000)
        return max(self.burst, self.mtu + ETHERNET_HEADER)

    @property
    def _unsegmented(self) -> bool:
        """Whether packets must stay one MTU long for the bucket to be that small."""
        return self.burst_bytes < GSO_PACKET + self.mtu

    def _shape(self, namespace: str, dev: str, latency_s: float) -> None:
        rate = f"{self.rate_bps}bit"
        burst = self.burst_bytes
        quantum = min(200_000, max(self.mtu + ETHERNET_HEADER, self.rate_bps // 8 // 1000))
        self._tc(
            namespace, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"
        )
        self._tc(
            namespace, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
            "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
            "quantum", str(quantum),
        )  # fmt: skip
        if latency_s > 0:
            usec = max(1, round(latency_s * 1e6))
            # The queue must hold a bandwidth-delay product of packets or it drops.
            limit = max(1000, int(self.rate_bps / 8 * latency_s / self.mtu) * 2 + 1000)
            proc = _ip_command(
                [
                    "tc", "-n", namespace, "qdisc", "add", "dev", dev, "parent", "1:1",
                    "handle", "10:", "netem", "delay", f"{usec}us", "limit", str(limit),
                ],
                check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise NetemError(
                    "cannot add latency: the netem qdisc is missing from this kernel "
                    f"(CONFIG_NET_SCH_NETEM; tc said: {proc.stderr.strip()}). "
                    "Run with --latency 0, or on a kernel with sch_netem."
                )

    def _ip(self, namespace: str, *args: str) -> None:
        _ip_command(["ip", "-n", namespace, *args])

    def _tc(self, namespace: str, *args: str) -> None:
        _ip_command(["tc", "-n", namespace, *args])

    def teardown(self) -> None:
        """Remove every namespace of this network (and the processes still in them).

        Raises:
            NetemError: something could not be removed; the message names it.
        """
        present = set(list_namespaces())
        remaining = remove_namespaces([n for n in self.namespaces() if n in present])
        if remaining:
            raise NetemError(
                f"could not remove {', '.join(remaining)}; try `python bench/netem.py --cleanup`"
            )

    # -- measuring -----------------------------------------------------------------------------

    def link_bytes(self) -> list[LinkBytes]:
        """Current counters of every node's interface (tx = upload, rx = download)."""
        links = []
        for node in range(self.nodes):
            proc = _ip_command(
                ["ip", "-n", self.namespace(node), "-s", "-j", "link", "show", "dev", IFNAME]
            )
            stats = json.loads(proc.stdout)[0]["stats64"]
            links.append(
                LinkBytes(
                    node,
                    self.address(node),
                    stats["tx"]["bytes"],
                    stats["rx"]["bytes"],
                    stats["tx"]["packets"],
                    stats["rx"]["packets"],
                )
            )
        return links

    # -- running -------------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for `mpirun` over this network (also what every rank sees).

        Sets MASTER_ADDR to rank 0's emulated address, MASTER_PORT (default 29500; every
        network has its own namespaces, so the port cannot clash), GLOO_SOCKET_IFNAME and
        TP_SOCKET_IFNAME, and PIPESGD_NETEM_RATE_BPS (bits/s), PIPESGD_NETEM_LATENCY_S
        (one-way, seconds), PIPESGD_NETEM_NP and PIPESGD_NETEM_IFNAME for benchmarks.
        """
        env = dict(os.environ if base is None else base)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        env["MASTER_ADDR"] = self.address(0)
        env.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        env["GLOO_SOCKET_IFNAME"] = IFNAME
        env["TP_SOCKET_IFNAME"] = IFNAME
        env["PIPESGD_NETEM_RATE_BPS"] = str(self.rate_bps)
        env["PIPESGD_NETEM_LATENCY_S"] = repr(self.latency_s)
        env["PIPESGD_NETEM_NP"] = str(self.np)
        env["PIPESGD_NETEM_RANKS_PER_NODE"] = str(self.ranks_per_node)
        env["PIPESGD_NETEM_IFNAME"] = IFNAME
        return env

    def mpirun_command(self, command: Sequence[str], mpirun_args: Sequence[str] = ()) -> list[str]:
        """`mpirun -n np` with TCP-only MCA flags, running `command` through the rank wrapper."""
        launcher = shutil.which("mpirun", path=self.env()["PATH"])
        if launcher is None:
            raise NetemError("mpirun not found on PATH: run `make setup` first")
        cmd = [launcher, "--oversubscribe", "-n", str(self.np)]
        for key, value in MPI_TCP_ONLY:
            cmd += ["--mca", key, value]
        return [*cmd, *mpirun_args, sys.executable, str(RANK_WRAPPER), self.name, "--", *command]

    def run(
        self,
        command: Sequence[str],
        *,
        mpirun_args: Sequence[str] = (),
        timeout: float | None = None,
        capture_output: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> NetemRun:
        """Run `command` on every rank under mpirun over this network.

        SIGINT, SIGTERM and SIGHUP received meanwhile are passed to mpirun (a second one
        kills it); the call then raises KeyboardInterrupt so callers still tear down.

        Args:
            command: the per-rank command, e.g. `["python", "bench/allreduce.py"]`.
            mpirun_args: extra mpirun options placed before the command.
            timeout: seconds before mpirun's process group is killed (TimeoutExpired).
            capture_output: collect stdout+stderr into `NetemRun.output`.
            env: base environment (default: this process's); see `env()`.
            cwd: working directory of mpirun.
        """
        cmd = self.mpirun_command(command, mpirun_args)
        before = self.link_bytes()
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            env=self.env(env),
            cwd=cwd,
            stdout=subprocess.PIPE if capture_output else None,
            stderr=subprocess.STDOUT if capture_output else None,
            text=True,
            start_new_session=True,  # Ctrl-C reaches us; we decide how mpirun stops.
            preexec_fn=_stop_with_parent,
        )
        with _forward_signals(proc) as interrupted:
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                output, _ = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout or 0, output) from None
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        elapsed = time.monotonic() - start
        if interrupted:
            raise KeyboardInterrupt(f"interrupted by signal {interrupted[0]}")
        after = self.link_bytes()
        links = [a - b for a, b in zip(after, before, strict=True)]
        return NetemRun(cmd, proc.returncode, elapsed, links, self.rate_bps, self.latency_s, output)


def _stop_with_parent() -> None:
    # If netem is killed outright, mpirun gets SIGTERM and stops its ranks; each rank's
    # wrapper in turn takes its command down (PR_SET_PDEATHSIG there too).
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _forward_signals(proc: subprocess.Popen[str]) -> Iterator[list[int]]:
    """Pass SIGINT/SIGTERM/SIGHUP to mpirun; a second signal kills its process group."""
    interrupted: list[int] = []
    if not _in_main_thread():
        yield interrupted
        return

    def forward(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        with contextlib.suppress(ProcessLookupError):
            if len(interrupted) == 1:
                os.kill(proc.pid, signum)  # mpirun stops its ranks on SIGINT/SIGTERM
            else:
                os.killpg(proc.pid, signal.SIGKILL)

    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in signums}
    try:
        yield interrupted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def emulated_network(
    np: int = 2, rate: str | int = "1gbit", latency: str | float = 0.0, mtu: int = 1500,
    burst: str | int | None = None, nodes: int | None = None,
) -> Iterator[EmulatedNetwork]:
    """Set up an emulated switched network for `np` ranks; always remove it on exit.

    Args:
        np: number of ranks (each gets a namespace and a link).
        rate: per-link rate each way, as text (`"1gbit"`) or bits/s.
        latency: added one-way latency per packet a rank sends, as text (`"1ms"`) or seconds.
        mtu: link MTU (1500 like plain Ethernet; 9000 for jumbo frames).
        burst: each link's token bucket, as text (`"512KiB"`) or bytes; None: the
            smallest that shapes smoothly (`EmulatedNetwork.burst_bytes`).
        nodes: nodes the ranks are spread over, consecutive ranks on one node (None: one
            rank per node). A node's ranks share its namespace and its one shaped link.

    Raises:
        NetemError: setup failed (for example latency on a kernel without sch_netem).

    Example:
        with emulated_network(np=2, rate="200mbit") as net:
            run = net.run(["python", "tests/mpi/netem_probe.py", "ring", "8388608"])
            print(run.format_table())
    """
    rate_bps = parse_rate(rate) if isinstance(rate, str) else int(rate)
    latency_s = parse_latency(latency) if isinstance(latency, str) else float(latency)
    burst_bytes = parse_burst(burst) if isinstance(burst, str) else burst
    net = EmulatedNetwork(np, rate_bps, latency_s, mtu, burst_bytes, nodes)
    net.setup()
    try:
        yield net
    finally:
        net.teardown()


def mpirun_over_netem(
    command: Sequence[str],
    np: int = 2,
    rate: str | int = "1gbit",
    latency: str | float = 0.0,
    mtu: int = 1500,
    burst: str | int | None = None,
    nodes: int | None = None,
    **run_kwargs: object,
) -> NetemRun:
    """Set up a network, run `command` on `np` ranks over it, tear it down; see `run()`.

    Example:
        run = mpirun_over_netem(["python", "bench/allreduce.py"], np=4, rate="1gbit")
        sys.exit(run.returncode)
    """
    with emulated_network(np, rate, latency, mtu, burst, nodes) as net:
        return net.run(command, **run_kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/netem.py",
        description=(
            "Run an MPI command over an emulated switched network: every rank gets its own "
            "full-duplex link of the given rate (root only)."
        ),
        usage="%(prog)s [options] -- COMMAND [ARGS...]\n       %(prog)s --cleanup [--all]",
        epilog=(
            "example: %(prog)s --np 4 --rate 1gbit -- python bench/allreduce.py --sizes 64MiB\n"
            "The per-rank byte table goes to stderr after the run; the exit status is the "
            "command's."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--nodes", type=int, help="spread the ranks over this many nodes, consecutive ranks "
        "sharing a node's network stack and its one link (default: one rank per node)")
    parser.add_argument("--rate", default="1gbit", help="per-link rate each way (default 1gbit)")
    parser.add_argument(
        "--latency", default="0", help="added one-way latency, e.g. 20us, 1ms (default 0)"
    )
    parser.add_argument("--mtu", type=int, default=1500, help="link MTU (default 1500)")
    parser.add_argument(
        "--burst", help="each link's token bucket, e.g. 0, 128KiB, 1MiB (default: the "
        "smallest that shapes smoothly, 64 KiB + MTU or 1 ms of the rate)")
    parser.add_argument("--timeout", type=float, help="kill the command after this many seconds")
    parser.add_argument(
        "--mpirun-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra mpirun option, repeatable (e.g. --mpirun-arg=--bind-to --mpirun-arg=none)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help=(
            "return the command's status even if its traffic bypassed the emulated links "
            f"(by default, exiting 0 without moving bytes over them gives status {EXIT_BYPASSED})"
        ),
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help=f"remove namespaces named {PREFIX}-* left by netem runs that are no longer running",
    )
    parser.add_argument(
        "--all", action="store_true", help="with --cleanup: also remove those of running netem"
    )
    return parser


def _raise_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1 :]
    parser = _parser()
    args = parser.parse_args(options)
    if not args.cleanup and not command:
        parser.error("give the command to run after `--`, e.g. -- python bench/allreduce.py")
    try:
        rate_bps = parse_rate(args.rate)
        latency_s = parse_latency(args.latency)
        burst = None if args.burst is None else parse_burst(args.burst)
        EmulatedNetwork(args.np, rate_bps, nodes=args.nodes)  # checks np and nodes
    except ValueError as exc:
        parser.error(str(exc))

    reason = unavailable_reason()
    if reason is not None:
        print(f"netem: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    # SIGTERM/SIGHUP outside a run (during setup) unwind through the `finally`s like Ctrl-C.
    signal.signal(signal.SIGTERM, _raise_on_signal)
    signal.signal(signal.SIGHUP, _raise_on_signal)

    if args.cleanup:
        removed, skipped = cleanup(include_live=args.all)
        print(f"netem: removed {len(removed)} namespaces" + "".join(f"\n  {n}" for n in removed))
        if skipped:
            print(
                f"netem: left {len(skipped)} of running netem processes (add --all to remove):"
                + "".join(f"\n  {n}" for n in skipped)
            )
        return 0

    stale = [name for name in list_namespaces() if not _owner_alive(name)]
    if stale:
        print(
            f"netem: note: {len(stale)} namespaces from earlier runs remain; "
            "`python bench/netem.py --cleanup` removes them",
            file=sys.stderr,
        )
    try:
        with emulated_network(args.np, rate_bps, latency_s, args.mtu, burst, args.nodes) as net:
            run = net.run(command, mpirun_args=args.mpirun_arg, timeout=args.timeout)
    except NetemError as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netem: interrupted; emulated network removed", file=sys.stderr)
        return 130
    except subprocess.TimeoutExpired:
        print(f"netem: command killed after {args.timeout} s", file=sys.stderr)
        return 124
    print(run.format_table(), file=sys.stderr)
    moved = sum(link.tx_bytes for link in run.links)
    if run.returncode == 0 and args.np > 1 and moved < 4096 and not args.keep_going:
        print(
            f"netem: the command exited 0 but only {moved} B crossed the emulated links: its "
            "traffic bypassed them (shared memory? another interface?). Pass --keep-going if "
            "it really does not communicate.",
            file=sys.stderr,
        )
        return EXIT_BYPASSED
    # A command killed by signal N exits 128+N, as a shell would report it.
    return run.returncode if run.returncode >= 0 else 128 - run.returncode


if __name__ == "__main__":
    sys.exit(main())
