"""Pipeline vs data parallelism on a slow network: when does sending activations win?

PipeDream's argument (pipedream-sosp19 §3): for a model whose weights are large next to
its activations, a pipeline sends a little activation per sample between stages while
data parallelism all-reduces every weight every iteration. For a model with few weights
and large activations the balance flips. Two models make the contrast:

    wide-mlp        1024-4096-4096-10 MLP, 84 MB of weights (VGG's fully connected end)
    separable-cnn   depthwise-separable convolutions at 32x32, 64 channels: 0.1 MB of
                    weights, 256 KiB of activation per sample (MobileNet's shape)

Each runs on the same ranks as

    pipeline 1f1b   one stage per rank, layers cut where per-layer time balances, micro-batch 32
    DP D-Sync       pipesgd.DistributedOptimizer, K = 1
    DP Pipe-SGD     K = 2, and K = 2 with quant8

Throughput is samples per second over the whole job. Under the emulator (root):

    .venv/bin/python bench/netem.py --np 2 --rate 1gbit -- .venv/bin/python bench/pipeline_vs_dp.py

or on shared memory: `mpirun -n 2 python bench/pipeline_vs_dp.py`. Writes
bench/results/pipeline_vs_dp[_tag].json and .png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, link_rate_bps, print_table, write_json
from pipeline import balanced_cut, layer_times

import pipesgd
from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, models
from pipesgd.pipeline.data import synthetic

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()


def separable_cnn(channels: int = 64, blocks: int = 4, num_classes: int = 10) -> models.LayerModel:
    """Depthwise-separable blocks at full 32x32 resolution: few weights, big activations."""

    def block() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
            nn.Conv2d(channels, channels, 1),
            nn.ReLU(),
        )

    builders = [
        lambda: nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()),
        *([block] * blocks),
        lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(channels, num_classes)),
    ]
    return models.LayerModel("separable-cnn", tuple(builders), (3, 32, 32), num_classes)


MODELS = {
    "wide-mlp": lambda: models.mlp((1024, 4096, 4096, 10)),
    "separable-cnn": separable_cnn,
}


def weight_bytes(model: models.LayerModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.build().parameters())


def cut_activation_bytes(model: models.LayerModel, cut: int) -> int:
    """Bytes per sample crossing the stage boundary at layer `cut`."""
    with torch.no_grad():
        out = model.build(0, cut)(torch.zeros(1, *model.input_shape))
    return out.numel() * out.element_size()


def pipeline_throughput(model: models.LayerModel, bounds: list[int], micro: int,
                        micro_batches: int, data: MicroBatches) -> float:
    plan = Plan(stages=tuple(StagePlan(bounds[i], bounds[i + 1]) for i in range(SIZE)),
                schedule="1f1b", micro_batch=micro)
    pipe = Pipeline(model, plan, lr=0.01, seed=0, record_timeline=False)
    pipe.train_epoch(data, 0, max_micro_batches=4 * SIZE)  # warm-up
    stats = pipe.train_epoch(data, 1, max_micro_batches=micro_batches)
    pipe.close()
    return stats.throughput_samples_per_s


def data_parallel_throughput(model: models.LayerModel, batch: int, steps: int,
                             x: torch.Tensor, y: torch.Tensor, *, drain: bool = True,
                             **config) -> float:
    """Samples/s of `pipesgd.DistributedOptimizer(..., **config)` (staleness,
    compression, overlap) on every rank, `batch` samples per rank and step: from a
    barrier to the end of the allreduces still in flight after the last `step()`, as a
    whole epoch's throughput counts its drain; with `drain=False` to the slowest rank's
    last `step()`, the steady state, as a pipeline's steady rate leaves out its drain
    (with Pipe-SGD+Q over 300 Mbit/s, p = 4, the CNN's drain was 6 % of 16 steps)."""
    net = model.build(seed=0)
    opt = pipesgd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                       net.named_parameters(), **config)

    def step(i: int) -> None:
        lo = ((i * SIZE + RANK) * batch) % (len(x) - batch)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[lo : lo + batch]), y[lo : lo + batch]).backward()
        opt.step()

    for i in range(3):
        step(i)
    comm.Barrier()
    begin = time.perf_counter()
    for i in range(steps):
        step(3 + i)
    if drain:
        opt.synchronize()
    seconds = comm.allreduce(time.perf_counter() - begin, op=MPI.MAX)
    opt.synchronize()  # nothing left in flight, either way
    return steps * batch * SIZE / seconds


