"""Tests for bench/netem.py: byte counts, per-link rate caps (switch, not hub), and cleanup.

The network tests need root and `ip netns`; they are skipped with the reason otherwise.
Each moves 8 MiB at 200 Mbit/s (0.34 s per link direction); with the four token buckets
the burst probe looks for, the module takes about a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench
from mpirun import ROOT, SCRIPTS, mpi_env, mpirun_command

netem = load_bench("netem")

RATE = "200mbit"
RATE_BPS = 200_000_000
NBYTES = 8 << 20
PROBE = str(SCRIPTS / "netem_probe.py")
OVERHEAD = 1.05  # headers and MPI's own messages on top of the payload

needs_netns = pytest.mark.skipif(
    (reason := netem.unavailable_reason()) is not None, reason=reason or ""
)


def _probe(net, pattern: str, nbytes: int = NBYTES):
    run = net.run(
        [sys.executable, PROBE, pattern, str(nbytes)],
        capture_output=True,
        timeout=60,
        env=mpi_env(),
        cwd=ROOT,
    )
    assert run.returncode == 0, f"{pattern} failed:\n{run.output}\n{run.format_table()}"
    lines = [line for line in run.output.splitlines() if line.startswith("{")]
    assert lines, f"no result line from the probe:\n{run.output}"
    return run, json.loads(lines[-1])["seconds"]


def _probe_result(net, pattern: str, key: str):
    """`key` of the JSON line the probe prints for `pattern` (no bytes moved)."""
    run = net.run([sys.executable, PROBE, pattern, "0"], capture_output=True, timeout=60,
                  env=mpi_env(), cwd=ROOT)
    assert run.returncode == 0, f"{pattern} probe failed:\n{run.output}"
    return json.loads([ln for ln in run.output.splitlines() if ln.startswith("{")][-1])[key]


def _assert_bytes(actual: int, expected: int, what: str, run) -> None:
    assert expected <= actual <= expected * OVERHEAD, (
        f"{what}: link counted {actual:,} B, expected {expected:,}..{int(expected * OVERHEAD):,}"
        f"\n{run.format_table()}"
    )


def _own_namespaces(net_name: str) -> list[str]:
    return [name for name in netem.list_namespaces() if name.startswith(f"{net_name}-")]


@pytest.fixture(scope="module")
def net3():
    with netem.emulated_network(np=3, rate=RATE) as net:
        yield net
    assert not _own_namespaces(net.name), "namespaces left after the network was closed"


# -- parsing (no root needed) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("200mbit", 2 * 10**8), ("10Gbit", 10**10), ("1.5Mbit/s", 1_500_000)],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert netem.parse_rate(text) == bits


@pytest.mark.parametrize(("text", "seconds"), [("0", 0.0), ("20us", 20e-6), ("1ms", 1e-3)])
def test_parse_latency(text: str, seconds: float) -> None:
    assert netem.parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "nbytes"),
                         [("0", 0), ("64KiB", 65536), ("1MiB", 1 << 20), ("125kB", 125000)])
def test_parse_burst(text: str, nbytes: int) -> None:
    assert netem.parse_burst(text) == nbytes


def test_burst_below_a_gso_packet_needs_unsegmented_links() -> None:
    """htb lets a whole packet through on any token left: a bucket below one 64 KiB GSO
    packet only shapes if packets stay one MTU long."""
    assert not netem.EmulatedNetwork(2, RATE_BPS)._unsegmented
    assert netem.EmulatedNetwork(2, RATE_BPS, burst=0)._unsegmented
    assert netem.EmulatedNetwork(2, RATE_BPS, burst=0).burst_bytes == 1500 + 14
    assert not netem.EmulatedNetwork(2, RATE_BPS, burst=1 << 20)._unsegmented
    with pytest.raises(ValueError, match="burst"):
        netem.EmulatedNetwork(2, RATE_BPS, burst=-1)
    with pytest.raises(ValueError, match="--burst 128KiB"):
        netem.parse_burst("lots")


@pytest.mark.parametrize("text", ["1gbps", "fast", "100"])
def test_parse_rate_rejects_with_example(text: str) -> None:
    with pytest.raises(ValueError, match="--rate 1gbit"):
        netem.parse_rate(text)


def test_not_root_exits_77(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert netem.main(["--", "true"]) == netem.EXIT_UNAVAILABLE
    assert "needs root" in capsys.readouterr().err


# -- the emulated network -----------------------------------------------------------------------


@needs_netns
def test_ring_moves_expected_bytes_at_link_rate(net3) -> None:
    """Every rank sends and receives NBYTES at once, each on its own links: one link time."""
    run, seconds = _probe(net3, "ring")
    for link in run.links:
        _assert_bytes(link.tx_bytes, NBYTES, f"rank {link.node} sent", run)
        _assert_bytes(link.rx_bytes, NBYTES, f"rank {link.node} received", run)
    bound = NBYTES * 8 / RATE_BPS
    assert seconds >= 0.9 * bound, f"ring took {seconds:.3f} s, faster than the cap allows"
    # A hub (one shared medium) would need 3 link times for the 3 transfers.
    assert seconds < 2 * bound, f"ring took {seconds:.3f} s for a {bound:.3f} s bound: not a switch"


@pytest.mark.parametrize("burst", [0, 64 << 10, 512 << 10, 2 << 20])
@needs_netns
def test_timing_model_finds_any_token_bucket(burst: int) -> None:
    """measure_network's burst probe finds the bucket the emulator configured, whatever
    its size (none, smaller than its first transfer, larger than any fixed probe), and
    the rate of its one flow beyond the bucket."""
    with netem.emulated_network(np=2, rate=RATE, burst=burst) as net:
        run = net.run(
            [sys.executable, PROBE, "burst", "0"],
            capture_output=True, timeout=120, env=mpi_env(), cwd=ROOT,
        )  # fmt: skip
    assert run.returncode == 0, f"burst probe failed:\n{run.output}"
    result = json.loads([ln for ln in run.output.splitlines() if ln.startswith("{")][-1])
    found = result["burst_bytes"]
    flow_bps = 8 / result["flow_beta"]
    assert 0.75 * RATE_BPS <= flow_bps <= 1.1 * RATE_BPS, (
        f"one flow at {flow_bps / 1e6:.0f} Mbit/s; the emulator's links carry {RATE}")
    if burst == 0:
        # an htb bucket is never below one packet; the probe resolves 16 KiB
        assert found <= 16 << 10, f"found a {found:,.0f} B bucket on links without one"
    else:
        assert 0.75 * burst <= found <= 1.25 * burst, (
            f"found a {found:,.0f} B bucket; the emulator's links have {burst:,} B")


@needs_netns
def test_comm_thread_sleeps_longer_while_segments_stream(net3) -> None:
    """On a slow link the poll sleep doubles after empty wakes: far fewer wake-ups.

    1 MiB at p = 3 on 200 Mbit/s: six 60 KiB segments per ring step, 2.5 ms each, which
    a fixed 50 us sleep checks about fifty times. Without the doubling the two counts are
    alike; with it, a quarter to a half: on a loaded machine each short sleep overshoots,
    which thins the fixed count (766 against 418 in one such run of a single allreduce).
    """
    run = net3.run(
        [sys.executable, PROBE, "wakes", str(1 << 20)],
        capture_output=True, timeout=60, env=mpi_env(), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, f"wakes probe failed:\n{run.output}"
    result = json.loads([ln for ln in run.output.splitlines() if ln.startswith("{")][-1])
    assert result["doubling"] < 0.7 * result["fixed"], result


def _tcp_eager_limit() -> int:
    """Open MPI's TCP eager limit, from its own parameter listing (`ompi_info`, beside
    the `mpirun` the tests launch: the wheel's in the venv, or a cluster's own)."""
    ompi_info = Path(mpirun_command(1)[0]).with_name("ompi_info")
    out = subprocess.run([str(ompi_info), "--param", "btl", "tcp", "--level", "9",
                          "--parsable"], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    line = next(ln for ln in out.splitlines() if ":btl_tcp_eager_limit:value:" in ln)
    return int(line.rsplit(":", 1)[1])


@needs_netns
def test_eager_probe_finds_the_transports_eager_limit(net3) -> None:
    """Over TCP a message up to Open MPI's eager limit, less its header, is sent before
    the receiver asks; the probe resolves 64 bytes."""
    found = _probe_result(net3, "eager", "eager_bytes")
    limit = _tcp_eager_limit()
    assert limit - 512 < found <= limit, f"found {found:,} B; btl_tcp_eager_limit {limit:,} B"


@needs_netns
def test_pipeline_links_between_nodes_cut_payloads_at_the_eager_limit(net3) -> None:
    """Ranks in separate namespaces are on separate nodes: the pipeline's link between
    them cuts payloads into pieces of Open MPI's TCP eager limit, to the probe's 1 KiB."""
    found = _probe_result(net3, "pieces", "piece_bytes")
    limit = _tcp_eager_limit()
    assert limit - 1024 - 512 < found <= limit, f"pieces of {found:,} B; limit {limit:,} B"


@needs_netns
def test_sending_to_two_peers_is_limited_by_the_uplink(net3) -> None:
    run, seconds = _probe(net3, "fanout")
    _assert_bytes(run.links[0].tx_bytes, 2 * NBYTES, "rank 0 sent", run)
    _assert_bytes(run.links[1].rx_bytes, NBYTES, "rank 1 received", run)
    _assert_bytes(run.links[2].rx_bytes, NBYTES, "rank 2 received", run)
    bound = 2 * NBYTES * 8 / RATE_BPS
    assert seconds >= 0.9 * bound, (
        f"fan-out took {seconds:.3f} s; rank 0's uplink needs {bound:.3f} s for both sends"
    )


def test_nodes_divide_the_ranks() -> None:
    net = netem.EmulatedNetwork(4, RATE_BPS, nodes=2)
    assert [net.node_of(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert len(net.namespaces()) == 3  # two nodes and the switch
    for nodes in (0, 3, 5):
        with pytest.raises(ValueError, match="nodes"):
            netem.EmulatedNetwork(4, RATE_BPS, nodes=nodes)


@needs_netns
def test_ranks_of_a_node_share_its_one_link() -> None:
    """2 nodes x 2 ranks, every rank sending NBYTES to rank + 1: only the two edges that
    leave a node cross a link, so each node's link carries NBYTES each way, not 2x."""
    with netem.emulated_network(np=4, rate=RATE, nodes=2) as net:
        run, seconds = _probe(net, "ring")
    assert len(run.links) == 2
    for link in run.links:
        _assert_bytes(link.tx_bytes, NBYTES, f"node {link.node} sent", run)
        _assert_bytes(link.rx_bytes, NBYTES, f"node {link.node} received", run)
    bound = NBYTES * 8 / RATE_BPS
    assert 0.9 * bound <= seconds < 2 * bound, f"ring took {seconds:.3f} s for {bound:.3f} s"


