"""`pipesgd plan` end to end on the MLP (profiled here, small batch) and on hand-made
profiles, and its errors for bad input."""

import json
import subprocess
import sys

import pytest
from mpirun import ROOT

from pipesgd.cli import main
from pipesgd.pipeline.plan import Plan
from pipesgd.planner import ModelProfile


def plan(capsys, *args):
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    assert main(["plan", "--model", "mlp", "--batch-size", "4", "--profile-only",
                 str(path)]) == 0
    return path


def hand_profile(tmp_path, weights, outputs):
    """5 layers (as many as the MLP's) of 1 + 2 ms at batch 8."""
    path = tmp_path / "prof.json"
    prof = ModelProfile.from_columns([1e-3] * 5, [2e-3] * 5, [outputs] * 5, [weights] * 5,
                                     saved_bytes=[1e6] * 5, batch_size=8)
    prof.save(path)
    return path


def test_mlp_end_to_end(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    rc, out, err = plan(capsys, "--model", "mlp", "--batch-size", "4", "--workers", "2",
                        "--bandwidth", "1Gbit", "--memory", "64MB", "--json", str(out_json))
    assert rc == 0, err
    assert "model mlp: 5 layers, profile at batch 4" in out
    for family in ("data-parallel", "pipedream", "madpipe"):
        assert family in out
    assert "fwd+bwd ms" in out and "choice:" in out and "run it with:" in out
    data = json.loads(out_json.read_text())
    loaded = Plan.load(out_json)  # the runtime reads it as it is
    assert loaded.num_layers == 5 and loaded.world_size <= 2
    assert data["predicted_samples_per_s"] > 0
    assert data["choice"]["family"] in ("data-parallel", "pipedream", "madpipe")
    assert {a["family"] for a in data["alternatives"]} == {"data-parallel", "pipedream",
                                                          "madpipe"}
    ranked = [a["samples_per_s"] for a in data["alternatives"] if a["fits"]]
    assert ranked == sorted(ranked, reverse=True)


def test_profile_only_then_profile(mlp_profile, tmp_path, capsys):
    prof = ModelProfile.load(mlp_profile)
    assert prof.num_layers == 5 and prof.batch_size == 4 and prof.extra["model"] == "mlp"
    rc, out, err = plan(capsys, "--profile", str(mlp_profile), "--batch-size", "8",
                        "--micro-batch", "4", "--topology", "2x[10GB/s], 2x[1Gbit]")
    assert rc == 0, err
    assert "model mlp" in out and "micro-batch 4" in out
    assert "2x[10GB/s], 2x[0.125GB/s]" in out


def test_pipeline_wins_prints_its_stages_and_command(tmp_path, capsys):
    prof = hand_profile(tmp_path, weights=100e6, outputs=1e3)
    out_json = tmp_path / "plan.json"
    rc, out, err = plan(capsys, "--profile", str(prof), "--model", "mlp", "--batch-size",
                        "8", "--workers", "4", "--bandwidth", "1Gbit", "--json",
                        str(out_json))
    assert rc == 0, err
    assert "pipedream plan: 1f1b" in out and "<- bottleneck" in out
    assert f"mpirun -n 4 pipesgd pipeline --model mlp --plan {out_json}" in out
    data = json.loads(out_json.read_text())
    assert data["choice"]["family"] == "pipedream" and data["planner"] == "pipedream"
    assert len(data["stages"]) == 4 and data["predicted_samples_per_s"] > 1000


def test_device_gbps_plans_for_gpus_staging_through_the_host(tmp_path, capsys):
    # 1 MB activations between stages: on GPUs copying 1 GB/s to the host every message
    # pays its copies both ways, so the same pipeline is predicted slower.
    prof = hand_profile(tmp_path, weights=100e6, outputs=1e6)
    rates = []
    for extra in ([], ["--device-gbps", "1"]):
        out_json = tmp_path / f"plan{len(extra)}.json"
        rc, _, err = plan(capsys, "--profile", str(prof), "--model", "mlp", "--batch-size",
                          "8", "--workers", "4", "--bandwidth", "1Gbit", "--json",
                          str(out_json), *extra)
        assert rc == 0, err
        rates.append(json.loads(out_json.read_text())["predicted_samples_per_s"])
    assert rates[1] < rates[0]


def test_data_parallel_wins_prints_the_train_command(tmp_path, capsys):
    prof = hand_profile(tmp_path, weights=1e3, outputs=1e9)
    out_json = tmp_path / "plan.json"
    rc, out, err = plan(capsys, "--profile", str(prof), "--model", "mlp", "--batch-size",
                        "8", "--workers", "4", "--bandwidth", "1Gbit", "--json",
                        str(out_json))
    assert rc == 0, err
    assert "data parallelism wins; run it with:" in out
    assert "mpirun -n 4 pipesgd train --model mlp --batch-size 8 --staleness" in out
    assert "best pipeline (not the choice)" in out
    data = json.loads(out_json.read_text())
    assert data["choice"]["family"] == "data-parallel"
    assert data["choice"]["command"].startswith("mpirun -n 4 pipesgd train")
    assert Plan.load(out_json).world_size <= 4  # the best pipeline, runnable


def measured_network(tmp_path, measured_p=4):
    """A network file as `pipesgd timing measure --json` writes it, for 4 ranks on 1 Gbit/s
    links (one per host, 16 cores each)."""
    import dataclasses

    from pipesgd.timing.cluster import describe_cluster

    net = dataclasses.replace(describe_cluster("1Gbit", "30us", cores=16, ranks_per_host=1),
                              measured_p=measured_p, burst_bytes=256e3)
    path = tmp_path / "net.json"
    net.save(path)
    return path, net


def test_a_measured_network_plans_every_family_on_it(tmp_path, capsys):
    from pipesgd.planner import choose
    from pipesgd.planner.topology import from_network

    prof_path = hand_profile(tmp_path, weights=100e6, outputs=1e3)
    net_path, net = measured_network(tmp_path)
    out_json = tmp_path / "plan.json"
    rc, out, err = plan(capsys, "--profile", str(prof_path), "--model", "mlp",
                        "--batch-size", "8", "--network", str(net_path), "--json",
                        str(out_json))
    assert rc == 0, err
    assert "(4 workers)" in out  # the ranks it was measured on
    # the same ranking as the library gives on that network's links and costs
    expected = choose(ModelProfile.load(prof_path), from_network(net, 4), None, batch_size=8,
                      dp_network=net)
    got = {a["family"]: a["samples_per_s"] for a in json.loads(out_json.read_text())
           ["alternatives"] if a["fits"]}
    assert got == pytest.approx({c.family: c.samples_per_s for c in expected.ranked})
    # --workers plans for another count on the same links
    rc, out, err = plan(capsys, "--profile", str(prof_path), "--model", "mlp",
                        "--batch-size", "8", "--network", str(net_path), "--workers", "2")
    assert rc == 0 and "(2 workers)" in out, err
    by_hand, _ = measured_network(tmp_path, measured_p=None)
    rc, _, err = plan(capsys, "--profile", str(prof_path), "--batch-size", "8",
                      "--network", str(by_hand))
    assert rc == 2 and "was not measured on ranks" in err and "--workers 4" in err


def test_a_topology_file_plans_as_its_text(tmp_path, capsys):
    from pipesgd.planner.topology import HierarchicalTopology

    prof_path = hand_profile(tmp_path, weights=10e6, outputs=1e5)
    text = "2x[10GB/s], 2x[1Gbit]"
    HierarchicalTopology.parse(text).save(tmp_path / "topo.json")
    rates = []
    for given in (text, str(tmp_path / "topo.json")):
        out_json = tmp_path / "plan.json"
        rc, _, err = plan(capsys, "--profile", str(prof_path), "--model", "mlp",
                          "--batch-size", "8", "--topology", given, "--json", str(out_json))
        assert rc == 0, err
        rates.append([a["samples_per_s"] for a in
                      json.loads(out_json.read_text())["alternatives"]])
    assert rates[0] == rates[1]


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "8"], "say how the workers are connected"),
    (["--batch-size", "8", "--bandwidth", "1Gbit"], "--bandwidth needs --workers"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--topology",
      "2x[1Gbit]"], "not --topology and --bandwidth"),
    (["--batch-size", "8", "--workers", "3", "--topology", "2x[1Gbit]"],
     "the topology '2x[1Gbit]' has 2 workers"),
    (["--batch-size", "8", "--topology", "2x1Gbit"], "bad topology"),
    (["--batch-size", "8", "--topology", "missing.json"],
     "missing.json: no such file; expected a topology"),
    (["--batch-size", "8", "--network", "missing.json"],
     "missing.json: no such file; expected a network description"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--network", "n.json"],
     "not --bandwidth and --network"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "fast"], "bad bandwidth"),
    (["--batch-size", "8", "--micro-batch", "3", "--workers", "2", "--bandwidth", "1Gbit"],
     "must divide --batch-size"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--memory", "lots"],
     "bad memory size"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--memory", "1kB"],
     "smallest budget that fits is"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--model", "cnn"],
     "the profile has 5 layers but the model has 12"),
    (["--batch-size", "8", "--profile-only", "x.json"], "give one"),
    (["--batch-size", "8", "--workers", "2", "--bandwidth", "1Gbit", "--device-gbps", "0"],
     "device_gbps must be a positive number"),
])
def test_bad_input_is_a_clear_error(mlp_profile, capsys, args, message):
    rc, _, err = plan(capsys, "--profile", str(mlp_profile), *args)
    assert rc == 2
    assert err.startswith("pipesgd plan: error: ") and message in err, err


def test_bad_model_and_missing_files(tmp_path, capsys):
    rc, _, err = plan(capsys, "--model", "nosuch", "--batch-size", "4",
                      "--profile-only", str(tmp_path / "p.json"))
    assert rc == 2 and "--model 'nosuch': expected one of mlp, cnn or MODULE:FUNCTION" in err
    rc, _, err = plan(capsys, "--model", "torch.nn:Identity", "--batch-size", "4",
                      "--profile-only", str(tmp_path / "p.json"))
    assert rc == 2 and "needs --data or --input-shape" in err
    rc, _, err = plan(capsys, "--profile", str(tmp_path / "missing.json"), "--batch-size",
                      "4", "--workers", "2", "--bandwidth", "1Gbit")
    assert rc == 2 and "missing.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": 3}')
    rc, _, err = plan(capsys, "--profile", str(bad), "--batch-size", "4", "--workers", "2",
                      "--bandwidth", "1Gbit")
    assert rc == 2 and "a model profile is" in err


def test_registered_subcommand():
    res = subprocess.run([sys.executable, "-m", "pipesgd.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "plan" in res.stdout
    res = subprocess.run([sys.executable, "-m", "pipesgd.cli", "plan", "--workers", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--batch-size" in res.stderr
