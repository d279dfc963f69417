"""The paper's experiment through the timing model (pipesgd.timing.paper) and
`pipesgd timing reproduce-paper`: PS-Sync's equation, batch scaling and the predicted
frameworks against hand computations; the command's table, JSON and errors."""

import json

import pytest
from cli_in_process import pipesgd
from fakes import KERNELS

from pipesgd.timing import NetworkParams, Profile
from pipesgd.timing import paper as P

MIB = 1 << 20


def nic(**kw):
    """A described cluster: a NIC moves the bytes (beta_cpu = 0), a core per rank."""
    base = dict(alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10, sync_s=2e-5,
                kernels=KERNELS, copy_s_per_byte=5e-11, beta_cpu_s_per_byte=0.0, cores=64,
                ranks_per_host=1)
    base.update(kw)
    return NetworkParams(**base)


def prof(**kw):
    base = dict(forward_s=0.01, backward_s=0.02, update_s=0.005, gradient_bytes=4e6,
                batch_size=64)
    base.update(kw)
    return Profile(**base)


def test_ps_sync_by_hand():
    # p = 4 workers, n = 4e6 B in 1 MiB segments; the link (1 ns/B) is slower than the
    # server's sums (0.1 ns/B), so the inbound stream of p n bytes sets the pace.
    t = P.ps_sync(prof(), nic(), 4)
    compute, pack, latency = 0.03, 2 * 4e6 * 5e-11, 2 * 1e-5
    stream = 4 * 4e6 * 1e-9
    last = 4 * MIB * (1e-9 + 1e-10)
    assert t["stream_s"] == pytest.approx(stream)
    assert t["last_segment_s"] == pytest.approx(last)
    assert t["predicted_s"] == pytest.approx(compute + pack + latency + stream + last)
    # a server that sums slower than its link receives: p n γ sets the pace
    slow = P.ps_sync(prof(), nic(gamma_s_per_byte=2e-9), 4)
    assert slow["stream_s"] == pytest.approx(4 * 4e6 * 2e-9)
    # a gradient smaller than a segment is its own last segment
    small = P.ps_sync(prof(gradient_bytes=1e5), nic(), 4)
    assert small["last_segment_s"] == pytest.approx(4 * 1e5 * 1.1e-9)
    with pytest.raises(ValueError, match="p \\(number of workers\\)"):
        P.ps_sync(prof(), nic(), 0)


def test_at_batch_scales_forward_and_backward_only():
    scaled = P.at_batch(prof(batch_size=8), 64)
    assert scaled.forward_s == pytest.approx(0.08) and scaled.backward_s == pytest.approx(0.16)
    assert scaled.update_s == 0.005 and scaled.gradient_bytes == 4e6
    assert scaled.batch_size == 64 and "scaled x8 from batch 8 to 64" in scaled.source
    unknown = P.at_batch(prof(batch_size=0), 25)
    assert unknown.forward_s == 0.01 and unknown.batch_size == 25
    with pytest.raises(ValueError, match="batch must be"):
        P.at_batch(prof(), 0)


def test_frameworks_by_hand_on_a_described_cluster():
    # p = 4, n = 4e6: each rank's ring moves 6 chunks of 1e6 B (6 ms at 1 ns/B) and
    # reduces 3 of them (0.3 ms at 0.1 ns/B), behind the wire but for one segment's
    # reduction (a 1e6 B chunk is one 1 MiB segment): 0.1 ms.
    ring = 6 * 1e-5 + 6e-3 + 0.3e-3 / 3 + 2e-5
    pack = 2 * 4e6 * 5e-11
    dsync = 0.005 + pack + 0.03 + ring
    pipe = max(0.005 + pack + 0.03, ring)
    ps = 0.03 + pack + 2e-5 + 4 * 4e6 * 1e-9 + 4 * MIB * 1.1e-9
    out = P.predict_benchmark(prof(), nic(), 4)
    assert out["times_s"]["D-Sync"] == pytest.approx(dsync)
    assert out["times_s"]["Pipe-SGD"] == pytest.approx(pipe)
    assert out["times_s"]["PS-Sync"] == pytest.approx(ps)
    # compute-bound: compression cannot beat plain Pipe-SGD, which wins the tie
    assert out["best_pipe_sgd"] == "Pipe-SGD"
    assert out["speedup_over_dsync"] == pytest.approx(dsync / pipe)
    assert out["speedup_over_ps_sync"] == pytest.approx(ps / pipe)
    assert out["ratios"]["D-Sync over PS-Sync"] == pytest.approx(ps / dsync)


