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

    me = threading.get_native_id()
    before, run_before = core_sharing.thread_cpu_s(), core_sharing.thread_times(me)[0]
    began = time.thread_time()
    while time.thread_time() - began < 0.02:
        pass
    after, run_after = core_sharing.thread_cpu_s(), core_sharing.thread_times(me)[0]
    mine = [name for name in after if name.endswith(f":{me}")]
    assert len(mine) == 1
    assert after[mine[0]] - before[mine[0]] == pytest.approx(0.02, abs=0.01)
    assert run_after - run_before == pytest.approx(0.02, abs=0.01)


def test_stretch_host_bound_and_labels():
    assert core_sharing.stretch(0.0495, 0.030) == pytest.approx(1.65)
    # three ranks of 31 + 1.5 + 2.5 ms on two cores: 52.5 ms
    assert core_sharing.host_bound(3, 2, 0.031, 0.0015, 0.0025) == pytest.approx(0.0525)
    assert core_sharing.label(2, "quant8", True) == "Pipe-SGD+Q (yield)"
    assert core_sharing.label(1, "none", False) == "D-Sync (nap)"
