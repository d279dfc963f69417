"""The planner against real runs: every plan it could choose, predicted and measured.

    .venv/bin/python bench/planner.py                  # p = 3, 4 x shared memory, 1 Gbit/s
    .venv/bin/python bench/planner.py --scenarios 500mbit-b256KiB-p3,2gbit-b0-p4

Each scenario is one `mpirun` (under `bench/netem.py` for emulated links) that, for the
MLP and the CNN of `pipesgd pipeline`:

1. measures the job's network (`measure_network`), runs the whole model on every rank at
   once (`action_times_beside_others`) and profiles it as `pipesgd pipeline --plan auto`
   does (`calibrated_profile`): layer by layer on rank 0 (one thread, the run's
   micro-batch, scaled to that run) while the other ranks sleep, charged what a round of
   it replicated on every rank (`replicated_round_s`), the pipeline of one stage per rank
   the chooser offers (`pipeline_micro_batch_s`) and the data-parallel
   configuration the timing model ranks first (`data_parallel_iteration_s`, about two
   seconds) took beyond their models;
2. enumerates every plan on all p ranks: each way of giving the ranks to consecutive
   stages (replica counts summing to p) times each contiguous cut of the layers, 1F1B
   (1F1B-RR where a stage is replicated); per replica shape it keeps the `--per-shape`
   cuts `pipesgd.planner.simulate` predicts fastest, and adds the candidate of every
   family the chooser ranks (`pipesgd.planner.choose`: data parallelism with the
   configuration the timing model ranks first, PipeDream's plan, the straight pipeline)
   if it is not among them, so the pick is measured beside each;
3. runs every kept plan for real, in rounds (each plan once per round, `--rounds`, five
   by default, for `--micro-batches` or a second at its predicted rate, whichever is
   longer), and takes the steady-state samples/s as the simulator does: micro-batches
   completed by the first stage between the end of the startup and the start of the
   drain (data parallelism: its steps after three of warm-up, without the drain of the
   allreduces still in flight). Each round after the first calibrates again (step 1)
   and predicts every kept plan again before running them, so that a prediction and
   the run it is judged on share a spell of the machine: a plan's error is the median
   over the rounds of predicted / measured - 1 (`error`);
4. runs the chooser's pick side by side with the two plans the rounds measured fastest
   besides it, in turn, `--side-by-side` rounds more: the fastest of a dozen medians of
   a few noisy rounds reads above its plan's own rate (the maximum of noisy readings),
   so the pick is judged on per-round ratios against each rival instead.

Targets, over all plans of all scenarios: median |error| <= 15 %, worst <= 30 % (each
plan's error the median of its rounds'); in every scenario and model, the chooser's pick
measured fastest or within 5 % of the fastest plan (side by side). Writes
bench/results/planner.json and .png; exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PYTHON_UNDER_MPI,
    RESULTS,
    add_launcher_arguments,
    mpi_env,
    mpirun,
    netem_command,
    print_table,
    write_results,
)

HERE = Path(__file__).resolve()
MEDIAN_ERROR, WORST_ERROR, PICK_WITHIN = 0.15, 0.30, 0.05
# The pick is judged against this many rivals, side by side (`side_by_side`).
RIVALS = 2
MICRO_BATCH = {"mlp": 64, "cnn": 16}
# Each plan is timed for about this long at the least (by its predicted rate), as long
# as the calibration runs its prediction is fitted to: 64 of the MLP's micro-batches took
# a fifth of a second. Not for less noise: six runs in a row of the MLP's straight
# pipeline on 3 ranks over 1 Gbit/s spread 1.37 (max/min) at 64 micro-batches and 1.46
# at 256; this machine's slow and fast spells outlast either.
MIN_WINDOW_S = 1.0
# Rounds per plan, the error taken on their median: one slow spell of the machine can
# take a whole round, which moves a median of three but not of five (the evidence:
# BENCHMARKS.md, "Planner: predicted against measured", "Five rounds").
ROUNDS = 5
DEFAULT_SCENARIOS = "shm-p3,shm-p4,1gbit-p3,1gbit-p4"


# --------------------------------------------------------------------------- plans
def compositions(n: int) -> list[tuple[int, ...]]:
    """Every ordered way of writing n as a sum of positive integers."""
    out = []
    for k in range(1, n + 1):
        for bars in itertools.combinations(range(1, n), k - 1):
            edges = (0, *bars, n)
            out.append(tuple(b - a for a, b in itertools.pairwise(edges)))
    return out


def enumerate_plans(num_layers: int, workers: int, micro_batch: int) -> list[Any]:
    """Every plan of `num_layers` layers on exactly `workers` ranks."""
    from pipesgd.pipeline import Plan, StagePlan

    plans = []
    for shape in compositions(workers):
        if len(shape) > num_layers:
            continue
        for cut in itertools.combinations(range(1, num_layers), len(shape) - 1):
            bounds = (0, *cut, num_layers)
            stages = tuple(StagePlan(a, b, r) for (a, b), r in
                           zip(itertools.pairwise(bounds), shape, strict=True))
            plans.append(Plan(stages, schedule="1f1b-rr" if max(shape) > 1 else "1f1b",
                              micro_batch=micro_batch))
    return plans


def describe(plan: Any) -> str:
    return ", ".join(f"{s.start}-{s.end}" + (f" x{s.replicas}" if s.replicas > 1 else "")
                      for s in plan.stages)


def select_plans(prof: Any, topo: Any, net: Any, workers: int, micro_batch: int,
                 per_shape: int) -> tuple[list[dict], dict]:
    """Per replica shape the `per_shape` fastest predicted cuts, and the candidate of every
    family the chooser ranks (so its pick is judged against each); the pick's label."""
    from pipesgd.planner import choose, simulate

    by_shape: dict[tuple[int, ...], list[tuple[float, Any]]] = {}
    for plan in enumerate_plans(prof.num_layers, workers, micro_batch):
        rate = simulate(plan, prof, topo).samples_per_s
        by_shape.setdefault(tuple(s.replicas for s in plan.stages), []).append((rate, plan))
    kept = []
    for ranked in by_shape.values():
        ranked.sort(key=lambda x: -x[0])
        kept += [{"plan": p.to_dict(), "label": describe(p), "predicted": r}
                 for r, p in ranked[:per_shape]]
    choice = choose(prof, topo, batch_size=micro_batch, dp_network=net)
    labels = {k["label"] for k in kept}
    for candidate in choice.ranked:
        row = candidate_row(candidate)
        if row["label"] not in labels:
            labels.add(row["label"])
            kept.append(row)
    return kept, {"label": candidate_row(choice.best)["label"], "family": choice.best.family,
                  "explanation": choice.explanation}


