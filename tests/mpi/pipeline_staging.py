"""Host staging in the pipeline on the CPU (`Pipeline(staging=True)`, the path a GPU stage
takes): the same plans trained with and without it end bitwise equal on every rank, and
a send whose copy to the host has not completed waits, in order, until it has.

With `cuda` (tests/gpu): every stage on the GPU trains as the CPU does (to rounding),
replicas stay bitwise equal, and a send returns while the GPU is still busy with the
work before it (its copy is ordered by an event, not by waiting).

Run: mpirun -n 4 python tests/mpi/pipeline_staging.py [cuda]
"""

import sys
import time

import torch
from mpi4py import MPI

from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, models
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.p2p import StageLink
from pipesgd.pipeline.schedule import Action
from pipesgd.staging import HostStaging

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
MODEL = models.mlp((10, 16, 16, 4))  # 5 layers
MB = 4


def train(plan: Plan, staging: bool | None, **options) -> dict[str, torch.Tensor]:
    """The merged model after two epochs; checks first that every replicated stage's
    replicas hold bitwise the same parameters and buffers."""
    x, y = synthetic(24 * MB, (10,), 4, seed=5)
    data = MicroBatches(x, y, MB, shuffle=True, seed=1)
    pipe = Pipeline(MODEL, plan, comm, lr=0.05, momentum=0.9, seed=3, staging=staging,
                    **options)
    for epoch in range(2):
        pipe.train_epoch(data, epoch)
    per_rank = comm.allgather(pipe.layer_state())
    for stage in range(plan.num_stages):
        first, *others = [per_rank[plan.rank_of(stage, r)]
                          for r in range(plan.stages[stage].replicas)]
        for other in others:
            for key, value in first.items():
                assert torch.equal(value.cpu(), other[key].cpu()), \
                    f"replicas of stage {stage} differ in {key}"
    state = pipe.model_state(root=None)
    pipe.close()
    assert state is not None
    return state


PLANS = {
    "1f1b 1-1-1-1": (Plan.even(5, 4, micro_batch=MB), {}),
    "gpipe 2-1-1": (Plan(stages=(StagePlan(0, 2, 2), StagePlan(2, 4, 1),
                                 StagePlan(4, 5, 1)), schedule="gpipe",
                         micro_batch=MB), {}),
    "1f1b-rr 2-2 K=2 quant8": (Plan(stages=(StagePlan(0, 3, 2), StagePlan(3, 5, 2)),
                                    schedule="1f1b-rr", micro_batch=MB),
                               {"staleness": 2, "compression": "quant8"}),
"async 1-1-1-1": (Plan.even(5, 4, micro_batch=MB).replace(schedule="async"), {}),
}


def same_with_and_without_staging() -> None:
    for name, (plan, options) in PLANS.items():
        plain = train(plan, False, **options)
        staged = train(plan, True, **options)
        for key, value in plain.items():
            assert torch.equal(value, staged[key]), f"{name}: {key} differs with staging"
        if rank == 0:
            print(f"{name}: staged == plain", flush=True)


class SlowCopy:
    """A copy that completes only when waited for, or after `polls` queries."""

    def __init__(self, polls: int) -> None:
        self.polls, self.done = polls, False

    def query(self) -> bool:
        self.polls -= 1
        self.done = self.done or self.polls < 0
        return self.done

    def synchronize(self) -> None:
        self.done = True


class SlowStaging(HostStaging):
    def __init__(self, polls: list[int]) -> None:
        super().__init__(torch.device("cpu"))
        self.polls = polls

    def copy_to_host(self, host, device):
        super().copy_to_host(host, device)
        return SlowCopy(self.polls.pop(0))


def deferred_sends_wait_for_their_copies() -> None:
    plan = Plan.even(5, 2, micro_batch=MB)
    world = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if world == MPI.COMM_NULL:
        return
    payloads = [torch.arange(6.0).reshape(2, 3) + i for i in range(3)]
    if rank == 0:
        # mb 0's copy completes only when waited for; mb 1's is done; mb 2's after 1 poll
        link = StageLink(world, plan, 0, staging=SlowStaging([10**9, 0, 1]))
        for mb, t in enumerate(payloads):
            link.send(t, Action(0, "SF", mb), dst=1)
        assert link.deferred == 3, link.deferred  # in order: nothing passes mb 0
        link.progress()
        assert link.deferred == 3
        for t in payloads:
            t.add_(100)  # the host copies were taken at send
        link.drain()  # waits for mb 0's copy, then posts all three in order
        assert link.deferred == 0
    else:
        link = StageLink(world, plan, 1, staging=HostStaging(torch.device("cpu")))
        for mb, expected in enumerate(payloads):
            got, _ = link.recv(Action(1, "RF", mb), src=0)
            assert torch.equal(got, expected), (mb, got)
        link.drain()
    link.close()
    world.Free()
    if rank == 0:
        print("deferred sends: posted in order once copied", flush=True)


def on_the_gpu_as_on_the_cpu() -> None:
    for name, (plan, options) in PLANS.items():
        on_cpu = train(plan, False, **options)
        on_gpu = train(plan, None, device="cuda", **options)
        assert all(v.is_cuda for v in on_gpu.values() if v.is_floating_point()), name
        if options.get("compression", "none") == "none":  # quantizing amplifies rounding
            for key, value in on_cpu.items():
                torch.testing.assert_close(on_gpu[key].cpu(), value, rtol=1e-4, atol=1e-5,
                                           msg=f"{name}: {key}")
        if rank == 0:
            print(f"{name}: cuda == cpu", flush=True)


def a_send_does_not_wait_for_the_gpu() -> None:
    plan = Plan.even(5, 2, micro_batch=MB)
    world = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if world == MPI.COMM_NULL:
        return
    device = torch.device("cuda")
    link = StageLink(world, plan, rank, staging=HostStaging(device))
    if rank == 0:
        x = torch.ones(256, 64, device=device)
        # Load the multiply's kernel now: CUDA loads a kernel at its first launch (lazy
        # loading, the default since CUDA 12.2), and that load waits for the whole
        # context: done below, it would wait out the sleep before the send (seen on an
        # H100: the send then found its copy complete).
        x * 3
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)  # the compute stream is busy for a while ...
        out = x * 3  # ... and this activation is computed after it
        begin = time.perf_counter()
        link.send(out, Action(0, "SF", 0), dst=1)
        took = time.perf_counter() - begin
        pending = link.deferred
        busy = not torch.cuda.current_stream().query()
        link.drain()
        assert busy and pending == 1 and took < 0.05, (busy, pending, took)
        print(f"send returned in {took * 1e3:.2f} ms with the GPU busy", flush=True)
    else:
        got, _ = link.recv(Action(1, "RF", 0), src=0, device=device)
        assert got.is_cuda and torch.equal(got.cpu(), torch.full((256, 64), 3.0))
        link.drain()
    link.close()
    world.Free()


if len(sys.argv) > 1 and sys.argv[1] == "cuda":
    on_the_gpu_as_on_the_cpu()
    a_send_does_not_wait_for_the_gpu()
else:
    same_with_and_without_staging()
    deferred_sends_wait_for_their_copies()
comm.Barrier()
if rank == 0:
    print("OK", flush=True)
