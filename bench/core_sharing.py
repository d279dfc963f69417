"""How ranks that share a host's cores share them in training: each configuration's
long-run iteration time beside the CPU its threads burn, with the engine's polling while
a caller waits on and off; and the stretch of a fixed compute unit under D-Sync's and
Pipe-SGD's coupling, against the model's R t / C.

    python bench/netem.py --np 3 --rate 600mbit --burst 512KiB -- \\
        python bench/core_sharing.py --model paper-cifar100-cnn --batch-size 32 --bucket-mb 0.5

The timing model stretches compute by R t / C where R ranks of t threads share C cores
and counts the comm thread's CPU from its kernels and bytes (docs/timing_model.md,
"Uneven sharing"). Here every configuration trains `--steps` steps in one run (the last
two thirds timed), so a rank that runs ahead and one that falls behind average out: the
figure is the slowest rank's mean, the job's pace. Beside it, per iteration, where each
rank's CPU goes: forward and backward (and how long they waited for a core), `step()`
(the optimizer, its bookkeeping and its waits), the comm thread (the scheduler's account
of it); and R x that CPU / C, the iteration the host's cores allow.
Prints a table and the unit's stretches; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

CONFIGS = ((1, "quant8"), (2, "quant8"), (1, "none"), (2, "none"))


def thread_times(tid: int | str) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of thread `tid` of this
    process, from the scheduler's own accounting (nanoseconds, where /proc/.../stat
    counts clock ticks)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run_ns, wait_ns, _ = (int(v) for v in f.read().split())
    return run_ns * 1e-9, wait_ns * 1e-9


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name and id: the comm thread's
    includes the kernel's network work it does."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out[f"{name}:{tid}"] = thread_times(tid)[0]
        except OSError:  # the thread ended
            continue
    return out


def comm_thread_cpu(before: dict[str, float], after: dict[str, float]) -> float:
    """CPU seconds the engine's comm threads burnt between two `thread_cpu_s` readings."""
    return sum(after[k] - before.get(k, 0.0) for k in after if k.startswith("pipesgd-comm"))


def host_bound(ranks: int, cores: int, *cpu_s: float) -> float:
    """The iteration the host's cores allow when each of `ranks` ranks burns the sum of
    `cpu_s` per iteration on `cores` cores."""
    return ranks * sum(cpu_s) / cores


def stretch(slowest_mean_s: float, unit_s: float) -> float:
    """Iteration time over the compute's own CPU time (1 on a core of its own)."""
    return slowest_mean_s / unit_s


def label(staleness: int, compression: str, poll_while_waited: bool) -> str:
    from pipesgd.timing import Config

    name = Config(staleness, compression, "sequential").label
    return f"{name} ({'yield' if poll_while_waited else 'nap'})"


@dataclass
class Row:
    """One configuration's run: the slowest rank's mean iteration (the job's pace) and,
    per iteration, the median rank's CPU of forward and backward (its median), the time
    they waited for a core, the CPU of `step()` (the optimizer and its waits) and of the
    comm thread (means)."""

    label: str
    iteration_s: float
    compute_s: float
    compute_wait_s: float
    step_s: float
    comm_s: float


def train_rows(args: argparse.Namespace, comm) -> list[Row]:
    """Every configuration with the engine's waited polling on and off, alternating,
    twice."""
    import threading

    import torch

    import pipesgd
    from pipesgd.pipeline.models import MODELS

    spec = MODELS[args.model]()
    gen = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(args.batch_size, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (args.batch_size,), generator=gen)
    me = threading.get_native_id()

    def median_rank(value: float) -> float:
        return statistics.median(comm.allgather(value))

    rows = []
    for _ in range(2):
        for staleness, compression in CONFIGS:
            for waited in (True, False):
                engine = pipesgd.Engine(comm, poll_while_waited=waited)
                model = spec.build(seed=0)
                opt = pipesgd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=1e-3), model.named_parameters(),
                    staleness=staleness, compression=compression, bucket_mb=args.bucket_mb,
                    engine=engine, comm=comm)
                skip = args.steps // 3
                comm.Barrier()
                compute, compute_wait, step_cpu = [], 0.0, 0.0
                for step in range(args.steps):
                    if step == skip:
                        began, threads = time.perf_counter(), thread_cpu_s()
                    # CPU from the thread's clock (the scheduler's accounting of a
                    # running thread lags by its current slice); the wait for a core,
                    # which ends at a switch, from the scheduler's
                    cpu0, wait0 = time.thread_time(), thread_times(me)[1]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    cpu1, wait1 = time.thread_time(), thread_times(me)[1]
                    opt.step()
                    if step >= skip:
                        compute.append(cpu1 - cpu0)
                        compute_wait += wait1 - wait0
                        step_cpu += time.thread_time() - cpu1
                steps = args.steps - skip
                mean = (time.perf_counter() - began) / steps
                comm_cpu = comm_thread_cpu(threads, thread_cpu_s()) / steps
                opt.synchronize()
                opt.remove_hooks()
                engine.shutdown()
                rows.append(Row(label(staleness, compression, waited), max(comm.allgather(mean)),
                                median_rank(statistics.median(compute)),
                                median_rank(compute_wait / steps),
                                median_rank(step_cpu / steps), median_rank(comm_cpu)))
    return rows