def candidate_row(candidate: Any) -> dict:
    """A plan row of the chooser's candidate: a pipeline's plan, or data parallelism's
    configuration."""
    if candidate.plan is not None:
        return {"plan": candidate.plan.to_dict(), "label": describe(candidate.plan),
                "predicted": candidate.samples_per_s}
    config = candidate.prediction.config
    return {"label": f"data parallel {config.label}", "predicted": candidate.samples_per_s,
            "data_parallel": {"staleness": config.staleness,
                              "compression": config.compression, "overlap": config.overlap}}


def predict_row(row: dict, prof: Any, topo: Any, net: Any, workers: int,
                micro_batch: int) -> float:
    """A plan row's samples/s predicted on `prof` as `select_plans` predicts it: a
    pipeline's by the simulator, data parallelism's configuration by the timing model on
    the measured network `net`."""
    from pipesgd.pipeline import Plan
    from pipesgd.planner import simulate
    from pipesgd.planner.choose import data_parallel_profile, data_parallel_rate
    from pipesgd.timing.model import predict

    if "plan" in row:
        return simulate(Plan.from_dict(row["plan"]), prof, topo).samples_per_s
    dp = row["data_parallel"]
    pred = predict(data_parallel_profile(prof, micro_batch), net, workers, dp["staleness"],
                   dp["compression"], dp["overlap"])
    return data_parallel_rate(pred, workers, micro_batch)


# --------------------------------------------------------------------------- runs
def run_pipeline(comm: Any, spec: Any, plan_dict: dict, data: Any, micro_batches: int) -> float:
    from pipesgd.pipeline import Pipeline, Plan

    plan = Plan.from_dict(plan_dict)
    pipe = Pipeline(spec, plan, comm, lr=0.01, seed=0)
    pipe.train_epoch(data, 0, max_micro_batches=2 * plan.world_size)  # warm-up
    pipe.timeline.clear()
    pipe.train_epoch(data, 1, max_micro_batches=micro_batches)
    rate = plan.micro_batch / pipe.steady_micro_batch_s()
    pipe.close()
    return rate


