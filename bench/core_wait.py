"""How an allreduce slows beside compute on shared cores, against the timing model's rule.

Where ranks share cores, a ring step that runs while compute threads hold them waits for
its comm thread to be scheduled. The timing model takes D, the delay a whole ring
suffers beside compute, and charges Pipe-SGD's communication W' = W + D min(1, C /
(W + D)) when C seconds of compute overlap it (`pipesgd.timing.model.loaded_comm_seconds`:
the ring runs at the loaded pace W / (W + D) while compute runs, unloaded after). This
benchmark checks that rule apart from the rest of the model, on synthetic iterations:

- W: engine allreduces back to back, the caller blocked in `wait()` (as the timing
  model measures the network, and as Pipe-SGD waits once its compute is done);
- D: the same with every rank spinning a fixed compute unit instead of waiting, less W
  (as the model's load-latency probe times it);
- C: N compute units on every rank at once, no communication;
- Pipe-SGD (K = 2): N units, submit an allreduce, wait for the previous one; measured
  per iteration against max(C, W') (the rule) and against the form it replaced, which
  spread D over W' (W' = W + D min(1, C / W')).

It also times D-Sync's iteration (N units, then a blocking allreduce) against the same
iteration with the ranks sleeping as long as the units take, the core-wait question of
D-Sync's last ring step: the model charges one λ_load there where the ranks that left
the allreduce take every core.

    python bench/core_wait.py                                  # 1 and 2 Gbit/s, p = 4 (root)
    python bench/core_wait.py --links 500mbit:64KiB --np 3

Prints a table per link, writes bench/results/core_wait_p{NP}.json and .png; exit status 1
when the rule misses its target (median |error| <= 10 %, worst <= 25 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPRESSIONS = ("quant8", "trunc16", "none")
COMPUTE_MS = (0.5, 1.5, 2.5, 4.5, 7.5)
ITERATIONS = 30  # per configuration; the first 5 are not timed
TARGET_MEDIAN, TARGET_WORST = 0.10, 0.25


# ------------------------------------------------------------------------------------
# Worker (one rank of the mpirun job)


def worker(nbytes: int, out: str) -> None:
    import numpy as np
    from mpi4py import MPI

    import pipesgd
    from pipesgd.polling import idle_barrier
    from pipesgd.timing.host_costs import Spinner

    comm = MPI.COMM_WORLD
    engine = pipesgd.Engine(comm)
    spinner = Spinner()

    def spin(units: int) -> None:
        for _ in range(units):
            spinner.unit()

    def agreed(samples: list[float]) -> float:
        """The median over ranks of each rank's median."""
        return statistics.median(comm.allgather(statistics.median(samples)))

    def back_to_back(buf, compression: str, spinning: bool) -> float:
        """Seconds per allreduce, 8 in a row, the caller waiting or spinning meanwhile."""
        idle_barrier(comm)
        start = time.perf_counter()
        for _ in range(8):
            handle = engine.allreduce_async(buf, compression=compression)
            while spinning and not handle.done():
                spinner.unit()
            handle.wait()
        return (time.perf_counter() - start) / 8

    def iterations(buf, compression: str, work, overlapped: bool) -> float:
        """Median seconds per iteration: `work()` (compute, or a sleep), then the
        allreduce, waited for at once (D-Sync) or one iteration later (Pipe-SGD)."""
        idle_barrier(comm)
        times, previous = [], None
        for _ in range(ITERATIONS):
            start = time.perf_counter()
            work()
            if overlapped:
                handle = engine.allreduce_async(buf, compression=compression)
                if previous is not None:
                    previous.wait()
                previous = handle
            else:
                engine.allreduce(buf, compression=compression)
            times.append(time.perf_counter() - start)
        if previous is not None:
            previous.wait()
        return agreed(times[5:])

    idle_barrier(comm)
    start = time.perf_counter()
    spin(2000)
    units_per_s = agreed([2000 / (time.perf_counter() - start)])  # every rank spinning
    records = []
    for compression in COMPRESSIONS:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(3):
            engine.allreduce(buf, compression=compression)
        alone = agreed([back_to_back(buf, compression, False) for _ in range(5)])
        loaded = agreed([back_to_back(buf, compression, True) for _ in range(5)])
        for compute_ms in COMPUTE_MS:
            units = int(compute_ms * 1e-3 * units_per_s)
            idle_barrier(comm)
            start = time.perf_counter()
            for _ in range(10):
                spin(units)
            compute = agreed([(time.perf_counter() - start) / 10])
            computing, sleeping = partial(spin, units), partial(time.sleep, compute)
            records.append({
                "compression": compression, "W_s": alone, "D_s": max(0.0, loaded - alone),
                "C_s": compute,
                "pipe_sgd_s": iterations(buf, compression, computing, overlapped=True),
                "d_sync_s": iterations(buf, compression, computing, overlapped=False),
                "d_sync_sleeping_s": iterations(buf, compression, sleeping,
                                                overlapped=False),
            })
    engine.shutdown()
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps(records))


