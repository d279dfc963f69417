"""`pipesgd pipeline`: pipeline-parallel training under mpirun.

    mpirun -n 2 pipesgd pipeline --model mlp --schedule 1f1b --epochs 3 --timeline out/
    mpirun -n 4 pipesgd pipeline --model cnn --plan auto --bandwidth 1Gbit --json run.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pipesgd.cli import positive_int
from pipesgd.device import add_device_argument, run_device
from pipesgd.model_names import HELP, layer_model, parse_shape

from .auto_plan import AUTO, plan_argument
from .pipemare import PipeMareOptions
from .plan import PlanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Pipeline-parallel training (1F1B / 1F1B-RR / GPipe) under mpirun."
    parser.add_argument("--model", default="mlp", help=HELP)
    parser.add_argument("--input-shape", type=parse_shape,
                        help="one sample's shape for a MODULE:FUNCTION model (e.g. 3,32,32)")
    parser.add_argument("--classes", type=int, default=10,
                        help="output classes of a MODULE:FUNCTION model (default 10)")
    parser.add_argument("--plan", type=plan_argument,
                        help="plan JSON, or `auto`: rank 0 profiles the model, chooses the "
                        "best pipeline for this job's ranks and network and every rank runs "
                        "it (default: even split, 1 replica)")
    parser.add_argument("--topology", help="with --plan auto: the cluster, levels innermost "
                        "first, as `pipesgd plan --topology` (default: measure the network)")
    parser.add_argument("--bandwidth", help="with --plan auto: link rate between any two "
                        "ranks, e.g. 1Gbit (default: measure the network)")
    parser.add_argument("--latency", default="20us",
                        help="with --plan auto --bandwidth: one-way latency (default 20us)")
    parser.add_argument("--network", metavar="FILE",
                        help="with --plan auto: a network `pipesgd timing measure --json "
                        "FILE` wrote, instead of measuring this job's")
    parser.add_argument("--memory", help="with --plan auto: memory per worker, e.g. 512MB "
                        "(default: no budget)")
    parser.add_argument("--schedule", choices=("1f1b", "1f1b-rr", "gpipe", "async"),
                        help="override the plan's schedule; async: PipeMare, one copy of "
                        "the weights, each backward on the weights current then")
    parser.add_argument("--t1", type=positive_int, metavar="K",
                        help="async: PipeMare's T1, each stage's learning rate divided by "
                        "its delay to a power annealed from 1 to 0 over K steps")
    parser.add_argument("--t2", type=float, metavar="D",
                        help="async: PipeMare's T2, the backward's weights extrapolated "
                        "back by the forward's delay with a velocity of decay D (e.g. 0.1)")
    parser.add_argument("--recompute", nargs="?", const="all", metavar="STAGES",
                        help="keep only each micro-batch's input and recompute its forward "
                        "in the backward (activation recomputation): on the weights the "
                        "forward used, or under async on the current ones; every stage, "
                        "or those listed (e.g. 0,1)")
    parser.add_argument("--sync-warmup-epochs", type=int, default=0, metavar="E",
                        help="async: run the first E epochs as 1f1b with weight stashing "
                        "(PipeMareW), then switch")
    parser.add_argument("--data", choices=("digits", "synthetic"),
                        help="default: digits for mlp, synthetic 32x32 images for cnn "
                        "(digits with an image model: scaled up to its input)")
    parser.add_argument("--samples", type=positive_int, default=2048,
                        help="synthetic data set size")
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--steps", type=positive_int, help="optimizer steps per epoch (cap)")
    parser.add_argument("--batch-size", type=positive_int,
                        help="samples per optimizer step: gpipe's flush (default 32); 1f1b "
                        "accumulates batch/micro-batch micro-batches per step (default: one, "
                        "PipeDream's step per micro-batch)")
    parser.add_argument("--micro-batch", type=positive_int,
                        help="samples per micro-batch (plan's)")
    parser.add_argument("--lr", type=float,
                        help=f"learning rate (default {DEFAULT_LR['mlp']} for mlp, "
                        f"{DEFAULT_LR['cnn']} otherwise: the CNN diverges at 0.05)")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    add_device_argument(parser)
    parser.add_argument("--vertical-sync", action="store_true")
    parser.add_argument("--compression", choices=("none", "trunc16", "quant8"), default="none",
                        help="all-reduce compression of replicated stages")
    parser.add_argument("--staleness", type=positive_int, default=1,
                        help="replicated stages apply the gradient of K-1 rounds ago")
    parser.add_argument("--json", type=Path, help="write throughput, utilisation, memory")
    parser.add_argument("--save", type=Path, help="checkpoint directory (written each epoch)")
    parser.add_argument("--resume", type=Path, help="continue from this checkpoint")
    parser.add_argument("--timeline", type=Path, help="write timeline.json and timeline.png")
    parser.add_argument("--print-schedule", action="store_true",
                        help="print every rank's schedule table and exit")
    parser.add_argument("--no-progress", action="store_true")


def _model(args, builtin):
    """The built-in model, or a MODULE:FUNCTION one sized by --input-shape/--classes."""
    if args.model in builtin:
        return builtin[args.model]()
    if args.input_shape is None:
        raise SystemExit(f"pipesgd pipeline: --model {args.model!r} needs --input-shape")
    try:
        return layer_model(args.model, args.input_shape, args.classes, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"pipesgd pipeline: {exc}") from exc


DEFAULT_MICRO_BATCH = 8
# Plain SGD on one micro-batch per step: the CNN's loss became nan at 0.05 in its first
# epoch on synthetic data, and trained at 0.02 and 0.01.
DEFAULT_LR = {"mlp": 0.05, "cnn": 0.01}


def pipemare_options(args: argparse.Namespace, plan) -> PipeMareOptions | None:
    """T1 and T2 from the flags; they need schedule async."""
    asked = args.t1 is not None or args.t2 is not None or args.sync_warmup_epochs
    if not asked:
        return None
    if plan.schedule != "async":
        raise SystemExit("pipesgd pipeline: --t1, --t2 and --sync-warmup-epochs are "
                         "PipeMare's: use them with --schedule async")
    try:
        return PipeMareOptions(args.t1, args.t2)
    except ValueError as exc:
        raise SystemExit(f"pipesgd pipeline: {exc}") from exc


def recompute_stages(text: str | None) -> bool | list[int]:
    if text is None or text == "all":
        return text == "all"
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"pipesgd pipeline: --recompute takes stage numbers such as 0,1, "
                         f"got {text!r}") from None


def format_delays(delays: list[tuple[int, int]]) -> str:
    return "delays (optimizer steps): " + ", ".join(
        f"stage {i} tau_fwd {f} tau_bkwd {b}" for i, (f, b) in enumerate(delays))


def learning_rate(args: argparse.Namespace) -> float:
    return args.lr if args.lr is not None else DEFAULT_LR.get(args.model, DEFAULT_LR["cnn"])


def diverged(loss: float, epoch: int, lr: float) -> str | None:
    """Why training cannot go on, if the epoch's loss is not a number any more."""
    if math.isfinite(loss):
        return None
    return (f"pipesgd pipeline: the loss became {loss} in epoch {epoch}: training diverged "
            f"at --lr {lr:g}; lower it (say --lr {lr / 5:g})")