def unit_stretches(unit_ms: float, seconds: float, comm) -> dict[int, float]:
    """K -> stretch of a spinning unit of `unit_ms` of CPU when every rank runs it, submits
    a 4 KiB allreduce each iteration and waits for the one K - 1 iterations back (K = 1:
    D-Sync's coupling, its allreduce's latency included; K = 2: Pipe-SGD's)."""
    import numpy as np

    import pipesgd
    from pipesgd.polling import idle_barrier
    from pipesgd.timing.host_costs import Spinner

    spinner = Spinner()
    began, calls = time.thread_time(), 0
    while time.thread_time() - began < 0.2:
        spinner.unit()
        calls += 1
    per_call = (time.thread_time() - began) / calls
    # rank 0's calibration for every rank: each must submit as many allreduces
    calls = comm.bcast(max(1, round(unit_ms / 1e3 / per_call)), root=0)
    unit_s = calls * comm.bcast(per_call, root=0)
    iterations = max(10, round(seconds / (1.5 * unit_s)))
    engine = pipesgd.Engine(comm)
    buf = np.ones(1024, dtype=np.float32)
    out = {}
    for staleness in (1, 2):
        idle_barrier(comm)
        handles, times = [], []
        for _ in range(iterations):
            start = time.perf_counter()
            for _ in range(calls):
                spinner.unit()
            handles.append(engine.allreduce_async(buf))
            if len(handles) >= staleness:
                handles.pop(0).wait()
            times.append(time.perf_counter() - start)
        for handle in handles:
            handle.wait()
        slowest = max(comm.allgather(statistics.mean(times[iterations // 5:])))
        out[staleness] = stretch(slowest, unit_s)
    engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="paper-cifar100-cnn",
                    help="a model of pipesgd.pipeline.models")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=240, help="per configuration and run")
    ap.add_argument("--unit-ms", default="5,30",
                    help="comma-separated CPU lengths of the spinning unit")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    from pipesgd.timing.network import default_cores

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    ranks, cores = comm.Get_size(), default_cores()
    rows = train_rows(args, comm)
    units = {float(u): unit_stretches(float(u), 3.0, comm) for u in args.unit_ms.split(",")}
    if comm.Get_rank() == 0:
        print(f"{ranks} ranks on {cores} cores (R t / C = {max(1.0, ranks / cores):.2f}), "
              f"{args.model}, batch {args.batch_size}, {args.bucket_mb:g} MB buckets")
        print(f"{'configuration':22s} {'iteration':>9s} {'fwd+bwd CPU':>11s} "
              f"{'waiting':>7s} {'step CPU':>8s} {'comm CPU':>8s} {'R x CPU / C':>11s} "
              f"{'stretch':>7s}   (ms per iteration)")
        for row in rows:
            bound = host_bound(ranks, cores, row.compute_s, row.step_s, row.comm_s)
            print(f"{row.label:22s} {row.iteration_s * 1e3:9.2f} {row.compute_s * 1e3:11.2f} "
                  f"{row.compute_wait_s * 1e3:7.2f} {row.step_s * 1e3:8.2f} "
                  f"{row.comm_s * 1e3:8.2f} {bound * 1e3:11.2f} "
                  f"{stretch(row.iteration_s, row.compute_s):7.2f}")
        for unit, by_k in units.items():
            print(f"spinning unit {unit:g} ms: stretch D-Sync coupling {by_k[1]:.2f}, "
                  f"Pipe-SGD coupling {by_k[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