def rivals_of(plans: list[dict], pick: str) -> list[dict]:
    """The `RIVALS` plans measured fastest besides the pick (medians over the rounds)."""
    others = [k for k in plans if k["label"] != pick]
    return sorted(others, key=lambda k: k["measured"], reverse=True)[:RIVALS]


def side_by_side(comm: Any, plans: list[dict], pick: str, rounds: int,
                 run: Callable[[dict], float]) -> dict:
    """The pick and its rivals (`rivals_of`) run in turn, `rounds` times, each round
    starting one plan later: their ratios measured in the same spell of the machine
    (collective). Returns {"pick": label, "rounds": {label: [samples/s per round]}}."""
    if rounds <= 0:
        return {}
    by_label = {k["label"]: k for k in plans}
    labels = comm.bcast([pick] + [k["label"] for k in rivals_of(plans, pick)], root=0)
    rates: dict[str, list[float]] = {label: [] for label in labels}
    for turn in range(rounds):
        first = turn % len(labels)
        for label in labels[first:] + labels[:first]:
            rates[label].append(run(by_label[label]))
    return {"pick": pick, "rounds": rates}


def pick_ratio(m: dict) -> tuple[float, str]:
    """The pick's samples/s over the fastest plan's, and against which plan: side by
    side (`side_by_side`, the median of the per-round ratios against each rival, the
    least of them) where the launch ran it, else the medians over the rounds."""
    pick = m["pick"]["label"]
    rounds = (m.get("side_by_side") or {}).get("rounds", {})
    if len(rounds) > 1:
        ratios = {label: statistics.median(a / b for a, b in zip(rounds[pick], theirs,
                                                                 strict=True))
                  for label, theirs in rounds.items() if label != pick}
        rival = min(ratios, key=ratios.__getitem__)
        return ratios[rival], f"{rival}, side by side over {len(rounds[pick])} rounds"
    fastest = max(m["plans"], key=lambda k: k["measured"])
    mine = next(k for k in m["plans"] if k["label"] == pick)
    return mine["measured"] / fastest["measured"], f"{fastest['label']}, the rounds' medians"


def worker(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI
    from pipeline_vs_dp import data_parallel_throughput

    import pipesgd
    from pipesgd.pipeline import MicroBatches, models
    from pipesgd.pipeline.auto_plan import calibrated_profile, measured_topology
    from pipesgd.pipeline.data import synthetic
    from pipesgd.pipeline.runtime import action_times_beside_others
    from pipesgd.polling import decided_on_root

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    pipesgd.init(comm)
    topo, network, net = measured_topology(comm)
    out: dict[str, Any] = {"ranks": size, "network": network, "topology": topo.to_dict(),
                           "measured": net.to_dict(), "models": {}}
    for name in args.models.split(","):
        spec = models.MODELS[name]()
        mb = MICRO_BATCH[name]

        def calibrate(spec=spec, name=name, mb=mb) -> Any:
            """The profile as --plan auto calibrates it (collective)."""
            whole = action_times_beside_others(comm, spec, mb)
            return calibrated_profile(comm, spec, name, mb, mb, topo, net, whole=whole)

        first = calibrate()

        def decide(prof=first, mb=mb) -> tuple[list[dict], dict, dict]:
            kept, pick = select_plans(prof, topo, net, size, mb, args.per_shape)
            return kept, pick, prof.to_dict()

        kept, pick, prof = decided_on_root(comm, decide)
        for k in kept:
            k["micro_batches"] = max(args.micro_batches,
                                     math.ceil(k["predicted"] * MIN_WINDOW_S / mb))
        samples = mb * (max(k["micro_batches"] for k in kept) + 2 * size)  # + warm-up
        x, y = synthetic(max(4096, samples), spec.input_shape, spec.num_classes, seed=0)
        data = MicroBatches(x, y, mb, seed=0)
        measured: dict[str, list[float]] = {k["label"]: [] for k in kept}

        def run(k: dict, spec=spec, mb=mb, data=data, x=x, y=y, name=name) -> float:
            if "plan" in k:
                rate = run_pipeline(comm, spec, k["plan"], data, k["micro_batches"])
            else:
                rate = data_parallel_throughput(spec, mb, k["micro_batches"] // size,
                                                x, y, drain=False, **k["data_parallel"])
            if rank == 0:
                print(f"{name} {k['label']}: predicted {k['predicted']:.0f}, "
                      f"measured {rate:.0f} samples/s", flush=True)
            return rate

        # Each round after the first calibrates again: a spell of the machine outlasts one
        # calibration (docs/planner.md, "How close it comes").
        predicted: dict[str, list[float]] = {k["label"]: [k["predicted"]] for k in kept}
        later_profiles = []
        for turn in range(args.rounds):
            if turn:
                again = calibrate()

                def repredict(prof=again, mb=mb, kept=kept) -> tuple[list[float], dict]:
                    return ([predict_row(k, prof, topo, net, size, mb) for k in kept],
                            prof.to_dict())

                rates, again_dict = decided_on_root(comm, repredict)
                later_profiles.append(again_dict)
                for k, rate in zip(kept, rates, strict=True):
                    predicted[k["label"]].append(rate)
            for k in kept:
                measured[k["label"]].append(run(k))
        for k in kept:
            k["predicted_first"] = k["predicted"]
            k["predicted_rounds"] = predicted[k["label"]]
            k["predicted"] = statistics.median(predicted[k["label"]])
            k["measured"] = statistics.median(measured[k["label"]])
            k["measured_rounds"] = measured[k["label"]]
        duel = side_by_side(comm, kept, pick["label"], args.side_by_side, run)
        out["models"][name] = {"plans": kept, "pick": pick, "profile": prof,
                               "later_profiles": later_profiles, "micro_batch": mb,
                               "side_by_side": duel}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=2))
    pipesgd.shutdown()
    return 0


