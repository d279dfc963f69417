"""Planners: where each layer runs, from a per-layer profile and a topology.

    import torch
    from torch import nn
    from pipesgd.planner import madpipe, pipedream, profile, to_plan

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    prof = profile(model, torch.randn(32, 64))          # per-layer times and bytes
    result = pipedream(prof, "4x[20GB/s], 2x[1Gbit]")  # PipeDream §3.1
    print(result.describe())
    to_plan(result).save("plan.json")                   # pipesgd.pipeline's format
    print(madpipe(prof, "4x[10Gbit]", memory_per_worker="1MB").describe())

Modules: profile (LayerProfile, ModelProfile, profile), topology (levels of components
and bandwidths), pipedream (the hierarchical DP with replicated stages), madpipe (1F1B*
activation counts and the memory-aware DP).
"""

from .madpipe import (
    MadPipeResult,
    madpipe,
    madpipe_dp,
    smallest_budget,
    stage_memory,
    stored_activations,
)
from .pipedream import LevelStage, PipeDreamResult, pipedream, to_plan
from .profile import LayerProfile, ModelProfile, profile
from .topology import HierarchicalTopology, Level, parse_bytes

__all__ = [
    "HierarchicalTopology",
    "LayerProfile",
    "Level",
    "LevelStage",
    "MadPipeResult",
    "ModelProfile",
    "PipeDreamResult",
    "madpipe",
    "madpipe_dp",
    "parse_bytes",
    "pipedream",
    "profile",
    "smallest_budget",
    "stage_memory",
    "stored_activations",
    "to_plan",
]
