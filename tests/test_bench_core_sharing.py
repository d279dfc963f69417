"""bench/core_sharing.py: the comm threads' CPU between two readings, and the stretch."""

import pytest
from bench_scripts import load_bench

core_sharing = load_bench("core_sharing")


def test_comm_thread_cpu_counts_only_comm_threads_and_new_ones_whole():
    before = {"python:10": 1.0, "pipesgd-comm:11": 0.25}
    after = {"python:10": 3.0, "pipesgd-comm:11": 0.75, "pipesgd-comm:12": 0.5}
    # the compute thread's 2 s are not communication; a comm thread born since counts whole
    assert core_sharing.comm_thread_cpu(before, after) == pytest.approx(1.0)


def test_this_thread_is_read_and_its_cpu_grows():
    import threading
    import time

    me = f":{threading.get_native_id()}"
    before = core_sharing.thread_cpu_s()
    began = time.thread_time()
    while time.thread_time() - began < 0.05:  # five clock ticks of CPU
        pass
    after = core_sharing.thread_cpu_s()
    mine = [name for name in after if name.endswith(me)]
    assert len(mine) == 1
    assert after[mine[0]] - before[mine[0]] >= 0.03


def test_stretch_and_labels():
    assert core_sharing.stretch(0.0495, 0.030) == pytest.approx(1.65)
    assert core_sharing.label(2, "quant8", True) == "Pipe-SGD+Q (yield)"
    assert core_sharing.label(1, "none", False) == "D-Sync (nap)"
