"""Page faults per micro-batch on the middle stage of the CNN cut in three (0-4, 4-6,
6-12): every step frees and allocates the same activations and gradients, which a
process keeping its freed memory (`pipesgd.host_memory`) serves from its heap.

Run: mpirun -n 3 python tests/mpi/pipeline_page_faults.py
Prints "middle stage: F page faults per micro-batch (malloc: S)".
"""

import resource

import torch
from mpi4py import MPI

from pipesgd.host_memory import keep_freed_memory
from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, models
from pipesgd.pipeline.data import synthetic

MB, WARM, MEASURED = 16, 8, 24

comm = MPI.COMM_WORLD
torch.set_num_threads(1)
spec = models.MODELS["cnn"]()
plan = Plan((StagePlan(0, 4), StagePlan(4, 6), StagePlan(6, 12)), schedule="1f1b",
            micro_batch=MB)
x, y = synthetic((WARM + MEASURED) * MB, spec.input_shape, spec.num_classes, seed=0)
data = MicroBatches(x, y, MB, seed=0)
pipe = Pipeline(spec, plan, comm, lr=0.01, seed=0)
pipe.train_epoch(data, 0, max_micro_batches=WARM)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pipe.train_epoch(data, 1, max_micro_batches=MEASURED)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
pipe.close()
if comm.Get_rank() == 1:
    print(f"middle stage: {faults / MEASURED:.0f} page faults per micro-batch "
          f"(malloc: {keep_freed_memory()})", flush=True)
