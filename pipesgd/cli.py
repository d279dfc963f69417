"""The `pipesgd` command: one sub-command per capability.

Each sub-command lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen so `pipesgd --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

SUBCOMMANDS = {
    "train": ("pipesgd.train.cli", "data-parallel training with Pipe-SGD (run under mpirun)"),
    "timing": ("pipesgd.timing.cli", "measure the network, predict and choose a configuration"),
    "pipeline": ("pipesgd.pipeline.cli", "1F1B / GPipe pipeline-parallel training (mpirun)"),
    "plan": ("pipesgd.planner.cli", "choose a pipeline plan or data parallelism for a cluster"),
}


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count: samples in a batch, workers, threads,
    K), refused when the command line is parsed, before anything runs."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pipesgd",
        description="Faster data-parallel and pipeline-parallel training where the network is "
                    "slower than the accelerators. Run train and pipeline under mpirun; "
                    "`pipesgd COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        # Build only the parser that is asked for: modules import torch.
        if argv and argv[0] == name:
            sub_parser = sub.add_parser(name, help=help_text)
            importlib.import_module(module).add_arguments(sub_parser)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    command = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(command.run(args) or 0)
    except Exception as exc:
        abort_other_ranks(f"pipesgd {args.command}", exc)
        raise


def abort_other_ranks(what: str, exc: BaseException) -> None:
    """Under mpirun, end the whole job when this rank fails, as `python -m mpi4py` does.

    The other ranks may be waiting for this one in a collective, and a rank that exits
    does not end them: the job would hang until killed. Prints the traceback and one
    line naming the rank first. Returns (and the caller re-raises) on a single rank or
    where MPI was never started.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() < 2:
        return
    traceback.print_exc()
    print(f"{what}: rank {world.Get_rank()}: {type(exc).__name__}: {exc} "
          "(aborting the job: the other ranks may be waiting for this one)",
          file=sys.stderr, flush=True)
    world.Abort(1)


if __name__ == "__main__":
    sys.exit(main())