# --------------------------------------------------------------------------- driver
def scenario_command(scenario: str, inner: list[str]) -> list[str]:
    """The command that runs `inner` on a scenario's ranks: `shm-pN` under mpirun,
    `RATE[-bBURST]-pN` under bench/netem.py (e.g. `500mbit-b256KiB-p3`)."""
    link, sep, ranks = scenario.rpartition("-p")
    if not sep or not link or not ranks.isdigit() or int(ranks) < 2:
        raise ValueError(f"bad scenario {scenario!r}: write LINK-pRANKS with 2 or more "
                         "ranks, e.g. shm-p4, 1gbit-p3 or 500mbit-b256KiB-p3")
    if link == "shm":
        return [mpirun(), "--oversubscribe", "-n", ranks, *inner]
    rate, _, burst = link.partition("-b")
    return netem_command(ranks, rate, burst, inner)


def launch(scenario: str, args: argparse.Namespace, out: Path) -> dict:
    inner = [*PYTHON_UNDER_MPI, str(HERE), "--worker", "--out", str(out), "--models",
             args.models, "--rounds", str(args.rounds), "--per-shape", str(args.per_shape),
             "--side-by-side", str(args.side_by_side),
             "--micro-batches", str(args.micro_batches)]
    cmd = scenario_command(scenario, inner)
    print(f"\n== {scenario}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=mpi_env(), check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def error(row: dict) -> float:
    """predicted / measured - 1: the median over the rounds of each round's ratio where
    every round predicted again (`predicted_rounds`), else on the rounds' median."""
    rounds = row.get("predicted_rounds")
    if rounds and len(rounds) == len(row.get("measured_rounds", ())):
        return statistics.median(p / m for p, m in zip(rounds, row["measured_rounds"],
                                                       strict=True)) - 1
    return row["predicted"] / row["measured"] - 1


def first_calibration_line(results: dict[str, dict]) -> str:
    """The errors of the first calibration's predictions alone against the rounds'
    medians: what a job that calibrates once (`--plan auto`) would read (no target)."""
    errors = sorted(abs(r["predicted_first"] / r["measured"] - 1)
                    for data in results.values() for m in data["models"].values()
                    for r in m["plans"] if "predicted_first" in r)
    if not errors:
        return "first calibration alone: not recorded"
    return (f"first calibration alone, against the rounds' medians: median |error| "
            f"{statistics.median(errors):.1%}, worst {errors[-1]:.1%} (no target)")


def rounds_spread(results: dict[str, dict]) -> str:
    """The median and the largest, over every plan, of its fastest round over its
    slowest: how far one round may read from another with nothing but noise between."""
    spreads = sorted(max(r["measured_rounds"]) / min(r["measured_rounds"])
                     for data in results.values() for m in data["models"].values()
                     for r in m["plans"] if len(r.get("measured_rounds", [])) > 1)
    if not spreads:
        return "rounds' spread: one round per plan"
    return (f"rounds' spread per plan (fastest / slowest): median "
            f"{statistics.median(spreads):.2f}, largest {spreads[-1]:.2f} over "
            f"{len(spreads)} plans (no target)")


def evaluate(results: dict[str, dict]) -> tuple[list[dict], list[str], bool]:
    rows, verdicts, ok = [], [], True
    errors = []
    for scenario, data in results.items():
        for model, m in data["models"].items():
            pick = next(r for r in m["plans"] if r["label"] == m["pick"]["label"])
            ratio, against = pick_ratio(m)
            good = ratio >= 1 - PICK_WITHIN
            ok &= good
            verdicts.append(f"{scenario} {model}: pick {pick['label']} measured "
                            f"{ratio:.2f} of {against}: {'PASS' if good else 'FAIL'}")
            for r in m["plans"]:
                errors.append(abs(error(r)))
                rows.append({"scenario": scenario, "model": model, "plan": r["label"],
                             "predicted/s": r["predicted"], "measured/s": r["measured"],
                             "error": f"{error(r):+.1%}",
                             "pick": "*" if r is pick else ""})
    med, worst = statistics.median(errors), max(errors)
    verdicts.append(rounds_spread(results))
    verdicts.append(first_calibration_line(results))
    verdicts.append(f"median |error| {med:.1%} (<= {MEDIAN_ERROR:.0%}): "
                    f"{'PASS' if med <= MEDIAN_ERROR else 'FAIL'}")
    verdicts.append(f"worst |error| {worst:.1%} (<= {WORST_ERROR:.0%}): "
                    f"{'PASS' if worst <= WORST_ERROR else 'FAIL'}")
    ok &= med <= MEDIAN_ERROR and worst <= WORST_ERROR
    return rows, verdicts, ok


def plot(rows: list[dict], path: Path) -> None:
    """Measured against predicted samples/s, one panel per model, the picks circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        for scenario in dict.fromkeys(r["scenario"] for r in mine):
            pts = [r for r in mine if r["scenario"] == scenario]
            ax.scatter([r["predicted/s"] for r in pts], [r["measured/s"] for r in pts],
                       s=14, label=scenario)
            picks = [r for r in pts if r["pick"]]
            ax.scatter([r["predicted/s"] for r in picks], [r["measured/s"] for r in picks],
                       s=80, facecolors="none", edgecolors="black")
        hi = max(max(r["predicted/s"], r["measured/s"]) for r in mine) * 1.05
        for k, style in ((1.0, "-"), (1 + MEDIAN_ERROR, ":"), (1 / (1 + MEDIAN_ERROR), ":")):
            ax.plot([0, hi], [0, hi / k], "k" + style, lw=0.8)
        ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="predicted samples/s",
               ylabel="measured samples/s", title=f"{model} (circles: the chooser's pick)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                    help="LINK-pRANKS, LINK shm or an emulated rate with an optional token "
                    "bucket, e.g. 500mbit-b256KiB-p3 (default: netem's smallest bucket; "
                    f"default scenarios {DEFAULT_SCENARIOS})")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"rounds per plan, judged on their median (default {ROUNDS})")
    ap.add_argument("--per-shape", type=int, default=2)
    ap.add_argument("--side-by-side", type=int, default=4,
                    help=f"rounds in which the pick and the {RIVALS} plans measured fastest "
                    "besides it run in turn, which judge the pick (0: the rounds' medians)")
    ap.add_argument("--micro-batches", type=int, default=64,
                    help="micro-batches per timed epoch at the least (more where they "
                    f"would take under {MIN_WINDOW_S:g} s at the predicted rate)")
    add_launcher_arguments(ap, timeout_s=1800)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    for scenario in args.scenarios.split(","):
        try:
            scenario_command(scenario, [])  # every name checked before the first launch
        except ValueError as err:
            ap.error(str(err))
    results = {}
    for scenario in args.scenarios.split(","):
        results[scenario] = launch(scenario, args, RESULTS / f"planner_{scenario}.json")
    rows, verdicts, ok = evaluate(results)
    print_table(rows, "Planner: predicted against measured samples/s")
    print("\n".join(verdicts))
    write_results("planner", args.tag, {"scenarios": results, "verdicts": verdicts},
                  lambda png: plot(rows, png))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