@needs_netns
def test_measure_finds_the_network_and_the_node_link(tmp_path: Path) -> None:
    """Across nodes, α and β are the network's (the ring's slowest edges) and the node
    link is measured beside them, much faster."""
    out = tmp_path / "net.json"
    with netem.emulated_network(np=4, rate="1gbit", nodes=2) as net:
        run = net.run([sys.executable, "-m", "pipesgd.cli", "timing", "measure", "--repeats",
                       "5", "--json", str(out)],
                      capture_output=True, timeout=240, env=mpi_env(), cwd=ROOT)
    assert run.returncode == 0, run.output
    measured = json.loads(out.read_text())
    assert measured["ranks_per_node"] == 2
    rate = 8 / measured["beta_s_per_byte"]
    assert 0.75e9 <= rate <= 1.05e9, f"network measured at {rate / 1e9:.2f} Gbit/s"
    assert measured["node_beta_s_per_byte"] < measured["beta_s_per_byte"] / 3


@needs_netns
@pytest.mark.parametrize("per_node", [2, 3])
def test_a_ring_across_nodes_links_the_edges_within_a_node(per_node: int) -> None:
    """2 nodes: the engine's edges within a node go through shared-memory links, those
    between nodes as MPI messages; results match float64, MPI's Allreduce and the
    compressed error bounds, bitwise equal on every rank. With 3 ranks a node, the
    middle one has links on both sides (it sleeps on their doorbell)."""
    env = {**mpi_env(), "PIPESGD_SHM_LINKS": "1"}
    with netem.emulated_network(np=2 * per_node, rate="1gbit", nodes=2) as net:
        checks = [(SCRIPTS / "engine_mixed_ring.py", str(per_node))]
        if per_node == 2:
            checks.append((SCRIPTS / "compressed_allreduce.py", "65536"))
        for script, arg in checks:
            run = net.run([sys.executable, str(script), arg], capture_output=True,
                          timeout=240, env=env, cwd=ROOT)
            assert run.returncode == 0, f"{script.name} failed:\n{run.output}"
            if script.name == "engine_mixed_ring.py":
                assert "bitwise equal on every rank" in run.output, run.output


