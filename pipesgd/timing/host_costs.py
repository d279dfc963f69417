"""What communication and its kernels cost the host: γ, the copy and the compression
kernels on one core (`measure_kernels`), δ between a GPU and pinned host memory
(`measure_device_copy`), and, measured on the engine, β_in_place (its in-place
reduction of a node's shared buffers: `measure_in_place`), β_cpu (the CPU a rank's
communication takes per wire byte) and the load latency (how much longer a ring step
takes while every rank's compute keeps the shared cores busy: `engine_costs`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from pipesgd.polling import idle_barrier
from pipesgd.timing.link_probes import per_wire_byte, slowest_seconds
from pipesgd.timing.network import COMPRESSED_MODES, KernelCosts, default_cores
from pipesgd.timing.spread import interquartile_range, median_spread


def _time_each(call: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure_kernels(
    nbytes: int = 32 << 20, repeats: int = 15, seed: int = 0
) -> tuple[float, float, dict[str, KernelCosts], dict[str, float]]:
    """γ, the copy cost and every compression kernel's cost on this process's core.

    Works on blocks of `nbytes` of float32, larger than the caches: the ring streams a
    gradient through each kernel once, from memory (a 4 MiB block that stays in L2 runs
    the kernels 3-4x faster than the ring sees them).

    Returns:
        (gamma, copy, kernels, spread), all in seconds per float32 byte.
    """
    import numpy as np

    from pipesgd import compression as C

    n = nbytes // 4
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    local = rng.standard_normal(n, dtype=np.float32)
    acc = np.empty_like(x)
    spread: dict[str, float] = {}

    def per_byte(name: str, call: Callable[[], None]) -> float:
        call()  # warm-up: page faults, first-touch
        med, sp = median_spread(_time_each(call, repeats))
        spread[name] = sp
        return med / (4 * n)

    gamma = per_byte("gamma", lambda: np.add(x, local, out=acc))
    copy = per_byte("copy", lambda: np.copyto(acc, x))
    kernels = {}
    for mode in COMPRESSED_MODES:
        wire = C.encode(x, mode)
        kernels[mode] = KernelCosts(
            encode=per_byte(f"{mode}.encode", lambda m=mode: C.encode(x, m)),
            decode_add_encode=per_byte(
                f"{mode}.decode_add_encode", lambda m=mode, w=wire: C.decode_add_encode(w, local, m)
            ),
            decode=per_byte(f"{mode}.decode", lambda m=mode, w=wire: C.decode(w, n, m)),
            # overwrites its local block: acc, whose values do not change the cost
            decode_add_encode_decode=per_byte(
                f"{mode}.decode_add_encode_decode",
                lambda m=mode, w=wire: C.decode_add_encode_decode(w, acc, m),
            ),
        )
    return gamma, copy, kernels, spread


def measure_device_copy(device: Any, nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """δ: seconds per byte of a copy between `device` and pinned host memory, the mean of
    both directions (median of `repeats` each, timed by CUDA events after a warm-up).
    0.0 for the CPU, where nothing is staged."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(dst: Any, src: Any) -> float:
        samples = []
        for i in range(repeats + 1):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:  # the first is the warm-up
                samples.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    return (timed(on_device, host) + timed(host, on_device)) / (2 * nbytes)


