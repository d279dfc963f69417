"""A ring across nodes: shared-memory links on the edges within a node, MPI messages on
the edges between nodes (run under bench/netem.py --nodes, PIPESGD_SHM_LINKS=1).

Checks each rank's linked edges against the node layout (consecutive ranks share a
node), then allreduces of several sizes, sum and average: the result against a float64
numpy reference of all ranks' inputs and against MPI's own Allreduce, and bitwise equal
on every rank (compressed ones: tests/mpi/compressed_allreduce.py, run the same way).
Prints one line per check on rank 0.

Usage: engine_mixed_ring.py RANKS_PER_NODE
"""

import hashlib
import sys

import numpy as np
import torch
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
r, p = comm.rank, comm.size
per_node = int(sys.argv[1])
engine = pipesgd.Engine(comm)
node = r // per_node
expected = (((r - 1) % p) // per_node == node, ((r + 1) % p) // per_node == node)
assert engine.linked_edges == expected, (r, engine.linked_edges, expected)
edges = comm.gather(engine.linked_edges)
if r == 0:
    print(f"linked edges per rank (left, right): {edges}", flush=True)

for count in (1, 1000, 100_003, 1 << 20):
    for op in ("sum", "average"):
        rng = np.random.default_rng(1000 * r + count)
        data = rng.standard_normal(count).astype(np.float32)
        everyone = np.stack(comm.allgather(data)).astype(np.float64)
        truth = everyone.sum(axis=0) / (p if op == "average" else 1)
        mpi = np.empty_like(data)
        comm.Allreduce(data, mpi, op=MPI.SUM)
        if op == "average":
            mpi /= p
        tensor = torch.from_numpy(data.copy())
        engine.allreduce(tensor, op=op)
        got = tensor.numpy()
        assert np.allclose(got, truth, rtol=1e-5, atol=1e-5), (count, op)
        assert np.allclose(got, mpi, rtol=1e-5, atol=1e-5), (count, op)
        digest = hashlib.sha256(got.tobytes()).hexdigest()
        assert len(set(comm.allgather(digest))) == 1, f"ranks differ: {count} {op}"
if r == 0:
    print("mixed ring: every result within tolerance of float64 and bitwise equal on "
          "every rank", flush=True)
engine.shutdown()