@needs_netns
def test_failing_command_leaves_nothing() -> None:
    with netem.emulated_network(np=2, rate=RATE) as net:
        assert len(_own_namespaces(net.name)) == 3  # two ranks and the switch
        run = net.run([sys.executable, PROBE, "fail", "0"], capture_output=True, timeout=60)
        assert run.returncode != 0, run.output
    assert not _own_namespaces(net.name)


@needs_netns
def test_exception_inside_network_leaves_nothing() -> None:
    with pytest.raises(RuntimeError, match="boom"), netem.emulated_network(np=2) as net:
        raise RuntimeError("boom")
    assert not _own_namespaces(net.name)


@needs_netns
def test_cli_returns_command_status_and_cleans_up() -> None:
    before = set(netem.list_namespaces())
    proc = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "netem.py"), "--np", "2", "--rate", RATE,
            "--", sys.executable, PROBE, "fail", "0",
        ],
        capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "sent bytes" in proc.stderr, "no per-rank byte table printed"
    assert set(netem.list_namespaces()) <= before


@needs_netns
def test_latency_without_sch_netem_fails_clearly_and_cleans_up() -> None:
    before = set(netem.list_namespaces())
    try:
        with netem.emulated_network(np=2, rate=RATE, latency="1ms") as net:
            assert len(_own_namespaces(net.name)) == 3
    except netem.NetemError as exc:  # kernels built without CONFIG_NET_SCH_NETEM
        assert "--latency 0" in str(exc)
    assert set(netem.list_namespaces()) <= before


def test_probe_script_exists() -> None:
    assert Path(PROBE).is_file()