def test_reproduce_paper_flags_what_falls_outside_the_papers_ranges():
    profiles = {key: prof(batch_size=P.BENCHMARKS[key].batch_per_worker())
                for key in P.BENCHMARKS}
    result = P.reproduce_paper(profiles, nic(), 4)
    assert [r["benchmark"] for r in result["rows"]] == [
        "MNIST-MLP", "CIFAR100-Convex", "AlexNet", "ResNet-18"]
    for row in result["rows"]:
        # the paper (§4): 2.0-3.2x over D-Sync, 4.0-5.4x over PS-Sync
        assert row["in_paper_range"]["over_dsync"] == (
            2.0 <= row["speedup_over_dsync"] <= 3.2)
        assert row["in_paper_range"]["over_ps_sync"] == (
            4.0 <= row["speedup_over_ps_sync"] <= 5.4)
        assert ("ratios" in row) == (row["key"] == "cifar100-convex")
    # this compute-bound toy is (35.4 ms + its 6.18 ms ring) / 35.4 ms = 1.17x over
    # D-Sync (as by hand above): outside, and said so
    assert not result["summary"]["all_in_paper_range"]
    text = P.format_result(result)
    assert "outside the paper's range" in text
    assert f"{(35.4e-3 + 6.18e-3) / 35.4e-3:.2f}*" in text
    assert "2.0-3.2x faster than D-Sync, 4.0-5.4x faster than PS-Sync" in text
    assert P.format_result(result, markdown=True).startswith("| benchmark | batch/worker |")
    with pytest.raises(ValueError, match="unknown benchmark 'vgg'"):
        P.reproduce_paper({"vgg": prof()}, nic())
    with pytest.raises(ValueError, match="no benchmarks"):
        P.reproduce_paper({}, nic())


def test_cifar100_convex_trains_only_the_last_layer():
    # the last layer of the CIFAR100 network is FC 64 -> 100
    p = P.profile_benchmark("cifar100-convex", profile_batch=4, warmup=1, repeats=2)
    assert p.gradient_bytes == (64 * 100 + 100) * 4
    assert p.batch_size == 64 and "from batch 4 to 64" in p.source
    assert P.profiled_batch("alexnet") == 8 and P.profiled_batch("mnist-mlp") == 25
    assert P.profiled_batch("resnet18", 1000) == 64


def test_cli_with_given_profiles_writes_the_table(tmp_path):
    args = ["timing", "reproduce-paper", "--speedup", "1", "--host-gbps", "10"]
    for key, bench in P.BENCHMARKS.items():
        path = tmp_path / f"{key}.json"
        prof(batch_size=bench.batch_per_worker()).save(path)
        args += ["--profile", f"{key}={path}"]
    out = tmp_path / "paper.json"
    res = pipesgd(*args, "--markdown", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "| MNIST-MLP | 25 |" in res.stdout and "| ResNet-18 | 64 |" in res.stdout
    assert "host: reduction 10.0 GB/s per core" in res.stdout
    data = json.loads(out.read_text())
    # the 10GbE cluster by hand: α 20 us, β 0.8 ns/B; --host-gbps 10: γ 0.1 ns/B, and the
    # copy scaled from the development VM's 6.8e-11 s/B by (1e-10 / 1.9e-10)
    copy = 6.8e-11 * 1e-10 / 1.9e-10
    ps = 0.03 + 2 * 4e6 * copy + 2 * 20e-6 + 4 * 4e6 * 0.8e-9 + 4 * MIB * (0.8e-9 + 1e-10)
    row = data["rows"][0]
    assert row["times_s"]["PS-Sync"] == pytest.approx(ps)
    assert data["setting"]["speedup"] == 1.0 and data["p"] == 4


@pytest.mark.parametrize(("args", "message"), [
    (["--benchmarks", "vgg"], "unknown benchmark 'vgg'"),
    (["--host-gbps", "-1"], "host_gbps must be a positive number"),
    (["--profile", "alexnet"], "--profile 'alexnet': expected BENCHMARK=FILE"),
    (["--profile", "vgg=x.json"], "unknown benchmark 'vgg'"),
    (["--profile-batch", "0"], "argument --profile-batch: expected an integer >= 1"),
])
def test_cli_bad_input_says_what_is_wrong(args, message):
    res = pipesgd("timing", "reproduce-paper", *args)
    assert res.returncode == 2
    assert f"pipesgd timing reproduce-paper: error: {message}" in res.stderr


def test_host_gbps_on_predict_and_project(tmp_path):
    path = tmp_path / "prof.json"
    prof().save(path)
    res = pipesgd("timing", "project", "--profile", str(path), "--host-gbps", "0")
    assert res.returncode == 2 and "host_gbps must be a positive number" in res.stderr
    res = pipesgd("timing", "project", "--profile", str(path), "--clusters", "10GbE")
    assert res.returncode == 0, res.stderr
    assert "host: reduction 5.3 GB/s per core" in res.stdout
    assert "HOST_CPU_DEFAULTS" in res.stdout
    net = tmp_path / "net.json"
    nic().save(net)
    res = pipesgd("timing", "predict", "--profile", str(path), "-p", "2", "--network",
                  str(net), "--host-gbps", "5")
    assert res.returncode == 2 and "--host-gbps describes the host" in res.stderr
