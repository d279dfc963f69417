"""Training benchmark: DDP, PS-Sync, D-Sync(+T/+Q) and Pipe-SGD(+T/+Q) on the MLP and the CNN.

A plain mpirun program (prints a table, writes bench/results/train_p{P}[_cuda][_tag].json
and a PNG of test accuracy against wall-clock time per configuration):

    mpirun -n 2 python bench/train.py
    mpirun -n 2 python bench/train.py --models mlp --configs ddp,dsync,pipesgd+q --epochs 5
    mpirun -n 2 python bench/train.py --device cuda  # on the GPUs, adds ddp-nccl

Over emulated 1 Gbit/s per-rank links (root; see bench/netem.py):

    python bench/netem.py --np 2 --rate 1gbit -- python bench/train.py --tag netem_1gbit

Configurations (paper §4): DDP = torch DistributedDataParallel over gloo (default 25 MB
buckets unless --ddp-bucket-mb); DDP-NCCL = the same over NCCL, GPU to GPU (--device
cuda, one GPU per rank); PS-Sync = synchronous parameter server on rank 0 (MPI
Gather of gradients, update on rank 0, Bcast of parameters); D-Sync = pipesgd with
K = 1; Pipe-SGD = K = 2; +T / +Q = trunc16 / quant8 compression. Every configuration
trains the same model from the same seed on the same shards of scikit-learn's digits.
Times are medians over iterations after warm-up, from rank 0. Exit status 1 when a
target that applies to the run misses (the speed-ups are judged on 1 Gbit/s links at
p = 2 only). On CUDA, pipesgd's configurations also report their host<->device staging
time per iteration (staging ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, init_gloo, init_nccl, link_rate_bps, print_table, write_json

import pipesgd
from pipesgd.buckets import GradientBuckets
from pipesgd.device import DEVICES, local_size, run_device
from pipesgd.engine import default_engine
from pipesgd.optim import DistributedOptimizer, StepTiming
from pipesgd.train import loop
from pipesgd.train.cli import PRESETS
from pipesgd.train.data import load

PIPESGD_CONFIGS = PRESETS
CONFIGS = ("ddp", "ddp-nccl", "ps-sync", *PIPESGD_CONFIGS)
CPU_CONFIGS = tuple(c for c in CONFIGS if c != "ddp-nccl")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How each model is trained at `RECIPE_RANKS` ranks, identical for every configuration.

    On p ranks a run keeps the same number of iterations (epochs × p / RECIPE_RANKS: an
    epoch has fewer iterations when the global batch grows) and warms up for
    warmup_steps × p / RECIPE_RANKS iterations: the switch to K = 2 hurts more at a larger
    global batch (BENCHMARKS.md, training p = 4).
    """

    epochs: int
    batch_size: int
    optimizer: str
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    lr_schedule: str = "constant"
    warmup_steps: int = 0  # Pipe-SGD only: the first iterations run with K = 1
    ramp_steps: int = 0  # Pipe-SGD only: LR ramp over the first stale updates
    channels_last: bool = False  # NHWC layout (every configuration, DDP included)


# The MLP's configurations all reach their plateau on digits. The CNN warms up
# synchronously for two epochs at p = 2, as the paper does for AlexNet, and then ramps
# the learning rate of its stale updates over 200 iterations, with Nesterov momentum for
# every configuration: without both, the switch to K = 2 throws the CNN out of its basin
# and it ends 1-3 points behind (docs/training.md, "Learning rate and momentum with K >= 2").
RECIPE_RANKS = 2
RECIPES = {
    "mlp": Recipe(epochs=30, batch_size=64, optimizer="sgd", lr=0.05, momentum=0.9),
    "cnn": Recipe(epochs=30, batch_size=32, optimizer="sgd", lr=0.01, momentum=0.9,
                  nesterov=True, lr_schedule="cosine", warmup_steps=44, ramp_steps=200,
                  channels_last=True),
}


