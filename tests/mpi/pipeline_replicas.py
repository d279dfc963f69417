"""A 2-1 plan on 3 ranks under 1F1B-RR: the two replicas of stage 0 end bitwise identical,
with an odd number of micro-batches (uneven counts per replica), and match a single-process
simulation of round-based averaging, with their gradients in buckets small enough that
most start their all-reduce during the backward (wait-free).

Run: mpirun -n 3 python tests/mpi/pipeline_replicas.py [compression]
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, models
from pipesgd.pipeline.data import synthetic

comm = MPI.COMM_WORLD
LR, MB, SEED, N = 0.1, 8, 2, 9
MODEL = models.mlp((10, 16, 16, 4))  # 5 layers


def reference(plan, data):
    """Round k: stage 0 averages the gradients of micro-batches 2k and 2k+1 (taken with the
    weights of round k-1 ... as each replica's forward saw them); stage 1 steps per mb."""
    model = MODEL.build(seed=SEED)
    names = [k for k, _ in model.named_parameters()]
    first = [k for k in names if int(k.split(".")[0]) < plan.stages[0].end]
    w = {k: p.detach().clone() for k, p in model.named_parameters()}
    hist0 = [{k: w[k] for k in first}]
    hist1 = [{k: w[k] for k in names if k not in first}]
    # Stage 0 replica r runs F of its mbs with warm-up 2: version of its j-th mb is max(0, j-1).
    # Stage 1 (warm-up 2 as well, straight after stage 0) steps after every backward.
    rounds = {}
    for t in range(N):
        j = t // 2
        v0 = max(0, j - 1)
        v1 = max(0, t - 1)
        params = {**{k: x.clone().requires_grad_(True) for k, x in hist0[v0].items()},
                  **{k: x.clone().requires_grad_(True) for k, x in hist1[v1].items()}}
        out = torch.func.functional_call(model, params, (data.inputs(0, t),))
        loss = nn.functional.cross_entropy(out, data.labels(0, t))
        g = dict(zip(names, torch.autograd.grad(loss, [params[k] for k in names]), strict=True))
        hist1.append({k: hist1[-1][k] - LR * g[k] for k in hist1[-1]})
        rounds.setdefault(j, []).append({k: g[k] for k in first})
        if len(rounds[j]) == 2 or t == N - 1:
            avg = {k: sum(r[k] for r in rounds[j]) / len(rounds[j]) for k in first}
            hist0.append({k: hist0[-1][k] - LR * avg[k] for k in first})
    return {**hist0[-1], **hist1[-1]}


def main():
    compression = sys.argv[1] if len(sys.argv) > 1 else "none"
    plan = Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 1)), schedule="1f1b-rr",
                micro_batch=MB)
    x, y = synthetic(N * MB, (10,), 4, seed=4)
    data = MicroBatches(x, y, MB, shuffle=False)
    pipe = Pipeline(MODEL, plan, lr=LR, seed=SEED, compression=compression)
    if pipe.stage_id == 0:
        pipe.sync.bucket_bytes = 256  # stage 0's 448 gradients in 7 buckets
    stats = pipe.train_epoch(data)
    states = pipe.gather_state()
    early = comm.gather(getattr(pipe.sync, "early_buckets", 0))
    if comm.Get_rank() == 0:
        a, b = states[0], states[1]
        for k in a:
            assert torch.equal(a[k], b[k]), f"replicas of stage 0 differ in {k}"
        print(f"replicas bitwise identical over {N} micro-batches; versions {stats.peak_versions}")
        # every round but the first (its buffer is allocated at the all-reduce) and the
        # short replica's empty last one: 4 and 3 rounds of 7 buckets
        print(f"buckets reduced during the backward per replica: {early[:2]}")
        assert early[:2] == [4 * 7, 3 * 7], early
        if compression == "none":
            want = reference(plan, data)
            got = {**states[0], **states[2]}
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            print(f"max |pipeline - reference| = {worst:.3g}")
            assert worst < 1e-5, worst
    pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
