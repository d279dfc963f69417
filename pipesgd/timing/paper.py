"""The Pipe-SGD paper's experiment (§4) through the timing model, beside what it reports.

The paper trains four benchmarks on four nodes, one Titan XP GPU each, linked by 10 Gb
Ethernet (global batch 100 for MNIST-MLP, 256 for the others), and reports the best
Pipe-SGD 2.0-3.2x faster than D-Sync and 4.0-5.4x faster than PS-Sync; on
CIFAR100-Convex, D-Sync about 40 % faster than PS-Sync and Pipe-SGD another 37 %.
`reproduce_paper` predicts the iteration time of every framework for each benchmark on
a described 10GbE cluster (`pipesgd.timing.cluster`), from a profile of the network
(`profile_benchmark`: one core of this machine, to be scaled to a GPU; or given), and
sets the predicted speed-ups beside the reported ones. Nothing is fitted to the paper:
where a prediction falls outside its range, the table says so.

PS-Sync, the paper's centralised baseline (one more node as the parameter server), has
no equation in the paper. Here (`ps_sync`): every worker sends its n gradient bytes to
the server and gets n bytes of parameters back; the server's one link carries p n bytes
in and p n out, full duplex, in segments of s bytes (the ring's, 1 MiB): it sums a
segment of all p workers and applies the update (p - 1 sums and the update, p n γ in
all) while the next segment arrives, and sends the segment's parameters back while
receiving the next. So

    l_PS = l_for + l_back + 2 n c + 2α + max(p n β, p n γ) + p s' (β + γ),  s' = min(n, s)

where 2 n c packs the gradient and unpacks the parameters on the worker (c: copy cost
per byte), 2α is one request and one reply, max(...) is the inbound stream with the
server's kernels behind it (the outbound stream runs beside it), and the last term is
the last segment, reduced and sent back after everything else has arrived. The update
runs on the server, so the worker has no l_up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipesgd.timing.model import DEFAULT_SEGMENT_BYTES, MODES, Config, predict
from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile

PAPER_WORKERS = 4
PAPER_CLUSTER = "10GbE"  # pipesgd.timing.cluster.CLUSTERS
# §4, "Timing Breakdown" and "Convergence"
PAPER_SPEEDUP_OVER_DSYNC = (2.0, 3.2)
PAPER_SPEEDUP_OVER_PS = (4.0, 5.4)
# CIFAR100-Convex, "x % faster" read as a ratio of iteration times of 1 + x
PAPER_CONVEX_RATIOS = {
    "D-Sync over PS-Sync": 1.40,
    "Pipe-SGD over D-Sync": 1.37,
    "Pipe-SGD+T over D-Sync+T": 1.46,
}
FRAMEWORKS = ("PS-Sync", *(Config(k, c, "sequential").label for k in (1, 2) for c in MODES))
PIPE_SGD = tuple(label for label in FRAMEWORKS if label.startswith("Pipe-SGD"))


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of the paper.

    Attributes:
        title: the paper's name for it.
        model: the network (`pipesgd.paper_models`).
        global_batch: samples per iteration over all workers.
        last_layer_only: train only the last layer, the rest fixed (CIFAR100-Convex: a
            convex problem); its gradient is that layer's, its backward stops there.
        profile_batch: the batch per worker profiled by default (None: the paper's);
            forward and backward are scaled linearly from it.
    """

    title: str
    model: str
    global_batch: int
    last_layer_only: bool = False
    profile_batch: int | None = None

    def batch_per_worker(self, p: int = PAPER_WORKERS) -> int:
        return self.global_batch // p


BENCHMARKS: dict[str, Benchmark] = {
    "mnist-mlp": Benchmark("MNIST-MLP", "paper-mnist-mlp", 100),
    # the paper gives no batch for CIFAR100; 256, as for ImageNet
    "cifar100-convex": Benchmark("CIFAR100-Convex", "paper-cifar100-cnn", 256,
                                 last_layer_only=True),
    # one core takes seconds per iteration of these at the paper's batch
    "alexnet": Benchmark("AlexNet", "alexnet", 256, profile_batch=8),
    "resnet18": Benchmark("ResNet-18", "resnet18", 256, profile_batch=8),
}


def benchmark(key: str) -> Benchmark:
    """The benchmark `key` of `BENCHMARKS`.

    Raises:
        ValueError: no such benchmark; the message lists the known ones.
    """
    try:
        return BENCHMARKS[key]
    except KeyError:
        raise ValueError(f"unknown benchmark {key!r}; known: {', '.join(BENCHMARKS)}") from None


