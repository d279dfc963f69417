"""Operations on the caller's arrays are timed over the shared-memory links, as MPI
messages (from 4 MiB) and staged on the board, and keep the fastest path
(csrc/path_tuner.h); results never depend on the path.

Every operation, on trial or decided, must equal MPI's own Allreduce exactly (integer
values keep every partial sum exact) and be bitwise identical on every rank; all ranks
must keep the same path per size class, and send a class back to its trials alike (the
watch over a decided path). Usage: path_tuning.py tuned|fixed
"""

import hashlib
import sys

import numpy as np
from mpi4py import MPI

import pipesgd

comm = MPI.COMM_WORLD
mode = sys.argv[1]
engine = pipesgd.Engine(comm)
assert engine.shm_links, "this test is about ranks that share a node"

# Three tuned classes (4, 8 and 1 MiB; 5 MiB + 28 bytes leaves the staged board a last
# piece shorter than the rest), one too small; float64 averages of an odd length.
SIZES = [((5 << 20) + 28, np.float32, "sum"), (9 << 20, np.float32, "sum"),
         (1 << 20, np.float32, "sum"), (1 << 14, np.float32, "sum"),
         (8 * 300_001, np.float64, "average")]
for nbytes, dtype, op in SIZES:
    for i in range(13):  # up to nine trials, then a watch window of four (path_tuner.h)
        rng = np.random.default_rng(1000 * comm.rank + i)
        a = rng.integers(-50, 50, nbytes // np.dtype(dtype).itemsize).astype(dtype)
        expect = np.empty_like(a)
        comm.Allreduce(a, expect, op=MPI.SUM)
        if op == "average":
            expect /= comm.size
        engine.allreduce(a, op=op)
        assert np.array_equal(a, expect), f"{nbytes} bytes, operation {i}: differs from MPI"
        assert len(set(comm.allgather(hashlib.sha256(a.tobytes()).hexdigest()))) == 1, (
            f"{nbytes} bytes, operation {i}: ranks differ")
    # Compressed operations keep to the links and are never tried as messages.
    engine.allreduce(np.ones(nbytes // 4, np.float32), compression="quant8")

paths = engine.operation_paths
trials = engine.operation_trials
if mode == "tuned":
    assert set(paths) == {1 << 20, 2 << 20, 4 << 20, 8 << 20}, paths
    assert set(paths.values()) <= {"links", "messages", "staged"}, paths
    assert paths[1 << 20] != "messages", "messages are not tried below 4 MiB"
    # Each decided class shows the trials it was decided on: two timed runs of every
    # candidate (messages from 4 MiB), each a positive time.
    assert set(trials) == set(paths), (trials, paths)
    for size_class, runs in trials.items():
        assert ("messages" in runs) == (size_class >= 4 << 20), (size_class, runs)
        assert paths[size_class] in runs, (size_class, runs)
        assert all(len(t) == 2 and min(t) > 0 for t in runs.values()), (size_class, runs)
else:  # PIPESGD_SHM_LINKS=1: one path for every size
    assert paths == {} and trials == {}, (paths, trials)
assert len(set(map(str, comm.allgather(sorted(paths.items()))))) == 1, "ranks chose differently"
assert len(set(map(str, comm.allgather(sorted(trials.items()))))) == 1, "ranks timed differently"
retrials = comm.allgather(engine.path_retrials)
assert len(set(retrials)) == 1, f"ranks watched differently: {retrials}"
engine.shutdown()
if comm.rank == 0:
    print(f"path_tuning {mode}: {paths}")
