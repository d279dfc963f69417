"""The pipeline runtime: runs this rank's schedule, one action at a time, over MPI.

    pipe = Pipeline(models.mlp(), Plan.even(5, 2), lr=0.05)   # every rank, under mpirun
    stats = pipe.train_epoch(MicroBatches(x, y, micro_batch=8), epoch=0)

Each action dispatches through one table (`_HANDLERS`); receives are posted a few
actions ahead so the sends of neighbours land early. The schedule is generated from
the plan and deadlock-checked offline (schedule.build) before the first action runs.
When an action fails, the rank prints its schedule table with that action marked.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from mpi4py import MPI
from torch import Tensor, nn

from pipesgd.device import require_cuda_everywhere, torch_threads
from pipesgd.host_memory import keep_freed_memory
from pipesgd.staging import HostStaging
from pipesgd.timing.profile import times_cpu_work

from . import schedule as sched
from .data import MicroBatches
from .evaluate import Evaluation, evaluate
from .models import LayerModel, from_modules
from .p2p import StageLink, TensorSpec
from .pipemare import AsyncWeights, PipeMareOptions
from .plan import Plan, PlanError, StagePlan
from .replicas import LocalGradients, ReplicaGradientSync, broadcast_from_first_replica
from .schedule import Action, no_step_between_forward_and_backward
from .stage import Stage
from .stash import WeightPolicy, make_policy, tensors_bytes
from .timeline import Timeline

LOOKAHEAD = 8  # actions ahead whose receives are posted early
DATA_PARALLEL_BATCHES = 16  # distinct batches `data_parallel_iteration_s` cycles through
CALIBRATION_RUNS = 4  # parts a calibration run is timed in, judged by their median
# The most a calibration run counts over its CALIBRATION_RUNS parts (rounds, iterations,
# or a pipeline's micro-batches per rank): enough that a small model's run takes about a
# second, not a quarter. With the MLP at 64
# samples on 4 ranks of 2 cores, six runs in a row spread (max/min) 1.24-1.25 under a
# cap of 24 and 1.09-1.12 under 128 or more (data parallelism, two launches), its
# replicated rounds 1.18-1.48 against 1.12-1.18.
CALIBRATION_CAP = 128


@dataclass
class EpochStats:
    """What one epoch did, identical on every rank (per-rank lists indexed by rank)."""

    epoch: int
    micro_batches: int
    samples: int
    seconds: float
    throughput_samples_per_s: float
    loss: float
    accuracy: float
    utilisation: list[float] = field(default_factory=list)
    stage_utilisation: list[float] = field(default_factory=list)
    peak_versions: list[int] = field(default_factory=list)
    peak_stash_mb: list[float] = field(default_factory=list)
    peak_activation_mb: list[float] = field(default_factory=list)
    # what autograd saved for the backwards of the micro-batches in flight, at its peak
    peak_saved_mb: list[float] = field(default_factory=list)
    peak_rss_mb: list[float] = field(default_factory=list)
    # the live parameters and the optimizer's state (momentum, ...), beside the extra
    # weight copies of peak_stash_mb
    weight_mb: list[float] = field(default_factory=list)
    optimizer_state_mb: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class Pipeline:
    """One stage replica of a pipeline-parallel model on this rank (call on every rank).

    Args:
        model: a `LayerModel` (each rank builds only its layers) or a list/`nn.Sequential`
            of layers (built everywhere; only this stage's are kept).
        plan: stage boundaries, replicas, schedule, micro-batch size.
        comm: MPI communicator (default COMM_WORLD); its size must match the plan.
        lr, momentum, weight_decay: SGD settings, unless `optimizer` is given.
        optimizer: factory `params -> torch.optim.Optimizer`.
        loss_fn: loss of the last stage (default cross-entropy, mean over the micro-batch).
        weight_policy: "stash" (default for 1f1b), "latest" (default for gpipe),
            "vertical", or a `WeightPolicy` subclass; schedule "async" always runs
            PipeMare's `AsyncWeights`.
        pipemare: T1 and T2 of the "async" schedule (`pipemare.PipeMareOptions`).
        recompute: True, or the stages that keep only each micro-batch's input and
            recompute its forward in the backward (activation recomputation): on the
            version the forward used, or under "async" on the current weights. The last
            stage never does (its loss needs the labels).
        vertical_sync: shorthand for weight_policy="vertical".
        compression, staleness: gradient all-reduce of replicated stages (engine).
        seed: layer initialization and per-micro-batch RNG (dropout) seed. The replicas of
            a replicated stage start from its first replica's parameters and buffers
            (broadcast at construction), however each rank built them.
        input_shape: one sample's shape when `model` is a plain list of layers.
        device: where this rank's stage computes (`pipesgd.device()` gives the rank's
            GPU); None: where the model builds its layers (the CPU). Inputs and labels
            move to it; activations and gradients cross ranks through host staging.
        staging: move activations, gradients and replica all-reduces through host
            buffers ordered by events (`pipesgd.staging`); None: where the stage is on a
            GPU. True on the CPU runs the same path without one (for tests).

    Raises:
        PlanError: the plan does not fit the model or the number of ranks.
    """

    def __init__(
        self,
        model: LayerModel | nn.Sequential | Sequence[nn.Module],
        plan: Plan,
        comm: MPI.Comm | None = None,
        *,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        weight_policy: str | type[WeightPolicy] | None = None,
        vertical_sync: bool = False,
        compression: str = "none",
        staleness: int = 1,
        seed: int = 0,
        record_timeline: bool = True,
        pipemare: PipeMareOptions | None = None,
        recompute: bool | Sequence[int] = False,
        device: torch.device | str | None = None,
        staging: bool | None = None,
    ) -> None:
        keep_freed_memory()  # a stage's tensors reuse the heap instead of page-faulting
        if not isinstance(model, LayerModel):
            model = from_modules(list(model), input_shape=(), num_classes=0)
        self.model = model
        self.plan = plan
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        plan.validate(num_layers=model.num_layers)
        plan.check_world(self.comm.Get_size())
        self.rank = self.comm.Get_rank()
        self.stage_id, self.replica = plan.position(self.rank)
        self.stage_plan = plan.stages[self.stage_id]
        self.first = self.stage_id == 0
        self.last = self.stage_id == plan.num_stages - 1
        self.seed = seed
        if vertical_sync:
            weight_policy = "vertical"
        self._chosen_policy = weight_policy  # None: follows the schedule (use_schedule)
        if plan.schedule == "async" and weight_policy is not None:
            raise PlanError("schedule 'async' holds one copy of the weights (PipeMare): it "
                            "takes no weight_policy or vertical_sync")
        if weight_policy is None:
            weight_policy = "latest" if plan.schedule == "gpipe" else "stash"
        self.pipemare = pipemare or PipeMareOptions()
        if not isinstance(recompute, bool):
            stages = set(recompute)
            if not stages <= set(range(plan.num_stages)):
                raise PlanError(f"recompute names stages {sorted(stages)} but the plan has "
                                f"stages 0..{plan.num_stages - 1}")
            recompute = self.stage_id in stages
        self.recompute = recompute
        if weight_policy == "vertical" and any(s.replicas > 1 for s in plan.stages):
            raise PlanError(
                "vertical sync needs one version counter per stage; it does not combine with "
                "replicated stages: set every stage's replicas to 1 or drop vertical_sync"
            )
        self.weight_policy = weight_policy
        # Collective: a rank without CUDA stops every rank, not only itself, so none is
        # left waiting in the communicator split below.
        asked = torch.device(device) if device is not None else None
        require_cuda_everywhere(self.comm, asked is not None and asked.type == "cuda",
                                f"device={device!r}", "leave device=None (the CPU)")
        module = model.build(self.stage_plan.start, self.stage_plan.end, seed=seed)
        if asked is not None:
            module = module.to(asked)
        # a stage without parameters or buffers still computes where it was asked to
        self.device = asked if asked is not None else _module_device(module)
        if staging is False and self.device.type != "cpu":
            raise ValueError(f"stage {self.stage_id} is on {self.device}, and MPI and the "
                             "engine read host memory: leave staging=None (or True)")
        self.staging = HostStaging(self.device) \
            if staging or self.device.type != "cpu" else None
        # Collective over comm: every rank splits, each stage gets its replicas' group.
        self.stage_comm = self.comm.Split(self.stage_id, self.replica)
        if self.stage_plan.replicas > 1:
            # Before the stage exists: its weight policy and optimizer see only replica 0's
            # weights, whatever each rank's model built.
            broadcast_from_first_replica(module, self.stage_comm)
        if optimizer is None:
            def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
                return torch.optim.SGD(params, lr=lr, momentum=momentum,
                                       weight_decay=weight_decay)
        self.stage = Stage(
            module,
            self.stage_id,
            self.last,
            optimizer,
            self._policy_factory(plan, weight_policy),
            loss_fn or nn.CrossEntropyLoss(),
            recompute=recompute,
        )
        if self.stage_plan.replicas > 1:
            self.sync: LocalGradients | ReplicaGradientSync = ReplicaGradientSync(
                self.stage_comm, compression=compression, staleness=staleness,
                staging=self.staging,
            )
        else:
            self.sync = LocalGradients()
        self.link = StageLink(self.comm, plan, self.rank, staging=self.staging)
        label = f"stage {self.stage_id}" + (
            f" replica {self.replica}" if self.stage_plan.replicas > 1 else ""
        )
        self.timeline = Timeline(self.rank, label)
        self.record_timeline = record_timeline
        self.epochs_done = 0
        self._schedules: dict[int, sched.Schedule] = {}
        self._shaken = False
        self._handlers: dict[str, Callable[[Action], None]] = {
            "F": self._forward, "B": self._backward, "U": self._update, "AR": self._allreduce,
            "RF": self._recv, "RB": self._recv, "SF": self._send, "SB": self._send,
        }

    def _policy_factory(self, plan: Plan, weight_policy: str | type[WeightPolicy]
                        ) -> Callable[[list[nn.Parameter]], WeightPolicy]:
        if plan.schedule != "async":
            return lambda params: make_policy(weight_policy, params)
        tau_fwd, tau_bkwd = sched.delays(plan)[self.stage_id]
        return lambda params: AsyncWeights(params, tau_fwd, tau_bkwd, self.pipemare,
                                           recompute=self.recompute)

    def use_schedule(self, schedule: str) -> None:
        """Switch the schedule between epochs, e.g. from synchronous warm-up epochs
        (`1f1b` with stashing, PipeMareW) to `async`, keeping the weights, the optimizer
        state and its step count, and the weight policy the pipeline was built with (or,
        if none was named, the new schedule's default). Call it on every rank between
        epochs.

        Raises:
            PlanError: "async" for a pipeline built with a weight policy or vertical sync
                (PipeMare keeps one copy of the weights).
        """
        if self.stage.in_flight:
            raise RuntimeError("switch schedules between epochs, not with micro-batches "
                               "in flight")
        if schedule == "async" and self._chosen_policy is not None:
            raise PlanError(f"schedule 'async' holds one copy of the weights (PipeMare); "
                            f"this pipeline was built with weight policy "
                            f"{self._chosen_policy!r}: build it without one to switch")
        plan = self.plan.replace(schedule=schedule)
        plan.validate(num_layers=self.model.num_layers)
        policy = self._chosen_policy or ("latest" if schedule == "gpipe" else "stash")
        self.plan, self._schedules = plan, {}
        self.stage.set_policy(self._policy_factory(plan, policy))

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps this stage has taken since the run began (resumes included)."""
        return self.stage.steps

    @property
    def delays(self) -> list[tuple[int, int]]:
        """(tau_fwd, tau_bkwd) of every stage in optimizer steps (`schedule.delays`)."""
        return sched.delays(self.plan)

    # ------------------------------------------------------------------ schedule
    def schedule(self, num_micro_batches: int) -> sched.Schedule:
        """Every rank's lowered, deadlock-checked schedule of one epoch."""
        if num_micro_batches not in self._schedules:
            self._schedules[num_micro_batches] = sched.build(self.plan, num_micro_batches)
        return self._schedules[num_micro_batches]

    # ------------------------------------------------------------------ training
    def train_epoch(
        self,
        data: MicroBatches,
        epoch: int | None = None,
        *,
        max_micro_batches: int | None = None,
        on_micro_batch: Callable[[int, float], None] | None = None,
    ) -> EpochStats:
        """Run one epoch of the plan's schedule; returns the same stats on every rank.

        Args:
            data: the same deterministic stream on every rank (only the first stage reads
                inputs, only the last reads labels).
            epoch: epoch number (default: the next one); it seeds the data order.
            max_micro_batches: cut the epoch short (e.g. for benchmarks).
            on_micro_batch: called on last-stage ranks after each forward with
                (micro-batch, loss).
        """
        epoch = self.epochs_done if epoch is None else epoch
        n = len(data) if max_micro_batches is None else min(len(data), max_micro_batches)
        if data.micro_batch != self.plan.micro_batch:
            raise PlanError(
                f"the data is cut into micro-batches of {data.micro_batch} but the plan says "
                f"{self.plan.micro_batch}: build MicroBatches(x, y, "
                f"micro_batch={self.plan.micro_batch})"
            )
        acts = self.schedule(n)[self.rank]
        if not self._shaken:
            spec = None
            if self.first:
                x0 = data.inputs(epoch, 0)
                spec = TensorSpec(x0.dtype, tuple(x0.shape))
            self.link.handshake(spec, self.stage.probe)
            self._shaken = True
        self._data, self._epoch, self._on_mb = data, epoch, on_micro_batch
        self._inputs: dict[int, tuple[Tensor, int]] = {}
        self._outputs: dict[int, tuple[Tensor, int]] = {}
        self._grads: dict[int, Tensor] = {}
        self._grad_in: dict[int, Tensor] = {}
        self._last_round = max((a.mb for a in acts if a.kind == "U"), default=-1)
        self._closing = sched.closing_backwards(acts)
        self._live_ok = no_step_between_forward_and_backward(acts)
        # floats, or tensors summed on the device (see _forward)
        self._loss_sum: float | Tensor = 0.0
        self._correct: int | Tensor = 0
        self._seen = 0
        if not self.record_timeline:
            self.timeline.clear()

        self.comm.Barrier()
        self.timeline.start_epoch(epoch)
        start = time.perf_counter()
        posted = 0
        for i, a in enumerate(acts):
            while posted < min(len(acts), i + LOOKAHEAD):
                b = acts[posted]
                if b.kind in ("RF", "RB"):
                    self.link.post(b, sched.peer(self.plan, b))
                posted += 1
            t0 = time.perf_counter()
            try:
                self._handlers[a.kind](a)
            except Exception:
                print(
                    f"rank {self.rank} failed at action {a} (step {i}); schedule:\n"
                    + sched.format_table({self.rank: acts}, {self.rank: i}),
                    file=sys.stderr, flush=True,
                )
                raise
            self.timeline.record(str(a), a.kind, t0, time.perf_counter())
            self.link.progress()
        self.link.drain()
        elapsed = time.perf_counter() - start
        if self.stage.in_flight:
            raise RuntimeError(f"rank {self.rank}: {self.stage.in_flight} micro-batches left "
                               f"in flight after the epoch; the schedule is incomplete")
        self.epochs_done = epoch + 1
        return self._epoch_stats(epoch, n, elapsed)

    def _epoch_stats(self, epoch: int, n: int, elapsed: float) -> EpochStats:
        mine = {
            "stage": self.stage_id,
            "seconds": elapsed,
            "busy": self.timeline.busy(),
            "loss": float(self._loss_sum),
            "correct": int(self._correct),
            "seen": self._seen,
            "versions": self.stage.policy.peak_versions,
            "stash": self.stage.policy.peak_bytes / 2**20,
            "act": self.stage.peak_activation_bytes / 2**20,
            "saved": self.stage.peak_saved_bytes / 2**20,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "weights": tensors_bytes(self.stage.params) / 2**20,
            "optimizer": (0 if self.stage.optimizer is None else tensors_bytes(
                t for state in self.stage.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)) / 2**20),
        }
        every = self.comm.allgather(mine)
        seconds = max(r["seconds"] for r in every)
        seen = sum(r["seen"] for r in every)
        util = [r["busy"] / seconds for r in every]
        per_stage = [
            sum(u for u, r in zip(util, every, strict=True) if r["stage"] == s)
            / self.plan.stages[s].replicas
            for s in range(self.plan.num_stages)
        ]
        samples = n * self.plan.micro_batch
        return EpochStats(
            epoch=epoch,
            micro_batches=n,
            samples=samples,
            seconds=seconds,
            throughput_samples_per_s=samples / seconds,
            loss=sum(r["loss"] for r in every) / max(1, seen),
            accuracy=sum(r["correct"] for r in every) / max(1, seen),
            utilisation=util,
            stage_utilisation=per_stage,
            peak_versions=[r["versions"] for r in every],
            peak_stash_mb=[r["stash"] for r in every],
            peak_activation_mb=[r["act"] for r in every],
            peak_saved_mb=[r["saved"] for r in every],
            peak_rss_mb=[r["rss"] for r in every],
            weight_mb=[r["weights"] for r in every],
            optimizer_state_mb=[r["optimizer"] for r in every],
        )

    # ------------------------------------------------------------------ actions
    def _seed(self, mb: int) -> None:
        # Per-micro-batch RNG: dropout masks do not depend on the partition or on resume,
        # and a recomputed forward draws the same ones. Only the generators the stage
        # draws from: torch.manual_seed also queues every accelerator backend's seeding
        # with a stack trace, ~0.1 ms per micro-batch.
        seed = (self.seed * 1_000_003 + self._epoch * 100_019 + mb) * 131 + self.stage_id
        torch.default_generator.manual_seed(seed)
        device = self.device
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            torch.cuda.default_generators[index].manual_seed(seed)

    def _forward(self, a: Action) -> None:
        self._seed(a.mb)
        if self.first:
            x, version = self._data.inputs(self._epoch, a.mb).to(self.device), None
        else:
            x, version = self._inputs.pop(a.mb)
        out, used = self.stage.forward(a.mb, x, version, a.mb in self._live_ok)
        if self.last:
            y = self._data.labels(self._epoch, a.mb).to(self.device)
            loss = self.stage.loss(a.mb, y).detach()
            correct = (out.detach().argmax(dim=1) == y).sum()
            if loss.is_cuda and self._on_mb is None:
                # summed on the device: reading them each micro-batch would wait for it
                self._loss_sum += loss.double() * len(y)
                self._correct += correct
            else:
                value = float(loss)
                self._loss_sum += value * len(y)
                self._correct += int(correct)
                if self._on_mb is not None:
                    self._on_mb(a.mb, value)
            self._seen += len(y)
        else:
            self._outputs[a.mb] = (out, used)

    def _backward(self, a: Action) -> None:
        grad = None if self.last else self._grads.pop(a.mb)
        if self.stage.recomputes:
            self._seed(a.mb)
        made = None
        if a.mb in self._closing:  # a replica reduces buckets as the backward makes them
            made = self.sync.open_round(self.stage.grad_sum, self.stage.param_ranges)
        grad_x = self.stage.backward(a.mb, grad, made)
        if not self.first:
            self._grad_in[a.mb] = grad_x

    def _send(self, a: Action) -> None:
        dst = sched.peer(self.plan, a)
        if a.kind == "SF":
            out, version = self._outputs.pop(a.mb)
            self.link.send(out, a, dst, version)
        else:
            self.link.send(self._grad_in.pop(a.mb), a, dst)

    def _recv(self, a: Action) -> None:
        t, version = self.link.recv(a, sched.peer(self.plan, a), self.device)
        if a.kind == "RF":
            self._inputs[a.mb] = (t, version)
        else:
            self._grads[a.mb] = t

    def _allreduce(self, a: Action) -> None:
        flat, count = self.stage.take_gradient()
        self.sync.submit(flat, count)

    def _update(self, a: Action) -> None:
        if self.stage_plan.replicas == 1:
            flat, count = self.stage.take_gradient()
            self.sync.submit(flat, count)
        else:
            self.link.flush()  # the other replicas' rounds may wait for this rank's sends
        grads = self.sync.flush() if a.mb == self._last_round else self.sync.ready()
        for g in grads:
            self.stage.step(g)

    def evaluate(self, inputs: Tensor, labels: Tensor,
                 batch_size: int | None = None) -> Evaluation:
        """Loss and accuracy of the current weights on held-out samples, the same on
        every rank (collective; `pipesgd.pipeline.evaluate`)."""
        return evaluate(self, inputs, labels, batch_size)

    # ------------------------------------------------------------------ state
    def layer_state(self) -> dict[str, Tensor]:
        """This stage's parameters and buffers keyed `<global layer>.<name>`."""
        out = {}
        for key, t in self.stage.module.state_dict().items():
            local, _, rest = key.partition(".")
            out[f"{int(local) + self.stage_plan.start}.{rest}"] = t.detach().clone()
        return out

    def gather_state(self, root: int = 0) -> list[dict[str, Tensor]] | None:
        """Every rank's `layer_state()` on `root` (indexed by rank), None elsewhere."""
        return self.comm.gather(self.layer_state(), root=root)

    def model_state(self, root: int | None = 0) -> dict[str, Tensor] | None:
        """The whole model's parameters and buffers keyed `<global layer>.<name>`, merged
        from every stage: on `root` (None elsewhere), or on every rank with root=None."""
        mine = self.layer_state()
        states = self.comm.allgather(mine) if root is None else self.comm.gather(mine, root)
        return None if states is None else {k: v for s in states for k, v in s.items()}

    def steady_micro_batch_s(self) -> float:
        """Seconds per micro-batch of the epochs the timeline holds (since it was last
        cleared), in their steady state: `steady_micro_batch_s` of the first stage's
        backwards on every replica, over whole cycles of the plan. The same on every
        rank; collective."""
        mine = [t1 for _, kind, _, _, t1 in self.timeline.events if kind == "B"] \
            if self.stage_id == 0 else []
        return steady_micro_batch_s([t for ends in self.comm.allgather(mine) for t in ends],
                                    self.plan.cycle)

    def close(self) -> None:
        """Release the communicators and the engine of a replicated stage."""
        self.sync.shutdown()
        if self.staging is not None:
            self.staging.close()
        self.link.close()
        self.stage_comm.Free()


