"""Predicted vs measured iteration time of every configuration and how close the model lands.

For each scenario (link rate under bench/netem.py, p, model) one mpirun job
(`--worker`) measures the network (`measure_network`), profiles the model on rank 0 alone
(one thread, the others asleep), then trains every configuration (K in {1, 2} x
none/trunc16/quant8 x sequential/backward overlap) with the engine, a few steps each in
turn over several rounds, and reports each one's median iteration time. The parent
predicts each configuration from the measured network and profile only, prints
predicted beside measured, and checks the targets: median |pred - meas| / meas <= 10 %,
worst <= 25 %, and in every scenario the configuration `choose` ranks first is measured
fastest or within 5 % of the fastest.

The worker times what users run: `pipesgd.DistributedOptimizer` around SGD (default 25 MB
buckets), one `zero_grad(); backward(); step()` per iteration, on a fixed batch per rank.

    python bench/timing_suite.py                      # under the emulator (root)
    python bench/timing_suite.py --no-netem           # shared memory, no emulator
    python bench/timing_suite.py --rates 1gbit --ps 2 --models mlp   # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# (warm-up, timed) steps per configuration and round; after a round's drain the first
# step of a pipelined configuration finds its due gradient already reduced.
STEPS = {"mlp": (2, 10), "cnn": (1, 2)}
# Enough rounds that configurations the model calls equal (one bucket either way) are
# not told apart by noise alone: MLP iterations are a few ms on a 2-core VM.
ROUNDS = {"mlp": 12, "cnn": 6}
# repetitions of each profile, one before the rounds and one after each
PROFILE_REPEATS = {"mlp": 10, "cnn": 4}
BATCH = {"mlp": 64, "cnn": 32}


# ------------------------------------------------------------------------------------
# Worker (one rank of the mpirun job)


def worker(model_name: str, batch_size: int, out: str) -> None:
    import torch
    from mpi4py import MPI

    import pipesgd
    from pipesgd.pipeline.models import MODELS
    from pipesgd.timing import all_configs, measure_network, profile_named
    from pipesgd.timing.network import _idle_barrier

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    net = measure_network(comm, repeats=10)
    profiles = []

    def profile_alone() -> None:
        # rank 0 profiles while the others sleep; repeated between rounds (below)
        if rank == 0:
            profiles.append(profile_named(model_name, batch_size, threads=1,
                                          repeats=PROFILE_REPEATS[model_name]))
        _idle_barrier(comm)

    profile_alone()

    engine = pipesgd.Engine(comm)
    spec = MODELS[model_name]()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch_size, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
    warmup, timed = STEPS[model_name]
    # Every configuration runs a few steps per round, round after round, so a spell of
    # load on the machine hits all of them alike instead of the one running then.
    runs = []
    for cfg in all_configs():
        # What users run: the optimizer wrapper, default 25 MB buckets.
        model = spec.build(seed=0)
        opt = pipesgd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3), model.named_parameters(),
            staleness=cfg.staleness, compression=cfg.compression, overlap=cfg.overlap,
            engine=engine, comm=comm)
        runs.append((cfg, model, opt, []))
    for _ in range(ROUNDS[model_name]):
        for _cfg, model, opt, times in runs:
            comm.Barrier()
            for step in range(warmup + timed):
                begin = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if step >= warmup:
                    times.append(time.perf_counter() - begin)
            # Drain before the next configuration uses the link.
            opt.synchronize()
        profile_alone()
    results = []
    for cfg, _model, opt, times in runs:
        opt.remove_hooks()
        # the slowest rank sets the pace
        med = comm.allreduce(statistics.median(times), op=MPI.MAX)
        # rank 0's iterations in the order they ran, to tell a slow spell from the model
        results.append({"staleness": cfg.staleness, "compression": cfg.compression,
                        "overlap": cfg.overlap, "measured_s": med, "rank0_iterations_s": times})
    engine.shutdown()
    if rank == 0:
        prof = median_profile(profiles)
        Path(out).write_text(json.dumps({
            "network": net.to_dict(), "profile": prof.to_dict(), "runs": results}, indent=2))


def median_profile(profiles: list) -> Any:
    """One profile from several taken across the scenario: the median of each time.

    A single profile taken during a slow spell of the VM (the CNN once profiled at 164 ms
    of forward and backward where every other profile of the day gave 120-125 ms) shifts
    every prediction of its scenario; the timed configurations are spread over rounds,
    and so are the profiles they are compared with.
    """
    import dataclasses

    first = profiles[0]
    return dataclasses.replace(
        first,
        **{name: statistics.median(getattr(p, name) for p in profiles)
           for name in ("forward_s", "backward_s", "update_s")},
        source=f"{first.source}; median of {len(profiles)} profiles taken between rounds",
    )


# ------------------------------------------------------------------------------------
# Parent


def run_scenario(rate: str | None, p: int, model: str, out: Path, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model,
           str(BATCH[model]), str(out)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if rate is None:
        mpirun = Path(sys.executable).parent / "mpirun"
        subprocess.run([str(mpirun), "--oversubscribe", "-n", str(p), *cmd], check=True,
                       env=env, cwd=ROOT, timeout=timeout)
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from netem import mpirun_over_netem

        run = mpirun_over_netem(cmd, np=p, rate=rate, env=env, cwd=ROOT, timeout=timeout)
        if run.returncode != 0:
            raise RuntimeError(f"scenario {rate} p={p} {model} failed: {run.returncode}")
    return json.loads(out.read_text())


def evaluate(data: dict, p: int) -> dict:
    from pipesgd.timing import NetworkParams, Profile, choose

    net = NetworkParams.from_dict(data["network"])
    prof = Profile.from_dict(data["profile"])
    ranked = choose(prof, net, p)
    measured = {(r["staleness"], r["compression"], r["overlap"]): r["measured_s"]
                for r in data["runs"]}
    rows = []
    for pr in ranked:
        c = pr.config
        meas = measured[(c.staleness, c.compression, c.overlap)]
        rows.append({**pr.to_dict(), "measured_s": meas,
                     "rel_error": (pr.predicted_s - meas) / meas})
    fastest = min(measured.values())
    pick = rows[0]
    return {"rows": rows, "pick": pick["label"], "pick_measured_s": pick["measured_s"],
            "fastest_measured_s": fastest,
            "pick_within_5pct": pick["measured_s"] <= 1.05 * fastest,
            "ranked": ranked, "measured": measured}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1], int(argv[2]), argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1gbit,200mbit")
    ap.add_argument("--ps", default="2,4")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--no-netem", action="store_true", help="shared memory, no emulator")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULTS / "timing_suite.json"))
    args = ap.parse_args(argv)

    from pipesgd.timing.report import format_ranking, plot_breakdown

    rates = [None] if args.no_netem else args.rates.split(",")
    RESULTS.mkdir(parents=True, exist_ok=True)
    scenarios, errors = [], []
    for rate in rates:
        for p in (int(v) for v in args.ps.split(",")):
            for model in args.models.split(","):
                name = f"{rate or 'shm'}-p{p}-{model}"
                raw = RESULTS / f"timing_suite_{name}.raw.json"
                t0 = time.time()
                data = run_scenario(rate, p, model, raw, args.timeout)
                ev = evaluate(data, p)
                print(f"\n== {name}  ({time.time() - t0:.0f} s)")
                print(format_ranking(ev["ranked"], ev["measured"]))
                print(f"choose's pick {ev['pick']}: measured {ev['pick_measured_s'] * 1e3:.2f}"
                      f" ms, fastest measured {ev['fastest_measured_s'] * 1e3:.2f} ms -> "
                      f"{'OK' if ev['pick_within_5pct'] else 'MISS'}")
                png = RESULTS / f"timing_suite_{name}.png"
                plot_breakdown(ev["ranked"], png, name, ev["measured"])
                errors += [abs(r["rel_error"]) for r in ev["rows"]]
                scenarios.append({"name": name, "rate": rate, "p": p, "model": model,
                                  "network": data["network"], "profile": data["profile"],
                                  "rows": ev["rows"], "pick": ev["pick"],
                                  "pick_within_5pct": ev["pick_within_5pct"]})
    median_err, worst_err = statistics.median(errors), max(errors)
    picks = all(s["pick_within_5pct"] for s in scenarios)
    summary = {"median_abs_rel_error": median_err, "worst_abs_rel_error": worst_err,
               "picks_ok": picks, "targets": {"median": median_err <= 0.10,
                                              "worst": worst_err <= 0.25, "pick": picks},
               "netem": not args.no_netem, "scenarios": scenarios}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    verdict = "PASS" if all(summary["targets"].values()) else "FAIL"
    print(f"\nmedian |err| {median_err:.1%} (target 10%), worst {worst_err:.1%} (target 25%), "
          f"choose's pick within 5% of fastest in every scenario: {picks} -> {verdict}")
    print(f"wrote {args.out}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
