"""`pipesgd timing` end to end: measure under mpirun, predict from files, project."""

import dataclasses
import json
import statistics

import pytest
from cli_in_process import pipesgd
from mpirun import run_mpi

from pipesgd.timing import Profile


def test_measure_network_on_two_ranks_is_sane():
    out = run_mpi(2, "timing_measure.py", timeout=90).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["measured_p"] == 2 and figures["beta_s_per_byte"] > 0


def test_without_shared_memory_no_in_place_rate_is_measured():
    out = run_mpi(2, "timing_measure.py", timeout=90, env={"PIPESGD_SHM_LINKS": "0"}).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["in_place_s_per_byte"] == 0.0 and figures["beta_s_per_byte"] > 0


def test_predict_by_hand_writes_json_and_png(tmp_path):
    prof = tmp_path / "prof.json"
    Profile(forward_s=0.002, backward_s=0.004, update_s=0.001, gradient_bytes=20e6,
            model="toy", batch_size=32).save(prof)
    out = tmp_path / "pred.json"
    res = pipesgd("timing", "predict", "--profile", str(prof), "-p", "4",
                  "--bandwidth", "10Gbit", "--latency", "20us", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "choice:" in res.stdout
    data = json.loads(out.read_text())
    assert len(data["configs"]) == 12
    first = data["configs"][0]
    assert {"staleness", "compression", "overlap", "predicted_s", "breakdown"} <= set(first)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_a_gpu_cluster_pays_host_staging_at_its_copy_rate(tmp_path):
    # 20 MB of gradients at 25 GB/s each way: 1.6 ms on D-Sync's critical path
    prof = tmp_path / "prof.json"
    Profile(forward_s=0.002, backward_s=0.004, update_s=0.001, gradient_bytes=20e6,
            model="toy", batch_size=32).save(prof)
    times = {}
    for extra in ([], ["--device-gbps", "25"]):
        out = tmp_path / f"pred{len(extra)}.json"
        res = pipesgd("timing", "predict", "--profile", str(prof), "-p", "4", "--bandwidth",
                      "10Gbit", "--latency", "20us", "--json", str(out), *extra)
        assert res.returncode == 0, res.stderr
        dsync = next(c for c in json.loads(out.read_text())["configs"]
                     if c["staleness"] == 1 and c["compression"] == "none"
                     and c["overlap"] == "sequential")
        times[bool(extra)] = (dsync["predicted_s"], dsync["breakdown"]["staging"])
    assert times[False][1] == 0 and abs(times[True][1] - 1.6e-3) < 1e-9
    assert abs(times[True][0] - times[False][0] - 1.6e-3) < 1e-9
    bad = pipesgd("timing", "predict", "--profile", str(prof), "-p", "4", "--bandwidth",
                  "10Gbit", "--device-gbps", "-3")
    assert bad.returncode == 2 and "device_gbps must be a positive number" in bad.stderr


def test_predict_without_a_network_says_how_to_give_one(tmp_path):
    prof = tmp_path / "prof.json"
    Profile(forward_s=0.002, backward_s=0.004, update_s=0.001, gradient_bytes=2e6).save(prof)
    res = pipesgd("timing", "predict", "--profile", str(prof), "-p", "2")
    assert res.returncode == 2 and "--bandwidth 10Gbit" in res.stderr
    res = pipesgd("timing", "predict", "--profile", str(prof), "-p", "0",
                  "--bandwidth", "1Gbit")
    assert res.returncode == 2 and "p (number of ranks)" in res.stderr


def test_project_table(tmp_path):
    prof = tmp_path / "prof.json"
    Profile(forward_s=0.09, backward_s=0.15, update_s=0.003, gradient_bytes=18.5e6,
            model="cnn", batch_size=32).save(prof)
    res = pipesgd("timing", "project", "--profile", str(prof), "--speedup", "100",
                  "--markdown")
    assert res.returncode == 0, res.stderr
    assert "| 10GbE | 256 |" in res.stdout and "| 100Gbit | 2 |" in res.stdout


def test_the_network_table_flags_a_noisy_figure():
    """A network figure whose repetitions spread by more than a quarter is named, with what
    to do; kernels' spreads, which predictions lean on less, are not."""
    from pipesgd.timing import describe_cluster
    from pipesgd.timing.cli import format_network

    net = describe_cluster("1Gbit", "20us")
    quiet = dataclasses.replace(net, spread={"alpha": 0.01, "beta": 0.16, "quant8.encode": 0.4})
    assert "noisy" not in format_network(quiet)
    noisy = dataclasses.replace(net, spread={"alpha": 0.01, "beta": 0.354, "burst": 0.22})
    line = next(x for x in format_network(noisy).splitlines() if "noisy" in x)
    assert "beta 35%" in line and "alpha" not in line and "burst" not in line
    assert "--repeats" in line
    waits = dataclasses.replace(net, spread={"beta": 0.1, "load_latency": 1.4})
    line = next(x for x in format_network(waits).splitlines() if "noisy" in x)
    assert "load_latency 140%" in line and "beta" not in line


def test_load_latency_and_its_spread_from_paired_repetitions():
    """λ_load is the median over ranks of each rank's median extra, per ring step; the
    spread is the pairs' interquartile range over that extra."""
    from pipesgd.timing.host_costs import load_latency_from

    idle = [[1e-3] * 8, [2e-3] * 8]
    loaded = [[5e-3] * 8, [4e-3] * 8]  # extras 4 and 2 ms: median 3 ms over 2 steps
    lam, spread = load_latency_from(idle, loaded, steps=2)
    assert lam == pytest.approx(1.5e-3)
    q = statistics.quantiles([4e-3] * 8 + [2e-3] * 8, n=4)
    assert spread == pytest.approx((q[2] - q[0]) / 3e-3)
    # a rank that ran faster beside spinning ranks: no wait, and nothing to lean on
    assert load_latency_from([[2e-3] * 8], [[1e-3] * 8], steps=2) == (0.0, 0.0)


def test_a_figures_spread_is_its_interquartile_range_over_its_median():
    from pipesgd.timing.spread import median_spread

    samples = [1.0, 2.0, 3.0, 4.0, 100.0]
    q = statistics.quantiles(samples, n=4)
    assert median_spread(samples) == (3.0, pytest.approx((q[2] - q[0]) / 3.0))
    assert median_spread([1.0, 2.0, 3.0]) == (2.0, 0.0)  # too few to judge
    assert median_spread([0.0] * 5) == (0.0, 0.0)
