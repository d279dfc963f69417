"""Does the timing model's profile cost a pass what training pays for it? One process.

    .venv/bin/python bench/profile_fidelity.py                # MLP and CNN, batch 32
    .venv/bin/python bench/profile_fidelity.py --models mlp --batch-size 64

Round after round, in one process on one torch thread (thread CPU time, as
`pipesgd.timing.profile` times it there), three things run side by side:
1. `profile()` as the timing model takes it (`pipesgd train --config auto`, `timing
   predict`): gradients zeroed in place, so the backward adds into them;
2. the form it replaced: fresh gradients every pass (`zero_grad(set_to_none=True)`);
3. the training loop itself: `DistributedOptimizer.zero_grad()`, forward, loss and
   backward, then `step()`, on one rank.

The ratio of (3)'s compute (zero_grad to the end of the backward) to a profile's forward
plus backward is what a compute-bound prediction is off by. Target: the median ratio of
(1) within 10 % of 1 for every model. The step's ratio (3) / profile's update is shown
too: there the one-rank optimizer hands its buckets to the engine, which the timing
model counts as communication. Prints a table, writes bench/results/profile_fidelity.json
and .png; exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json

TARGET = 0.10
LOOP_PASSES, LOOP_WARMUP = 50, 10


def two_phases(setup: Callable[[], object], first: Callable[[], object],
               second: Callable[[], object], passes: int,
               warmup: int) -> tuple[float, float]:
    """Medians of `first` and `second` in thread CPU time, over `passes` after `warmup`;
    `setup` runs untimed before each pass."""
    a, b = [], []
    for i in range(warmup + passes):
        setup()
        t0 = time.thread_time()
        first()
        t1 = time.thread_time()
        second()
        t2 = time.thread_time()
        if i >= warmup:
            a.append(t1 - t0)
            b.append(t2 - t1)
    return statistics.median(a), statistics.median(b)


def fresh_gradient_profile(model, optimizer, x, y) -> tuple[float, float]:
    """The replaced form: (forward + backward, update) with gradients made anew, as
    `profile()` takes them (10 passes after 3)."""
    import torch.nn.functional as F

    return two_phases(lambda: optimizer.zero_grad(set_to_none=True),
                      lambda: F.cross_entropy(model(x), y).backward(), optimizer.step,
                      passes=10, warmup=3)


def training_loop(module, sync, x, y) -> tuple[float, float]:
    """The run's own iteration on one rank: (zero_grad to the end of the backward, step)."""
    import torch.nn.functional as F

    def compute() -> None:
        sync.zero_grad()
        F.cross_entropy(module(x), y).backward()

    return two_phases(lambda: None, compute, sync.step, passes=LOOP_PASSES,
                      warmup=LOOP_WARMUP)


def measure(model_name: str, batch_size: int, rounds: int) -> dict:
    from pipesgd.timing import profile
    from pipesgd.train.loop import TrainConfig, build_optimizer, pipesgd_synchronizer, prepare

    config = TrainConfig(model=model_name, data="synthetic", batch_size=batch_size, steps=1)
    dataset, model = prepare(config)
    x, y = dataset.train_x[:batch_size], dataset.train_y[:batch_size]
    _, twin = prepare(config)  # the profiles' own copy, as `profile_run` builds one
    twin_opt = build_optimizer(config, twin)
    module, sync = pipesgd_synchronizer(model, build_optimizer(config, model), config)
    rows = []
    for _ in range(rounds):
        prof = profile(twin, (x, y), twin_opt)
        fresh_fb, fresh_up = fresh_gradient_profile(twin, twin_opt, x, y)
        compute, step = training_loop(module, sync, x, y)
        rows.append({"profile_fb": prof.forward_s + prof.backward_s,
                     "profile_update": prof.update_s, "fresh_fb": fresh_fb,
                     "fresh_update": fresh_up, "loop_compute": compute, "loop_step": step})
    sync.synchronize()
    ratio = [r["loop_compute"] / r["profile_fb"] for r in rows]
    fresh = [r["loop_compute"] / r["fresh_fb"] for r in rows]
    step = [r["loop_step"] / r["profile_update"] for r in rows]
    return {"model": model_name, "batch_size": batch_size, "rounds": rows,
            "compute_ratio": ratio, "replaced_ratio": fresh, "step_ratio": step,
            "median_compute_ratio": statistics.median(ratio),
            "median_replaced_ratio": statistics.median(fresh),
            "median_step_ratio": statistics.median(step),
            "ok": abs(statistics.median(ratio) - 1) <= TARGET}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, res in enumerate(results):
        for j, (key, color, label) in enumerate((("compute_ratio", "tab:blue", "profile"),
                                                 ("replaced_ratio", "tab:gray", "replaced"))):
            xs = [i + 0.2 * (j - 0.5)] * len(res[key])
            ax.plot(xs, res[key], "o", color=color, alpha=0.6,
                    label=label if i == 0 else None)
    ax.axhspan(1 - TARGET, 1 + TARGET, color="tab:green", alpha=0.12, label="target")
    ax.set_xticks(range(len(results)),
                  [f"{r['model']} b{r['batch_size']}" for r in results])
    ax.set_ylabel("training compute / profile F + B")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)

    import torch

    import pipesgd

    torch.set_num_threads(1)  # thread CPU time is the profile's clock on one thread
    pipesgd.init()
    try:
        results = [measure(m, args.batch_size, args.rounds) for m in args.models.split(",")]
    finally:
        pipesgd.shutdown()
    print_table([{
        "model": f"{r['model']} b{r['batch_size']}",
        "compute / profile F+B (median, range)":
            f"{r['median_compute_ratio']:.2f} ({min(r['compute_ratio']):.2f}-"
            f"{max(r['compute_ratio']):.2f})",
        "compute / replaced F+B": f"{r['median_replaced_ratio']:.2f} "
                                  f"({min(r['replaced_ratio']):.2f}-"
                                  f"{max(r['replaced_ratio']):.2f})",
        "step / profile update": f"{r['median_step_ratio']:.2f}",
        "verdict": "PASS" if r["ok"] else "FAIL",
    } for r in results], title=f"Profile against training ({args.rounds} rounds each)")
    path = write_json("profile_fidelity.json", {"target": TARGET, "results": results})
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
