"""Planners: where each layer runs, from a per-layer profile and a topology.

    import torch
    from torch import nn
    from pipesgd.planner import choose, madpipe, pipedream, profile, simulate, to_plan

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    prof = profile(model, torch.randn(32, 64))          # per-layer times and bytes
    result = pipedream(prof, "4x[20GB/s], 2x[1Gbit]")  # PipeDream §3.1
    print(result.describe())
    to_plan(result).save("plan.json")                   # pipesgd.pipeline's format
    print(madpipe(prof, "4x[10Gbit]", memory_per_worker="1MB").describe())
    print(simulate(to_plan(result), prof, "4x[20GB/s], 2x[1Gbit]").describe())
    print(choose(prof, "8x[1Gbit]", "64MB", batch_size=32).explanation)

Modules: profile (LayerProfile, ModelProfile, profile, and profile_layer_model: a
`LayerModel`'s profile scaled to a real run of it), topology (levels of components
and bandwidths, the cores workers share), pipedream (the hierarchical DP with replicated
stages), madpipe (1F1B* activation counts and the memory-aware DP), simulate (the
runtime's schedule of a plan, timed: samples/s, bubbles, peak memory), choose
(PipeDream, MadPipe, one stage per worker or data parallelism, ranked by predicted
samples/s within a memory budget), calibrate (what a pipeline's micro-batch, a replicated
round and a data-parallel iteration cost beyond the models, fitted to real runs), cli
(`pipesgd plan`).
"""

from .calibrate import fit_data_parallel_overhead, fit_pipeline_overhead, fit_replica_overhead
from .choose import Candidate, PlanChoice, choose, straight_pipeline
from .madpipe import (
    MadPipeResult,
    madpipe,
    madpipe_dp,
    smallest_budget,
    stage_memory,
    stored_activations,
)
from .pipedream import LevelStage, PipeDreamResult, pipedream, to_plan
from .profile import LayerProfile, ModelProfile, profile, profile_layer_model
from .simulate import SimulationResult, StageReport, simulate
from .topology import HierarchicalTopology, Level, SharedCores, from_network, parse_bytes

__all__ = [
    "Candidate",
    "HierarchicalTopology",
    "LayerProfile",
    "Level",
    "LevelStage",
    "MadPipeResult",
    "ModelProfile",
    "PipeDreamResult",
    "PlanChoice",
    "SharedCores",
    "SimulationResult",
    "StageReport",
    "choose",
    "fit_data_parallel_overhead",
    "fit_pipeline_overhead",
    "fit_replica_overhead",
    "from_network",
    "madpipe",
    "madpipe_dp",
    "parse_bytes",
    "pipedream",
    "profile",
    "profile_layer_model",
    "simulate",
    "smallest_budget",
    "stage_memory",
    "stored_activations",
    "straight_pipeline",
    "to_plan",
]
