"""Checkpoints keyed by global layer index, so a different partition can reload them.

    DIR/manifest.json        epochs done, the plan that wrote it, file of every layer
    DIR/layer_0003.pt        state dict of global layer 3 (parameters and buffers)
    DIR/optimizer_0003.pt    optimizer state of layer 3's parameters, keyed by name

Replica 0 of each stage writes its layers (replicas are identical). Every file is
loaded with `torch.load(..., weights_only=True)`: tensors and plain containers only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runtime import Pipeline

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the model being loaded."""


def _split_key(key: str) -> tuple[int, str]:
    local, _, rest = key.partition(".")
    return int(local), rest


def save(pipe: Pipeline, directory: str | Path) -> Path:
    """Write this stage's layers and optimizer state (collective over the pipeline)."""
    out = Path(directory)
    if pipe.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    pipe.comm.Barrier()
    start = pipe.stage_plan.start
    if pipe.replica == 0:
        layers: dict[int, dict[str, torch.Tensor]] = {
            i: {} for i in range(start, pipe.stage_plan.end)
        }
        for key, t in pipe.stage.module.state_dict().items():
            local, rest = _split_key(key)
            layers[start + local][rest] = t.detach().cpu().clone()
        optim: dict[int, dict] = {i: {"state": {}, "param_groups": []} for i in layers}
        opt = pipe.stage.optimizer
        if opt is not None:
            sd = opt.state_dict()
            groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            for idx, name in enumerate(pipe.stage.names):
                local, rest = _split_key(name)
                entry = optim[start + local]
                entry["param_groups"] = groups
                if idx in sd["state"]:
                    entry["state"][rest] = {
                        k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                        for k, v in sd["state"][idx].items()
                    }
        for i in layers:
            torch.save(layers[i], out / f"layer_{i:04d}.pt")
            torch.save(optim[i], out / f"optimizer_{i:04d}.pt")
    pipe.comm.Barrier()
    if pipe.rank == 0:
        manifest = {
            "epochs_done": pipe.epochs_done,
            "num_layers": pipe.plan.num_layers,
            "plan": pipe.plan.to_dict(),
            "layers": {str(i): f"layer_{i:04d}.pt" for i in range(pipe.plan.num_layers)},
            "optimizer": {str(i): f"optimizer_{i:04d}.pt" for i in range(pipe.plan.num_layers)},
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    pipe.comm.Barrier()
    return out


def load(pipe: Pipeline, directory: str | Path, *, optimizer: bool = True) -> int:
    """Load this stage's layers (any partition of the same model); returns epochs done.

    Raises:
        CheckpointError: no manifest, or the model has a different number of layers.
    """
    src = Path(directory)
    path = src / MANIFEST
    if not path.exists():
        raise CheckpointError(
            f"{src} holds no {MANIFEST}: pass the directory given to `--save` "
            f"(or to checkpoint.save)"
        )
    manifest = json.loads(path.read_text())
    if manifest["num_layers"] != pipe.plan.num_layers:
        raise CheckpointError(
            f"the checkpoint in {src} has {manifest['num_layers']} layers but this model has "
            f"{pipe.plan.num_layers}: resume with the same --model"
        )
    start = pipe.stage_plan.start
    state = {}
    optim_by_name: dict[str, dict] = {}
    groups = None
    for i in range(start, pipe.stage_plan.end):
        layer = torch.load(src / manifest["layers"][str(i)], weights_only=True)
        state.update({f"{i - start}.{k}": v for k, v in layer.items()})
        if optimizer:
            saved = torch.load(src / manifest["optimizer"][str(i)], weights_only=True)
            optim_by_name.update({f"{i - start}.{k}": v for k, v in saved["state"].items()})
            groups = groups or saved["param_groups"]
    pipe.stage.module.load_state_dict(state)
    pipe.stage.reset_policy()
    opt = pipe.stage.optimizer
    if optimizer and opt is not None:
        sd = opt.state_dict()
        sd["state"] = {
            idx: optim_by_name[name]
            for idx, name in enumerate(pipe.stage.names)
            if name in optim_by_name
        }
        if groups:
            sd["param_groups"] = [
                {**saved_g, "params": g["params"]}
                for saved_g, g in zip(groups, sd["param_groups"], strict=False)
            ]
        opt.load_state_dict(sd)
    pipe.epochs_done = int(manifest["epochs_done"])
    return pipe.epochs_done
