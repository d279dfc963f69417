"""Timing model of data-parallel training (Pipe-SGD eqs. 2-7): measure, predict, choose.

    network.py   NetworkParams                              α, β, γ, S, kernels, host
    measure.py   measure_network(comm), from the probes in
                 link_probes.py (α, β, eager), token_bucket.py (burst),
                 host_costs.py (γ, kernels, δ, β_cpu, load latency)
    profile.py   Profile, profile(model, batch, optimizer)  l_for, l_back, l_up, n
    model.py     predict(...), choose(...), the equations   iteration time per config
    cluster.py   describe_cluster("10Gbit", "20us"), CLUSTERS   clusters given by hand
    report.py    tables, the projection over p, PNG of the breakdown
    paper.py     reproduce_paper(...), ps_sync(...)     the paper's §4 benchmarks, PS-Sync
    cli.py       `pipesgd timing measure | predict | project | reproduce-paper`
"""

from pipesgd.timing.cluster import (
    CLUSTERS,
    describe_cluster,
    describe_host,
    named_cluster,
    parse_bandwidth,
    parse_duration,
)
from pipesgd.timing.measure import measure_network
from pipesgd.timing.model import (
    Config,
    Prediction,
    all_configs,
    allreduce_cost,
    choose,
    predict,
    ring_allreduce_cost,
)
from pipesgd.timing.network import KernelCosts, NetworkParams
from pipesgd.timing.paper import ps_sync, reproduce_paper
from pipesgd.timing.profile import Profile, profile, profile_named

__all__ = [
    "CLUSTERS",
    "Config",
    "KernelCosts",
    "NetworkParams",
    "Prediction",
    "Profile",
    "all_configs",
    "allreduce_cost",
    "choose",
    "describe_cluster",
    "describe_host",
    "measure_network",
    "named_cluster",
    "parse_bandwidth",
    "parse_duration",
    "predict",
    "profile",
    "profile_named",
    "ps_sync",
    "reproduce_paper",
    "ring_allreduce_cost",
]