def measure_in_place(comm: Any, engine: Any, nbytes: int, repeats: int) -> tuple[float, float]:
    """β_in_place and its spread: the slowest rank's time per buffer byte of an
    uncompressed allreduce of `nbytes` of the engine's own buffers (`Engine.zeros`,
    reduced in place where the ranks share a node's memory), sums included
    (collective). One large size rather than a slope between two: its two waits are
    microseconds against milliseconds, and a slope takes the difference of two noisy
    medians. 0 where the engine lends no shared memory."""
    import numpy as np

    if not engine.shares_memory:
        return 0.0, 0.0
    buf = engine.zeros(nbytes // 4, np.float32)
    buf[:] = 1.0  # averaged, it stays 1
    run = functools.partial(engine.allreduce, buf, op="average")
    median, spread = median_spread(slowest_seconds(comm, run, repeats, warmups=2))
    return median / nbytes, spread


def _engine_cpu_per_wire_byte(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                              gamma: float) -> float:
    """CPU seconds per wire byte of engine allreduces beyond their reductions (collective).

    Taken with no thread blocked in `wait`, as when Pipe-SGD computes beside them: a
    waiting caller makes the comm thread poll without napping (its core is idle then),
    which is not what communication costs the compute beside it (`wait_unwatched`)."""
    import numpy as np

    from pipesgd.polling import wait_unwatched

    cpu: dict[int, float] = {}
    for m in sizes:
        buf = np.ones(m // 4, dtype=np.float32)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            cpu0 = time.process_time()
            wait_unwatched(engine.allreduce_async(buf, op="average"))
            if i >= 2:
                samples.append(time.process_time() - cpu0)
        cpu[m] = statistics.median(samples)
    return per_wire_byte(cpu, sizes, comm.Get_size(), gamma)


class Spinner:
    """A fixed unit of single-threaded compute whose lost throughput measures stolen CPU."""

    def __init__(self) -> None:
        import numpy as np

        self._a = np.linspace(1.0, 2.0, 16 << 10, dtype=np.float32)  # 64 KiB: stays in cache
        self._b = np.empty_like(self._a)
        self._sqrt = np.sqrt

    def unit(self) -> None:
        for _ in range(16):
            self._sqrt(self._a, out=self._b)

    def rate(self, comm: Any, seconds: float) -> float:
        """Units per second with every rank spinning and no communication (collective)."""
        idle_barrier(comm)
        units, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.unit()
            units += 1
        return units / (time.perf_counter() - start)


def _engine_steal_per_wire_byte(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int,
                                gamma: float, cores: int, ranks_on_node: int) -> float:
    """CPU per wire byte of engine allreduces, seen as compute they take from a busy rank.

    Every rank spins a fixed compute unit while its comm thread runs allreduces, as
    Pipe-SGD overlaps them. The time the spinner loses, times C / R (R ranks share C
    cores), is what one rank's communication costs the host: the comm thread, the kernel's
    network stack (softirqs are charged to whoever they interrupt) and the scheduling of
    one more runnable thread. `process_time` sees only the first. Collective.
    """
    import numpy as np

    spinner = Spinner()
    rate = spinner.rate(comm, 0.3)
    steal: dict[int, float] = {}
    for m in sizes:
        buf = np.ones(m // 4, dtype=np.float32)
        engine.allreduce(buf, op="average")  # warm-up: connections, pages
        samples = []
        for _ in range(repeats):
            idle_barrier(comm)
            start, units = time.perf_counter(), 0
            handles = [engine.allreduce_async(buf, op="average") for _ in range(2)]
            while not handles[-1].done():
                spinner.unit()
                units += 1
            elapsed = time.perf_counter() - start
            handles[-1].wait()
            samples.append(max(elapsed - units / rate, 0.0) / len(handles))
        steal[m] = statistics.median(samples) * cores / ranks_on_node
    return per_wire_byte(steal, sizes, comm.Get_size(), gamma)


def _engine_load_latency(comm: Any, engine: Any, repeats: int,
                         nbytes: int = 4096) -> tuple[float, float]:
    """Extra seconds per ring step of an engine allreduce while every rank computes, and
    its spread (collective).

    A small allreduce is all latency: timed alone and with every rank spinning a compute
    unit beside it, the difference over its 2(p-1) steps is how long a step waits for
    its comm thread to get a core (`load_latency_from`).
    """
    import numpy as np

    spinner = Spinner()
    buf = np.ones(nbytes // 4, dtype=np.float32)
    engine.allreduce(buf)
    idle, loaded = [], []
    for _ in range(repeats):
        idle_barrier(comm)
        start = time.perf_counter()
        engine.allreduce(buf)
        idle.append(time.perf_counter() - start)
        idle_barrier(comm)
        start = time.perf_counter()
        handle = engine.allreduce_async(buf)
        while not handle.done():
            spinner.unit()
        loaded.append(time.perf_counter() - start)
    every = comm.allgather((idle, loaded))
    return load_latency_from([i for i, _ in every], [lo for _, lo in every],
                             2 * (comm.Get_size() - 1))


def load_latency_from(idle: list[list[float]], loaded: list[list[float]],
                      steps: int) -> tuple[float, float]:
    """(λ_load, spread) from each rank's allreduce times alone (`idle[rank]`) and beside
    spinning ranks (`loaded[rank]`), paired by repetition: λ_load is the median over the
    ranks of their median difference, per step; the spread is the interquartile range of
    every pair's difference over that median difference (0 where it is 0: nothing to
    lean on). The ranks wake from their barriers at different moments, so the pairs
    spread widely (167-1779 µs per step in one launch at p = 2)."""
    extra = float(statistics.median(statistics.median(lo) - statistics.median(i)
                                    for i, lo in zip(idle, loaded, strict=True)))
    pairs = [b - a for i, lo in zip(idle, loaded, strict=True)
             for a, b in zip(i, lo, strict=True)]
    spread = interquartile_range(pairs) / extra if extra > 0 and len(pairs) >= 4 else 0.0
    return max(0.0, extra) / steps, spread


def engine_costs(comm: Any, engine: Any, sizes: tuple[int, int], repeats: int, gamma: float,
                  ranks_on_node: int) -> tuple[float, float, float]:
    """(β_cpu, load latency, its spread), measured on `engine` (collective).

    β_cpu: the CPU the comm thread burns per wire byte, or, where ranks and comm threads
    outnumber the cores, what communication takes from compute, if that is more. Load
    latency (`_engine_load_latency`): only where cores are shared, else 0."""
    load_latency = load_spread = 0.0
    beta_cpu = _engine_cpu_per_wire_byte(comm, engine, sizes, repeats, gamma)
    cores = default_cores()
    if 2 * ranks_on_node > cores:
        beta_cpu = max(beta_cpu, _engine_steal_per_wire_byte(
            comm, engine, sizes, max(3, repeats // 2), gamma, cores, ranks_on_node))
        load_latency, load_spread = _engine_load_latency(comm, engine, 4 * repeats)
    return float(statistics.median(comm.allgather(beta_cpu))), load_latency, load_spread
