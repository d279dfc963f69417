"""`pipesgd plan`: profile a model, rank PipeDream's plan, MadPipe's plan and data
parallelism for a cluster, print the winner and write its plan.

    pipesgd plan --model cnn --batch-size 32 --workers 4 --bandwidth 1Gbit --json plan.json
    pipesgd plan --model mlp --batch-size 64 --micro-batch 16 --topology "4x[20GB/s], 2x[1Gbit]"
    pipesgd plan --model cnn --batch-size 32 --profile-only cnn.json      # profile, stop
    pipesgd plan --profile cnn.json --batch-size 32 --workers 8 --bandwidth 10Gbit --memory 1GB
    pipesgd plan --model cnn --batch-size 32 --network net.json   # `pipesgd timing measure`'s

The JSON is the runtime's plan (`Plan.load`, `pipesgd pipeline --plan`) of the best
pipeline, with `predicted_samples_per_s`, the overall `choice` (which may be data
parallelism, with the `pipesgd train` command that runs it) and the ranked `alternatives`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pipesgd.cli import positive_int
from pipesgd.model_names import HELP, add_model_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Choose between PipeDream's plan, MadPipe's plan and data "
                          "parallelism for a model on a cluster (predicted samples/s).")
    add_model_arguments(parser, model_default=None,
                        model_help=HELP + " (default mlp, or the --profile's)")
    parser.add_argument("--batch-size", type=positive_int, required=True,
                        help="samples per optimizer step of one worker: per rank for data "
                             "parallelism, micro-batch x micro-batches per step for a pipeline")
    parser.add_argument("--micro-batch", type=positive_int,
                        help="samples per pipeline micro-batch (default: --batch-size); "
                             "divides --batch-size")
    parser.add_argument("--workers", type=positive_int,
                        help="number of workers (with --bandwidth; with --network, default: "
                             "the ranks it was measured on)")
    parser.add_argument("--topology",
                        help="levels innermost first, e.g. '4x[20GB/s], 2x[1Gbit]' (4 "
                             "workers per node, 2 nodes), or a topology JSON file "
                             "(`HierarchicalTopology.save`); instead of --workers/--bandwidth")
    parser.add_argument("--network", metavar="FILE",
                        help="a network measured by `mpirun -n P pipesgd timing measure "
                             "--json FILE`: the workers' links, the cores they share and "
                             "what communication costs them, for pipelines and data "
                             "parallelism alike; instead of --topology/--bandwidth")
    parser.add_argument("--bandwidth", help="link rate between any two workers, e.g. 1Gbit")
    parser.add_argument("--latency", default="20us",
                        help="one-way latency with --bandwidth (default 20us)")
    parser.add_argument("--memory", help="memory per worker, e.g. 2GiB or 512MB (default: none)")
    parser.add_argument("--device-gbps", type=float,
                        help="workers are GPUs whose copies to pinned host memory run at this "
                             "many GB/s: plans count staging activations, gradients and "
                             "all-reduces through the host (default: workers are CPUs)")
    parser.add_argument("--staleness", type=positive_int, default=1,
                        help="K of replicated stages' all-reduce, as `pipesgd pipeline "
                             "--staleness` (default 1)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads while profiling (default 1)")
    parser.add_argument("--profile", metavar="FILE",
                        help="a per-layer profile JSON (from --profile-only) instead of "
                             "profiling here")
    parser.add_argument("--profile-only", metavar="FILE",
                        help="profile the model, write the per-layer profile here and stop")
    parser.add_argument("--json", metavar="FILE", help="write the plan and the alternatives")


def run(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except (ValueError, OSError) as err:
        print(f"pipesgd plan: error: {err}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- inputs
def _check(args: argparse.Namespace) -> None:
    if args.micro_batch is not None and args.batch_size % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide --batch-size "
                         f"{args.batch_size}, e.g. --batch-size 32 --micro-batch 8")
    if args.profile and args.profile_only:
        raise ValueError("--profile reads a profile and --profile-only writes one: give one")
    if args.profile and (args.data or args.input_shape):
        raise ValueError("--data and --input-shape size a model to profile; a --profile "
                         "file is already measured")


def topology_of(args: argparse.Namespace) -> Any:
    """The cluster from --topology, --network or --workers and --bandwidth (one level),
    with --device-gbps's host staging."""
    return cluster_of(args)[0]


