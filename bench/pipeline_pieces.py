"""Pipeline payloads between nodes: in eager pieces (the runtime's way) against whole.

    .venv/bin/python bench/pipeline_pieces.py                 # 3 launches, 1 Gbit/s links
    .venv/bin/python bench/pipeline_pieces.py --rate 200mbit --burst 0 --launches 2

Over TCP, Open MPI moves the rest of a message larger than its eager limit only at its
sender's next MPI call, so a stage that sends an activation and then computes holds its
neighbour up for that compute. The runtime cuts payloads between nodes into pieces no
larger than the eager limit (`pipesgd.pipeline.pieces`); this benchmark runs the same
plans with that and, by replacing the piece size with 0 in the benchmark's own process,
with whole messages, side by side in every launch (arms alternate, `--rounds` each).

Plans: the pipeline command's MLP (micro-batch 64, 128 KB activations) cut into one
stage per rank, on 4 and on 3 ranks, each rank behind its own emulated link
(`bench/netem.py`, root). Steady-state samples/s as `bench/planner.py` counts them.
Target: pieces at least as fast as whole messages in every launch (ratio >= 0.95), and
1.15x faster in the median launch of each plan. Writes
bench/results/pipeline_pieces[_tag].json and .png; exit status 1 when a target misses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PYTHON_UNDER_MPI,
    RESULTS,
    add_launcher_arguments,
    mpi_env,
    netem_command,
    print_table,
    write_results,
)

HERE = Path(__file__).resolve()
WORST, MEDIAN = 0.95, 1.15
PLANS = {4: ((0, 2), (2, 3), (3, 4), (4, 5)), 3: ((0, 1), (1, 2), (2, 5))}
MICRO_BATCH = 64


def worker(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI
    from planner import run_pipeline

    import pipesgd
    import pipesgd.pipeline.p2p as p2p
    from pipesgd.pipeline import MicroBatches, Plan, StagePlan, models
    from pipesgd.pipeline.data import synthetic

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    pipesgd.init(comm)
    spec = models.MODELS["mlp"]()
    plan = Plan(tuple(StagePlan(a, b) for a, b in PLANS[comm.Get_size()]), schedule="1f1b",
                micro_batch=MICRO_BATCH)
    x, y = synthetic(4096, spec.input_shape, spec.num_classes, seed=0)
    data = MicroBatches(x, y, MICRO_BATCH, seed=0)
    cut = p2p.piece_bytes
    rates: dict[str, list[float]] = {"whole": [], "pieces": []}
    for _ in range(args.rounds):
        for arm in rates:
            p2p.piece_bytes = cut if arm == "pieces" else (lambda *a, **k: 0)
            rates[arm].append(run_pipeline(comm, spec, plan.to_dict(), data,
                                           args.micro_batches))
    p2p.piece_bytes = cut
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"ranks": comm.Get_size(), "rates": rates}))
    pipesgd.shutdown()
    return 0


def launch(ranks: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    inner = [*PYTHON_UNDER_MPI, str(HERE), "--worker", "--out", str(out),
             "--rounds", str(args.rounds), "--micro-batches", str(args.micro_batches)]
    cmd = netem_command(ranks, args.rate, args.burst, inner)
    subprocess.run(cmd, env=mpi_env(), check=True, timeout=args.timeout,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        ax.plot([r["launch"] for r in mine], [r["pieces / whole"] for r in mine], "o-",
                label=f"{ranks} stages")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(MEDIAN, color="k", ls=":", lw=0.8)
    ax.set(xlabel="launch", ylabel="pieces / whole (samples/s)",
           title="MLP pipeline over emulated links: eager pieces against whole messages")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="each rank's emulated link")
    ap.add_argument("--burst", default="", help="its token bucket (default: netem's)")
    ap.add_argument("--ranks", default="4,3", help="plans to run: 4 and/or 3 stages")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each arm per launch")
    ap.add_argument("--micro-batches", type=int, default=64)
    add_launcher_arguments(ap, timeout_s=600)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    for launch_no in range(1, args.launches + 1):
        for ranks in (int(r) for r in args.ranks.split(",")):
            got = launch(ranks, args, RESULTS / f"pipeline_pieces_p{ranks}.json")
            whole = statistics.median(got["rates"]["whole"])
            pieces = statistics.median(got["rates"]["pieces"])
            rows.append({"launch": launch_no, "ranks": ranks, "whole/s": round(whole),
                         "pieces/s": round(pieces), "pieces / whole": round(pieces / whole, 3),
                         "rounds": got["rates"]})
            print(f"launch {launch_no}, {ranks} stages: whole {whole:.0f}/s, pieces "
                  f"{pieces:.0f}/s ({pieces / whole:.2f}x)", flush=True)
    print_table([{k: v for k, v in r.items() if k != "rounds"} for r in rows],
                f"MLP pipeline over {args.rate} links: eager pieces against whole messages")
    ok = True
    verdicts = []
    for ranks in sorted({r["ranks"] for r in rows}):
        ratios = [r["pieces / whole"] for r in rows if r["ranks"] == ranks]
        good = min(ratios) >= WORST and statistics.median(ratios) >= MEDIAN
        ok &= good
        verdicts.append(f"{ranks} stages: pieces / whole {min(ratios):.2f} worst, "
                        f"{statistics.median(ratios):.2f} median (targets {WORST}, "
                        f"{MEDIAN}): {'PASS' if good else 'FAIL'}")
    print("\n".join(verdicts))
    write_results("pipeline_pieces", args.tag, {"rate": args.rate, "burst": args.burst,
                                                "rows": rows, "verdicts": verdicts},
                  lambda png: plot(rows, png))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
