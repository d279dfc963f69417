"""gpipe == single-process SGD on the full batch; 1f1b (stash, vertical sync) == an
independent single-process simulation of PipeDream's update rule (sosp19 §3.3); the
stash holds as many versions as the schedule implies.

Run: mpirun -n 3 python tests/mpi/pipeline_equivalence.py
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, models
from pipesgd.pipeline import schedule as sched
from pipesgd.pipeline.data import synthetic

comm = MPI.COMM_WORLD
S = comm.Get_size()
LR, MB, SEED = 0.1, 8, 3
MODEL = models.mlp((12, 16, 16, 16, 5))  # 7 layers
X, Y = synthetic(8 * MB * 2, (12,), 5, seed=1)


def layer_stage(plan):
    return {i: s for s, sp in enumerate(plan.stages) for i in range(sp.start, sp.end)}


def reference_gpipe(plan, data, epochs):
    model = MODEL.build(seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    m = plan.micro_batches_per_step
    for epoch in range(epochs):
        for first in range(0, len(data), m):
            idx = torch.cat([data.indices(epoch, i) for i in range(first, first + m)])
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
            opt.step()
    return model.state_dict()


def reference_pipedream(plan, data, vertical, warmups=None):
    """w_s^(t+1) = w_s^(t) - lr * grad_s f(w_1^(t-n+1), ..., w_n^(t)) (vertical: all t-n+1).

    With m = micro_batches_per_step > 1, update j of every stage applies the mean of the
    gradients of micro-batches jm .. jm+m-1, and stage s runs micro-batch t on the
    version it had after floor((t - w_s + 1) / m) updates (vertical: stage 0's), where
    w_s is the stage's forwards before its first backward: n - s (PipeDream's NOAM - s)
    unless `warmups` gives them.
    """
    n, m = plan.num_stages, plan.micro_batches_per_step
    warm = list(warmups) if warmups is not None else [n - s for s in range(n)]
    model = MODEL.build(seed=SEED)
    of = layer_stage(plan)
    names = [k for k, _ in model.named_parameters()]
    history = {s: [{k: p.detach().clone() for k, p in model.named_parameters()
                    if of[int(k.split(".")[0])] == s}] for s in range(n)}
    summed, count = {}, 0
    for t in range(len(data)):
        params = {}
        for s in range(n):
            v = max(0, t - warm[0] + 1) // m if vertical else max(0, t - warm[s] + 1) // m
            for k, w in history[s][v].items():
                params[k] = w.clone().requires_grad_(True)
        out = torch.func.functional_call(model, params, (data.inputs(0, t),))
        loss = nn.functional.cross_entropy(out, data.labels(0, t))
        grads = dict(zip(names, torch.autograd.grad(loss, [params[k] for k in names]),
                         strict=True))
        summed = {k: summed[k] + g for k, g in grads.items()} if summed else grads
        count += 1
        if count == m or t == len(data) - 1:
            for s in range(n):
                latest = history[s][-1]
                history[s].append({k: w - LR * summed[k] / count for k, w in latest.items()})
            summed, count = {}, 0
    final = {}
    for s in range(n):
        final.update(history[s][-1])
    return final


def implied_versions(actions):
    """Most distinct weight versions held by in-flight micro-batches, walking the list."""
    version, in_flight, peak = 0, {}, 0
    for a in actions:
        if a.kind == "U":
            version += 1
        elif a.kind == "F":
            in_flight[a.mb] = version
            peak = max(peak, len(set(in_flight.values())))
        elif a.kind == "B":
            del in_flight[a.mb]
    return peak


def compare(name, got, want, tol):
    if got is None:
        return
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert set(got) >= set(want), (name, sorted(set(want) - set(got)))
    print(f"{name}: max |pipeline - reference| = {worst:.3g}", flush=True)
    assert worst <= tol, f"{name}: pipeline differs from the reference by {worst}"


def main():
    bounds = Plan.even(MODEL.num_layers, S)
    data = MicroBatches(X, Y, MB, seed=5)

    plan = bounds.replace(schedule="gpipe", micro_batch=MB, micro_batches_per_step=4)
    pipe = Pipeline(MODEL, plan, lr=LR, seed=SEED)
    for _ in range(2):
        pipe.train_epoch(data)
    compare("gpipe", pipe.model_state(), reference_gpipe(plan, data, 2), 1e-5)
    pipe.close()

    for vertical, per_step in ((False, 1), (True, 1), (False, 3), (True, 3)):
        plan = bounds.replace(schedule="1f1b", micro_batch=MB, micro_batches_per_step=per_step)
        pipe = Pipeline(MODEL, plan, lr=LR, seed=SEED, vertical_sync=vertical)
        stats = pipe.train_epoch(data, 0)
        name = ("1f1b vertical sync" if vertical else "1f1b weight stashing") + (
            f", {per_step} micro-batches per step" if per_step > 1 else "")
        got = pipe.model_state()
        if got is not None:
            want = reference_pipedream(plan, data, vertical)
            compare(name, {k: v for k, v in got.items() if k in want}, want, 1e-5)
        if not vertical and comm.Get_rank() == 0:
            table = sched.from_csv(sched.to_csv(pipe.schedule(len(data))))
            implied = [implied_versions(table[r]) for r in range(S)]
            print(f"{name}: stashed versions measured {stats.peak_versions} implied {implied}")
            assert stats.peak_versions == implied, (stats.peak_versions, implied)
            if per_step == 1:
                assert implied == [S - s for s in range(S)], implied
        pipe.close()
    # Activation recomputation changes what is kept, not what is computed.
    for schedule, reference in (("gpipe", None), ("1f1b", "stash")):
        plan = bounds.replace(schedule=schedule, micro_batch=MB,
                              micro_batches_per_step=4 if schedule == "gpipe" else 1)
        kept = []
        for recompute in (False, [0, 1]):
            pipe = Pipeline(MODEL, plan, lr=LR, seed=SEED, recompute=recompute)
            stats = pipe.train_epoch(data, 0)
            kept.append(stats.peak_activation_mb)
            got = pipe.model_state()
            pipe.close()
        if got is not None:
            want = (reference_gpipe(plan, data, 1) if reference is None
                    else reference_pipedream(plan, data, False))
            compare(f"{schedule} with recomputation", {k: v for k, v in got.items()
                                                        if k in want}, want, 1e-5)
        if comm.Get_rank() == 0:
            print(f"{schedule} activations kept (MB) {kept[0]} -> {kept[1]} with recomputation")
            assert kept[1][0] < kept[0][0], kept  # stage 0 keeps its inputs only

    # MadPipe's 1F1B* counts: each stage keeps its own number of micro-batches in flight.
    counts = [max(1, S - 1 - s // 2) for s in range(S)]  # 3 ranks: [2, 2, 1]
    plan = bounds.replace(schedule="1f1b", micro_batch=MB, stage_in_flight=counts)
    pipe = Pipeline(MODEL, plan, lr=LR, seed=SEED)
    stats = pipe.train_epoch(data, 0)
    got = pipe.model_state()
    if got is not None:
        want = reference_pipedream(plan, data, False, counts)
        compare(f"1f1b per-stage in flight {counts}", {k: v for k, v in got.items()
                                                       if k in want}, want, 1e-5)
        # ... which the default counts would not have matched (ten times the tolerance:
        # only stage 0's warm-up differs, by one micro-batch).
        other = reference_pipedream(plan.replace(stage_in_flight=None), data, False)
        gap = max((want[k] - other[k]).abs().max().item() for k in want)
        assert gap > 1e-4, f"per-stage and PipeDream's warm-up references agree to {gap}"
    if comm.Get_rank() == 0:
        table = sched.from_csv(sched.to_csv(pipe.schedule(len(data))))
        implied = [implied_versions(table[r]) for r in range(S)]
        print(f"per-stage in flight {counts}: stashed versions measured {stats.peak_versions} "
              f"implied {implied}")
        assert stats.peak_versions == implied == counts, (stats.peak_versions, implied)
    pipe.close()
    if comm.Get_rank() == 0:
        # The two rules must be distinguishable at this tolerance, or the checks prove nothing.
        plan = bounds.replace(schedule="1f1b", micro_batch=MB)
        a, b = reference_pipedream(plan, data, False), reference_pipedream(plan, data, True)
        gap = max((a[k] - b[k]).abs().max().item() for k in a)
        assert gap > 1e-3, f"stashing and vertical sync references agree to {gap}"
        # ... and accumulating must differ from a step per micro-batch.
        c = reference_pipedream(plan.replace(micro_batches_per_step=3), data, False)
        gap = max((a[k] - c[k]).abs().max().item() for k in a)
        assert gap > 1e-3, f"accumulating and per-micro-batch references agree to {gap}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