def cluster_of(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the cluster's topology, the measured `NetworkParams` data parallelism is predicted
    on, or None to predict it from the topology)."""
    topo, net = _links_of(args)
    gbps = getattr(args, "device_gbps", None)
    if gbps is None:
        return topo, net
    from pipesgd.timing.cluster import device_copy_s_per_byte

    copy = device_copy_s_per_byte(gbps)
    if net is not None:
        net = dataclasses.replace(net, device_copy_s_per_byte=copy)
    return dataclasses.replace(topo, device_copy_s_per_byte=copy), net


def _links_of(args: argparse.Namespace) -> tuple[Any, Any]:
    from .topology import HierarchicalTopology

    network = getattr(args, "network", None)
    given = [flag for flag, value in (("--topology", args.topology),
                                      ("--bandwidth", args.bandwidth),
                                      ("--network", network)) if value]
    if len(given) > 1:
        raise ValueError(f"give one of --topology, --bandwidth and --network, not "
                         f"{' and '.join(given)} (each describes the links, e.g. --topology "
                         "'4x[20GB/s], 2x[1Gbit]')")
    if network:
        return _measured_links(network, args.workers)
    if args.topology:
        if args.topology.endswith(".json") or Path(args.topology).is_file():
            topo = HierarchicalTopology.load(args.topology)
        else:
            topo = HierarchicalTopology.parse(args.topology)
        if args.workers is not None and args.workers != topo.num_workers:
            raise ValueError(f"--workers {args.workers} but the topology {args.topology!r} "
                             f"has {topo.num_workers} workers; drop --workers or fix one")
        return topo, None
    if not args.bandwidth:
        raise ValueError("say how the workers are connected: --workers 4 --bandwidth 1Gbit, "
                         "--topology '4x[20GB/s], 2x[1Gbit]' or --network net.json (from "
                         "`mpirun -n 4 pipesgd timing measure --json net.json`)")
    if args.workers is None:
        raise ValueError("--bandwidth needs --workers, e.g. --workers 4 --bandwidth 1Gbit")
    return HierarchicalTopology.parse(f"{args.workers}x[{args.bandwidth}, {args.latency}]"), None


def _measured_links(path: str, workers: int | None) -> tuple[Any, Any]:
    """One level of workers on a measured network's links, as `pipesgd pipeline --plan
    auto` plans on the job's own (`from_network`), and that network."""
    from pipesgd.timing.network import NetworkParams

    from .topology import from_network

    net = NetworkParams.load(path)
    workers = workers or net.measured_p
    if workers is None:
        raise ValueError(f"--network {path} was not measured on ranks (a description by "
                         "hand): say how many workers, e.g. --workers 4")
    return from_network(net, workers), net


def _layer_model(args: argparse.Namespace) -> Any:
    from pipesgd.model_names import layer_model, model_shape
    from pipesgd.pipeline.models import MODELS

    shape = model_shape(args)
    if shape:
        return layer_model(args.model, shape["input_shape"], shape["num_classes"])
    return MODELS[args.model]()


def measure(args: argparse.Namespace) -> Any:
    """Profile --model layer by layer on one micro-batch of random samples."""
    from .profile import profile_layer_model

    return profile_layer_model(_layer_model(args), args.model,
                               args.micro_batch or args.batch_size, args.threads)


def _profile(args: argparse.Namespace) -> Any:
    from .profile import ModelProfile

    if not args.profile:
        args.model = args.model or "mlp"
        return measure(args)
    prof = ModelProfile.load(args.profile)
    given = args.model
    args.model = given or str(prof.extra.get("model") or "mlp")
    if given:
        prof.check(_layer_model(args).num_layers)
    return prof


# --------------------------------------------------------------------------- output
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def describe_profile(prof: Any, model: str) -> str:
    from .choose import format_bytes

    total = {k: sum(getattr(lp, k) for lp in prof.layers)
             for k in ("forward_s", "backward_s", "param_bytes", "saved_bytes")}
    return (f"model {model}: {prof.num_layers} layers, profile at batch {prof.batch_size} "
            f"({prof.source}): forward {_ms(total['forward_s'])} ms, backward "
            f"{_ms(total['backward_s'])} ms, weights {format_bytes(total['param_bytes'])}, "
            f"saved activations {format_bytes(total['saved_bytes'])}")


def format_ranking(choice: Any) -> str:
    from .choose import format_bytes

    head = f"{'#':>2}  {'candidate':<14} {'workers':>7} {'samples/s':>11} {'memory/worker':>14}"
    lines = [head, "-" * len(head)]
    for i, c in enumerate(choice.ranked, 1):
        lines.append(f"{i:>2}  {c.family:<14} {c.workers:>7} {c.samples_per_s:>11.1f} "
                     f"{format_bytes(c.memory_bytes):>14}")
    for c in choice.excluded:
        rate = f"{c.samples_per_s:.1f}" if c.plan or c.prediction else "-"
        memory = format_bytes(c.memory_bytes) if c.memory_bytes == c.memory_bytes else "-"
        lines.append(f"{'-':>2}  {c.family:<14} {c.workers:>7} {rate:>11} {memory:>14}"
                     "  excluded")
    lines.append("")
    lines += [f"{i:>2}. {c.reason}" for i, c in enumerate(choice.ranked, 1)]
    lines += [f" -. {c.reason}" for c in choice.excluded]
    return "\n".join(lines)


def describe_choice(prof: Any, topo: Any, choice: Any, model: str) -> str:
    """The profile, the cluster and the ranking, as `pipesgd plan` prints them."""
    from .choose import format_bytes

    budget = ("no budget (--memory)" if choice.memory_per_worker is None
              else format_bytes(choice.memory_per_worker))
    return "\n".join([
        describe_profile(prof, model),
        f"cluster: {topo} ({topo.num_workers} workers), memory per worker: {budget}; "
        f"batch {choice.batch_size} per worker step, micro-batch {choice.micro_batch}",
        "",
        format_ranking(choice),
    ])


def print_choice(prof: Any, topo: Any, choice: Any, model: str) -> None:
    """The profile, the cluster and the ranking, the best pipeline's stages, and the
    choice explained, as `pipesgd plan` and `pipesgd pipeline --plan auto` show them."""
    print(describe_choice(prof, topo, choice, model))
    print()
    pipeline = choice.best_pipeline
    if pipeline is not None:
        title = "" if pipeline is choice.best else "best pipeline (not the choice): "
        print(title + format_stages(pipeline))
        print()
    print(f"choice: {choice.explanation}")


def format_stages(candidate: Any) -> str:
    """One row per stage of a pipeline candidate's simulated plan."""
    from .choose import format_bytes

    sim = candidate.simulation
    plan = sim.plan
    steps = plan.micro_batches_per_step
    lines = [f"{candidate.family} plan: {plan.schedule}, micro-batch {plan.micro_batch}, "
             f"{plan.noam} in flight, {steps} micro-batch(es) per step; "
             f"{sim.samples_per_s:.1f} samples/s, bottleneck {sim.bottleneck}"]
    head = (f"{'stage':>5}  {'layers':<10} {'replicas':>8} {'fwd+bwd ms':>10} "
            f"{'all-reduce ms':>13} {'busy':>5} {'in flight':>9} {'versions':>8} "
            f"{'memory':>10}")
    lines += [head, "-" * len(head)]
    for s in sim.stages:
        mark = "  <- bottleneck" if sim.bottleneck == f"stage {s.stage}" else ""
        reduce = _ms(s.allreduce_s) if s.replicas > 1 else "-"
        lines.append(f"{s.stage:>5}  {f'[{s.start}, {s.end})':<10} {s.replicas:>8} "
                     f"{_ms(s.compute_s):>10} {reduce:>13} {s.busy:>5.0%} {s.in_flight:>9} "
                     f"{s.weight_versions:>8} {format_bytes(s.memory_bytes):>10}{mark}")
    if sim.link_busy:
        lines.append("links busy: " + ", ".join(f"{i}-{i + 1} {b:.0%}"
                                                 for i, b in enumerate(sim.link_busy)))
    return "\n".join(lines)


def _model_args(args: argparse.Namespace) -> list[str]:
    """The model options of `pipesgd pipeline` (its --data takes digits or synthetic)."""
    out = ["--model", args.model]
    if args.data in ("digits", "synthetic"):
        out += ["--data", args.data]
    if args.input_shape:
        out += ["--input-shape", ",".join(map(str, args.input_shape)),
                "--classes", str(args.classes)]
    return out


def train_command(args: argparse.Namespace, candidate: Any, workers: int) -> str:
    c = candidate.prediction.config
    words = ["mpirun", "-n", str(workers), "pipesgd", "train", "--model", args.model]
    if args.data:
        words += ["--data", args.data]
    words += ["--batch-size", str(args.batch_size), "--staleness", str(c.staleness),
              "--compression", c.compression, "--overlap", c.overlap]
    return " ".join(words)


def pipeline_command(args: argparse.Namespace, candidate: Any) -> str:
    words = ["mpirun", "-n", str(candidate.plan.world_size), "pipesgd", "pipeline",
             *_model_args(args), "--plan", args.json or "PLAN.json"]
    if args.staleness != 1:
        words += ["--staleness", str(args.staleness)]
    return " ".join(words)


def _json(choice: Any, args: argparse.Namespace, commands: dict[str, str]) -> dict[str, Any]:
    best = choice.best
    pipeline = choice.best_pipeline
    head: dict[str, Any] = {"family": best.family,
                            "samples_per_s": best.to_dict()["samples_per_s"],
                            "reason": best.reason, "explanation": choice.explanation}
    if best.family in commands:
        head["command"] = commands[best.family]
    out: dict[str, Any] = {}
    if pipeline is not None:
        out.update(pipeline.plan.to_dict())
        out["planner"] = pipeline.family
        out["predicted_samples_per_s"] = pipeline.to_dict()["samples_per_s"]
        out["command"] = commands["pipeline"]
    out["choice"] = head
    out["memory_per_worker"] = choice.memory_per_worker
    out["alternatives"] = [c.to_dict() for c in (*choice.ranked, *choice.excluded)]
    return out


# --------------------------------------------------------------------------- run
def _plan(args: argparse.Namespace) -> int:
    _check(args)
    if args.profile_only:
        args.model = args.model or "mlp"
        prof = measure(args)
        prof.save(args.profile_only)
        print(describe_profile(prof, args.model))
        print(f"wrote {args.profile_only}")
        return 0
    topo, net = cluster_of(args)
    prof = _profile(args)
    from .choose import choose

    choice = choose(prof, topo, args.memory, batch_size=args.batch_size,
                    micro_batch=args.micro_batch, staleness=args.staleness, dp_network=net)
    print_choice(prof, topo, choice, args.model)
    best, pipeline = choice.best, choice.best_pipeline
    commands = {}
    if pipeline is not None:
        commands["pipeline"] = pipeline_command(args, pipeline)
    dp = next((c for c in choice.ranked if c.family == "data-parallel"), None)
    if dp is not None:
        commands["data-parallel"] = train_command(args, dp, topo.num_workers)
    if best.family == "data-parallel":
        print(f"data parallelism wins; run it with:\n  {commands['data-parallel']}")
    else:
        print(f"run it with:\n  {commands['pipeline']}")
    if args.json:
        Path(args.json).write_text(json.dumps(_json(choice, args, commands), indent=2) + "\n")
        what = ("the plan" if pipeline is best else
                "the best pipeline's plan" if pipeline is not None else
                "the choice (no pipeline plan fits)")
        print(f"wrote {args.json} ({what} and the alternatives)")
    return 0
