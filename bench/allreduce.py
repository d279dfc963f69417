"""AllReduce benchmark: pipesgd's engine vs MPI Allreduce (mpi4py) vs torch.distributed gloo.

Run under mpirun (prints a table, writes bench/results/allreduce_p{P}[_netem].json and .png):

    mpirun -n 4 python bench/allreduce.py
    mpirun -n 2 python bench/allreduce.py --sizes 64KiB,8MiB --impl pipesgd,mpi

Or over emulated per-rank links (root; see bench/netem.py), with compression:

    python bench/allreduce.py --netem 1gbit --np 4 --sizes 1MiB,8MiB,64MiB
    python bench/allreduce.py --netem 1gbit --np 4 --nodes 2 --sizes 64MiB   # 2 nodes x 2

Or as N separate launches (a new `mpirun` each; bench/launches.py says why), which
reports every launch's median against MPI's in the same launch:

    python bench/allreduce.py --launches 20 --np 2      # 1, 16 and 64 MiB, pipesgd and MPI
    python bench/allreduce.py --launches 10 --np 4 --ring --sizes 64KiB,256KiB,1MiB

A launch series times the engine on the caller's arrays and on its own (`Engine.zeros`,
reduced in place where the ranks share memory, as the optimizer's buckets are).
`--ring` times, beside them, an engine without the shared-memory board (small operations
around the ring too). A launch series judges, per size, every launch at 0.9x MPI's speed
or more and 8 MiB at 1.2x or more, for both kinds of buffer, besides the spread between
launches.

Time per size is the median over repetitions of the slowest rank's time, each
repetition starting from a barrier. algbw = bytes / time; busbw = algbw * 2(p-1)/p
(the bytes each rank's link carries, as in nccl-tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    format_size,
    init_gloo,
    link_rate_bps,
    parse_size,
    print_table,
    ranks_per_node,
    write_json,
)
from launches import run_launches

DEFAULT_SIZES = "64KiB,256KiB,1MiB,4MiB,8MiB,16MiB,64MiB"
LAUNCH_SIZES = "1MiB,16MiB,64MiB"
# Launch-series targets: every launch within this factor of the fastest launch, and
# from LAUNCH_FLOOR_BYTES up the slowest launch at least as fast as MPI in that launch.
LAUNCH_SPREAD = 1.3
LAUNCH_FLOOR_BYTES = 16 * 2**20
# And in every launch: at least 0.9x MPI's speed at every size, at least 1.2x at 8 MiB.
LAUNCH_LEVEL = 0.9
LAUNCH_AHEAD, LAUNCH_AHEAD_BYTES = 1.2, 8 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", help=f"comma-separated buffer sizes (default {DEFAULT_SIZES}; "
                    f"with --launches {LAUNCH_SIZES})")
    ap.add_argument("--repeat", type=int, default=10, help="timed repetitions per size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--settle-ms", type=float, default=2.0,
                    help="pause before each timed operation, so none pays for the last one's "
                    "leftover threads")
    ap.add_argument("--impl", default="pipesgd,shared,mpi,gloo",
                    help="pipesgd,shared,mpi,gloo (shared: pipesgd on its own buffers, "
                    "Engine.zeros)")
    ap.add_argument(
        "--compression",
        default=None,
        help="pipesgd compression modes (default: none; with --netem: all three)",
    )
    ap.add_argument("--windows", metavar="W,W",
                    help="also time one engine per ring window (e.g. 8,2), uncompressed, "
                         "interleaved with the rest")
    ap.add_argument("--ring", action="store_true",
                    help="also time an engine without the shared-memory board (every "
                         "operation around the ring), interleaved with the rest")
    ap.add_argument("--netem", metavar="RATE", help="run over emulated per-rank links (root)")
    ap.add_argument("--np", type=int, default=2, help="ranks, with --netem or --launches")
    ap.add_argument("--launches", type=int, default=0, metavar="N",
                    help="run N separate mpirun jobs and judge the spread between them")
    ap.add_argument("--record", metavar="PATH", help=argparse.SUPPRESS)  # one launch's records
    ap.add_argument("--latency", default="0ms", help="added one-way latency, with --netem")
    ap.add_argument("--nodes", type=int,
                    help="with --netem: spread the ranks over this many nodes (netem.py --nodes)")
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    return ap.parse_args(argv)


def relaunch_over_netem(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this script as the rank program of bench/netem.py."""
    rank_argv = strip_options(argv, ("--netem", "--np", "--latency", "--nodes"))
    if args.compression is None:
        rank_argv += ["--compression", "none,trunc16,quant8"]
    if not args.tag:
        nodes = f"_nodes{args.nodes}" if args.nodes else ""
        rank_argv += ["--tag", f"netem_{args.netem}{nodes}"]
    netem = Path(__file__).resolve().parent / "netem.py"
    env = dict(os.environ)
    if args.nodes:
        # The emulator keeps Open MPI off shared memory; the engine's links on the
        # edges within a node must be asked for.
        env.setdefault("PIPESGD_SHM_LINKS", "1")
    cmd = [
        sys.executable,
        str(netem),
        "--np",
        str(args.np),
        "--rate",
        args.netem,
        "--latency",
        args.latency,
        *(["--nodes", str(args.nodes)] if args.nodes else []),
        "--",
        sys.executable,
        str(Path(__file__).resolve()),
        *rank_argv,
    ]
    return subprocess.call(cmd, env=env)


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the options `names` and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(f"{n}=" for n in names)):
            out.append(a)
    return out


