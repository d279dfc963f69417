"""`pipesgd pipeline --plan auto`: choose the plan inside the job that runs it.

    mpirun -n 4 pipesgd pipeline --model cnn --plan auto --bandwidth 1Gbit --memory 64MB

Every rank takes the cluster from --topology, --bandwidth or --network (a network
`pipesgd timing measure` wrote) as `pipesgd plan` does, or else from the job's own
network (`measure_network`, all ranks, one level of p workers at its β and α, sharing the
cores it counted). Rank 0 profiles the model the run builds (its
`LayerModel`, at the run's micro-batch, one thread; scaled to the whole model's run on
every rank at once, as training will share the hosts, and on CPUs charged what a
replicated round and a data-parallel run of it took beyond their models:
`calibrated_profile`), ranks the candidates with
`pipesgd.planner.choose` and prints the ranking as
`pipesgd plan` prints it. The other ranks sleep meanwhile (`idle_barrier`). Rank 0 then
broadcasts its decision, or its error, so every rank runs the same plan or every rank
stops with the same message. The run is the best pipeline even where data parallelism
ranks first (the user asked for a pipeline); a line says so and gives its command.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .plan import Plan

AUTO = "auto"
NETWORK_REPEATS = 5  # measure_network's repeats: a few seconds on the job's own links


class AutoPlanError(ValueError):
    """No plan for this run (rank 0's error, raised on every rank)."""


def plan_argument(text: str) -> Path | str:
    """--plan: a plan JSON file, or the word `auto`."""
    if text == AUTO:
        return AUTO
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"no plan file {text!r}: give a plan JSON (`pipesgd plan --json plan.json` "
            "writes one) or `auto`")
    return Path(text)


@dataclass(frozen=True)
class AutoPlan:
    """What rank 0 decided, as every rank receives it.

    Attributes:
        plan: the best pipeline's plan (`PlanChoice.best_pipeline`), run by every rank.
        planner: the family that planned it ("pipedream", "madpipe" or "straight").
        predicted_samples_per_s: its simulated throughput.
        choice: the family ranked first (may be "data-parallel").
        explanation: the chooser's sentence on the winner against the runner-up.
        train_command: the `pipesgd train` command where data parallelism ranks first.
        profile: the per-layer profile (`ModelProfile.to_dict`) the chooser ranked on.
        topology: the cluster (`HierarchicalTopology.to_dict`).
        network: where the topology came from (options, or the measurement's source).
        memory_per_worker: the budget in bytes, or None.
        batch_size, micro_batch, staleness: as given to `choose`.
    """

    plan: Plan
    planner: str
    predicted_samples_per_s: float
    choice: str
    explanation: str
    train_command: str | None
    profile: dict[str, Any]
    topology: dict[str, Any]
    network: str
    memory_per_worker: float | None
    batch_size: int
    micro_batch: int
    staleness: int

    def to_dict(self, measured_samples_per_s: float | None = None) -> dict[str, Any]:
        """The chosen plan, its predicted and the run's measured samples/s side by side,
        and what `choose` needs to reproduce the choice."""
        return {
            "planner": self.planner,
            "plan": self.plan.to_dict(),
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "measured_samples_per_s": measured_samples_per_s,
            "choice": self.choice,
            "explanation": self.explanation,
            "train_command": self.train_command,
            "memory_per_worker": self.memory_per_worker,
            "batch_size": self.batch_size,
            "micro_batch": self.micro_batch,
            "staleness": self.staleness,
            "network": self.network,
            "topology": self.topology,
            "profile": self.profile,
        }

    def summary(self, measured_samples_per_s: float, ran: Plan | None = None) -> str:
        """Prediction beside measurement; `ran`: the plan that ran, if --schedule or
        --micro-batch changed the chosen one (the prediction is then for another plan)."""
        line = (f"auto plan ({self.planner}): predicted {self.predicted_samples_per_s:.0f} "
                f"samples/s, measured {measured_samples_per_s:.0f} samples/s")
        if ran is not None and describe_plan(ran) != describe_plan(self.plan):
            line += (f" (the prediction is for {describe_plan(self.plan)}; this run changed "
                     f"it to {describe_plan(ran)})")
        return line


def describe_plan(plan: Plan) -> str:
    """One line that is equal on two ranks exactly when they run the same plan."""
    stages = " ".join(f"[{s.start}, {s.end})x{s.replicas}" for s in plan.stages)
    return (f"stages {stages}, {plan.schedule}, micro-batch {plan.micro_batch}, "
            f"{plan.noam} in flight, {plan.micro_batches_per_step} micro-batch(es) per step")


