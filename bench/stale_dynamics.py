"""What a stale gradient does to training, without MPI: a single-process reference.

Trains bench/train.py's model on the same global batches (the union of the
`--ranks` shards of scikit-learn's digits) with plain torch, applying the gradient of
iteration t at iteration t + K - 1 exactly as `DistributedOptimizer(staleness=K,
warmup_steps=W)` does, for each K given. No engine, no compression, no rounding of
a ring: whatever these curves show is the algorithm's, not the implementation's.

    python bench/stale_dynamics.py                                 # CNN, K = 1 and 2
    python bench/stale_dynamics.py --lr 0.002 --epochs 6           # a smaller step
    python bench/stale_dynamics.py --nesterov --staleness 1,2,3
    python bench/stale_dynamics.py --batch-norm                    # BatchNorm after convs
    python bench/stale_dynamics.py --clip-grad-norm 2 --epochs 8   # clip the applied gradient
    python bench/stale_dynamics.py --predict-weights 1 --epochs 15 # gradients at predicted weights
    python bench/stale_dynamics.py --nesterov --ramp-steps 200 --epochs 15  # bench/train.py's CNN

Prints test accuracy and training loss per epoch for each K and writes
bench/results/stale_dynamics[_tag].json and .png.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_json

from pipesgd.pipeline import models
from pipesgd.train import loop
from pipesgd.train.data import ShardedBatches, load


def train(args: argparse.Namespace, staleness: int) -> list[dict[str, float]]:
    """Per-epoch test accuracy and mean training loss of one run."""
    torch.manual_seed(args.seed)
    dataset = load("digits", args.model)
    if args.batch_norm:
        model = models.cnn(dataset.num_classes, channels=dataset.input_shape[0],
                           batch_norm=True).build(seed=args.seed)
    else:
        model = loop.build_model(args.model, dataset, seed=args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, nesterov=args.nesterov)
    shards = [ShardedBatches(len(dataset.train_x), args.batch_size, r, args.ranks, args.seed)
              for r in range(args.ranks)]
    per_epoch = len(shards[0])
    total = args.schedule_epochs * per_epoch
    # (iteration, gradient) pairs not yet applied
    in_flight: collections.deque[tuple[int, list[torch.Tensor]]] = collections.deque()
    previous = [p.detach().clone() for p in params]  # the weights before the last step
    # (kept only for --predict-weights)
    history = []
    it = 0
    for epoch in range(args.epochs):
        losses = []
        for step in range(per_epoch):
            idx = torch.cat([s.indices(epoch, step) for s in shards])
            lr = args.lr * loop.lr_factor(args.lr_schedule, it, total)
            opt.zero_grad()
            k = 1 if it < args.warmup_steps else staleness
            current = None
            if args.predict_weights and k > 1:
                # The gradient is applied K - 1 steps later: compute it where the weights
                # will be by then if they keep moving as in the last step.
                current = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for p, prev in zip(params, previous, strict=True):
                        p.add_(p - prev, alpha=args.predict_weights * (k - 1))
            loss = F.cross_entropy(model(dataset.train_x[idx]), dataset.train_y[idx])
            loss.backward()
            if current is not None:
                with torch.no_grad():
                    for p, w in zip(params, current, strict=True):
                        p.copy_(w)
            losses.append(loss.item())
            in_flight.append((it, [p.grad.detach().clone() for p in params]))
            # the gradient of iteration t is applied at t + k - 1; none is due while the
            # pipe fills after the switch
            if len(in_flight) >= k:
                applied, grads = in_flight.popleft()
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                for group in opt.param_groups:
                    # DistributedOptimizer.lr_scale_at, written out
                    ramped = args.ramp_steps and applied >= args.warmup_steps and staleness > 1
                    group["lr"] = lr * (min(1.0, (applied - args.warmup_steps + 1)
                                            / args.ramp_steps) if ramped else 1.0)
                if args.clip_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
                if args.predict_weights:
                    previous = [p.detach().clone() for p in params]
                opt.step()
            it += 1
        with torch.no_grad():
            logits = model(dataset.test_x)
        accuracy = (logits.argmax(1) == dataset.test_y).float().mean().item()
        history.append({"epoch": epoch + 1, "accuracy": accuracy,
                        "train_loss": sum(losses) / len(losses)})
    return history


def plot(runs: dict[int, list[dict[str, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, history in runs.items():
        ax.plot([h["epoch"] for h in history], [100 * h["accuracy"] for h in history],
                marker="o", markersize=3, label=f"K = {k}")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("mlp", "cnn"), default="cnn")
    ap.add_argument("--staleness", default="1,2", help="comma-separated K values")
    ap.add_argument("--epochs", type=int, default=6, help="epochs to train")
    ap.add_argument("--schedule-epochs", type=int, default=15,
                    help="length of the learning-rate schedule (bench/train.py's recipe)")
    ap.add_argument("--ranks", type=int, default=2, help="shards making one global batch")
    ap.add_argument("--batch-size", type=int, default=32, help="per shard")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--lr-schedule", choices=loop.LR_SCHEDULES, default="cosine")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--warmup-steps", type=int, default=44, help="first iterations with K = 1")
    ap.add_argument("--batch-norm", action="store_true",
                    help="the CNN with BatchNorm after each convolution")
    ap.add_argument("--clip-grad-norm", type=float, default=0.0,
                    help="clip the norm of the gradient each step applies (0: no clipping)")
    ap.add_argument("--predict-weights", type=float, default=0.0, metavar="ALPHA",
                    help="with K >= 2, compute each gradient at w + ALPHA (K - 1)(w - w_prev) "
                    "(PipeMare-style weight prediction; 0: off)")
    ap.add_argument("--ramp-steps", type=int, default=0,
                    help="ramp the learning rate of the first N stale updates from 1/N up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.staleness.split(",")]
    if any(k < 1 for k in ks):
        ap.error("staleness values must be >= 1")
    if args.batch_norm and args.model != "cnn":
        ap.error("--batch-norm applies to the CNN only")

    runs: dict[int, list[dict[str, Any]]] = {}
    for k in ks:
        runs[k] = train(args, k)
        print(f"K = {k}: " + " ".join(f"{100 * h['accuracy']:.1f}" for h in runs[k]), flush=True)
    rows = [{"epoch": e + 1,
             **{f"K={k} acc %": 100 * runs[k][e]["accuracy"] for k in ks},
             **{f"K={k} loss": runs[k][e]["train_loss"] for k in ks}}
            for e in range(args.epochs)]
    momentum = f"{'Nesterov ' if args.nesterov else ''}momentum {args.momentum:g}"
    if args.clip_grad_norm > 0:
        momentum += f", gradient norm clipped at {args.clip_grad_norm:g}"
    if args.predict_weights:
        momentum += f", weights predicted with alpha {args.predict_weights:g}"
    if args.ramp_steps:
        momentum += f", stale updates ramped over {args.ramp_steps}"
    title = (f"{args.model.upper()} on digits, one process, lr {args.lr:g} {args.lr_schedule}, "
             f"{momentum}, K = 1 for {args.warmup_steps} iterations")
    print_table(rows, title)
    suffix = f"_{args.tag}" if args.tag else ""
    path = write_json(f"stale_dynamics{suffix}.json", {"args": vars(args), "runs": runs})
    plot(runs, RESULTS / f"stale_dynamics{suffix}.png", title)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