def run_launch_series(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this benchmark in `args.launches` separate mpirun jobs of `args.np` ranks,
    prints each size's spread over launches and its ratio to MPI, writes
    allreduce_launches_p{P}.json and .png; returns 1 if a target is missed."""
    child = strip_options(argv, ("--launches", "--np", "--sizes", "--impl", "--tag"))
    child += ["--sizes", args.sizes or LAUNCH_SIZES, "--impl", "pipesgd,shared,mpi"]
    per_launch = run_launches(Path(__file__).resolve(), args.np, args.launches, child)
    rows, summary, verdicts = summarize_launches(per_launch)
    p = args.np
    print_table(rows, f"AllReduce over {args.launches} launches, p = {p}, float32, "
                f"per-launch medians of {args.repeat} repetitions")
    for line in verdicts:
        print(line)
    tag = f"_{args.tag}" if args.tag else ""
    path = write_json(f"allreduce_launches_p{p}{tag}.json", {
        "p": p, "launches": per_launch, "summary": summary, "targets": verdicts,
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
    })
    plot_launches(summary, p, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 1 if any(v.endswith("FAIL") for v in verdicts) else 0


def summarize_launches(per_launch: list[list[dict]]) -> tuple[list[dict], list[dict], list[str]]:
    """Table rows, a JSON summary and target verdicts from each launch's records."""
    rows, summary, verdicts = [], [], []
    for nbytes in sorted({r["bytes"] for launch in per_launch for r in launch}):
        mine, mpi, paths, ring, shared, retried = [], [], [], [], [], 0
        for launch in per_launch:
            by = {r["impl"]: r for r in launch if r["bytes"] == nbytes}
            mine.append(by["pipesgd"]["time_s"])
            mpi.append(by["mpi"]["time_s"])
            paths.append(by["pipesgd"].get("path", "?"))
            retried += by["pipesgd"].get("retrials", 0) > 0
            if "pipesgd-ring" in by:
                ring.append(by["pipesgd-ring"]["time_s"])
            if "pipesgd-shared" in by:
                shared.append(by["pipesgd-shared"]["time_s"])
        fastest, slowest = min(mine), max(mine)
        # MPI's own spread, and that of pipesgd's time over MPI's in the same launch: the
        # machine's state moves both implementations (docs/engine.md, "Counting launches")
        mpi_spread = max(mpi) / min(mpi)
        relative = [t / m for t, m in zip(mine, mpi, strict=True)]
        relative_spread = max(relative) / min(relative)
        worst_launch = mine.index(slowest)
        slowest_vs_mpi = mpi[worst_launch] / slowest  # > 1: pipesgd faster than MPI
        spread = slowest / fastest
        speed = [m / t for m, t in zip(mpi, mine, strict=True)]  # > 1: pipesgd faster
        summary.append({"bytes": nbytes, "pipesgd_s": mine, "mpi_s": mpi, "paths": paths,
                        "launches_retried": retried, "spread": spread,
                        "slowest_vs_mpi": slowest_vs_mpi,
                        "mpi_spread": mpi_spread, "relative_spread": relative_spread,
                        "speed_vs_mpi": speed, **({"ring_s": ring} if ring else {}),
                        **({"shared_s": shared} if shared else {})})
        row = {
            "size": format_size(nbytes),
            "pipesgd fastest ms": fastest * 1e3,
            "median ms": statistics.median(mine) * 1e3,
            "slowest ms": slowest * 1e3,
            "slowest/fastest": spread,
            "MPI median ms": statistics.median(mpi) * 1e3,
            "MPI slowest/fastest": mpi_spread,
            "spread of pipesgd/MPI": relative_spread,
            "MPI/pipesgd, slowest launch": slowest_vs_mpi,
            "MPI/pipesgd, worst": min(speed),
            "MPI/pipesgd, median": statistics.median(speed),
            "pipesgd path (launches)": ", ".join(f"{k} {paths.count(k)}"
                                                 for k in sorted(set(paths)))
            + (f" (re-tried in {retried})" if retried else ""),
        }
        if ring:
            ring_speed = [m / t for m, t in zip(mpi, ring, strict=True)]
            row["MPI/ring alone, worst"] = min(ring_speed)
            row["MPI/ring alone, median"] = statistics.median(ring_speed)
        judged = [("pipesgd", speed)]
        if shared:
            shared_speed = [m / t for m, t in zip(mpi, shared, strict=True)]
            row["MPI/own buffers, worst"] = min(shared_speed)
            row["MPI/own buffers, median"] = statistics.median(shared_speed)
            judged.append(("pipesgd on its own buffers", shared_speed))
        rows.append(row)
        for who, ratios in judged:
            verdicts += level_verdicts(nbytes, who, ratios)
        verdicts.append(f"{format_size(nbytes)}: slowest / fastest launch = {spread:.2f} "
                        f"(target <= {LAUNCH_SPREAD}) "
                        f"{'PASS' if spread <= LAUNCH_SPREAD else 'FAIL'}")
        if nbytes >= LAUNCH_FLOOR_BYTES:
            verdicts.append(f"{format_size(nbytes)}: slowest launch's speed / MPI's in that "
                            f"launch = {slowest_vs_mpi:.2f} (target >= 1.0) "
                            f"{'PASS' if slowest_vs_mpi >= 1.0 else 'FAIL'}")
    return rows, summary, verdicts


def level_verdicts(nbytes: int, who: str, speed: list[float]) -> list[str]:
    """Whether `who` ran at LAUNCH_LEVEL x MPI's speed or more in every launch (`speed`:
    MPI's time over its own, per launch), and at LAUNCH_AHEAD x at LAUNCH_AHEAD_BYTES."""
    out = []
    for target, applies in ((LAUNCH_LEVEL, True), (LAUNCH_AHEAD, nbytes == LAUNCH_AHEAD_BYTES)):
        if applies:
            below = sum(s < target for s in speed)
            out.append(f"{format_size(nbytes)}: {who} at least {target}x MPI's speed in "
                       f"{len(speed) - below} of {len(speed)} launches "
                       f"{'PASS' if below == 0 else 'FAIL'}")
    return out


def plot_launches(summary: list[dict], p: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(3.2 * len(summary), 3.6), squeeze=False)
    for ax, s in zip(axes[0], summary, strict=True):
        launches = range(1, len(s["pipesgd_s"]) + 1)
        ax.plot(launches, [t * 1e3 for t in s["pipesgd_s"]], "o", label="pipesgd")
        if "shared_s" in s:
            ax.plot(launches, [t * 1e3 for t in s["shared_s"]], "s",
                    label="pipesgd, own buffers")
        ax.plot(launches, [t * 1e3 for t in s["mpi_s"]], "x", label="MPI Allreduce")
        ax.set_title(format_size(s["bytes"]))
        ax.set_xlabel("launch")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("per-launch median (ms)")
    axes[0][0].legend()
    fig.suptitle(f"AllReduce, p = {p}: one point per mpirun launch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_variants(comm, variants: list[tuple[str, Callable[[], None]]], reset: Callable[[], None],
                  repeat: int, warmup: int, settle_s: float) -> dict[str, tuple[float, float]]:
    """(median slowest-rank time, median CPU time) over repetitions, for every variant.

    CPU time is the process's (all threads, user + system) during the operation,
    averaged over ranks: what the operation takes from a compute thread sharing the cores.

    Repetitions are interleaved, each starting one variant later (A B C, B C A, C A B,
    ...), so a change in machine load during the run hits every variant alike and none
    always runs first: in a fixed order the first variant of each round ran 20-30 %
    slower than the same operation second (64-256 KiB, p = 2).
    `reset` restores the input before each operation (sums would otherwise overflow).

    Each operation starts after a pause of `settle_s`, so it does not pay for the
    previous variant's leftovers: gloo's two worker threads finish after all_reduce
    has returned, and without the pause they ran during the next operation, which
    spent 3-5x longer waiting for a core (8 MiB, p = 2, 2 cores: pipesgd's comm
    thread 25-33 ms runnable-but-waiting over 60 operations, against 6-12 ms).
    """
    from mpi4py import MPI

    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    cpus: dict[str, list[float]] = {label: [] for label, _ in variants}
    for i in range(warmup + repeat):
        turn = i % len(variants)
        for label, op in variants[turn:] + variants[:turn]:
            reset()
            time.sleep(settle_s)
            comm.Barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            op()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            elapsed = comm.allreduce(elapsed, op=MPI.MAX)
            cpu = comm.allreduce(cpu, op=MPI.SUM) / comm.size
            if i >= warmup:
                times[label].append(elapsed)
                cpus[label].append(cpu)
    return {
        label: (statistics.median(times[label]), statistics.median(cpus[label]))
        for label in times
    }


def engine_path(engine, nbytes: int) -> str:
    """How `engine` sent uncompressed operations of `nbytes`: "board", "links",
    "messages" or "staged"."""
    if nbytes <= engine.board_bytes:
        return "board"
    if not engine.shm_links:
        return "messages"
    return engine.operation_paths.get(size_class(nbytes), "links")


def size_class(nbytes: int) -> int:
    """The tuner's size class of an operation of `nbytes`: operations are tuned per
    power of two, each class named by its smallest size."""
    return 1 << (nbytes.bit_length() - 1)


def run(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import pipesgd

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    impls = args.impl.split(",")
    compressions = (args.compression or "none").split(",")
    engine = pipesgd.init()
    windows = [int(w) for w in args.windows.split(",")] if args.windows else []
    window_engines = {w: pipesgd.Engine(comm, window=w) for w in windows}
    ring_engine = pipesgd.Engine(comm, board_bytes=0) if args.ring else None
    dist = init_gloo(comm) if "gloo" in impls else None
    rate = link_rate_bps()
    rows, records = [], []
    for nbytes in (parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",")):
        n = nbytes // 4
        original = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        buf = original.copy()
        # The engine's own buffer (Engine.zeros): reduced in place where ranks share memory.
        shared = engine.zeros(n, np.float32) if "shared" in impls else None
        variants: list[tuple[str, Callable[[], None]]] = []
        for c in compressions if "pipesgd" in impls else []:
            label = "pipesgd" if c == "none" else f"pipesgd+{c}"
            variants.append(
                (label, lambda c=c, b=buf: engine.allreduce(b, op="sum", compression=c))
            )
        for w, e in window_engines.items():
            variants.append((f"pipesgd-w{w}", lambda e=e, b=buf: e.allreduce(b, op="sum")))
        if shared is not None:
            variants.append(("pipesgd-shared", lambda b=shared: engine.allreduce(b, op="sum")))
        if ring_engine is not None:
            variants.append(("pipesgd-ring", lambda b=buf: ring_engine.allreduce(b, op="sum")))
        if "mpi" in impls:
            variants.append(("mpi", lambda b=buf: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)))
        if dist is not None:
            import torch

            tensor = torch.from_numpy(buf)
            variants.append(("gloo", lambda t=tensor: dist.all_reduce(t)))
        retrials_before = engine.path_retrials
        def reset(b=buf, s=shared, o=original) -> None:
            np.copyto(b, o)
            if s is not None:
                np.copyto(s, o)

        medians = time_variants(comm, variants, reset, args.repeat, args.warmup,
                                args.settle_ms / 1e3)
        for label, (t, cpu) in medians.items():
            algbw = nbytes / t / 1e9
            busbw = algbw * 2 * (p - 1) / p if p > 1 else algbw
            record = {
                "impl": label,
                "bytes": nbytes,
                "p": p,
                "time_s": t,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "cpu_s": cpu,
            }
            row = {
                "size": format_size(nbytes),
                "impl": label,
                "time ms": t * 1e3,
                "algbw GB/s": algbw,
                "busbw GB/s": busbw,
                "cpu ms": cpu * 1e3,
            }
            if rate:
                bound = 2 * (p - 1) / p * nbytes * 8 / rate
                record["link_bound_s"] = bound
                row["bound/time"] = bound / t
            if label == "pipesgd":
                record["path"] = row["path"] = engine_path(engine, nbytes)
                # Times the path watch sent this size back to its trials (path_tuner.h;
                # a window ending on a size's last operation is judged at the next's).
                record["retrials"] = engine.path_retrials - retrials_before
                # What the kept path was decided on: each path's last timed trials.
                record["trials"] = engine.operation_trials.get(size_class(nbytes), {})
            records.append(record)
            rows.append(row)
    if rank == 0 and args.record:
        Path(args.record).write_text(json.dumps(records))
    elif rank == 0:
        where = f"emulated {rate / 1e9:g} Gbit/s links" if rate else "this machine"
        print_table(rows, f"AllReduce, p = {p}, float32, {where}")
        verdicts = check_targets(records, p, rate, ranks_per_node())
        for line in verdicts:
            print(line)
        tag = f"_{args.tag}" if args.tag else ""
        path = write_json(
            f"allreduce_p{p}{tag}.json",
            {
                "p": p,
                "link_rate_bps": rate,
                "records": records,
                "targets": verdicts,
                "command": " ".join(sys.argv),
            },
        )
        plot(records, p, path.with_suffix(".png"), where)
        print(f"wrote {path} and {path.with_suffix('.png')}")
    for e in [*window_engines.values(), *([ring_engine] if ring_engine else [])]:
        e.shutdown()
    engine.shutdown()
    if dist is not None:
        dist.destroy_process_group()


