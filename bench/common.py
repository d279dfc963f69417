"""Shared by the benchmarks: sizes, the results folder, tables, JSON, and the
emulated link (when running under bench/netem.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6}


def mpirun() -> str:
    """The mpirun beside this Python (the venv's Open MPI wheel), else the one on PATH."""
    bindir = Path(sys.executable).parent
    found = shutil.which("mpirun", path=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise SystemExit("mpirun not found: run `make setup` first")
    return found


# How a script runs as an mpirun worker: `-m mpi4py` aborts the whole job when one rank
# raises, so a failure ends the launch at once rather than at its time limit.
PYTHON_UNDER_MPI = [sys.executable, "-m", "mpi4py"]


def mpi_env(**extra: str) -> dict[str, str]:
    """This environment, allowed to run mpirun as root (containers), plus `extra`."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return {**env, **extra}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536; plain integers are bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}: use e.g. 64KiB, 8MiB, 1048576")
    unit = (m.group(2) or "").upper()
    return int(m.group(1)) * _UNITS[unit]


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def link_rate_bps() -> float | None:
    """Per-rank link rate in bit/s when running under bench/netem.py, else None."""
    value = os.environ.get("PIPESGD_NETEM_RATE_BPS")
    return float(value) if value else None


def ranks_per_node() -> int:
    """Ranks per emulated node under bench/netem.py --nodes, else 1."""
    return int(os.environ.get("PIPESGD_NETEM_RANKS_PER_NODE", "1"))


def print_table(rows: list[dict[str, Any]], title: str | None = None) -> None:
    from tabulate import tabulate  # here: netem.py imports this module without it

    if title:
        print(f"\n{title}")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2))
    return path


def add_launcher_arguments(ap: Any, timeout_s: float) -> None:
    """What a benchmark that starts its own `mpirun` workers takes besides its own options:
    a time limit per launch, a tag for its results, and the worker's hidden flags."""
    ap.add_argument("--timeout", type=float, default=timeout_s,
                    help=f"seconds per launch (default {timeout_s:g})")
    ap.add_argument("--tag", default="", help="results go to NAME_TAG.json and .png")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def netem_command(ranks: int | str, rate: str, burst: str, inner: list[str]) -> list[str]:
    """`inner` on `ranks` ranks, each behind its own emulated link of `rate` with a token
    bucket of `burst` ("": netem's default), as a command (bench/netem.py, root)."""
    return [sys.executable, str(Path(__file__).resolve().parent / "netem.py"), "--np",
            str(ranks), "--rate", rate, *(["--burst", burst] if burst else []), "--", *inner]


def write_results(stem: str, tag: str, payload: dict[str, Any],
                  plot: Any) -> Path:
    """bench/results/STEM[_TAG].json and, drawn by `plot(path)`, the .png beside it."""
    path = write_json(f"{stem}{f'_{tag}' if tag else ''}.json", payload)
    plot(path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def init_gloo(comm: Any) -> Any:
    """torch.distributed over gloo on the MPI ranks of `comm`; returns torch.distributed.

    MASTER_ADDR/MASTER_PORT come from bench/netem.py when it set them, else
    loopback and a free port chosen by rank 0.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        port = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ["MASTER_PORT"] = str(comm.bcast(port))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    return dist


def init_nccl(comm: Any) -> Any:
    """A NCCL process group over the ranks of `comm`, beside init_gloo's default gloo
    group (same rendezvous); returns the group. Each rank's CUDA device must be current."""
    return init_gloo(comm).new_group(backend="nccl")
