"""Per-rank exec wrapper for `bench/netem.py`: run one MPI rank inside its own network namespace.

`mpirun` starts this script once per rank, in the host's network namespace. It

1. picks the namespace of the rank's node (`<run>-n<node>`, from OMPI_COMM_WORLD_RANK and
   PIPESGD_NETEM_RANKS_PER_NODE),
2. relays the PMIx client connection into that namespace, and
3. runs the real command there, forwarding signals and returning its exit status.

Why the relay: Open MPI 5 ranks reach their PRRTE daemon through PMIx over TCP on
127.0.0.1 (`PMIX_SERVER_URI*` says `tcp4://127.0.0.1:<port>`; PMIx 5 has no Unix-socket
transport). A rank that enters another network namespace before MPI_Init sees a different,
empty loopback and cannot reach the daemon. So this wrapper listens on the same
127.0.0.1:<port> *inside* the rank's namespace and forwards every connection to the
daemon's port in the host namespace. Sockets keep the namespace they were created in, so
one process can hold both ends. PMIx traffic stays on the namespace's loopback and never
touches the emulated link, so the link's byte counters see only the application's traffic.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
NETNS_DIR = "/run/netns"

# Signals mpirun (PRRTE) sends to a rank that it wants the rank's command to see.
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)

_libc = ctypes.CDLL(None, use_errno=True)
# After its command ends, how long a wrapper keeps relaying the connections of other ranks
# of its node (they end when those ranks finalize; mpirun kills a rank that hangs).
RELAY_LINGER_S = 120.0


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at `fd`."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


def pmix_server_endpoints(env: dict[str, str]) -> list[tuple[str, int]]:
    """The distinct TCP endpoints named by the PMIX_SERVER_URI* variables.

    Raises:
        RuntimeError: none is set (the wrapper was not started by mpirun).
    """
    endpoints: list[tuple[str, int]] = []
    for key, value in env.items():
        if not key.startswith("PMIX_SERVER_URI"):
            continue
        for host, port in re.findall(r"tcp4://([0-9.]+):(\d+)", value):
            if (host, int(port)) not in endpoints:
                endpoints.append((host, int(port)))
    if not endpoints:
        raise RuntimeError(
            "no PMIX_SERVER_URI* with a tcp4:// address in the environment: "
            "netem_rank.py must be started by mpirun (use bench/netem.py)"
        )
    return endpoints


def listen_inside(netns_fd: int, endpoints: list[tuple[str, int]]) -> list[socket.socket]:
    """Open a listening socket for each endpoint inside the namespace open at `netns_fd`."""
    host_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    listeners = []
    try:
        setns(netns_fd)
        try:
            for host, port in endpoints:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                # the other ranks of the node listen on the same port in the same namespace
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((host, port))
                sock.listen(64)
                listeners.append(sock)
        finally:
            setns(host_fd)
    finally:
        os.close(host_fd)
    return listeners


class _OpenRelays:
    """How many relayed connections are open. A node's ranks share its namespace and
    their listeners, so this wrapper may carry another rank's PMIx connection: it must
    outlive its own command until that connection closes."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def opened(self) -> None:
        with self._changed:
            self._count += 1

    def closed(self) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def wait_all_closed(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._count == 0, timeout)


_relays = _OpenRelays()


def _relay(inner: socket.socket, outer: socket.socket) -> None:
    """Both directions of one connection; counted open until both have ended."""
    _relays.opened()
    back = threading.Thread(target=_pump, args=(outer, inner), daemon=True)
    back.start()
    _pump(inner, outer)
    back.join()
    _relays.closed()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close so the peer sees EOF while the other direction drains.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _serve(listener: socket.socket, target: tuple[str, int]) -> None:
    """Accept connections in the rank's namespace; connect each to `target` in the host's."""
    while True:
        try:
            inner, _ = listener.accept()
        except OSError:
            return
        # This thread runs in the host namespace, so the outgoing socket is created there.
        outer = socket.create_connection(target)
        for sock in (inner, outer):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(inner, outer), daemon=True).start()


def _enter_namespace_in_child(netns_fd: int) -> None:
    # Runs between fork and exec, before any relay thread exists. PDEATHSIG ends the
    # command if this wrapper is killed with SIGKILL, so no rank outlives its wrapper.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    setns(netns_fd)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: netem_rank.py RUN_NAME -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    run_name, command = argv[0], argv[2:]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "-1")))
    if rank < 0:
        print("netem_rank.py: no OMPI_COMM_WORLD_RANK: start it through mpirun", file=sys.stderr)
        return 2
    # consecutive ranks share a node (netem.py's EmulatedNetwork.node_of)
    ranks_per_node = int(os.environ.get("PIPESGD_NETEM_RANKS_PER_NODE", "1"))
    netns = f"{run_name}-n{rank // ranks_per_node}"
    try:
        netns_fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
    except FileNotFoundError:
        print(f"netem_rank.py: network namespace {netns} does not exist", file=sys.stderr)
        return 2

    endpoints = pmix_server_endpoints(dict(os.environ))
    listeners = listen_inside(netns_fd, endpoints)

    env = dict(os.environ)
    env.setdefault("RANK", str(rank))
    env.setdefault("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", ""))
    child = subprocess.Popen(
        command,
        env=env,
        # preexec_fn runs before the child closes inherited descriptors, so it can use
        # netns_fd without passing it on to the command.
        preexec_fn=lambda: _enter_namespace_in_child(netns_fd),
    )
    os.close(netns_fd)
    for listener, target in zip(listeners, endpoints, strict=True):
        threading.Thread(target=_serve, args=(listener, target), daemon=True).start()

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    status = child.wait()
    for listener in listeners:  # new connections go to the node's other ranks' listeners
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    _relays.wait_all_closed(timeout=RELAY_LINGER_S)
    if status < 0:
        # Die of the same signal so mpirun reports the rank the way it would without us.
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
