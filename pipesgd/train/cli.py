"""`pipesgd train`: parse options, run one job (or several with --compare), print, write JSON.

Run it under mpirun, e.g.::

    mpirun -n 2 pipesgd train --model mlp --data digits --epochs 5 --staleness 2
    mpirun -n 2 pipesgd train --epochs 5 --compare dsync,pipesgd+q
    mpirun -n 2 pipesgd train --model cnn --steps 200 --config auto --json run.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from pipesgd.agreement import failure_anywhere
from pipesgd.buffers import COMPRESSIONS
from pipesgd.cli import positive_int
from pipesgd.device import add_device_argument
from pipesgd.model_names import BUILTIN, HELP, load_model_function
from pipesgd.optim import OVERLAP_MODES

# --compare presets: name -> (staleness, compression), the paper's configurations.
PRESETS: dict[str, tuple[int, str]] = {
    "dsync": (1, "none"),
    "dsync+t": (1, "trunc16"),
    "dsync+q": (1, "quant8"),
    "pipesgd": (2, "none"),
    "pipesgd+t": (2, "trunc16"),
    "pipesgd+q": (2, "quant8"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `pipesgd train`."""
    parser.add_argument("--model", default="mlp", help=HELP + "; it gets images "
                        "(N, C, 32, 32) as the CNN does, so start an MLP with nn.Flatten()")
    parser.add_argument("--data", default="digits",
                        help="digits (bundled with scikit-learn), synthetic, or a folder of "
                             "MNIST IDX files")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=positive_int, default=5)
    length.add_argument("--steps", type=positive_int, help="train this many iterations instead")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="samples per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="cosine decays the learning rate to 0 over the run")
    parser.add_argument("--lr-warmup-steps", type=int, default=0, metavar="N",
                        help="ramp the learning rate linearly up over the first N iterations")
    parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
    parser.add_argument("--nesterov", action="store_true",
                        help="Nesterov momentum (SGD); tolerates stale gradients better")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    # None = not given: TrainConfig's default, or what --config auto chooses
    parser.add_argument("--staleness", type=positive_int,
                        help="iteration dependency K: 1 = synchronous (D-Sync), 2 = Pipe-SGD "
                             "(default)")
    parser.add_argument("--compression", choices=COMPRESSIONS, help="default none")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="first iterations run synchronously (K = 1)")
    parser.add_argument("--ramp-steps", type=int, default=0, metavar="N",
                        help="ramp the learning rate of the first N stale updates linearly "
                             "up to the full rate (K >= 2)")
    parser.add_argument("--overlap", choices=OVERLAP_MODES,
                        help="submit gradients after backward (sequential, the default), or "
                             "bucket by bucket during it")
    parser.add_argument("--bucket-mb", type=float, help="gradient bucket size in MiB (default 25)")
    parser.add_argument("--config", choices=("auto",),
                        help="auto: measure the network, profile the model and train the "
                             "configuration (staleness, compression, overlap, bucket size) "
                             "the timing model predicts fastest")
    parser.add_argument("--channels-last", action="store_true",
                        help="CNN in NHWC layout (oneDNN's faster convolutions on CPU)")
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint every epoch")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --checkpoint DIR if there is one")
    parser.add_argument("--json", metavar="FILE", help="write a summary of the run(s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    parser.add_argument("--compare", nargs="?", const="dsync,pipesgd+q", metavar="PRESETS",
                        help="run several configurations one after another and print a table; "
                             f"comma-separated from {', '.join(PRESETS)} "
                             "(default dsync,pipesgd+q)")


# What --config auto chooses: options that conflict with it.
AUTO_CHOSEN = ("staleness", "compression", "overlap", "bucket_mb")


def config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig the options describe; options not given keep TrainConfig's defaults."""
    from pipesgd.train.loop import TrainConfig

    chosen = {name: getattr(args, name) for name in AUTO_CHOSEN
              if getattr(args, name) is not None}
    return TrainConfig(
        model=args.model, data=args.data, epochs=args.epochs, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
        weight_decay=args.weight_decay, optimizer=args.optimizer,
        lr_schedule=args.lr_schedule, lr_warmup_steps=args.lr_warmup_steps,
        warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps,
        channels_last=args.channels_last, seed=args.seed, device=args.device,
        checkpoint=args.checkpoint, resume=args.resume, **chosen,
    )


def check_auto_options(args: argparse.Namespace) -> None:
    """Reject options that --config auto would override.

    Raises:
        ValueError: --config auto with --staleness/--compression/--overlap/--bucket-mb,
            --compare or --resume (the message says what to drop).
    """
    if args.config != "auto":
        return
    given = [f"--{name.replace('_', '-')}" for name in AUTO_CHOSEN
             if getattr(args, name) is not None]
    if given:
        raise ValueError(f"--config auto chooses {', '.join(given)} itself: drop "
                         f"{' and '.join(given)}, or drop --config auto to set them by hand")
    if args.compare:
        raise ValueError("--config auto trains the one configuration it chooses; --compare "
                         "trains presets one after another: give one or the other")
    if args.resume:
        raise ValueError("--resume continues a checkpoint in the configuration it was written "
                         "with, which --config auto may not choose again: resume with the "
                         "staleness, compression, overlap and bucket size the first run's "
                         "--json recorded")


