"""keep_freed_memory's decisions, each in a fresh interpreter (malloc's settings are
process-wide): it sets glibc's thresholds once, and leaves a user's own malloc settings
alone. What it does to training, page faults counted on a pipeline stage:
tests/mpi/pipeline_page_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parent.parent / "pipesgd" / "host_memory.py"
# The module alone, without the package (and torch) around it: a fresh interpreter each.
PROBE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("host_memory", {str(MODULE)!r})
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
keep_freed_memory = host_memory.keep_freed_memory
first = keep_freed_memory()
print(first, keep_freed_memory(), sep="|")
"""


def run(env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120, env={**os.environ, **(env or {})})
    return out.stdout.strip().split("|")


def test_thresholds_set_once() -> None:
    states = run()
    if states[0] == "not glibc":
        pytest.skip("this C library's malloc is not glibc's")
    assert states == ["set", "set"]


@pytest.mark.parametrize("setting", [
    {"MALLOC_TRIM_THRESHOLD_": "131072"},
    {"MALLOC_MMAP_THRESHOLD_": "131072"},
    {"MALLOC_TOP_PAD_": "0"},
    {"MALLOC_MMAP_MAX_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
])
def test_a_users_malloc_settings_win(setting: dict[str, str]) -> None:
    assert run(setting)[0] in ("user settings", "not glibc")


def test_unrelated_tunables_do_not_count_as_malloc_settings() -> None:
    state = run({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})[0]
    assert state in ("set", "not glibc")