class LocalStep:
    """DDP: gradients are averaged inside backward; step() only updates."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner, self.timing = inner, StepTiming()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        begin = time.perf_counter()
        self.inner.step()
        self.timing = StepTiming(0.0, 0.0, time.perf_counter() - begin)

    def synchronize(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class ParameterServer(LocalStep):
    """PS-Sync: rank 0 gathers every gradient, averages, updates, broadcasts parameters.

    The flat buffers live in host memory (MPI reads them): parameters on a GPU go through
    them with plain blocking copies each way.
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, comm: MPI.Comm) -> None:
        super().__init__(inner)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm
        n = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(n)
        self.gathered = torch.zeros(comm.size, n) if comm.rank == 0 else None

    def _copy(self, tensors: list[torch.Tensor], into_flat: bool) -> None:
        offset = 0
        for t in tensors:
            view = self.flat[offset : offset + t.numel()].view_as(t)
            (view.copy_(t) if into_flat else t.copy_(view))
            offset += t.numel()

    def step(self) -> None:
        begin = time.perf_counter()
        self._copy([p.grad for p in self.params], into_flat=True)
        sent = time.perf_counter()
        self.comm.Gather(
            self.flat.numpy(), None if self.gathered is None else self.gathered.numpy(), root=0
        )
        gathered = time.perf_counter()
        if self.comm.rank == 0:
            torch.mean(self.gathered, dim=0, out=self.flat)
            with torch.no_grad():
                self._copy([p.grad for p in self.params], into_flat=False)
                self.inner.step()
                self._copy([p.detach() for p in self.params], into_flat=True)
        updated = time.perf_counter()
        self.comm.Bcast(self.flat.numpy(), root=0)
        received = time.perf_counter()
        with torch.no_grad():
            self._copy([p.detach() for p in self.params], into_flat=False)
        end = time.perf_counter()
        self.timing = StepTiming(
            sent - begin,
            (gathered - sent) + (received - updated),
            (updated - gathered) + (end - received),
        )


def synchronizer_for(name: str, comm: MPI.Comm, ddp_bucket_mb: float,
                     nccl: Any = None) -> loop.SynchronizerFactory:
    if name in ("ddp", "ddp-nccl"):
        from torch.nn.parallel import DistributedDataParallel

        def ddp(model, inner, config):
            # "ddp": the default gloo group, which takes CPU and CUDA tensors alike
            extra = {} if name == "ddp" else {
                "process_group": nccl, "device_ids": [next(model.parameters()).device]}
            return (DistributedDataParallel(model, bucket_cap_mb=ddp_bucket_mb, **extra),
                    LocalStep(inner))

        return ddp
    if name == "ps-sync":
        return lambda model, inner, config: (model, ParameterServer(model, inner, comm))
    return loop.pipesgd_synchronizer


def keeping(factory: loop.SynchronizerFactory, made: list[Any]) -> loop.SynchronizerFactory:
    """`factory`, appending each synchronizer it makes to `made` (read after the run)."""

    def make(model, inner, config):
        module, sync = factory(model, inner, config)
        made.append(sync)
        return module, sync

    return make


def staging_ms(sync: Any) -> float | None:
    """Host<->device staging per iteration of a pipesgd run (0 on the CPU); None for DDP
    and PS-Sync, which do not stage."""
    if not isinstance(sync, DistributedOptimizer):
        return None
    return 1000 * sync.staging_seconds / max(sync.iteration, 1)