def check_targets(records: list[dict], p: int, rate: float | None,
                  rpn: int = 1) -> list[str]:
    """The benchmark's targets, checked on this run's figures."""
    by = {(r["impl"], r["bytes"]): r for r in records}
    sizes = sorted({r["bytes"] for r in records})
    out = []
    for nbytes in sizes:
        mine = by.get(("pipesgd", nbytes))
        if mine is None:
            continue
        if rate is None and nbytes >= 8 * 2**20:
            others = [by[(i, nbytes)]["busbw_GBps"] for i in ("mpi", "gloo") if (i, nbytes) in by]
            if others:
                ratio = mine["busbw_GBps"] / max(others)
                verdict = "PASS" if ratio >= 0.9 else "FAIL"
                out.append(
                    f"{format_size(nbytes)}: pipesgd busbw / best other = {ratio:.2f} "
                    f"(target >= 0.9) {verdict}"
                )
        if rate is not None and nbytes == max(sizes):
            ratio = mine["link_bound_s"] / mine["time_s"]
            out.append(
                f"{format_size(nbytes)}: link bound / pipesgd time = {ratio:.2f} "
                f"(target >= 0.9) {'PASS' if ratio >= 0.9 else 'FAIL'}"
            )
            if rpn > 1 and p > rpn:
                # the flat ring sends 2(p-1)/p n over each node's link, a two-level one
                # (reduce in nodes, ring between, broadcast in) 2(N-1)/N n
                nodes = p // rpn
                gain = (2 * (p - 1) / p) / (2 * (nodes - 1) / nodes)
                out.append(f"{format_size(nbytes)}: {nodes} nodes x {rpn} ranks: a two-level "
                           f"allreduce would move {1 / gain:.2f}x the bytes over each node's "
                           f"link, so at best {gain:.2f}x faster (bytes on the "
                           "link only)")
            for c, limit in (("trunc16", 0.55), ("quant8", 0.30)):
                other = by.get((f"pipesgd+{c}", nbytes))
                if other:
                    rel = other["time_s"] / mine["time_s"]
                    out.append(
                        f"{format_size(nbytes)}: {c} time / uncompressed = {rel:.2f} "
                        f"(target <= {limit}) {'PASS' if rel <= limit else 'FAIL'}"
                    )
    return out


def plot(records: list[dict], p: int, path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in dict.fromkeys(r["impl"] for r in records):
        pts = sorted((r["bytes"], r["busbw_GBps"]) for r in records if r["impl"] == impl)
        ax.plot([x / 2**20 for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size (MiB)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"AllReduce busbw, p = {p}, {where}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.netem:
        return relaunch_over_netem(args, argv)
    if args.launches:
        return run_launch_series(args, argv)
    from mpi4py import MPI

    if MPI.COMM_WORLD.size < 2:
        print("allreduce.py: one rank has nothing to reduce with; run it under "
              "`mpirun -n 2` or more, or with --launches N --np P or --netem RATE --np P",
              file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
