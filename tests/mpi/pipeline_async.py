"""PipeMare's `async` schedule on real ranks (run with 4 ranks).

1. Delayed gradient descent through the runtime: a quadratic loss 0.5 w^2 whose one weight
   sits on one stage (delays 3, 2, 1 steps on stages 0, 1, 2) and identities elsewhere.
   Above Lemma 1's bound for that delay the asynchronous run diverges, below it converges;
   with T1 (the step divided by the delay to an annealed power) the diverging step
   converges wherever there is a delay to divide by (2 steps or more).
2. Memory: the weight storages a stage holds at once, counted from the tensors its
   in-flight micro-batches keep (not from the policy's own count): the live set alone
   under async; under 1f1b with stashing NOAM - s copies beside it (none on the last
   stage, whose backward follows its forward).
3. A run resumed from a checkpoint continues T1's annealing exactly: bitwise equal to an
   uninterrupted run.

Run: mpirun -n 4 python tests/mpi/pipeline_async.py CHECKPOINT_DIR
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, checkpoint, models
from pipesgd.pipeline import schedule as sched
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.pipemare import PipeMareOptions, lemma1_bound

comm = MPI.COMM_WORLD
S = comm.Get_size()
rank = comm.Get_rank()
CKPT = sys.argv[1]


def half_square(out, _y):
    return 0.5 * (out**2).mean()


def quadratic_run(stage: int, lr: float, options: PipeMareOptions | None,
                  steps: int = 160) -> float:
    """|w| after `steps` asynchronous updates of w from 1 on 0.5 w^2 (inputs all 1), the
    weight on `stage` and identities elsewhere."""
    weight = nn.Linear(1, 1, bias=False)
    layers = [nn.Identity() for _ in range(S)]
    layers[stage] = weight
    with torch.no_grad():
        weight.weight.fill_(1.0)
    plan = Plan.even(S, S, schedule="async", micro_batch=2)
    pipe = Pipeline(layers, plan, lr=lr, loss_fn=half_square, pipemare=options)
    data = MicroBatches(torch.ones(2 * steps, 1), torch.zeros(2 * steps, 1), 2, shuffle=False)
    pipe.train_epoch(data, 0)
    mine = pipe.layer_state().get(f"{stage}.weight")
    w = comm.allgather(None if mine is None else float(mine))[stage]
    pipe.close()
    return abs(w)


def held_weight_sets(schedule: str) -> int:
    """Most distinct weight storages stage `rank` held at once during an epoch."""
    model = models.mlp((12, 16, 16, 16, 5))
    plan = Plan.even(model.num_layers, S, schedule=schedule, micro_batch=4)
    pipe = Pipeline(model, plan, lr=0.05)
    stage, peak = pipe.stage, 0
    forward = stage.forward

    def counting_forward(*args, **kwargs):
        nonlocal peak
        out = forward(*args, **kwargs)
        # the live parameters, and every other set an in-flight micro-batch keeps
        held = {tuple(t.data_ptr() for t in f.weights) for f in stage._in_flight.values()
                if f.weights} | {tuple(p.data_ptr() for p in stage.params)}
        peak = max(peak, len(held))
        return out

    stage.forward = counting_forward
    x, y = synthetic(64, (12,), 5, seed=1)
    pipe.train_epoch(MicroBatches(x, y, 4, seed=2), 0)
    pipe.close()
    return peak


def resumed_equals_continuous() -> bool:
    model = models.mlp((12, 16, 16, 16, 5))
    plan = Plan.even(model.num_layers, S, schedule="async", micro_batch=4)
    options = PipeMareOptions(t1_anneal_steps=40)
    x, y = synthetic(64, (12,), 5, seed=1)
    data = MicroBatches(x, y, 4, seed=2)

    straight = Pipeline(model, plan, lr=0.05, seed=3, pipemare=options)
    for _ in range(2):
        straight.train_epoch(data)
    want = straight.layer_state()
    straight.close()

    first = Pipeline(model, plan, lr=0.05, seed=3, pipemare=options)
    first.train_epoch(data)
    checkpoint.save(first, CKPT)
    steps = first.optimizer_steps
    first.close()
    resumed = Pipeline(model, plan, lr=0.05, seed=99, pipemare=options)
    checkpoint.load(resumed, CKPT)
    assert resumed.optimizer_steps == steps > 0, (resumed.optimizer_steps, steps)
    resumed.train_epoch(data)
    got = resumed.layer_state()
    resumed.close()
    return all(torch.equal(got[k], want[k]) for k in want)


def main() -> int:
    delays = sched.delays(Plan.even(S, S, schedule="async"))
    for stage in range(S - 2, -1, -1):  # every stage with a delay: 1, 2, 3 steps on 4 ranks
        tau = delays[stage][0]
        bound = lemma1_bound(tau, 1.0)
        lr = 1.3 * bound
        naive = quadratic_run(stage, lr, None)
        rescued = quadratic_run(stage, lr, PipeMareOptions(t1_anneal_steps=10_000))
        below = quadratic_run(stage, 0.8 * bound, None)
        if rank == 0:
            print(f"stage {stage}, delay {tau}, Lemma 1 bound {bound:.4f}: |w| after 160 "
                  f"steps at 1.3x the bound {naive:.3g} (async), {rescued:.3g} (async + T1); "
                  f"at 0.8x {below:.3g}", flush=True)
        assert naive > 1.0, f"delay {tau}: above the bound it should diverge: |w| = {naive}"
        assert below < 1e-2, f"delay {tau}: below the bound it converges: |w| = {below}"
        if tau > 1:  # ... where T1 has a delay to divide by
            assert rescued < 1e-2, f"delay {tau}: T1 should make it converge: |w| = {rescued}"

    stash = comm.gather(held_weight_sets("1f1b"), root=0)
    one = comm.gather(held_weight_sets("async"), root=0)
    if rank == 0:
        print(f"weight sets held per stage: 1f1b stashing {stash}, async {one}", flush=True)
        # stashing: NOAM - s copies beside the live weights, the last stage none
        assert stash == [S - s + 1 for s in range(S - 1)] + [1], stash
        assert one == [1] * S, one

    same = resumed_equals_continuous()
    assert same, "a resumed async + T1 run differs from the uninterrupted one"
    if rank == 0:
        print("async + T1 resumed from a checkpoint: bitwise equal to the uninterrupted run",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