def plot(results: list[dict[str, Any]], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["config"]["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in results:
            if r["config"]["model"] != model:
                continue
            xs = [0.0] + [h["wall_s"] for h in r["history"]]
            ys = [0.1] + [100 * h["accuracy"] for h in r["history"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=r["config"]["name"])
        ax.set_title(f"{model.upper()} on digits, {where}")
        ax.set_xlabel("wall-clock training time (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_communication(model: nn.Module, compression: str, bucket_mb: float,
                          repeats: int = 7) -> float:
    """Median time of one iteration's gradient allreduce alone (all buckets, in flight together)."""
    params = [p for p in model.parameters() if p.requires_grad]
    engine = default_engine()
    # The optimizer's own buffers: in the engine's shared memory where the ranks share it.
    buckets = GradientBuckets(params, int(bucket_mb * 2**20), engine=engine)
    for b in buckets.buffers[0]:
        b.normal_()
    times = []
    for _ in range(repeats + 1):
        MPI.COMM_WORLD.Barrier()
        begin = time.perf_counter()
        handles = [buckets.submit(engine, 0, i, compression=compression)
                   for i in range(buckets.num_buckets)]
        for h in handles:
            h.wait()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def target_checks(results: list[loop.RunResult], comm_s: dict[tuple[str, str], float],
                  ranks: int, rate: float | None, recipe: bool = True) -> list[str]:
    """The benchmark's targets for one run of the suite, as PASS/FAIL lines (rank 0).
    The accuracy target is judged only on the recipes' own epochs and learning rates
    (`recipe`): a shortened run has not converged."""
    by_name = {(r.config.model, r.config.name): r for r in results}
    # the speed-up targets hold where communication is slow: p = 2 on 1 Gbit/s links
    stated = ranks == 2 and rate is not None and abs(rate - 1e9) <= 1e6
    lines = []
    for model, speedup in (("mlp", 3.0), ("cnn", 2.0)):
        fast = by_name.get((model, "pipesgd+q"))
        if fast is None:
            continue
        comm = comm_s[(model, "quant8")]
        # compute + update per iteration (their median), not the sum of their medians: the
        # comm thread's CPU lands in one or the other from iteration to iteration.
        ratio = fast.iteration_time_s / max(fast.compute_update_s, comm)
        lines.append(f"{model}: Pipe-SGD+Q iteration / max(compute + update "
                     f"{1000 * fast.compute_update_s:.2f} ms, comm {1000 * comm:.1f} ms) = "
                     f"{ratio:.2f} (target <= 1.1) {'PASS' if ratio <= 1.1 else 'FAIL'}")
        sum_of_medians = fast.iteration_time_s / max(fast.compute_s + fast.update_s, comm)
        lines.append(f"{model}:   (with the sum of the medians of compute and update instead: "
                     f"{sum_of_medians:.2f})")
        sync = by_name.get((model, "dsync+q"))
        if sync is not None:
            # What overlapping costs beyond the wait: the comm thread's CPU, taken from
            # compute on shared cores (D-Sync+Q communicates while compute waits).
            extra = fast.compute_update_s / sync.compute_update_s - 1
            lines.append(f"{model}:   compute + update of Pipe-SGD+Q vs D-Sync+Q: "
                         f"{1000 * fast.compute_update_s:.2f} vs "
                         f"{1000 * sync.compute_update_s:.2f} ms ({extra:+.0%}, the CPU "
                         "the overlapped communication takes from compute)")
        for other in ("ddp", "dsync"):
            if (model, other) in by_name:
                x = by_name[(model, other)].iteration_time_s / fast.iteration_time_s
                verdict = ("PASS" if x >= speedup else "FAIL") if stated else "not judged here"
                lines.append(f"{model}: Pipe-SGD+Q speed-up over {other} = {x:.2f} "
                             f"(target >= {speedup:g} on 1 Gbit/s at p = 2) {verdict}")
        if (model, "dsync") in by_name:
            gap = 100 * (by_name[(model, "dsync")].final_accuracy - fast.final_accuracy)
            verdict = ("PASS" if gap <= 0.5 else "FAIL") if recipe else \
                "not judged (--epochs or --lr given)"
            lines.append(f"{model}: accuracy D-Sync - Pipe-SGD+Q = {gap:+.2f} pp "
                         f"(target <= 0.5) {verdict}")
    if not stated:
        lines.insert(0, "(the speed-up targets are stated for p = 2 on 1 Gbit/s links)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--configs", help=f"from {', '.join(CONFIGS)} (default: all; ddp-nccl "
                                      "with --device cuda only)")
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="where every configuration computes (cuda: each rank's GPU)")
    ap.add_argument("--epochs", type=int, help="override every model's epochs (see RECIPES)")
    ap.add_argument("--lr", type=float, help="override every model's learning rate")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="pipesgd bucket size")
    ap.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    ap.add_argument("--comm-nice", type=int, default=-10,
                    help="nice value of the engine's comm thread (0: the process's own; "
                         "below 0 needs root or CAP_SYS_NICE, else ignored)")
    ap.add_argument("--nchw", action="store_true",
                    help="run the CNN in the default NCHW layout instead of channels_last")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else None
    unknown = [c for c in configs or () if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}: choose from {CONFIGS}")
    if args.device == "cpu" and configs and "ddp-nccl" in configs:
        ap.error("ddp-nccl runs DDP over NCCL between GPUs: it needs --device cuda")

    comm = MPI.COMM_WORLD
    try:  # every rank checks, before any collective: a missing GPU ends the run at once
        run_device(args.device, comm)
    except ValueError as e:
        if comm.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    # NCCL refuses two ranks on one GPU
    sharing = local_size(comm) if args.device == "cuda" else 0
    gpu_per_rank = args.device == "cuda" and torch.cuda.device_count() >= sharing
    if configs is None:
        configs = list(CONFIGS if gpu_per_rank else CPU_CONFIGS)
    elif "ddp-nccl" in configs and not gpu_per_rank:
        if comm.rank == 0:
            print(f"error: ddp-nccl needs one GPU per rank; {sharing} ranks share "
                  f"{torch.cuda.device_count()} GPU(s) on this node", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    # Ranks share cores here: at a lower nice the comm thread gets its core back from
    # a compute thread sooner, so a ring step waits less (BENCHMARKS.md, training).
    pipesgd.init(comm, comm_nice=args.comm_nice)
    if "ddp" in configs:
        init_gloo(comm)
    nccl = init_nccl(comm) if "ddp-nccl" in configs else None
    rate = link_rate_bps()
    where = f"p={comm.size}, " + (f"{rate / 1e9:g} Gbit/s links" if rate else "shared memory")
    results: list[loop.RunResult] = []
    staging: list[float | None] = []  # per result
    comm_s: dict[tuple[str, str], float] = {}

    def scale(count: int) -> int:
        return round(count * comm.size / RECIPE_RANKS)

    for model in args.models.split(","):
        recipe = RECIPES[model]
        for name in configs:
            staleness, compression = PIPESGD_CONFIGS.get(name, (1, "none"))
            config = loop.TrainConfig(
                model=model,
                data="digits",
                epochs=args.epochs or scale(recipe.epochs),
                batch_size=recipe.batch_size,
                optimizer=recipe.optimizer,
                lr=args.lr or recipe.lr,
                momentum=recipe.momentum,
                nesterov=recipe.nesterov,
                lr_schedule=recipe.lr_schedule,
                warmup_steps=scale(recipe.warmup_steps) if staleness > 1 else 0,
                ramp_steps=scale(recipe.ramp_steps) if staleness > 1 else 0,
                staleness=staleness,
                compression=compression,
                bucket_mb=args.bucket_mb,
                channels_last=recipe.channels_last and not args.nchw,
                device=args.device,
                name=name,
            )
            comm.Barrier()
            made: list[Any] = []
            result = loop.run(
                config,
                comm,
                keeping(synchronizer_for(name, comm, args.ddp_bucket_mb, nccl), made),
                progress=False,
                log=lambda *_: None,
            )
            if args.device == "cuda":  # the last copies back counted too
                torch.cuda.synchronize()
            results.append(result)
            staging.append(staging_ms(made[0]))
            if comm.rank == 0:
                print(
                    f"{model} {name}: {1000 * result.iteration_time_s:.2f} ms/iteration, "
                    f"accuracy {100 * result.final_accuracy:.2f}%",
                    flush=True,
                )
        reference = loop.build_model(model, load("digits", model), seed=0)
        for compression in ("none", "trunc16", "quant8"):
            comm_s[(model, compression)] = measure_communication(reference, compression,
                                                                 args.bucket_mb)
    if comm.rank == 0:
        rows = []
        for r, staged in zip(results, staging, strict=True):
            c = r.config
            ddp = next(
                (x for x in results if x.config.model == c.model and x.config.name == "ddp"), None
            )
            staleness, compression = PIPESGD_CONFIGS.get(c.name, (1, "none"))
            rows.append(
                {
                    "model": c.model,
                    "configuration": c.name,
                    "iter ms": 1000 * r.iteration_time_s,
                    "compute ms": 1000 * r.compute_s,
                    "update ms": 1000 * r.update_s,
                    "compute+update ms": 1000 * r.compute_update_s,
                    "comm wait ms": 1000 * r.comm_wait_s,
                    "staging ms": staged,
                    "allreduce alone ms": 1000 * comm_s[(c.model, compression)]
                    if c.name in PIPESGD_CONFIGS else None,
                    "speed-up vs DDP": ddp.iteration_time_s / r.iteration_time_s if ddp else None,
                    "epochs": len(r.history),
                    "wall s": r.wall_time_s,
                    "accuracy %": 100 * r.final_accuracy,
                }
            )
        # "-": configurations that do not stage (null in the JSON)
        shown = [{**row, "staging ms": "-" if row["staging ms"] is None
                  else f"{row['staging ms']:.3g}"} for row in rows]
        print_table(shown, f"Training, {where} (median per iteration, rank 0)")
        checks = target_checks(results, comm_s, comm.size, rate,
                               recipe=args.epochs is None and args.lr is None)
        print("\n".join(checks))
        payload = {
            "ranks": comm.size,
            "link_rate_bps": rate,
            "comm_nice": args.comm_nice,
            "device": args.device,
            "recipes": {m: dataclasses.asdict(r) for m, r in RECIPES.items()},
            "rows": rows,
            "communication_s": {f"{m}/{c}": t for (m, c), t in comm_s.items()},
            "checks": checks,
            "runs": [{**dataclasses.asdict(r), "staging_ms": staged}
                     for r, staged in zip(results, staging, strict=True)],
        }
        suffix = ("_cuda" if args.device == "cuda" else "") + (f"_{args.tag}" if args.tag else "")
        path = write_json(f"train_p{comm.size}{suffix}.json", payload)
        plot(payload["runs"], RESULTS / f"train_p{comm.size}{suffix}.png", where)
        print(f"wrote {path} and {path.with_suffix('.png')}")
    missed = comm.bcast(any(line.endswith("FAIL") for line in checks)
                        if comm.rank == 0 else None, root=0)
    pipesgd.shutdown()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
