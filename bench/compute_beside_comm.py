"""What communication costs the compute beside it: a model's forward and backward timed
in the thread's CPU time alone and while the engine allreduces its gradient without
pause, and the user and system CPU of a bare allreduce.

    python bench/netem.py --np 2 --rate 1gbit --burst 0 -- \\
        python bench/compute_beside_comm.py --model mlp --batch-size 64 --compression quant8

The timing model's profile is taken beside the other ranks' compute, not beside
communication, so where ranks share cores a pass that runs beside the allreduce costs
more than the profile says (BENCHMARKS.md, "Timing model", CPU-bound rows). Prints one
line per rank and round; writes nothing.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def process_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", help="mlp or cnn (pipesgd.pipeline.models)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--compression", default="none", choices=("none", "trunc16", "quant8"))
    ap.add_argument("--steps", type=int, default=40, help="passes per round (5 untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    import pipesgd
    from pipesgd.pipeline.models import MODELS

    torch.set_num_threads(1)  # as the timing model profiles
    comm = MPI.COMM_WORLD
    spec = MODELS[args.model]()
    model = spec.build(seed=0)
    x = torch.randn(args.batch_size, *spec.input_shape)
    y = torch.randint(0, spec.num_classes, (args.batch_size,))
    grad = torch.zeros(sum(p.numel() for p in model.parameters())).numpy()
    engine = pipesgd.Engine(comm)

    def passes(beside: bool) -> float:
        """Median thread CPU seconds of a forward and backward pass."""
        times, handle = [], None
        for step in range(args.steps):
            if beside:  # one allreduce always in flight, as Pipe-SGD keeps one
                if handle is not None:
                    handle.wait()
                handle = engine.allreduce_async(grad, compression=args.compression)
            model.zero_grad(set_to_none=True)
            begin = time.thread_time()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step >= 5:
                times.append(time.thread_time() - begin)
        if handle is not None:
            handle.wait()
        return statistics.median(times)

    lines = []
    for r in range(args.rounds):
        comm.Barrier()
        alone = passes(beside=False)
        comm.Barrier()
        beside = passes(beside=True)
        comm.Barrier()
        user0, sys0 = process_cpu()
        wall0 = time.perf_counter()
        for _ in range(10):
            engine.allreduce(grad, compression=args.compression)
        wall = time.perf_counter() - wall0
        user1, sys1 = process_cpu()
        lines.append(f"round {r}: pass {alone * 1e3:.2f} ms alone, {beside * 1e3:.2f} ms beside "
                     f"the allreduce ({beside / alone - 1:+.1%}); a bare allreduce "
                     f"{wall * 100:.2f} ms, user {(user1 - user0) * 100:.2f} ms, "
                     f"system {(sys1 - sys0) * 100:.2f} ms")
    every = comm.gather(lines)
    if comm.Get_rank() == 0:
        for rank, mine in enumerate(every):
            for line in mine:
                print(f"rank {rank} {line}")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