def plot(rows: list[dict], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["model"] == name]
        ax.barh([r["configuration"] for r in mine], [r["samples/s"] for r in mine],
                color=["#dd8452" if r["configuration"].startswith("pipeline") else "#4c72b0"
                       for r in mine])
        ax.invert_yaxis()
        ax.set_xlabel("samples/s")
        ax.set_title(f"{name}: {mine[0]['weights MB']:.1f} MB weights, "
                     f"{mine[0]['cut KiB/sample']:.0f} KiB/sample at the cut ({where})",
                     fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch-size", type=int, default=32, help="data parallel: samples per rank")
    ap.add_argument("--micro-batch", type=int, default=32, help="pipeline micro-batch")
    ap.add_argument("--samples", type=int, default=1024, help="samples timed per configuration")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipesgd.init(comm)
    rate = link_rate_bps()
    where = f"p={SIZE}, " + (f"{rate / 1e9:g} Gbit/s links" if rate else "shared memory")
    rows = []
    for name in args.models.split(","):
        model = MODELS[name]()
        times = layer_times(model, args.micro_batch) if RANK == 0 else None
        bounds = comm.bcast(balanced_cut(times, SIZE) if RANK == 0 else None, root=0)
        x, y = synthetic(max(4096, 2 * args.samples), model.input_shape, model.num_classes,
                         seed=0)
        common = {"model": name, "weights MB": weight_bytes(model) / 1e6,
                  "cut KiB/sample": cut_activation_bytes(model, bounds[1]) / 1024}
        results = {
            f"pipeline 1f1b {bounds}": pipeline_throughput(
                model, bounds, args.micro_batch, args.samples // args.micro_batch,
                MicroBatches(x, y, args.micro_batch, seed=0)),
        }
        steps = max(4, args.samples // (args.batch_size * SIZE))
        for label, k, compression in (("DP D-Sync", 1, "none"), ("DP Pipe-SGD", 2, "none"),
                                      ("DP Pipe-SGD+Q", 2, "quant8")):
            results[label] = data_parallel_throughput(model, args.batch_size, steps, x, y,
                                                      staleness=k, compression=compression)
        for label, throughput in results.items():
            rows.append({**common, "configuration": label, "samples/s": throughput})
        if RANK == 0:
            print(f"{name}: " + ", ".join(f"{k} {v:.0f}/s" for k, v in results.items()),
                  flush=True)
    if RANK == 0:
        print_table(rows, f"Pipeline vs data parallelism, {where}")
        verdicts = []
        for name in dict.fromkeys(r["model"] for r in rows):
            mine = {r["configuration"]: r["samples/s"] for r in rows if r["model"] == name}
            pp = next(v for k, v in mine.items() if k.startswith("pipeline"))
            dp_label = max((k for k in mine if k.startswith("DP")), key=mine.__getitem__)
            ratio = pp / mine[dp_label]
            verdicts.append(f"{name}: pipeline / best data parallel ({dp_label}) = {ratio:.2f} "
                            f"-> {'pipeline' if ratio > 1 else 'data parallel'} wins")
        print("\n".join(verdicts))
        suffix = f"_{args.tag}" if args.tag else ""
        path = write_json(f"pipeline_vs_dp{suffix}.json", {
            "ranks": SIZE, "link_rate_bps": rate, "rows": rows, "verdicts": verdicts})
        plot(rows, RESULTS / f"pipeline_vs_dp{suffix}.png", where)
        print(f"wrote {path} and {path.with_suffix('.png')}")
    pipesgd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
