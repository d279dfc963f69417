"""Bandwidth of the compression kernels against numpy's memcpy and a = b + c.

Every kernel and fused ring op runs on one block of 64 MiB of float32 (one quant8
scale for the whole block), single-threaded, next to single-core baselines measured in
the same run: memcpy (``np.copyto``) and ``a = b + c`` (``np.add(b, c, out=a)``).
Operations are timed round-robin (one call of each per round) so that load from other
processes on a shared machine hits all of them alike; the median round counts.

Bandwidth convention: bytes of every input read plus every output written, each counted
once (quant8 scratch is not counted). For ``a = b + c`` that is 3 x 64 MiB, for a quant8
encode 64 MiB + (4 B + 16 MiB). A kernel passes when it reaches at least half the
bandwidth of ``a = b + c``.

    python bench/kernels.py            # table, bench/results/kernels.{json,png}
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipesgd import _C

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 0.5  # of the a = b + c bandwidth


@dataclass
class Measurement:
    name: str
    bytes_touched: int
    median_s: float
    gb_per_s: float
    ratio_to_add: float | None = None
    passed: bool | None = None


def build_ops(n: int, seed: int) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (call, bytes touched) for the baselines and every kernel, on n float32."""
    k = _C.compression
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    local = rng.standard_normal(n, dtype=np.float32)
    dst = np.empty_like(x)
    out = np.empty_like(x)
    scratch = np.empty_like(x)
    f32 = 4 * n
    t16 = k.trunc16_wire_bytes(n)
    q8 = k.quant8_wire_bytes(n)
    t16_in = np.empty(n, dtype=np.uint16)
    t16_out = np.empty(n, dtype=np.uint16)
    q8_in = np.empty(q8, dtype=np.uint8)
    q8_out = np.empty(q8, dtype=np.uint8)
    k.trunc16_encode(x, t16_in)
    k.quant8_encode(x, q8_in)
    return {
        "memcpy (np.copyto)": (lambda: np.copyto(dst, x), 2 * f32),
        "a = b + c (np.add)": (lambda: np.add(x, local, out=dst), 3 * f32),
        "trunc16 encode": (lambda: k.trunc16_encode(x, t16_out), f32 + t16),
        "trunc16 decode": (lambda: k.trunc16_decode(t16_in, out), t16 + f32),
        "trunc16 decode_add_encode": (
            lambda: k.trunc16_decode_add_encode(t16_in, local, t16_out),
            t16 + f32 + t16,
        ),
        "trunc16 decode_add": (lambda: k.trunc16_decode_add(t16_in, local, out), t16 + 2 * f32),
        # the owner's hop; it overwrites its float32 block (here `out`, values do not matter)
        "trunc16 decode_add_encode_decode": (
            lambda: k.trunc16_decode_add_encode_decode(t16_in, out, 0.5, t16_out),
            t16 + 2 * f32 + t16,
        ),
        "quant8 encode": (lambda: k.quant8_encode(x, q8_out), f32 + q8),
        "quant8 decode": (lambda: k.quant8_decode(q8_in, out), q8 + f32),
        "quant8 decode_add_encode": (
            lambda: k.quant8_decode_add_encode(q8_in, local, scratch, q8_out),
            q8 + f32 + q8,
        ),
        "quant8 decode_add": (lambda: k.quant8_decode_add(q8_in, local, out), q8 + 2 * f32),
        "quant8 decode_add_encode_decode": (
            lambda: k.quant8_decode_add_encode_decode(q8_in, out, 0.5, q8_out),
            q8 + 2 * f32 + q8,
        ),
    }


def measure(ops: dict[str, tuple[Callable[[], None], int]], repeat: int) -> list[Measurement]:
    times: dict[str, list[float]] = {name: [] for name in ops}
    for round_ in range(repeat + 2):  # two warm-up rounds fault the pages in
        for name, (call, _) in ops.items():
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if round_ >= 2:
                times[name].append(elapsed)
    result = []
    for name, (_, nbytes) in ops.items():
        median = statistics.median(times[name])
        result.append(Measurement(name, nbytes, median, nbytes / median / 1e9))
    add_bw = next(m.gb_per_s for m in result if m.name.startswith("a = b + c"))
    for m in result:
        if m.name.startswith(("trunc16", "quant8")):
            m.ratio_to_add = m.gb_per_s / add_bw
            m.passed = m.ratio_to_add >= TARGET_RATIO
    return result


def print_table(results: list[Measurement], mib: int, repeat: int) -> None:
    print(
        f"{mib} MiB float32, median of {repeat} rounds, 1 thread; "
        "GB/s = (bytes read + bytes written) / time, 1 GB = 1e9 B"
    )
    print(f"{'operation':<34} {'MB touched':>10} {'ms':>8} {'GB/s':>7} {'x add':>6}  target")
    for m in results:
        ratio = f"{m.ratio_to_add:6.2f}" if m.ratio_to_add is not None else " " * 6
        verdict = "" if m.passed is None else ("PASS" if m.passed else "FAIL")
        print(
            f"{m.name:<34} {m.bytes_touched / 1e6:>10.1f} {m.median_s * 1e3:>8.2f} "
            f"{m.gb_per_s:>7.2f} {ratio}  {verdict}"
        )


def plot(results: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    add_bw = next(m.gb_per_s for m in results if m.name.startswith("a = b + c"))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = [
        "tab:gray" if m.passed is None else "tab:green" if m.passed else "tab:red" for m in results
    ]
    ax.barh([m.name for m in results], [m.gb_per_s for m in results], color=colors)
    ax.axvline(
        TARGET_RATIO * add_bw,
        color="black",
        linestyle="--",
        label=f"target: {TARGET_RATIO} x (a = b + c)",
    )
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (bytes read + written per second), 1 thread")
    ax.set_title("pipesgd compression kernels, 64 MiB float32 block")
    ax.set_xlim(0, 1.5 * max(m.gb_per_s for m in results))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="float32 MiB per block")
    parser.add_argument("--repeat", type=int, default=21, help="timed rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 if a kernel misses the target"
    )
    args = parser.parse_args(argv)

    n = args.mib * (1 << 20) // 4
    results = measure(build_ops(n, args.seed), args.repeat)
    print_table(results, args.mib, args.repeat)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {
            "mib": args.mib,
            "elements": n,
            "repeat": args.repeat,
            "threads": 1,
            "bytes_convention": "bytes read + bytes written, each buffer counted once",
            "target_ratio_to_add": TARGET_RATIO,
            "machine": platform.processor() or platform.machine(),
            "numpy": np.__version__,
        },
        "results": [asdict(m) for m in results],
    }
    (args.out_dir / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        plot(results, args.out_dir / "kernels.png")
    failed = [m.name for m in results if m.passed is False]
    print("all kernels PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(main())
