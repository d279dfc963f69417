"""`pipesgd timing measure | predict | project | reproduce-paper`: the timing model on the
command line.

    mpirun -n 2 pipesgd timing measure --json net.json
    pipesgd timing predict --model mlp --batch-size 64 -p 2 --network net.json --json pred.json
    pipesgd timing predict --model cnn --batch-size 32 -p 8 --bandwidth 10Gbit --latency 20us
    pipesgd timing project --model cnn --batch-size 32 --speedup 100 --host-gbps 10
    pipesgd timing predict --model ./models.py:build --input-shape 784 --classes 10 -p 4 ...
    pipesgd timing reproduce-paper --markdown --json paper.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipesgd.cli import positive_int
from pipesgd.device import add_device_argument, run_device
from pipesgd.json_files import read_json
from pipesgd.model_names import add_model_arguments, model_shape
from pipesgd.timing.cluster import HOST_CPU_DEFAULTS
from pipesgd.timing.paper import BENCHMARKS

GPU_SPEEDUP = 100.0  # a GPU against the one CPU core a profile here is taken on
HOST_GBPS_HELP = ("GB/s of float32 one host core reduces, for a cluster described by "
                  "--bandwidth (or a named one): γ, memcpy and compression kernel costs "
                  "scale with it (default: the development VM's, "
                  f"{1e-9 / HOST_CPU_DEFAULTS['gamma_s_per_byte']:.1f})")  # type: ignore[operator]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="timing_command", metavar="ACTION", required=True)

    m = sub.add_parser("measure", help="measure α, β, γ, S and kernel costs (under mpirun)")
    m.add_argument("--json", help="write the figures here (rank 0)")
    m.add_argument("--repeats", type=positive_int, default=20)
    add_device_argument(m)  # on a GPU, also the copy rate between it and the host (δ)

    for name, text in (("predict", "predict and rank every configuration"),
                       ("project", "iteration time and scaling efficiency for p = 2..256")):
        s = sub.add_parser(name, help=text)
        add_model_arguments(s)
        s.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank")
        s.add_argument("--profile", help="a profile JSON instead of profiling the model here")
        s.add_argument("--threads", type=positive_int, default=1,
                       help="torch threads per rank while profiling (default 1)")
        s.add_argument("--speedup", type=float, default=None,
                       help="divide compute times by this (a faster device)")
        s.add_argument("--network", help="network JSON from `pipesgd timing measure`")
        s.add_argument("--bandwidth", help="link rate by hand, e.g. 10Gbit")
        s.add_argument("--latency", default="20us", help="one-way latency by hand, e.g. 20us")
        s.add_argument("--cores", type=positive_int,
                       help="cores per host (default: this machine's)")
        s.add_argument("--ranks-per-host", type=positive_int,
                       help="ranks per host (default: 1 by hand, measured with --network)")
        s.add_argument("--host-gbps", type=float, help=HOST_GBPS_HELP)
        s.add_argument("--device-gbps", type=float,
                       help="GB/s of a copy between each rank's GPU and pinned host memory "
                            "(PCIe, e.g. 25): count host staging of the gradients at it "
                            "(default: a measured network's own, else none)")
        s.add_argument("--json", help="write the predictions here")
    pr = sub.choices["predict"]
    pr.add_argument("-p", "--ranks", type=int, required=True, dest="p", help="number of ranks")
    pr.add_argument("--segments", type=positive_int,
                    help="L allreduces per iteration (default: buckets)")
    pr.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size (MiB)")
    pr.add_argument("--png", help="stacked-bar breakdown (default: next to --json)")
    pr.add_argument("--measured", help="measured iteration times (trainer JSONs) to compare")
    pj = sub.choices["project"]
    pj.add_argument("--clusters", default="10GbE,100Gbit", help="named clusters, comma-separated")
    pj.add_argument("--markdown", action="store_true", help="print a Markdown table")

    rp = sub.add_parser("reproduce-paper",
                        help="the Pipe-SGD paper's four benchmarks on its 4-node 10GbE cluster")
    rp.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                    help=f"comma-separated from {', '.join(BENCHMARKS)} (default: all)")
    rp.add_argument("--profile", action="append", default=[], metavar="BENCHMARK=FILE",
                    help="a profile JSON for one benchmark instead of profiling it here "
                         "(repeatable); scaled linearly to the paper's batch if taken at "
                         "another, then divided by --speedup")
    rp.add_argument("--profile-batch", type=positive_int,
                    help="batch per worker to profile at (default: the paper's, 8 for "
                         "AlexNet and ResNet-18); forward and backward scale linearly")
    rp.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads while profiling (default 1)")
    rp.add_argument("--speedup", type=float, default=None,
                    help=f"divide compute times by this (default {GPU_SPEEDUP:g}, "
                         "GPU_SPEEDUP: a GPU against one core here)")
    rp.add_argument("--host-gbps", type=float, help=HOST_GBPS_HELP)
    rp.add_argument("--json", help="write the table here")
    rp.add_argument("--markdown", action="store_true", help="print a Markdown table")


def run(args: argparse.Namespace) -> int:
    try:
        return {"measure": _measure, "predict": _predict, "project": _project,
                "reproduce-paper": _reproduce_paper}[args.timing_command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"pipesgd timing {args.timing_command}: error: {err}", file=sys.stderr)
        return 2


def _measure(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from pipesgd.timing.measure import measure_network

    device = run_device(args.device, MPI.COMM_WORLD)
    net = measure_network(MPI.COMM_WORLD, repeats=args.repeats, device=device)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(format_network(net))
        if args.json:
            net.save(args.json)
            print(f"wrote {args.json}")
    return 0


def format_network(net: Any) -> str:
    lines = [
        f"network: {net.source}",
        f"  alpha  {net.alpha_s * 1e6:10.2f} us        latency (half a small ping-pong)",
        f"  beta   {net.beta_s_per_byte * 1e9:10.4f} ns/B      "
        f"= {1 / net.beta_s_per_byte / 1e9:.2f} GB/s per ring step",
        f"  beta_cpu {net.beta_cpu_s_per_byte * 1e9:8.4f} ns/B      CPU burnt per byte moved",
        f"  burst  {net.burst_bytes / 1e3:10.1f} kB        sent at line rate after idling",
        *([f"  flow   {net.flow_beta_s_per_byte * 1e9:10.4f} ns/B      "
           f"= {1 / net.flow_beta_s_per_byte / 1e9:.2f} GB/s for one flow alone"]
          if net.flow_beta_s_per_byte else []),
        f"  eager  {net.eager_bytes / 1e3:10.1f} kB        of a message sent before the "
        "receiver asks",
        f"  load   {net.load_latency_s * 1e6:10.1f} us        per ring step while compute "
        "keeps the cores busy",
        f"  gamma  {net.gamma_s_per_byte * 1e9:10.4f} ns/B      float32 sum, one core",
        f"  copy   {net.copy_s_per_byte * 1e9:10.4f} ns/B      memcpy, one core",
        f"  S      {net.sync_s * 1e6:10.2f} us        barrier",
    ]
    if net.in_place_s_per_byte:
        lines.append(f"  in place {net.in_place_s_per_byte * 1e9:8.4f} ns/B      allreduce of the "
                     "engine's own buffers, one node")
    if net.device_copy_s_per_byte:
        lines.append(f"  delta  {net.device_copy_s_per_byte * 1e9:10.4f} ns/B      "
                     f"= {1e-9 / net.device_copy_s_per_byte:.2f} GB/s GPU <-> pinned host "
                     "(staging)")
    for mode, k in net.kernels.items():
        lines.append(f"  {mode:<7} ns/B: encode {k.encode * 1e9:.4f}  decode_add_encode "
                     f"{k.decode_add_encode * 1e9:.4f}  decode {k.decode * 1e9:.4f}  "
                     f"owner's decode_add_encode_decode {k.decode_add_encode_decode * 1e9:.4f}")
    if net.node_beta_s_per_byte is not None:
        lines.append(f"  nodes of {net.ranks_per_node} ranks: alpha and beta above are the "
                     f"network's; inside a node alpha {(net.node_alpha_s or 0) * 1e6:.2f} us, "
                     f"{1 / net.node_beta_s_per_byte / 1e9:.2f} GB/s")
    rph = "all ranks" if net.ranks_per_host is None else net.ranks_per_host
    lines.append(f"  host: {net.cores} cores, {rph} per host; spread (IQR/median): "
                 + ", ".join(f"{k} {v:.0%}" for k, v in net.spread.items()))
    noisy = net.noisy()
    if noisy:
        lines.append(f"  {noisy}")
    return "\n".join(lines)


def load_profile(args: argparse.Namespace) -> Any:
    from pipesgd.timing.profile import Profile, profile_named

    if args.profile:
        prof = Profile.load(args.profile)
    else:
        prof = profile_named(args.model, args.batch_size, threads=args.threads,
                             **model_shape(args))
    if args.speedup:
        prof = prof.scaled(args.speedup)
    return prof


def load_network(args: argparse.Namespace) -> Any:
    from pipesgd.timing.cluster import describe_cluster, with_device_copy
    from pipesgd.timing.network import NetworkParams

    if args.network and args.bandwidth:
        raise ValueError("give either --network FILE or --bandwidth/--latency, not both")
    if args.network and args.host_gbps is not None:
        raise ValueError("--host-gbps describes the host of a cluster given by --bandwidth; "
                         "a --network file carries its host's measured costs")
    if args.network:
        net = NetworkParams.load(args.network)
        if args.cores:
            net.cores = args.cores
        if args.ranks_per_host:
            net.ranks_per_host = args.ranks_per_host
        return with_device_copy(net, args.device_gbps)
    if not args.bandwidth:
        raise ValueError("say what network to predict for: --network net.json (from "
                         "`mpirun -n P pipesgd timing measure --json net.json`) or "
                         "--bandwidth 10Gbit --latency 20us")
    return describe_cluster(args.bandwidth, args.latency, cores=args.cores,
                            ranks_per_host=args.ranks_per_host or 1, host_gbps=args.host_gbps,
                            device_gbps=args.device_gbps)


def load_measured(path: str) -> dict[tuple[int, str, str], float]:
    """Iteration times from trainer JSONs: a file holding one object, a list of them, or
    {"configs": [...]} / {"runs": [...]}; each with staleness, compression, overlap and
    iteration_time_s (or measured_s)."""
    from pipesgd.timing.report import measured_key

    data = read_json(path, "measured iteration times (the JSON of `pipesgd train`)")
    if isinstance(data, dict):
        data = data.get("runs") or data.get("configs") or [data]
    out = {}
    for entry in data:
        cfg = entry.get("config", entry)
        value = entry.get("measured_s", entry.get("iteration_time_s"))
        if value:
            out[measured_key({**entry, **cfg})] = float(value)
    return out


def _predict(args: argparse.Namespace) -> int:
    from pipesgd.timing.cluster import describe_host
    from pipesgd.timing.model import choose
    from pipesgd.timing.report import format_ranking, plot_breakdown

    net = load_network(args)
    prof = load_profile(args)
    ranked = choose(prof, net, args.p, segments=args.segments,
                    bucket_bytes=int(args.bucket_mb * (1 << 20)))
    measured = load_measured(args.measured) if args.measured else {}
    print(f"model {prof.model}, batch {prof.batch_size}/rank: l_for {prof.forward_s * 1e3:.2f} "
          f"ms, l_back {prof.backward_s * 1e3:.2f} ms, l_up {prof.update_s * 1e3:.2f} ms, "
          f"n {prof.gradient_bytes / 1e6:.2f} MB; p = {args.p}; network: {net.source}")
    if not args.network:
        print(describe_host(net, args.host_gbps))
    print(format_ranking(ranked, measured))
    topology = net.topology(args.p)
    if topology is not None and topology.nodes > 1:
        from pipesgd.timing.topology import two_level_gain

        n = prof.gradient_bytes
        print(f"{topology.nodes} nodes x {topology.ranks_per_node} ranks: the ring's "
              f"{n / 1e6:.2f} MB allreduce spends {topology.flat_ring(n) * 1e3:.2f} ms on the "
              f"wire; a two-level one (reduce in nodes, ring between, broadcast in) would "
              f"spend {topology.two_level(n) * 1e3:.2f} ms ({two_level_gain(topology, n):.2f}x)")
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "p": args.p,
            "profile": prof.to_dict(),
            "network": net.to_dict(),
            "choice": ranked[0].to_dict(),
            "configs": [pr.to_dict() for pr in ranked],
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    if png:
        plot_breakdown(ranked, png, f"{prof.model}, p = {args.p}", measured)
        print(f"wrote {png}")
    return 0


def _project(args: argparse.Namespace) -> int:
    from pipesgd.timing.cluster import (
        describe_cluster,
        describe_host,
        named_cluster,
        with_device_copy,
    )
    from pipesgd.timing.network import NetworkParams
    from pipesgd.timing.report import format_projection, projection

    if args.speedup is None:
        args.speedup = GPU_SPEEDUP
    cpu_from = NetworkParams.load(args.network) if args.network else None
    clusters = {}
    if args.bandwidth:
        clusters[f"{args.bandwidth}/{args.latency}"] = describe_cluster(
            args.bandwidth, args.latency, cores=args.cores,
            ranks_per_host=args.ranks_per_host or 1, cpu_from=cpu_from,
            host_gbps=args.host_gbps, device_gbps=args.device_gbps)
    else:
        for name in args.clusters.split(","):
            clusters[name] = with_device_copy(
                named_cluster(name.strip(), cpu_from, args.host_gbps), args.device_gbps)
    prof = load_profile(args)
    rows = projection(prof, clusters)
    print(f"model {prof.model}, batch {prof.batch_size}/rank, compute scaled by 1/"
          f"{args.speedup:g}: l_for+l_back {prof.compute_s * 1e3:.3f} ms, l_up "
          f"{prof.update_s * 1e3:.3f} ms, n {prof.gradient_bytes / 1e6:.2f} MB")
    print(describe_host(next(iter(clusters.values())), args.host_gbps, cpu_from))
    print(format_projection(rows, markdown=args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": prof.to_dict(), "rows": rows},
                                              indent=2) + "\n")
    return 0


def parse_profiles(items: list[str]) -> dict[str, str]:
    """--profile BENCHMARK=FILE options -> {benchmark: file}.

    Raises:
        ValueError: an item without '=' or naming an unknown benchmark.
    """
    from pipesgd.timing.paper import benchmark

    files = {}
    for item in items:
        key, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--profile {item!r}: expected BENCHMARK=FILE, e.g. "
                             "--profile alexnet=alexnet.json")
        benchmark(key.strip())
        files[key.strip()] = path
    return files


def _reproduce_paper(args: argparse.Namespace) -> int:
    from pipesgd.timing.cluster import CLUSTERS, describe_host, named_cluster
    from pipesgd.timing.paper import (
        PAPER_CLUSTER,
        PAPER_WORKERS,
        at_batch,
        benchmark,
        format_result,
        profile_benchmark,
        profiled_batch,
        reproduce_paper,
    )
    from pipesgd.timing.profile import Profile

    speedup = GPU_SPEEDUP if args.speedup is None else args.speedup
    if not speedup > 0:
        raise ValueError(f"--speedup must be > 0, got {speedup:g}")
    keys = [k.strip() for k in args.benchmarks.split(",") if k.strip()]
    for key in keys:
        benchmark(key)
    files = parse_profiles(args.profile)
    net = named_cluster(PAPER_CLUSTER, host_gbps=args.host_gbps)
    spec = CLUSTERS[PAPER_CLUSTER]
    notes = []
    profiles = {}
    for key in keys:
        bench = benchmark(key)
        target = bench.batch_per_worker(PAPER_WORKERS)
        if key in files:
            prof = Profile.load(files[key])
            if prof.batch_size and prof.batch_size != target:
                notes.append(f"{bench.title}: profile {files[key]} taken at batch "
                             f"{prof.batch_size}, forward and backward scaled linearly to "
                             f"{target}")
            else:
                notes.append(f"{bench.title}: profile {files[key]}")
            prof = at_batch(prof, target)
        else:
            batch = profiled_batch(key, args.profile_batch, PAPER_WORKERS)
            prof = profile_benchmark(key, profile_batch=batch, threads=args.threads)
            if batch != target:
                notes.append(f"{bench.title}: profiled at batch {batch}, forward and "
                             f"backward scaled linearly to {target}")
        if bench.last_layer_only:
            notes.append(f"{bench.title}: only the last layer is trained "
                         f"({prof.gradient_bytes / 1e3:.1f} kB of gradient), as in the paper")
        profiles[key] = prof.scaled(speedup)
    result = reproduce_paper(profiles, net, PAPER_WORKERS)
    host = describe_host(net, args.host_gbps)
    result["setting"] = {
        "workers": PAPER_WORKERS,
        "cluster": {"name": PAPER_CLUSTER, **spec},
        "speedup": speedup,
        "host": host,
        "notes": notes,
    }
    print(f"Pipe-SGD §4 through the timing model: {PAPER_WORKERS} workers, one per host, "
          f"{PAPER_CLUSTER} ({spec['bandwidth']} links, {spec['latency']} latency); "
          "sequential communication; PS-Sync on one more node (pipesgd.timing.paper)")
    sources = []
    if any(key not in files for key in keys):
        sources.append(f"profiled here on {args.threads} thread"
                       + ("s" if args.threads > 1 else ""))
    if any(key in files for key in keys):
        sources.append("given (--profile)")
    print(f"compute: {' and '.join(sources)}, at the paper's batch per worker, divided by "
          f"{speedup:g} (--speedup"
          + ("; default GPU_SPEEDUP, a GPU against one core here)" if args.speedup is None
             else ")"))
    for note in notes:
        print(f"  {note}")
    print(host)
    print()
    print(format_result(result, markdown=args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