@dataclass(frozen=True)
class ActionTimes:
    """Mean seconds of one stage's forward (with the loss), backward and update actions
    per micro-batch, as `Pipeline.train_epoch` ran them."""

    forward_s: float
    backward_s: float
    update_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s


def _module_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its first parameter's or buffer's device (CPU if none)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def time_actions_in_cpu(pipe: Pipeline, spent: dict[str, float]) -> None:
    """From now on, add the thread CPU time of each of `pipe`'s actions whose kind is a key
    of `spent` ("F", "B", "AR", "U", ...) to that key."""
    def timed(kind: str, handler: Callable[[Action], None]) -> Callable[[Action], None]:
        def run(a: Action) -> None:
            start = time.thread_time()
            handler(a)
            spent[kind] += time.thread_time() - start
        return run

    pipe._handlers = {k: timed(k, h) if k in spent else h for k, h in pipe._handlers.items()}


def action_times(model: LayerModel, micro_batch: int, micro_batches: int = 32,
                 device: torch.device | str | None = None) -> ActionTimes:
    """`model` as a one-stage pipeline on this process alone (MPI.COMM_SELF), on random
    samples, on `device` (default the CPU): the mean F, B and U of `micro_batches`
    micro-batches after a warm-up. What the runtime's own calls cost around the layers,
    and the caches as training leaves them, are in these times; a per-layer profile's
    isolated layers miss both. On the CPU with one torch thread the times are the
    thread's CPU time (what the work costs, not the time it waited for a core it
    shares); else wall time (a GPU computes apart from the thread, and torch's idle
    intra-op threads spin)."""
    data = _random_micro_batches(model, micro_batch, micro_batches)
    pipe = Pipeline(model, Plan.even(model.num_layers, 1, micro_batch=micro_batch),
                    MPI.COMM_SELF, lr=1e-4, device=device)
    spent = {"F": 0.0, "B": 0.0, "U": 0.0}
    cpu_time = times_cpu_work(on_gpu=pipe.device.type != "cpu")
    if cpu_time:
        time_actions_in_cpu(pipe, spent)
    try:
        pipe.train_epoch(data, 0, max_micro_batches=max(2, micro_batches // 4))
        pipe.timeline.clear()
        spent.update(dict.fromkeys(spent, 0.0))
        pipe.train_epoch(data, 1)
        if not cpu_time:
            for _, kind, _, t0, t1 in pipe.timeline.events:
                if kind in spent:
                    spent[kind] += t1 - t0
        return ActionTimes(*(spent[k] / micro_batches for k in ("F", "B", "U")))
    finally:
        pipe.close()


def action_times_beside_others(comm: MPI.Comm, model: LayerModel, micro_batch: int,
                               device: torch.device | str | None = None,
                               threads: int = 1) -> ActionTimes | None:
    """`action_times` run by every rank of `comm` at once, each on its own process with
    `threads` torch threads (the profiler's), the mean over the ranks; None on every rank
    if the model does not fit one of them (out of memory).

    Ranks that share a host's cores and memory slow each other's passes (caches evicted
    at every switch, memory bandwidth): the small MLP's pass cost 26-58 % more CPU time
    with 3-4 ranks on 2 cores than alone, the CNN's 3-14 %. A profile calibrated on
    these times costs each action what training beside the other ranks will. Collective.

    Raises:
        RuntimeError: on every rank, naming the rank, where one failed otherwise.
    """
    comm.Barrier()
    mine: ActionTimes | str
    try:
        with torch_threads(threads):
            mine = action_times(model, micro_batch, device=device)
    except Exception as err:  # every rank must hear of it, not wait for it
        mine = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    every = comm.allgather(mine)
    failed = [(r, m) for r, m in enumerate(every) if isinstance(m, str)]
    broken = [(r, m) for r, m in failed if "out of memory" not in m.lower()]
    if broken:
        raise RuntimeError(f"rank {broken[0][0]} could not run the whole model: "
                           f"{broken[0][1]}")
    if failed:
        return None
    return ActionTimes(*(sum(getattr(t, f) for t in every) / len(every)
                         for f in ("forward_s", "backward_s", "update_s")))


def medians_in_turn(runs: Sequence[Iterator[float]],
                    count: int = CALIBRATION_RUNS) -> list[float]:
    """The median of `count` samples of each of `runs`, taken in turn, each turn
    starting one run later, so that every run samples the same spells of the machine:
    their ratios are what the planner ranks on, and a spell of seconds that took one
    run's samples alone would shift it against the others (one launch's five
    calibrations, each run after the other, put the CNN's straight pipeline on 3 ranks
    at 0.92-1.01 of data parallelism's rate, where their rounds measured 0.96-1.03).
    Closes every run, the last first (each holds its own torch thread count).
    Collective where the runs are."""
    samples: list[list[float]] = [[] for _ in runs]
    try:
        for turn in range(count):
            for i in range(len(runs)):
                k = (turn + i) % len(runs)
                samples[k].append(next(runs[k]))
    finally:
        for run in reversed(runs):
            run.close()
    return [statistics.median(s) for s in samples]


def _median_of(runs: Iterator[float] | None) -> float | None:
    """The median of `CALIBRATION_RUNS` samples of `runs` (None: None), closing it."""
    return None if runs is None else medians_in_turn([runs])[0]


def replicated_round_runs(comm: MPI.Comm, model: LayerModel, micro_batch: int,
                          rounds: int = CALIBRATION_CAP,
                          budget_s: float = 2.0) -> Iterator[float] | None:
    """Samples of the seconds one update round of `model` takes when every rank of
    `comm` is a replica of it (the whole model as one stage, 1F1B-RR: each rank's
    forward, backward, the gradient's ring all-reduce and the step): after two rounds of
    warm-up, each sample an epoch of `rounds` / `CALIBRATION_RUNS` rounds (fewer, at
    least one, where `CALIBRATION_RUNS` of them would take longer than `budget_s`), the
    slowest rank's seconds per round. None on a single rank. On the CPU with one torch
    thread, as the profile runs. Collective at each sample.

    Ranks that share cores lose more to a replicated round than its actions and its
    ring's bytes: the gradient's copy and the step find their data evicted after the
    wait, the engine's thread competes for the caches, and a ring step waits for both
    of its ranks to be on a core (`bench/replica_round.py` shows where it goes). The
    planner charges what these rounds took beyond their simulation to replicated stages
    (`planner.fit_replica_overhead`). A median of samples keeps a spell the machine
    spent elsewhere out of it (one epoch of a CNN's round took twice the others' time in
    a launch, and its charge made the whole model's replicas predicted 45 % slow)."""
    size = comm.Get_size()
    if size < 2:
        return None
    plan = Plan((StagePlan(0, model.num_layers, size),), schedule="1f1b-rr",
                micro_batch=micro_batch)

    def samples() -> Iterator[float]:
        with torch_threads(1):
            pipe = Pipeline(model, plan, comm, lr=1e-4)
            try:
                # epochs' seconds are the slowest rank's, so every rank picks the same count
                warm = pipe.train_epoch(_random_micro_batches(model, micro_batch, 2 * size), 0)
                fit = int(budget_s / max(warm.seconds / 2, 1e-9))
                each = max(1, min(rounds, fit) // CALIBRATION_RUNS)
                data = _random_micro_batches(model, micro_batch, each * size)
                for run in itertools.count(1):
                    yield pipe.train_epoch(data, run).seconds / each
            finally:
                pipe.close()

    return samples()


def replicated_round_s(comm: MPI.Comm, model: LayerModel, micro_batch: int,
                       rounds: int = CALIBRATION_CAP, budget_s: float = 2.0) -> float | None:
    """Seconds one update round of `model` takes with every rank of `comm` a replica of
    it: the median of `CALIBRATION_RUNS` samples of `replicated_round_runs`, the same on
    every rank; None on a single rank. Collective."""
    runs = replicated_round_runs(comm, model, micro_batch, rounds, budget_s)
    return _median_of(runs)


def steady_micro_batch_s(ends: Sequence[float], cycle: int = 1) -> float:
    """Seconds per micro-batch in a pipeline's steady state, from when the first stage's
    backwards ended (every replica's, in any order): from the end of the first quarter
    over whole cycles of `cycle` micro-batches (`Plan.cycle`) up to the start of the last
    quarter, so the startup and the drain stay out, as the planner's simulator counts
    it. Whole cycles, because replicas that work in step end their backwards in
    clusters: a count from a cluster's first end to another's last would count a
    cluster more than the time it spans.

    Raises:
        ValueError: too few ends for a cycle between the quarters."""
    ends = sorted(ends)
    a, b = len(ends) // 4, len(ends) - 1 - len(ends) // 4
    b = a + (b - a) // cycle * cycle
    if a == 0 or b <= a:
        raise ValueError(f"too few backwards ({len(ends)}) for a steady state of whole "
                         f"cycles of {cycle} micro-batches between the quarters")
    return (ends[b] - ends[a]) / (b - a)


def pipeline_micro_batch_runs(comm: MPI.Comm, model: LayerModel, plan: Plan,
                              budget_s: float = 2.0,
                              per_rank: int = CALIBRATION_CAP // CALIBRATION_RUNS
                              ) -> Iterator[float] | None:
    """Samples of the seconds per micro-batch of `plan` run on the ranks of `comm`, in
    its steady state (`steady_micro_batch_s`): after an epoch of warm-up, each sample an
    epoch of 4 to `per_rank` micro-batches per rank (as many as `CALIBRATION_RUNS`
    epochs fit in `budget_s`). The same on every rank, None on a single rank. On the
    CPU with one torch thread, as the profile runs. Collective at each sample.

    The pipeline counterpart of `replicated_round_runs`: where ranks share cores a
    stage's micro-batch costs more than its profiled layers and the runtime's measured
    overhead (the next stage's activations arrive from another process's memory,
    several micro-batches' saved tensors share the caches, every stage's thread wants a
    core), and the planner charges what this run took beyond its simulation to every
    stage of every plan (`planner.fit_pipeline_overhead`).

    Raises (at the first sample):
        PlanError: a plan for another number of ranks or layers (`Pipeline`'s checks)."""
    size = comm.Get_size()
    if size < 2:
        return None
    micro = plan.micro_batch

    def samples() -> Iterator[float]:
        with torch_threads(1):
            pipe = Pipeline(model, plan, comm, lr=1e-4)
            try:
                warm = pipe.train_epoch(_random_micro_batches(model, micro, 4 * size), 0)
                # epochs' seconds are the slowest rank's, so every rank picks the same count
                fit = int(budget_s / CALIBRATION_RUNS / max(warm.seconds / 4, 1e-9))
                data = _random_micro_batches(model, micro, size * max(4, min(per_rank, fit)))
                for run in itertools.count(1):
                    pipe.timeline.clear()
                    pipe.train_epoch(data, run)
                    yield pipe.steady_micro_batch_s()
            finally:
                pipe.close()

    return samples()


def pipeline_micro_batch_s(comm: MPI.Comm, model: LayerModel, plan: Plan,
                           budget_s: float = 2.0,
                           per_rank: int = CALIBRATION_CAP // CALIBRATION_RUNS) -> float | None:
    """Seconds per micro-batch of `plan` on the ranks of `comm`: the median of
    `CALIBRATION_RUNS` samples of `pipeline_micro_batch_runs`, the same on every rank;
    None on a single rank. Collective.

    Raises:
        PlanError: a plan for another number of ranks or layers (`Pipeline`'s checks)."""
    runs = pipeline_micro_batch_runs(comm, model, plan, budget_s, per_rank)
    return _median_of(runs)


def data_parallel_iteration_runs(comm: MPI.Comm, model: LayerModel, batch: int, *,
                                 staleness: int = 2, compression: str = "none",
                                 overlap: str = "sequential", steps: int = CALIBRATION_CAP,
                                 budget_s: float = 2.0) -> Iterator[float] | None:
    """Samples of the seconds one iteration of `model` takes under data parallelism on
    every rank of `comm` (`pipesgd.DistributedOptimizer` over SGD with `staleness`,
    `compression` and `overlap`, `batch` samples per rank): after three iterations of
    warm-up, each sample a run of `steps` / `CALIBRATION_RUNS` back-to-back iterations
    (fewer, at least one, where `CALIBRATION_RUNS` of them would take longer than
    `budget_s`) after one that refills the allreduces in flight, the slowest rank's
    seconds per iteration. None on a single rank. On the CPU with one torch thread, as
    the profile runs. Collective at each sample.

    The data-parallel counterpart of `replicated_round_runs`: ranks that share cores
    lose more to an iteration than the timing model counts (the step's hand-offs, the
    engine's thread beside the compute), and the planner charges what this run took
    beyond its prediction to every data-parallel configuration
    (`planner.fit_data_parallel_overhead`)."""
    from pipesgd.optim import DistributedOptimizer

    if comm.Get_size() < 2:
        return None

    def samples() -> Iterator[float]:
        with torch_threads(1):
            net = model.build(seed=0)
            opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-4),
                                       net.named_parameters(), staleness=staleness,
                                       compression=compression, overlap=overlap, comm=comm)
            # new samples every iteration, as training reads them (one batch kept in the
            # caches ran about 6 % faster than the same loop over a data set)
            data = _random_micro_batches(model, batch, DATA_PARALLEL_BATCHES)
            xs, ys = data.x.split(batch), data.y.split(batch)
            step = itertools.count()

            def run(count: int) -> list[float]:
                """When each of `count` iterations began, and when the last ended; the
                allreduces still in flight waited for after it."""
                comm.Barrier()
                stamps = []
                for _ in range(count):
                    stamps.append(time.perf_counter())
                    opt.zero_grad()
                    k = next(step) % DATA_PARALLEL_BATCHES
                    nn.functional.cross_entropy(net(xs[k]), ys[k]).backward()
                    opt.step()
                stamps.append(time.perf_counter())
                opt.synchronize()
                return stamps

            warm = run(3)
            # every rank must run as many: the slowest rank's warm-up decides
            per_step = comm.allreduce((warm[-1] - warm[0]) / 3, op=MPI.MAX)
            each = max(1, min(steps, int(budget_s / max(per_step, 1e-9))) // CALIBRATION_RUNS)
            while True:
                # the first iteration finds no allreduce in flight: not counted
                stamps = run(1 + each)
                yield comm.allreduce((stamps[-1] - stamps[1]) / each, op=MPI.MAX)

    return samples()


def data_parallel_iteration_s(comm: MPI.Comm, model: LayerModel, batch: int, *,
                              staleness: int = 2, compression: str = "none",
                              overlap: str = "sequential", steps: int = CALIBRATION_CAP,
                              budget_s: float = 2.0) -> float | None:
    """Seconds one iteration of `model` takes under data parallelism on every rank of
    `comm`: the median of `CALIBRATION_RUNS` samples of `data_parallel_iteration_runs`,
    the same on every rank; None on a single rank. Collective."""
    runs = data_parallel_iteration_runs(comm, model, batch, staleness=staleness,
                                        compression=compression, overlap=overlap,
                                        steps=steps, budget_s=budget_s)
    return _median_of(runs)


def _random_micro_batches(model: LayerModel, micro_batch: int, count: int) -> MicroBatches:
    """`count` micro-batches of random samples and labels for `model` (seeded)."""
    g = torch.Generator().manual_seed(0)
    n = count * micro_batch
    return MicroBatches(torch.randn(n, *model.input_shape, generator=g),
                        torch.randint(model.num_classes, (n,), generator=g), micro_batch)


def runtime_overhead(device: torch.device | str | None = None) -> ActionTimes:
    """The runtime's own time per micro-batch on one stage, its layers' work apart: the
    actions of a one-stage pipeline of a 4x4 linear layer, one sample per micro-batch."""
    tiny = from_modules([nn.Linear(4, 4)], input_shape=(4,), num_classes=4)
    return action_times(tiny, 1, 400, device)