def parse_presets(text: str) -> list[str]:
    """'dsync,pipesgd+q' -> ['dsync', 'pipesgd+q'].

    Raises:
        ValueError: an unknown preset (the message lists the known ones).
    """
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise ValueError(f"unknown --compare preset(s) {unknown}: choose from {list(PRESETS)}")
    return names


def format_result(result: Any) -> str:
    ms = 1000.0
    return (
        f"{result.iterations} iterations on {result.ranks} ranks in {result.wall_time_s:.2f} s; "
        f"final accuracy {100 * result.final_accuracy:.2f}%\n"
        f"per iteration (median): {ms * result.iteration_time_s:.2f} ms = compute "
        f"{ms * result.compute_s:.2f} ms + update {ms * result.update_s:.2f} ms + blocked on "
        f"communication {ms * result.comm_wait_s:.2f} ms"
    )


def comparison_table(results: list[Any]) -> str:
    header = ("configuration", "K", "compression", "iter ms", "compute ms", "update ms",
              "comm wait ms", "wall s", "accuracy %")
    rows = [header] + [
        (r.config.name, str(r.config.staleness), r.config.compression,
         f"{1000 * r.iteration_time_s:.2f}", f"{1000 * r.compute_s:.2f}",
         f"{1000 * r.update_s:.2f}", f"{1000 * r.comm_wait_s:.2f}", f"{r.wall_time_s:.2f}",
         f"{100 * r.final_accuracy:.2f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(results) > 1 and results[0].iteration_time_s > 0:
        base = results[0]
        for r in results[1:]:
            lines.append(f"{r.config.name}: {base.iteration_time_s / r.iteration_time_s:.2f}x "
                         f"the iteration speed of {base.config.name}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run `pipesgd train`; returns the exit status."""
    from mpi4py import MPI

    import pipesgd
    from pipesgd.train import loop
    from pipesgd.train.data import check_source

    comm = MPI.COMM_WORLD
    base = config_from_args(args)

    presets: list[str] = []

    def check_options() -> None:
        check_auto_options(args)
        check_source(args.data)
        presets.extend(parse_presets(args.compare) if args.compare else [])
        if args.model not in BUILTIN:
            load_model_function(args.model)  # fail here, with a message, not mid-run

    # every rank checks (a model's module may be missing on one node) and all stop alike
    if (why := failure_anywhere(comm, check_options)) is not None:
        if comm.rank == 0:
            print(f"pipesgd train: {why}")
        return 2
    if presets and (args.checkpoint or args.resume):
        if comm.rank == 0:
            print("pipesgd train: --compare runs several jobs; drop --checkpoint/--resume")
        return 2
    configs = [
        dataclasses.replace(base, staleness=PRESETS[p][0], compression=PRESETS[p][1], name=p)
        for p in presets
    ] or [dataclasses.replace(base, name=f"K={base.staleness} {base.compression}")]

    choice = None
    if args.config == "auto":
        from pipesgd.train import auto

        try:
            choice = auto.choose_for_run(base, comm)  # collective; before the engine starts
        except (ValueError, FileNotFoundError) as exc:
            if comm.rank == 0:
                print(f"pipesgd train: {exc}")
            return 2
        configs = [choice.apply(base)]
        if comm.rank == 0:
            print(auto.format_choice(choice), flush=True)

    pipesgd.init(comm)
    log = print if comm.rank == 0 and not args.quiet else (lambda *_: None)
    results = []
    for config in configs:
        if comm.rank == 0 and not args.quiet:
            print(f"== {config.name}: {config.model} on {config.data}, {comm.size} ranks x "
                  f"batch {config.batch_size}, staleness {config.staleness}, compression "
                  f"{config.compression}, overlap {config.overlap}")
        result = loop.run(config, comm, progress=not args.quiet, log=log)
        results.append(result)
        if comm.rank == 0:
            print(format_result(result), flush=True)
            if choice is not None:
                print(auto.format_outcome(choice, result.iteration_time_s), flush=True)
    if comm.rank == 0:
        if len(results) > 1:
            print()
            print(comparison_table(results))
        if args.json:
            payload: dict[str, Any] = (
                results[0].summary() if len(results) == 1
                else {"runs": [r.summary() for r in results]}
            )
            if choice is not None:
                payload["prediction"] = choice.to_dict(measured_s=results[0].iteration_time_s)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(payload, indent=2))
    pipesgd.shutdown()
    return 0