def batch_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(batch, micro-batch) of the run, resolved as `pipesgd pipeline` resolves them
    without a plan: micro-batch 8; one micro-batch per step for 1F1B, 32 samples per
    flush for GPipe."""
    from .cli import DEFAULT_MICRO_BATCH, default_steps

    micro = args.micro_batch or DEFAULT_MICRO_BATCH
    if args.batch_size is not None:
        return args.batch_size, micro
    return micro * default_steps(args.schedule, micro), micro


def decide(args: argparse.Namespace, model: Any, comm: Any) -> AutoPlan:
    """Choose the plan on rank 0 and give it to every rank (collective).

    Args:
        args: `pipesgd pipeline`'s options (--topology, --bandwidth, --latency, --memory,
            --batch-size, --micro-batch, --schedule, --staleness, --model, --data).
        model: the `LayerModel` the run builds.
        comm: the job's communicator; the plan is for all of its ranks.

    Raises:
        AutoPlanError: on every rank, with rank 0's message (bad topology or sizes, a
            model the profiler cannot run, no plan within --memory).
    """
    from pipesgd.device import run_device
    from pipesgd.polling import decided_on_root

    from .runtime import action_times_beside_others

    errors = (ValueError, TypeError, OSError, RuntimeError)
    try:
        # where the stages will compute; collective for "cuda"
        device = run_device(getattr(args, "device", "cpu"), comm)
    except ValueError as err:
        raise AutoPlanError(str(err)) from err
    workers = comm.Get_size()
    given = bool(args.topology or args.bandwidth or getattr(args, "network", None))
    measured = None
    try:
        # the same on every rank, and so are their errors
        batch, micro = batch_sizes(args)
        if given:
            topology, network, measured = _given_topology(args, workers)
    except errors as err:
        raise AutoPlanError(str(err)) from err
    if not given:
        # collective: every rank measures
        topology, network, measured = measured_topology(comm, device)
    try:
        # collective: every rank runs the whole model at once, as training will
        whole = action_times_beside_others(comm, model, micro, device)
    except (ValueError, RuntimeError) as err:  # raised on every rank alike
        raise AutoPlanError(str(err)) from err
    try:
        prof = calibrated_profile(comm, model, args.model, micro, batch, topology,
                                  measured, device, whole, errors)
        return decided_on_root(
            comm, lambda: _choose(args, prof, workers, topology, network, measured), errors)
    except errors as err:
        raise AutoPlanError(str(err)) from err


def calibrated_profile(comm: Any, model: Any, name: str, micro: int, batch: int,
                       topology: Any, measured: Any = None, device: Any = None,
                       whole: Any = None,
                       errors: tuple[type[Exception], ...] = (ValueError,)) -> Any:
    """`model`'s layer profile as the planner ranks on it, the same on every rank
    (collective): rank 0 profiles it at `micro` samples on `device` (scaled to `whole`,
    the model's run beside the other ranks); where ranks compute on the CPU, every rank
    then runs, in turn (`runtime.medians_in_turn`), the pipeline of one stage per rank the
    chooser offers (`planner.straight_pipeline`), a round of the model replicated on every
    rank and the data-parallel configuration the timing model ranks first on the profile
    at `batch` samples (on `measured`, else `topology`'s network), and the profile is
    charged what each took beyond its model (`planner.calibrate`). `errors` raised on
    rank 0 are raised on every rank."""
    from pipesgd.planner.calibrate import (
        fit_data_parallel_overhead,
        fit_pipeline_overhead,
        fit_replica_overhead,
    )
    from pipesgd.planner.choose import data_parallel_pick, straight_pipeline
    from pipesgd.planner.profile import profile_layer_model
    from pipesgd.planner.simulate import simulate
    from pipesgd.polling import decided_on_root

    from .runtime import (
        data_parallel_iteration_runs,
        medians_in_turn,
        pipeline_micro_batch_runs,
        replicated_round_runs,
    )

    workers = comm.Get_size()
    runs_here = workers > 1 and whole is not None and (device is None or device.type == "cpu")

    def profiled() -> tuple[Any, Any, Any]:
        prof = profile_layer_model(model, name, micro, threads=1, device=device,
                                   whole=whole)
        if not runs_here:
            return prof, None, None
        straight = straight_pipeline(prof, workers, micro,
                                     lambda plan: simulate(plan, prof, topology))
        return prof, straight, data_parallel_pick(prof, topology, batch, measured).config

    prof, straight, config = decided_on_root(comm, profiled, errors)
    if not runs_here:
        return prof
    micro_batch_s, round_s, iteration_s = medians_in_turn([
        pipeline_micro_batch_runs(comm, model, straight),
        replicated_round_runs(comm, model, micro),
        data_parallel_iteration_runs(comm, model, batch, staleness=config.staleness,
                                     compression=config.compression,
                                     overlap=config.overlap)])

    def fitted() -> Any:
        # the pipeline's first: the replicated round is simulated with it
        out = fit_pipeline_overhead(prof, topology, straight, micro_batch_s)
        out = fit_replica_overhead(out, topology, round_s, workers)
        return fit_data_parallel_overhead(out, topology, iteration_s, config, batch, measured)

    return decided_on_root(comm, fitted, errors)


def measured_topology(comm: Any, device: Any = None) -> tuple[Any, str, Any]:
    """(one level of the job's p ranks at the measured β and α with the cores they share
    and, on a GPU `device`, its copy rate to the host (δ); a description; the measured
    `NetworkParams`). Collective."""
    from pipesgd.planner.topology import from_network
    from pipesgd.timing.measure import measure_network

    net = measure_network(comm, repeats=NETWORK_REPEATS, device=device)
    return from_network(net, comm.Get_size()), (
        f"{net.source}: beta {net.bandwidth_bytes_per_s * 8 / 1e9:.3g} Gbit/s, "
        f"alpha {net.alpha_s * 1e6:.3g} us"), net


def _given_topology(args: argparse.Namespace, workers: int) -> tuple[Any, str, Any]:
    """(the cluster --topology, --bandwidth or --network describes, its description, the
    measured `NetworkParams` of --network or None)."""
    from pipesgd.planner.cli import cluster_of

    network = getattr(args, "network", None)
    topo, measured = cluster_of(argparse.Namespace(
        topology=args.topology, bandwidth=args.bandwidth, latency=args.latency,
        network=network, workers=None if args.topology else workers))
    if topo.num_workers != workers:
        raise ValueError(f"--topology {args.topology!r} has {topo.num_workers} workers but "
                         f"the job runs {workers} ranks: run `mpirun -n {topo.num_workers} "
                         "...` or describe this job's ranks")
    if network:
        return topo, f"--network {network} ({measured.source})", measured
    return topo, (f"--topology {args.topology}" if args.topology else
                  f"--bandwidth {args.bandwidth} --latency {args.latency}"), None


def _choose(args: argparse.Namespace, prof: Any, workers: int, topology: Any,
            network: str, measured: Any) -> AutoPlan:
    """Rank 0: choose on the calibrated profile, print; the decision to broadcast."""
    from pipesgd.planner.choose import choose
    from pipesgd.planner.cli import print_choice, train_command

    batch, micro = batch_sizes(args)
    choice = choose(prof, topology, args.memory, batch_size=batch, micro_batch=micro,
                    staleness=args.staleness, dp_network=measured)
    print_choice(prof, topology, choice, args.model)
    best, pipeline = choice.best, choice.best_pipeline
    command = None
    if best.family == "data-parallel":
        command = train_command(argparse.Namespace(model=args.model, data=args.data,
                                                   batch_size=batch), best, workers)
    if pipeline is None:
        raise ValueError(f"no pipeline plan fits the budget; {choice.explanation} Data "
                         f"parallelism fits: {command or 'see the ranking'}")
    if command is not None:
        print(f"data parallelism ranks first (run it with: {command}); running the best "
              f"pipeline, {pipeline.family}'s, as asked")
    rate = pipeline.samples_per_s
    return AutoPlan(
        plan=pipeline.plan, planner=pipeline.family,
        predicted_samples_per_s=rate if math.isfinite(rate) else 0.0,
        choice=best.family, explanation=choice.explanation, train_command=command,
        profile=prof.to_dict(), topology=topology.to_dict(), network=network,
        memory_per_worker=choice.memory_per_worker, batch_size=batch, micro_batch=micro,
        staleness=args.staleness)


def plan_comm(comm: Any, plan: Plan) -> Any:
    """The ranks that run `plan` (the first `plan.world_size`), or None on the others: a
    plan may leave workers out where more of them would not run faster."""
    if plan.world_size == comm.Get_size():
        return comm
    from mpi4py import MPI

    inside = comm.Get_rank() < plan.world_size
    sub = comm.Split(0 if inside else MPI.UNDEFINED, comm.Get_rank())
    return sub if inside else None


__all__ = ["AUTO", "AutoPlan", "AutoPlanError", "batch_sizes", "decide", "describe_plan",
           "plan_argument", "plan_comm"]