# ------------------------------------------------------------------------------------
# Parent


def spread_over_loaded(comm_s: float, compute_s: float, delay_s: float) -> float:
    """The form the rule replaced: W' = W + D min(1, C / W'), solved for W'."""
    if delay_s <= 0 or comm_s <= 0:
        return comm_s
    if comm_s + delay_s <= compute_s:
        return comm_s + delay_s
    return (comm_s + (comm_s * comm_s + 4 * delay_s * compute_s) ** 0.5) / 2


def evaluate(records: list[dict]) -> list[dict]:
    from pipesgd.timing.model import loaded_comm_seconds

    rows = []
    for r in records:
        W, D, C = r["W_s"], r["D_s"], r["C_s"]
        rule = max(C, loaded_comm_seconds(W, C, D))
        old = max(C, spread_over_loaded(W, C, D))
        rows.append({**r, "rule_s": rule, "old_s": old,
                     "rule_error": rule / r["pipe_sgd_s"] - 1,
                     "old_error": old / r["pipe_sgd_s"] - 1,
                     "d_sync_extra_s": r["d_sync_s"] - r["d_sync_sleeping_s"]})
    return rows


def table(link: str, rows: list[dict]) -> str:
    ms = 1e3
    lines = [f"== {link}",
             "compression    W ms    D ms    C ms | Pipe-SGD ms  rule   err    old    err |"
             " D-Sync ms  sleeping  extra"]
    for r in rows:
        lines.append(
            f"{r['compression']:10s} {r['W_s'] * ms:7.2f} {r['D_s'] * ms:7.2f} "
            f"{r['C_s'] * ms:7.2f} | {r['pipe_sgd_s'] * ms:11.2f} {r['rule_s'] * ms:6.2f} "
            f"{r['rule_error']:+6.1%} {r['old_s'] * ms:6.2f} {r['old_error']:+6.1%} |"
            f" {r['d_sync_s'] * ms:9.2f} {r['d_sync_sleeping_s'] * ms:9.2f} "
            f"{r['d_sync_extra_s'] * ms:+6.2f}")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for link, rows in results.items():
        meas = [r["pipe_sgd_s"] * 1e3 for r in rows]
        ax.scatter(meas, [r["rule_s"] * 1e3 for r in rows], label=f"{link}: rule", marker="o")
        ax.scatter(meas, [r["old_s"] * 1e3 for r in rows], label=f"{link}: spread over W'",
                   marker="x")
    top = max(max(r["old_s"], r["pipe_sgd_s"]) for rows in results.values() for r in rows) * 1e3
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.set_xlabel("measured Pipe-SGD iteration (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title("Allreduce beside compute on shared cores")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(int(argv[1]), argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="1gbit:128KiB,2gbit:128KiB",
                    help="RATE:BURST,... emulated links (bench/netem.py)")
    ap.add_argument("--np", type=int, default=4, help="ranks (all on this machine's cores)")
    ap.add_argument("--size", default="1152KiB", help="allreduce size (the MLP's gradient)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "bench"))
    from common import PYTHON_UNDER_MPI, RESULTS, mpi_env, parse_size, write_json
    from netem import mpirun_over_netem, unavailable_reason

    if (why := unavailable_reason()) is not None:
        print(f"core_wait: cannot emulate links here: {why}", file=sys.stderr)
        return 2
    results: dict[str, list[dict]] = {}
    for link in args.links.split(","):
        rate, _, burst = link.partition(":")
        with tempfile.TemporaryDirectory(prefix="pipesgd-core-wait-") as tmp:
            out = Path(tmp) / "records.json"
            cmd = [*PYTHON_UNDER_MPI, str(Path(__file__).resolve()), "--worker",
                   str(parse_size(args.size)), str(out)]
            run = mpirun_over_netem(cmd, np=args.np, rate=rate, burst=burst or None,
                                    env=mpi_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                                    cwd=ROOT, timeout=900)
            if run.returncode != 0 or not out.exists():
                print(f"core_wait: the job over {link} failed ({run.returncode})",
                      file=sys.stderr)
                return 1
            results[link] = evaluate(json.loads(out.read_text()))
        print(table(link, results[link]), flush=True)

    errors = [abs(r["rule_error"]) for rows in results.values() for r in rows]
    old = [abs(r["old_error"]) for rows in results.values() for r in rows]
    median, worst = statistics.median(errors), max(errors)
    ok = median <= TARGET_MEDIAN and worst <= TARGET_WORST
    print(f"\nrule: median |err| {median:.1%} (target {TARGET_MEDIAN:.0%}), worst {worst:.1%}"
          f" (target {TARGET_WORST:.0%}); the form it replaced: median "
          f"{statistics.median(old):.1%}, worst {max(old):.1%} -> {'PASS' if ok else 'FAIL'}")
    write_json(f"core_wait_p{args.np}.json", {"np": args.np, "size": args.size, "links": results,
                                  "median_error": median, "worst_error": worst, "pass": ok})
    plot(results, RESULTS / f"core_wait_p{args.np}.png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
