"""How fast the engine's allreduce moves bytes, timed the way `measure` takes β and the
ways training runs it: the caller running it, or the comm thread; a slope between two
large sizes, or whole allreduces at the optimizer's bucket sizes; back to back, or after
a spell of compute on every rank.

    python bench/netem.py --np 4 --rate 400mbit --burst 0 -- python bench/beta_probes.py

`measure` takes β between nodes as the first row's slope (less the reductions, which
this leaves in). Where the rows disagree, one β cannot fit every way training uses the
link (docs/timing_model.md, "Where it still misses"). Prints Mbit/s of wire bytes per
link, each the slowest rank's median over `--repeats`; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table

SLOPE_WIRE_BYTES = (4 << 20, 16 << 20)  # `measure_network`'s `large_bytes`


def wire_mbit_per_s(nbytes: int, p: int, seconds: float) -> float:
    """Mbit/s on each link of a ring allreduce of `nbytes` among `p` ranks in `seconds`."""
    return 8 * 2 * (p - 1) / p * nbytes / seconds / 1e6


def bucket_sizes(total_bytes: int, bucket_bytes: int) -> list[int]:
    """`total_bytes` of float32 cut into buckets of at most `bucket_bytes`, as the optimizer
    fills them (whole elements; the last one holds the rest)."""
    if total_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"sizes must be positive: total {total_bytes}, bucket {bucket_bytes}")
    elements, per_bucket = total_bytes // 4, max(1, bucket_bytes // 4)
    return [4 * min(per_bucket, elements - start) for start in range(0, elements, per_bucket)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gradient-mb", type=float, default=1.15,
                    help="the gradient's size (default: the 784-input MLP's, 1.15 MB)")
    ap.add_argument("--bucket-mb", type=float, default=0.5, help="the optimizer's buckets")
    ap.add_argument("--compute-ms", type=float, default=3.5,
                    help="the compute every rank spins before an allreduce in the "
                         "'after compute' column")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args(argv)

    import numpy as np
    from mpi4py import MPI

    import pipesgd
    from pipesgd.timing.host_costs import Spinner
    from pipesgd.timing.link_probes import (
        allreduce_bytes_for_wire,
        per_wire_byte,
        slowest_seconds,
    )

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p < 2:
        raise SystemExit("beta_probes.py needs at least 2 ranks (run it under mpirun)")
    engine = pipesgd.Engine(comm, board_bytes=0)  # the ring, as `measure` times it
    spinner = Spinner()

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            spinner.unit()

    def slowest_median(run: Callable[[], object], compute_s: float) -> float:
        return statistics.median(slowest_seconds(comm, run, args.repeats, warmups=1,
                                                 before=lambda: spin(compute_s)))

    def by_caller(buf: np.ndarray) -> Callable[[], object]:
        return lambda: engine.allreduce(buf)

    def by_thread(*bufs: np.ndarray) -> Callable[[], object]:
        return lambda: [h.wait() for h in [engine.allreduce_async(b) for b in bufs]]

    columns = (("back to back", 0.0), ("after compute", args.compute_ms / 1e3))
    gradient = int(args.gradient_mb * 1e6) // 4 * 4
    buckets = bucket_sizes(gradient, int(args.bucket_mb * 1e6))
    slope_sizes = tuple(allreduce_bytes_for_wire(m, p) for m in SLOPE_WIRE_BYTES)
    rows = []
    for way, runner in (("caller (measure's way)", by_caller), ("comm thread", by_thread)):
        row = {"allreduce": f"{way}, slope 4-16 MiB of wire bytes"}
        for column, compute_s in columns:
            seconds = {n: slowest_median(runner(np.ones(n // 4, np.float32)), compute_s)
                       for n in slope_sizes}
            row[column] = 8 / per_wire_byte(seconds, slope_sizes, p, 0.0) / 1e6
        rows.append(row)
    for label, sizes in ((f"comm thread, {len(buckets)} buckets of {args.bucket_mb:g} MB",
                          buckets),
                         (f"comm thread, the {args.gradient_mb:g} MB gradient whole",
                          [gradient])):
        run = by_thread(*(np.ones(n // 4, np.float32) for n in sizes))
        rows.append({"allreduce": label, **{
            column: wire_mbit_per_s(gradient, p, slowest_median(run, compute_s))
            for column, compute_s in columns}})
    engine.shutdown()
    if comm.Get_rank() == 0:
        print_table(rows, title=f"{p} ranks: Mbit/s of wire bytes per link "
                                f"(after compute: {args.compute_ms:g} ms on every rank first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
