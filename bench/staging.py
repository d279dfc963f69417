"""What host staging (pipesgd/staging.py) costs on the CPU: the CNN trained with Pipe-SGD
through the plain path and through the staged one (host copies of every bucket, gated
operations, the helper thread), side by side in one mpirun.

    mpirun -n 2 python bench/staging.py             # 3 rounds, 1 epoch each way
    mpirun -n 2 python bench/staging.py --rounds 5 --model mlp

On a GPU the copies cross PCIe and overlap compute; here they are memory copies on the
compute thread, so this bounds the path's own overhead (target: at most 5 % of the CNN's
iteration time). Rounds alternate the order of the two runs. Prints a table, writes
bench/results/staging_p{P}.json; exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json

from pipesgd.optim import DistributedOptimizer
from pipesgd.train import loop

TARGET = 0.05


def synchronizer(staging: bool, made: list[DistributedOptimizer]) -> loop.SynchronizerFactory:
    """Makes the run's optimizer and keeps it as `made[0]`, dropping the last run's (its
    buckets and host twins)."""
    def make(model, inner, config):
        opt = DistributedOptimizer(
            inner, model.named_parameters(), staleness=config.staleness,
            compression=config.compression, bucket_mb=config.bucket_mb, staging=staging)
        made[:] = [opt]
        return model, opt
    return make


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    config = loop.TrainConfig(model=args.model, data="digits", epochs=args.epochs,
                              batch_size=32, lr=0.01, momentum=0.9, staleness=2,
                              bucket_mb=args.bucket_mb, channels_last=args.model == "cnn")
    times: dict[bool, list[float]] = {False: [], True: []}
    copies: list[float] = []  # the staged runs' copy time per iteration
    made: list[DistributedOptimizer] = []  # the last run's optimizer
    # An untimed run first: a launch's first run took 8-14 % longer than the same path's
    # later ones (allocator, engine start-up, caches), against whichever path ran first.
    loop.run(config, comm, synchronizer=synchronizer(False, made), progress=False,
             log=lambda _: None)
    for r in range(args.rounds):
        for staging in ((False, True) if r % 2 == 0 else (True, False)):
            result = loop.run(config, comm, synchronizer=synchronizer(staging, made),
                              progress=False, log=lambda _: None)
            times[staging].append(result.iteration_time_s)
            if staging:
                copies.append(made[0].staging_seconds / max(made[0].iteration, 1))
    ratios = [s / p for p, s in zip(times[False], times[True], strict=True)]
    overhead = statistics.median(ratios) - 1.0
    ok = overhead <= TARGET
    if comm.rank == 0:
        rows = [{"path": "plain" if not staging else "staged",
                 "iteration ms (median of rounds)": 1e3 * statistics.median(times[staging]),
                 "each round ms": ", ".join(f"{1e3 * t:.2f}" for t in times[staging])}
                for staging in (False, True)]
        print_table(rows, f"Host staging on the CPU, {args.model}, Pipe-SGD, p = {comm.size}")
        print(f"the staged path's copies, device to host and back: "
              f"{1e3 * statistics.median(copies):.2f} ms per iteration (median of rounds)")
        print(f"staged / plain, median over rounds = {1 + overhead:.3f} "
              f"(each round {', '.join(f'{x:.3f}' for x in ratios)}; target <= "
              f"{1 + TARGET:.2f}) {'PASS' if ok else 'FAIL'}")
        path = write_json(f"staging_p{comm.size}.json", {
            "model": args.model, "plain_s": times[False], "staged_s": times[True],
            "ratios": ratios, "copies_s_per_iteration": copies, "target": 1 + TARGET,
            "pass": ok})
        plot(times, args.model, comm.size, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if ok else 1


def plot(times: dict[bool, list[float]], model: str, p: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for staging, marker in ((False, "o"), (True, "x")):
        rounds = range(1, len(times[staging]) + 1)
        ax.plot(rounds, [1e3 * t for t in times[staging]], marker,
                label="staged" if staging else "plain")
    ax.set_xlabel("round")
    ax.set_ylabel("iteration (ms, median)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"Host staging on the CPU, {model}, p = {p}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