def at_batch(prof: Profile, batch: int) -> Profile:
    """`prof` at `batch` samples per worker: forward and backward scaled linearly from
    prof.batch_size (the update and the gradient bytes do not depend on the batch). A
    profile without a batch size is taken to be at `batch` already.

    Raises:
        ValueError: batch < 1.
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if not prof.batch_size or prof.batch_size == batch:
        return dataclasses.replace(prof, batch_size=batch)
    factor = batch / prof.batch_size
    return dataclasses.replace(
        prof, forward_s=prof.forward_s * factor, backward_s=prof.backward_s * factor,
        batch_size=batch,
        source=f"{prof.source}; forward and backward scaled x{factor:g} from batch "
               f"{prof.batch_size} to {batch}")


def profiled_batch(key: str, profile_batch: int | None = None, p: int = PAPER_WORKERS) -> int:
    """The batch per worker `profile_benchmark` runs: min(profile_batch, or the
    benchmark's default, or the paper's; the paper's batch per worker).

    Raises:
        ValueError: an unknown benchmark or a profile batch below 1.
    """
    bench = benchmark(key)
    target = bench.batch_per_worker(p)
    batch = profile_batch or bench.profile_batch or target
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"profile batch must be an integer >= 1, got {batch!r}")
    return min(batch, target)


def profile_benchmark(
    key: str,
    *,
    profile_batch: int | None = None,
    p: int = PAPER_WORKERS,
    threads: int = 1,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> Profile:
    """Profile benchmark `key` here, at the paper's batch per worker.

    The network is profiled with SGD on a random batch of `profiled_batch` samples on
    `threads` threads, then `at_batch` scales it to the paper's batch per worker.

    Raises:
        ValueError: an unknown benchmark or a profile batch below 1.
    """
    from pipesgd.timing.profile import profile_named

    bench = benchmark(key)
    batch = profiled_batch(key, profile_batch, p)
    prof = profile_named(bench.model, batch, threads=threads, warmup=warmup, repeats=repeats,
                         seed=seed, last_layer_only=bench.last_layer_only, name=bench.title)
    return at_batch(prof, bench.batch_per_worker(p))


def ps_sync(profile: Profile, net: NetworkParams, p: int = PAPER_WORKERS,
            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> dict[str, float]:
    """PS-Sync's iteration on p workers and one parameter server (module docstring):
    seconds of each term and their sum, `predicted_s`.

    Raises:
        ValueError: p < 1 or segment_bytes < 1.
    """
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"p (number of workers) must be an integer >= 1, got {p!r}")
    if not isinstance(segment_bytes, int) or segment_bytes < 1:
        raise ValueError(f"segment_bytes must be an integer >= 1, got {segment_bytes!r}")
    profile.check()
    net.check()
    n = profile.gradient_bytes
    last = min(n, segment_bytes)
    terms = {
        "compute_s": profile.forward_s + profile.backward_s,
        "pack_s": 2 * n * net.copy_s_per_byte,
        "latency_s": 2 * net.alpha_s,
        "stream_s": max(p * n * net.beta_s_per_byte, p * n * net.gamma_s_per_byte),
        "last_segment_s": p * last * (net.beta_s_per_byte + net.gamma_s_per_byte),
    }
    terms["predicted_s"] = math.fsum(terms.values())
    return terms


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def predict_benchmark(prof: Profile, net: NetworkParams,
                      p: int = PAPER_WORKERS) -> dict[str, Any]:
    """Per-iteration seconds of PS-Sync, D-Sync and Pipe-SGD (each also +T and +Q,
    sequential communication, as the paper runs them) and the best Pipe-SGD's speed-up
    over D-Sync and over PS-Sync."""
    times = {"PS-Sync": ps_sync(prof, net, p)["predicted_s"]}
    for k in (1, 2):
        for mode in MODES:
            config = Config(k, mode, "sequential")
            times[config.label] = predict(prof, net, p, k, mode, "sequential").predicted_s
    best = min(PIPE_SGD, key=lambda label: times[label])
    return {
        "times_s": times,
        "best_pipe_sgd": best,
        "speedup_over_dsync": _ratio(times["D-Sync"], times[best]),
        "speedup_over_ps_sync": _ratio(times["PS-Sync"], times[best]),
        "ratios": {
            "D-Sync over PS-Sync": _ratio(times["PS-Sync"], times["D-Sync"]),
            "Pipe-SGD over D-Sync": _ratio(times["D-Sync"], times["Pipe-SGD"]),
            "Pipe-SGD+T over D-Sync+T": _ratio(times["D-Sync+T"], times["Pipe-SGD+T"]),
        },
    }


def _inside(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def reproduce_paper(profiles: dict[str, Profile], net: NetworkParams,
                    p: int = PAPER_WORKERS) -> dict[str, Any]:
    """Predict every benchmark of `profiles` (benchmark key -> profile at the paper's
    batch, already scaled to the device) on `net`, beside the paper's figures.

    Returns:
        {"p", "cluster", "rows": [...], "paper": {...}, "summary": {...}}; each row has
        the benchmark, its profile figures, `times_s` per framework, the best Pipe-SGD,
        its speed-ups and whether each lies in the paper's range.

    Raises:
        ValueError: an unknown benchmark key, or an empty `profiles`.
    """
    if not profiles:
        raise ValueError("no benchmarks to predict; known: " + ", ".join(BENCHMARKS))
    rows = []
    for key, prof in profiles.items():
        bench = benchmark(key)
        row: dict[str, Any] = {
            "benchmark": bench.title,
            "key": key,
            "model": bench.model,
            "batch_per_worker": prof.batch_size,
            "gradient_bytes": prof.gradient_bytes,
            "compute_s": prof.compute_s,
            "update_s": prof.update_s,
            "profile_source": prof.source,
            **predict_benchmark(prof, net, p),
        }
        row["in_paper_range"] = {
            "over_dsync": _inside(row["speedup_over_dsync"], PAPER_SPEEDUP_OVER_DSYNC),
            "over_ps_sync": _inside(row["speedup_over_ps_sync"], PAPER_SPEEDUP_OVER_PS),
        }
        if not bench.last_layer_only:
            del row["ratios"]
        rows.append(row)
    over_d = [r["speedup_over_dsync"] for r in rows]
    over_ps = [r["speedup_over_ps_sync"] for r in rows]
    return {
        "p": p,
        "cluster": net.source,
        "rows": rows,
        "paper": {
            "speedup_over_dsync": list(PAPER_SPEEDUP_OVER_DSYNC),
            "speedup_over_ps_sync": list(PAPER_SPEEDUP_OVER_PS),
            "cifar100_convex_ratios": dict(PAPER_CONVEX_RATIOS),
        },
        "summary": {
            "speedup_over_dsync": [min(over_d), max(over_d)],
            "speedup_over_ps_sync": [min(over_ps), max(over_ps)],
            "all_in_paper_range": all(all(r["in_paper_range"].values()) for r in rows),
        },
    }


def _range(values: Iterable[float], digits: int = 1) -> str:
    lo, hi = (f"{v:.{digits}f}" for v in values)
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def format_result(result: dict[str, Any], markdown: bool = False) -> str:
    """The table of `reproduce_paper` (ms per iteration), then the paper's figures beside
    the predicted ones; a speed-up outside the paper's range is marked with *."""
    header = ["benchmark", "batch/worker", "n MB", "compute ms", *FRAMEWORKS, "best",
              "x D-Sync", "x PS-Sync"]
    body = []
    for r in result["rows"]:
        inside = r["in_paper_range"]
        body.append([
            r["benchmark"], str(r["batch_per_worker"]), f"{r['gradient_bytes'] / 1e6:.2f}",
            f"{r['compute_s'] * 1e3:.2f}",
            *(f"{r['times_s'][label] * 1e3:.2f}" for label in FRAMEWORKS),
            r["best_pipe_sgd"],
            f"{r['speedup_over_dsync']:.2f}" + ("" if inside["over_dsync"] else "*"),
            f"{r['speedup_over_ps_sync']:.2f}" + ("" if inside["over_ps_sync"] else "*"),
        ])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
    else:
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                           for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                 for row in [header, *body]]
    paper, summary = result["paper"], result["summary"]
    lines += [
        "",
        "times in ms per iteration; x D-Sync, x PS-Sync: their time over the best Pipe-SGD's",
        f"paper (§4):  best Pipe-SGD {_range(paper['speedup_over_dsync'])} faster than "
        f"D-Sync, {_range(paper['speedup_over_ps_sync'])} faster than PS-Sync",
        f"predicted:   best Pipe-SGD {_range(summary['speedup_over_dsync'], 2)} faster than "
        f"D-Sync, {_range(summary['speedup_over_ps_sync'], 2)} faster than PS-Sync"
        + ("" if summary["all_in_paper_range"] else "  (* outside the paper's range)"),
    ]
    for r in result["rows"]:
        if "ratios" in r:
            pairs = ", ".join(f"{name} {paper['cifar100_convex_ratios'][name]:.2f}x "
                              f"(predicted {value:.2f}x)" for name, value in r["ratios"].items())
            lines.append(f"{r['benchmark']}: paper {pairs}")
    return "\n".join(lines)
