"""PipeMare's asynchronous pipeline against weight stashing and GPipe.

    .venv/bin/python bench/pipemare.py                 # MLP and CNN on digits, 4 stages

Every variant trains the same model through `pipesgd pipeline` on 4 ranks, in rounds
that run each variant once (a new `mpirun` each; every other round in reverse order)
from the round's seed (round r: seed r, which draws the weights, the data order and the
held-out split alike for every variant). Accuracy is the last epoch's on the held-out
digits, averaged over the rounds' seeds; samples/s is the median over rounds, and speed
ratios are taken within a round, then their median. The run's JSON gives accuracy,
samples/s and the memory each stage held:

    gpipe           synchronous (flush every 4 micro-batches)
    1f1b            PipeDream's weight stashing, a step per micro-batch
    async           PipeMare without its techniques: one copy of the weights
    async+T1        with the learning rate rescheduled by each stage's delay, annealed
                    over the first 40 % of the run's steps
    async+T1+T2     and the backward's weights extrapolated back (discrepancy correction)
    PipeMareW       async+T1+T2 after one synchronous (1f1b) epoch
    ..., recompute  async+T1+T2 keeping only stage inputs, the backward recomputing

Both models learn the digits (the CNN sees them scaled up to 3x32x32). Targets, for
each model: async+T1+T2 within 0.5 points of 1f1b's held-out accuracy (the mean over the
rounds' seeds), with less weight and optimizer memory on stage 0 (the deepest stash), at
1f1b's throughput or more. Writes bench/results/pipemare.json and .png; exit status 1
when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, mpi_env, mpirun, print_table, write_json

VARIANTS = {
    "gpipe": ["--schedule", "gpipe", "--batch-size", "32"],
    "1f1b": ["--schedule", "1f1b"],
    "async": ["--schedule", "async"],
    "async+T1": ["--schedule", "async", "--t1", "{k}"],
    "async+T1+T2": ["--schedule", "async", "--t1", "{k}", "--t2", "0.1"],
    "PipeMareW": ["--schedule", "async", "--t1", "{k}", "--t2", "0.1",
                  "--sync-warmup-epochs", "1"],
    "async+T1+T2, recompute": ["--schedule", "async", "--t1", "{k}", "--t2", "0.1",
                               "--recompute"],
}
ACCURACY_POINTS = 0.5
MICRO_BATCH = 8


def train_samples() -> int:
    from pipesgd.pipeline.data import digits

    (x, _), _ = digits()
    return len(x)


def run_variant(model: str, flags: list[str], epochs: int, lr: float, ranks: int,
                seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pipesgd-pipemare-") as tmp:
        out = Path(tmp) / "run.json"
        cmd = [mpirun(), "--oversubscribe", "-n", str(ranks), sys.executable, "-m",
               "pipesgd.cli", "pipeline", "--model", model, "--epochs", str(epochs),
               "--micro-batch", str(MICRO_BATCH), "--lr", str(lr), "--data", "digits",
               "--seed", str(seed), "--no-progress",
               "--json", str(out), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(),
                              timeout=1800, check=False)
        if proc.returncode != 0 or not out.exists():
            return {"failed": (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(out.read_text())


def summarize(name: str, model: str, reports: list[dict]) -> dict:
    """One row from a variant's runs, one per round (seed)."""
    ok = [r for r in reports if "failed" not in r]
    if len(ok) < len(reports):
        return {"model": model, "variant": name, "test accuracy": "failed",
                "training accuracy": "-", "samples/s": "-", "weight sets held": "-",
                "weights+optimizer MB": "-", "activations MB": "-"}
    first = ok[0]
    # live weights, the optimizer's state, and the copies beside them (stash, T2's u)
    held = [w + o + x for w, o, x in zip(first["weight_mb"], first["optimizer_state_mb"],
                                         first["peak_stash_mb"], strict=True)]
    tests = [r["test_accuracy"] for r in ok]
    epochs = [[e["test_accuracy"] for e in r["epochs"]] for r in ok]
    return {
        "model": model,
        "variant": name,
        "test accuracy": statistics.mean(tests),
        "test accuracy, each seed": tests,
        "training accuracy": statistics.mean(r["accuracy"] for r in ok),
        "samples/s": statistics.median(r["throughput_samples_per_s"] for r in ok),
        "samples/s, each run": [r["throughput_samples_per_s"] for r in ok],
        "weight sets held": "/".join(str(v) for v in first["peak_versions"]),
        "weights+optimizer MB": "/".join(f"{m:.2f}" for m in held),
        "activations MB": "/".join(f"{m:.2f}" for m in first["peak_activation_mb"]),
        "test accuracy by epoch": [statistics.mean(e) for e in zip(*epochs, strict=True)],
        "seconds by epoch": [statistics.mean(e["seconds"] for e in es) for es in zip(
            *(r["epochs"] for r in ok), strict=True)],
    }


