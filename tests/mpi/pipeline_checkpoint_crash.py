"""A save in which stage 1's rank fails after its first file: every rank raises, the
previous checkpoint still loads (epochs and layers), and no temporary file is left; the
next save replaces the checkpoint.

Run: mpirun -n 2 python tests/mpi/pipeline_checkpoint_crash.py DIR
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, checkpoint, models
from pipesgd.pipeline.data import synthetic

comm = MPI.COMM_WORLD
MODEL = models.mlp((10, 16, 16, 4))  # 5 layers
KW = {"lr": 0.05, "momentum": 0.9, "seed": 5}


def check(root, plan, epochs, want, what):
    fresh = Pipeline(MODEL, plan, **KW)
    got_epochs = checkpoint.load(fresh, root / "ck")
    # Listed before the collective below: past it, rank 0 may already be preparing the
    # next save's temporary directory while a slower rank still looks.
    stale = [p.name for p in root.iterdir() if p.name.startswith(".")]
    got = fresh.model_state(root=None)
    fresh.close()
    assert got_epochs == epochs, (got_epochs, epochs)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: layer {k} differs"
    assert not stale, f"{what}: left {stale}"


def main():
    root = Path(sys.argv[1])
    x, y = synthetic(64, (10,), 4, seed=2)
    data = MicroBatches(x, y, 8, seed=1)
    plan = Plan.even(MODEL.num_layers, comm.Get_size(), micro_batch=8)
    pipe = Pipeline(MODEL, plan, **KW)
    pipe.train_epoch(data)
    checkpoint.save(pipe, root / "ck")
    first = pipe.model_state(root=None)
    pipe.train_epoch(data)

    real = checkpoint._write_file
    written = []

    def fail_after_first(path, obj):
        if written:
            raise OSError("No space left on device (simulated)")
        written.append(path)
        real(path, obj)

    if comm.Get_rank() == 1:
        checkpoint._write_file = fail_after_first
    try:
        checkpoint.save(pipe, root / "ck")
        raise AssertionError(f"rank {comm.Get_rank()}: the failed save did not raise")
    except (OSError, checkpoint.CheckpointError) as exc:
        for r in range(comm.Get_size()):
            if r == comm.Get_rank():
                print(f"rank {r} raised {type(exc).__name__}: {exc}", flush=True)
            comm.Barrier()
    checkpoint._write_file = real
    check(root, plan, 1, first, "after the failed save")
    if comm.Get_rank() == 0:
        print("previous checkpoint loads: epochs 1, identical layers", flush=True)

    checkpoint.save(pipe, root / "ck")
    check(root, plan, 2, pipe.model_state(root=None), "after the next save")
    if comm.Get_rank() == 0:
        print("replaced: epochs 2, identical layers, no temporary files", flush=True)
    pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