def default_steps(schedule: str, micro_batch: int) -> int:
    """Micro-batches per step without --batch-size: one for 1F1B, 32 samples per GPipe
    flush."""
    return max(1, 32 // micro_batch) if schedule == "gpipe" else 1


def _plan(args, num_layers: int, world: int, chosen=None):
    from .plan import Plan

    if chosen is not None:
        plan = chosen
    elif args.plan is not None:
        plan = Plan.load(args.plan)
    else:
        plan = Plan.even(num_layers, world,
                         micro_batch=args.micro_batch or DEFAULT_MICRO_BATCH)
    changes = {}
    if args.schedule:
        changes["schedule"] = args.schedule
    if args.micro_batch:
        changes["micro_batch"] = args.micro_batch
    mb = changes.get("micro_batch", plan.micro_batch)
    schedule = changes.get("schedule", plan.schedule)
    if args.batch_size is not None:
        if args.batch_size < mb:
            raise SystemExit(f"--batch-size {args.batch_size} is smaller than one micro-batch "
                             f"({mb} samples)")
        changes["micro_batches_per_step"] = args.batch_size // mb
    elif args.plan is None:
        changes["micro_batches_per_step"] = default_steps(schedule, mb)
    return plan.replace(**changes)


def run(args: argparse.Namespace) -> int:
    cluster = [flag for flag, value in (
        ("--topology", args.topology), ("--bandwidth", args.bandwidth),
        ("--network", args.network), ("--memory", args.memory)) if value]
    if cluster and args.plan != AUTO:
        raise SystemExit(f"pipesgd pipeline: {' and '.join(cluster)} describe the job for "
                         "--plan auto, which chooses the plan: add --plan auto, or drop them")
    import torch
    from mpi4py import MPI

    from . import auto_plan, checkpoint, data, models
    from . import schedule as sched
    from . import timeline as tl
    from .runtime import Pipeline

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    model = _model(args, models.MODELS)
    auto = None
    if args.plan == AUTO:
        try:
            auto = auto_plan.decide(args, model, comm)
        except auto_plan.AutoPlanError as err:
            print(f"pipesgd pipeline: rank {rank}: error: {err}", file=sys.stderr, flush=True)
            return 2
        print(f"rank {rank}: {auto.planner} plan: {auto_plan.describe_plan(auto.plan)}",
              flush=True)
        comm = auto_plan.plan_comm(comm, auto.plan)
        if comm is None:
            print(f"rank {rank}: idle, the plan uses {auto.plan.world_size} ranks", flush=True)
            return 0
    try:  # the same on every rank, and so are their errors
        plan = _plan(args, model.num_layers, comm.Get_size(), auto and auto.plan)
        plan.validate(num_layers=model.num_layers)
    except ValueError as exc:  # a plan file that is no plan, or not for this model
        raise SystemExit(f"pipesgd pipeline: {exc}") from exc
    if args.print_schedule:
        if rank == 0:
            n = 2 * plan.world_size
            print(sched.format_table(sched.build(plan, n)))
            if plan.schedule == "async":
                print(format_delays(sched.delays(plan)))
        return 0
    try:
        plan.check_world(comm.Get_size())
    except PlanError as exc:
        raise SystemExit(f"pipesgd pipeline: {exc}") from exc
    kind = args.data or ("digits" if args.model == "mlp" else "synthetic")
    held_out = None  # the test split, evaluated after every epoch
    if kind == "digits":
        if model.input_shape == (64,):
            (x, y), held_out = data.digits(seed=args.seed)
        elif len(model.input_shape) == 3 and model.num_classes >= 10:
            (x, y), held_out = data.digits_as_images(model.input_shape, seed=args.seed)
        else:
            raise SystemExit(
                f"--data digits: 64 features or images (channels, height, width) of 10 "
                f"classes, but the model takes {model.input_shape} with "
                f"{model.num_classes} classes")
    else:
        x, y = data.synthetic(args.samples, model.input_shape, model.num_classes, args.seed)
    device = run_device(args.device, comm)
    # the data set is small: on the stage's device once, not per micro-batch
    stream = data.MicroBatches(x.to(device), y.to(device), plan.micro_batch,
                               seed=args.seed)
    limit = None
    if args.steps:
        limit = args.steps * plan.micro_batches_per_step
    lr = learning_rate(args)
    pipemare = pipemare_options(args, plan)
    warmup = args.sync_warmup_epochs if plan.schedule == "async" else 0
    try:  # its PlanErrors come before its first collective, alike on every rank
        pipe = Pipeline(model, plan.replace(schedule="1f1b") if warmup else plan, comm,
                        lr=lr, momentum=args.momentum, seed=args.seed,
                        vertical_sync=args.vertical_sync, compression=args.compression,
                        staleness=args.staleness, pipemare=pipemare,
                        recompute=recompute_stages(args.recompute),
                        device=device)
    except PlanError as exc:
        raise SystemExit(f"pipesgd pipeline: {exc}") from exc
    start_epoch = checkpoint.load(pipe, args.resume) if args.resume else 0
    history = []
    for epoch in range(start_epoch, start_epoch + args.epochs):
        if warmup and epoch >= warmup and pipe.plan.schedule != "async":
            # PipeMareW: the synchronous warm-up is over (or was, before a resume)
            pipe.use_schedule("async")
        bar = None
        if pipe.last and pipe.replica == 0 and not args.no_progress:
            from tqdm import tqdm

            n = len(stream) if limit is None else min(len(stream), limit)
            bar = tqdm(total=len([i for i in range(n)
                                  if plan.replica_of(pipe.stage_id, i) == 0]),
                       desc=f"epoch {epoch}", unit="mb", file=sys.stderr, leave=False)

        def tick(mb: int, loss: float, bar=bar) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")

        # without a bar, nothing reads each loss (on a GPU that would wait for it)
        stats = pipe.train_epoch(stream, epoch, max_micro_batches=limit,
                                 on_micro_batch=tick if bar is not None else None)
        if bar is not None:
            bar.close()
        history.append(stats.to_dict())
        held = ""
        if held_out is not None:
            test = pipe.evaluate(*held_out)
            history[-1].update(test_loss=test.loss, test_accuracy=test.accuracy)
            held = f" test accuracy {test.accuracy:.3f}"
        if rank == 0:
            util = " ".join(f"s{i}={u:.0%}" for i, u in enumerate(stats.stage_utilisation))
            print(f"epoch {epoch}: loss {stats.loss:.4f} accuracy {stats.accuracy:.3f}"
                  f"{held} | {stats.throughput_samples_per_s:.0f} samples/s | "
                  f"utilisation {util}", flush=True)
        # Every rank has the same loss (gathered), so all stop together.
        if (why := diverged(stats.loss, epoch, lr)) is not None:
            if rank == 0:
                print(why, file=sys.stderr, flush=True)
            pipe.close()
            return 1
        if args.save:
            checkpoint.save(pipe, args.save)
    if args.timeline:
        out = tl.write(pipe.timeline, comm, args.timeline, epoch=pipe.epochs_done - 1,
                       title=f"{args.model} {plan.schedule} {plan.num_stages} stages")
        if out is not None:
            print(f"timeline: {out / 'timeline.json'} {out / 'timeline.png'}")
    if auto is not None and rank == 0 and history:
        print(auto.summary(history[-1]["throughput_samples_per_s"], plan), flush=True)
    if args.json and rank == 0 and history:
        last = history[-1]
        report = {
            "model": args.model,
            "plan": plan.to_dict(),
            "throughput_samples_per_s": last["throughput_samples_per_s"],
            "stage_utilisation": last["stage_utilisation"],
            "utilisation_per_rank": last["utilisation"],
            "peak_rss_mb": last["peak_rss_mb"],
            "peak_stash_mb": last["peak_stash_mb"],
            "peak_activation_mb": last["peak_activation_mb"],
            "peak_saved_mb": last["peak_saved_mb"],
            "weight_mb": last["weight_mb"],
            "optimizer_state_mb": last["optimizer_state_mb"],
            "peak_versions": last["peak_versions"],
            "delays": pipe.delays if pipe.plan.schedule == "async" else None,
            "loss": last["loss"],
            "accuracy": last["accuracy"],
            "test_accuracy": last.get("test_accuracy"),
            "epochs": history,
        }
        if auto is not None:
            report["auto_plan"] = auto.to_dict(last["throughput_samples_per_s"])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    pipe.close()
    return 0
