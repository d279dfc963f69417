"""Compressed allreduce (trunc16, quant8) against a float64 reference, under mpirun.

The error bounds are derived here, independently of the kernels. Along the ring a
segment of chunk c starts at rank c and visits ranks c+1, ..., c+p-1 (mod p); every
visit adds that rank's values and re-encodes, the last one (the owner) encodes the
final sum once for the allgather. So the sum is encoded p times, once after each
partial sum P_k = x_c + ... + x_(c+k), k = 0..p-1. With E_k the error carried
after encode k (E_-1 = 0):

  trunc16 (truncation to 8 significant bits, per element):
      E_k <= E_(k-1) + 2^-7 * (|P_k| + E_(k-1))
  quant8 (one scale per block = ring segment, round to nearest):
      E_k <= E_(k-1) + (max_block |P_k| + E_(k-1)) / 254

plus float32 rounding of each addition (covered by a relative 1e-6 slack). Average
divides the result by p once. Usage: compressed_allreduce.py SEGMENT_BYTES
"""

import hashlib
import sys

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
segment_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
engine = pipesgd.Engine(comm, segment_bytes=segment_bytes)
SEG = segment_bytes // 4


def blocks(count: int) -> list[tuple[int, int, int]]:
    """(chunk, begin, end) of every ring segment: p chunks, leftovers to the first ones."""
    base, extra = divmod(count, p)
    out, begin = [], 0
    for c in range(p):
        length = base + (1 if c < extra else 0)
        for s in range(0, length, SEG):
            out.append((c, begin + s, begin + min(s + SEG, length)))
        begin += length
    return out


def error_bound(inputs: list[np.ndarray], mode: str) -> np.ndarray:
    count = inputs[0].size
    bound = np.zeros(count)
    x = [a.astype(np.float64) for a in inputs]
    for c, b, e in blocks(count):
        partial = np.zeros(e - b)
        err = np.zeros(e - b)
        for k in range(p):
            partial = partial + x[(c + k) % p][b:e]
            if mode == "trunc16":
                err = err + 2.0**-7 * (np.abs(partial) + err)
            else:
                err = err + (np.abs(partial).max() + err.max()) / 254.0
        bound[b:e] = err + 1e-6 * (np.abs(partial) + 1e-30) * p
    return bound


def identical_everywhere(a: np.ndarray) -> bool:
    return len(set(comm.allgather(hashlib.sha256(a.tobytes()).hexdigest()))) == 1


rng = np.random.default_rng(1234 + r)
for mode in ("trunc16", "quant8"):
    for count in (1, max(p - 1, 1), 4, 1000, 10007, 300001):
        for op in ("sum", "average"):
            # Magnitudes vary across blocks so one block's scale does not hide another's.
            x = (rng.standard_normal(count) * np.exp(rng.uniform(-8, 8, count))).astype(np.float32)
            inputs = comm.allgather(x.copy())
            exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
            bound = error_bound(inputs, mode)
            if op == "average":
                exact, bound = exact / p, bound / p + 1e-7 * np.abs(exact / p)
            engine.allreduce(x, op=op, compression=mode, timeout=60)
            assert identical_everywhere(x), (mode, count, op)
            if p == 1:
                assert np.array_equal(x, inputs[0]), "one rank: compression is skipped"
                continue
            err = np.abs(x.astype(np.float64) - exact)
            worst = int(np.argmax(err - bound))
            assert np.all(err <= bound), (mode, count, op, worst, err[worst], bound[worst])

    # A block of zeros decodes to zeros; denormals survive within the bound.
    z = np.zeros(3 * SEG, np.float32)
    z[SEG : 2 * SEG] = np.float32(1e-41) * (r + 1)  # denormal block
    inputs = comm.allgather(z.copy())
    exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
    engine.allreduce(z, op="sum", compression=mode, timeout=60)
    assert np.all(z[:SEG] == 0) and np.all(z[2 * SEG :] == 0)
    assert np.all(np.abs(z - exact) <= error_bound(inputs, mode) + 1e-45)
    assert identical_everywhere(z)

    # NaN / Inf: quant8 turns the whole block NaN on every rank; trunc16 is element-wise IEEE.
    if p > 1:
        count = 4 * p * SEG
        v = np.ones(count, np.float32)
        poison = SEG + 3
        if r == p - 1:
            v[poison] = np.inf if mode == "trunc16" else np.nan
            v[2 * SEG + 5] = np.inf  # second block, Inf
        engine.allreduce(v, op="sum", compression=mode, timeout=60)
        assert identical_everywhere(v)
        if mode == "quant8":
            for _, b, e in blocks(count):
                touched = b <= poison < e or b <= 2 * SEG + 5 < e
                assert np.all(np.isnan(v[b:e])) if touched else np.all(np.isfinite(v[b:e]))
        else:
            assert np.isinf(v[poison]) and np.isinf(v[2 * SEG + 5])
            others = np.ones(count, bool)
            others[[poison, 2 * SEG + 5]] = False
            assert np.all(v[others] == p)

# float64 is refused for compressed modes before anything is queued.
try:
    engine.allreduce(np.ones(4), compression="quant8")
except ValueError as e:
    assert "float32" in str(e)
else:
    raise AssertionError("float64 accepted with quant8")
engine.shutdown()
if r == 0:
    print(f"compressed_allreduce: p={p} segment={segment_bytes} ok")