def verdicts(rows: list[dict], model: str) -> list[str]:
    by = {(r["model"], r["variant"]): r for r in rows}
    base, mare = by.get((model, "1f1b")), by.get((model, "async+T1+T2"))
    if not base or not mare or "failed" in (base["test accuracy"], mare["test accuracy"]):
        return [f"{model}: a run failed FAIL"]
    out = []
    gap = 100 * (base["test accuracy"] - mare["test accuracy"])
    seeds = len(base["test accuracy, each seed"])
    out.append(f"{model}: async+T1+T2 held-out accuracy {100 * mare['test accuracy']:.2f} "
               f"against 1f1b {100 * base['test accuracy']:.2f}, mean of {seeds} seeds "
               f"({gap:+.2f} points behind; target <= {ACCURACY_POINTS}) "
               f"{'PASS' if gap <= ACCURACY_POINTS else 'FAIL'}")
    mine = float(mare["weights+optimizer MB"].split("/")[0])
    stash = float(base["weights+optimizer MB"].split("/")[0])
    out.append(f"{model}: weights+optimizer on stage 0, async+T1+T2 {mine:.2f} MB against "
               f"1f1b {stash:.2f} MB ({stash / mine:.2f}x less) "
               f"{'PASS' if mine < stash else 'FAIL'}")
    ratios = [m / b for m, b in zip(mare["samples/s, each run"], base["samples/s, each run"],
                                    strict=True) if m is not None and b is not None]
    ratio = statistics.median(ratios) if ratios else 0.0
    out.append(f"{model}: async+T1+T2 throughput / 1f1b, median over rounds = {ratio:.2f} "
               f"(each round {', '.join(f'{x:.2f}' for x in ratios)}; target >= 1.0) "
               f"{'PASS' if ratio >= 1.0 else 'FAIL'}")
    return out


def plot(rows: list[dict], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for (by_epoch, by_time), model in zip(axes, models, strict=True):
        for r in rows:
            if r["model"] != model or "test accuracy by epoch" not in r:
                continue
            acc = r["test accuracy by epoch"]
            elapsed = [sum(r["seconds by epoch"][: i + 1]) for i in range(len(acc))]
            by_epoch.plot(range(1, len(acc) + 1), acc, "o-", label=r["variant"], markersize=3)
            by_time.plot(elapsed, acc, "o-", label=r["variant"], markersize=3)
        by_epoch.set_xlabel("epoch")
        by_time.set_xlabel("seconds of training")
        for ax in (by_epoch, by_time):
            ax.set_ylabel(f"{model}: held-out accuracy")
            ax.grid(True, alpha=0.3)
        by_epoch.legend(fontsize=7)
    fig.suptitle("Digits on 4 pipeline stages: stashing, GPipe and PipeMare")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=8, help="MLP epochs")
    ap.add_argument("--lr", type=float, default=0.1, help="MLP learning rate")
    # 10: the CNN's held-out accuracy is still rising by a point an epoch at 5 under
    # every variant, flat from about 8 (a final accuracy is a converged one)
    ap.add_argument("--cnn-epochs", type=int, default=10, help="CNN epochs (0: skip the CNN)")
    ap.add_argument("--cnn-lr", type=float, default=0.01, help="CNN learning rate")
    ap.add_argument("--t1-fraction", type=float, default=0.4,
                    help="T1 anneals over this fraction of a run's steps (K)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds, each running every variant once (a new mpirun each) "
                    "from the round's seed; accuracy is the mean over rounds, samples/s "
                    "the median, speed ratios the median of each round's")
    args = ap.parse_args(argv)

    rows = []
    runs = [("mlp", args.epochs, args.lr)]
    if args.cnn_epochs:
        runs.append(("cnn", args.cnn_epochs, args.cnn_lr))
    for model, epochs, lr in runs:
        # One round runs every variant once, so each round's ratios compare runs made
        # side by side: these VMs change speed between launches, in streaks.
        names = [n for n in VARIANTS if not (epochs < 2 and n == "PipeMareW")]
        # one step per micro-batch under async: the same share of every run anneals
        t1_steps = max(1, round(args.t1_fraction * epochs * train_samples() / MICRO_BATCH))
        reports: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.repeats):
            # every other round backwards, so a drift along a round favours no variant
            for name in names if r % 2 == 0 else names[::-1]:
                flags = [f.format(k=t1_steps) for f in VARIANTS[name]]
                reports[name].append(run_variant(model, flags, epochs, lr, args.ranks,
                                                 seed=r))
            print(f"  {model}: round {r + 1} of {args.repeats} done", flush=True)
        rows.extend(summarize(name, model, reports[name]) for name in names)
    print_table([{k: v for k, v in r.items() if "by epoch" not in k and "each " not in k}
                 for r in rows],
                f"PipeMare against stashing and GPipe, {args.ranks} stages")
    lines = [line for model, _, _ in runs for line in verdicts(rows, model)]
    for line in lines:
        print(line)
    path = write_json("pipemare.json", {"rows": rows, "targets": lines,
                                        "command": " ".join(["bench/pipemare.py",
                                                             *(argv or sys.argv[1:])])})
    plot(rows, [model for model, _, _ in runs], RESULTS / "pipemare.png")
    print(f"wrote {path} and {RESULTS / 'pipemare.png'}")
    return 1 if any(v.endswith("FAIL") for v in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
