"""Whether the ranks compute in step: each rank's forward and backward in training, timed
on the machine's monotonic clock (one clock for every rank of a host), how many ranks
compute at once, and where an iteration goes between the ranks' computing and their
allreduce.

    python bench/netem.py --np 4 --rate 500mbit --burst 128KiB -- \\
        python bench/compute_stagger.py --bucket-mb 0.25

The timing model stretches compute by R t / C where R ranks of t threads share C cores,
as if every rank computed at once, and charges the ring's steps beside that compute a
wait for a core measured with every rank spinning at once (`measure`'s λ_load). This
shows how far training is from that (docs/timing_model.md, "Ranks do not compute in
step"). Per configuration it prints the iteration, a rank's compute, the spread of the
ranks' starts, the ranks computing at once, and the iteration in two parts: "last in",
from the first rank's start to the last rank's call of `step()` (compute, and how far
apart the ranks do it), and "after", from there to the first rank's return from
`step()` (the allreduce once every rank has joined it, and the update). Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

CONFIGS = {"quant8": ((1, "quant8"), (2, "quant8"), (1, "none"), (2, "none")),
           "d-sync": ((1, "quant8"), (1, "trunc16"), (1, "none"))}


def overlap_with_others(every: list[list[tuple[float, float]]], rank: int, i: int) -> float:
    """Ranks computing, on average, while `rank` computes iteration `i` (itself included):
    the seconds the ranks' compute spells overlap it, over its own length."""
    begin, end = every[rank][i]
    shared = sum(max(0.0, min(end, e) - max(begin, b))
                 for spells in every for b, e in spells[max(0, i - 3):i + 4])
    return shared / (end - begin)


def summarize(label: str, every: list[list[tuple[float, float]]], starts: list[float],
              returns: list[list[float]], skip: int) -> str:
    """`every[rank][i]`: (start, end) of that rank's compute in step i, which ends where it
    calls `step()`; `returns[rank][i]`: when that call returned; `starts`: rank 0's."""
    steps = range(skip, len(starts) - 4)
    iteration = statistics.median(starts[i + 1] - starts[i] for i in steps)
    compute = statistics.median(every[r][i][1] - every[r][i][0]
                                for r in range(len(every)) for i in steps)
    spread = statistics.median(max(s[i][0] for s in every) - min(s[i][0] for s in every)
                               for i in steps)
    at_once = statistics.mean(overlap_with_others(every, r, i)
                              for r in range(len(every)) for i in steps)
    last_in = statistics.median(max(s[i][1] for s in every) - min(s[i][0] for s in every)
                                for i in steps)
    after = statistics.median(min(r[i] for r in returns) - max(s[i][1] for s in every)
                              for i in steps)
    return (f"{label:12s} iteration {iteration * 1e3:7.2f} ms   compute {compute * 1e3:6.2f} ms"
            f"   starts spread {spread * 1e3:5.2f} ms   ranks computing at once {at_once:.2f}"
            f"   last in {last_in * 1e3:6.2f} ms   after {after * 1e3:6.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", help="mlp or cnn (pipesgd.pipeline.models)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=150, help="per configuration (50 untimed)")
    ap.add_argument("--configs", choices=sorted(CONFIGS), default="quant8",
                    help="quant8: D-Sync and Pipe-SGD, with quant8 and without; d-sync: "
                         "D-Sync in every compression mode")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    import pipesgd
    from pipesgd.pipeline.models import MODELS
    from pipesgd.timing import Config

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    engine = pipesgd.Engine(comm)
    spec = MODELS[args.model]()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (args.batch_size,), generator=gen)
    if rank == 0:
        print(f"{comm.Get_size()} ranks, {args.model}, batch {args.batch_size}, "
              f"{args.bucket_mb:g} MB buckets")
    for staleness, compression in CONFIGS[args.configs]:
        model = spec.build(seed=0)
        opt = pipesgd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3), model.named_parameters(),
            staleness=staleness, compression=compression, bucket_mb=args.bucket_mb,
            engine=engine, comm=comm)
        spells, starts, returns = [], [], []
        comm.Barrier()
        for _ in range(args.steps):
            begin = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            spells.append((begin, time.monotonic()))
            starts.append(begin)
            opt.step()
            returns.append(time.monotonic())
        opt.synchronize()
        opt.remove_hooks()
        gathered = comm.gather((spells, returns), root=0)
        if rank == 0:
            every, every_return = (list(part) for part in zip(*gathered, strict=True))
            label = Config(staleness, compression, "sequential").label
            print(summarize(label, every, starts, every_return, skip=min(50, args.steps // 3)))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
