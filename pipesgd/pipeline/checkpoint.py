"""Checkpoints keyed by global layer index, so a different partition can reload them.

    DIR/manifest.json        epochs done, the plan that wrote it, file of every layer
    DIR/layer_0003.pt        state dict of global layer 3 (parameters and buffers)
    DIR/optimizer_0003.pt    optimizer state of layer 3's parameters, keyed by name

Replica 0 of each stage writes its layers (replicas are identical). Every file is
loaded with `torch.load(..., weights_only=True)`: tensors and plain containers only.

A save replaces DIR atomically, so a crash at any moment leaves a loadable checkpoint:

 1. rank 0 creates DIR's sibling `.DIR.tmp-<pid>-<hex>` (same filesystem, so step 4 is
    a rename) and broadcasts its name;
 2. each stage's replica 0 writes its layer files into it and fsyncs each one;
 3. the ranks agree that every write succeeded (an all-gather of errors: a failed
    rank makes all of them raise, and rank 0 removes the temporary directory);
 4. rank 0 writes and fsyncs the manifest, then renames an existing DIR aside to
    `.DIR.old-<pid>-<hex>`, renames the temporary directory to DIR, fsyncs the parent
    and removes the old copy and any leftovers of crashed saves.

Until step 4 DIR is the previous checkpoint, untouched; after it, the new one, complete
(its files were durable before the rename). Between the two renames of step 4 DIR is
missing, and `load` reads the copy set aside. Each file is written once by one rank,
so no two ranks touch the same path, and only rank 0 renames, after every rank's files
are synced: on a shared filesystem the rename never publishes a half-written file.
Since a save replaces the whole directory, it refuses one that holds anything but a
checkpoint's files; one save at a time may write a given DIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipesgd.agreement import on_every_rank
from pipesgd.durable import fsync_dir as _fsync_dir
from pipesgd.durable import write_file as _write_file

if TYPE_CHECKING:
    from .runtime import Pipeline

MANIFEST = "manifest.json"
# What a checkpoint directory may hold; a save refuses to replace anything else.
_CHECKPOINT_FILE = re.compile(r"(manifest\.json|(layer|optimizer)_\d{4,}\.pt)")


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the model being loaded, or cannot be written."""


def _split_key(key: str) -> tuple[int, str]:
    local, _, rest = key.partition(".")
    return int(local), rest


def _sibling(target: Path, kind: str, token: str) -> Path:
    """`.NAME.tmp-TOKEN` (being written) or `.NAME.old-TOKEN` (set aside) next to target."""
    return target.parent / f".{target.name}.{kind}-{token}"


def _siblings(target: Path, kind: str) -> list[Path]:
    """Every `_sibling(target, kind, ...)` on disk."""
    prefix = _sibling(target, kind, "").name
    if not target.parent.is_dir():
        return []
    return [p for p in target.parent.iterdir() if p.name.startswith(prefix)]


def _stage_files(pipe: Pipeline) -> dict[str, Any]:
    """This stage's layer and optimizer files, by name (nothing on replicas > 0)."""
    if pipe.replica != 0:
        return {}
    start = pipe.stage_plan.start
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
    files: dict[str, Any] = {}
    for i in layers:
        files[f"layer_{i:04d}.pt"] = layers[i]
        files[f"optimizer_{i:04d}.pt"] = optim[i]
    return files


def _check_replaceable(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} is a file, not a checkpoint directory: pass a "
                              f"directory path to `--save` (or to checkpoint.save)")
    if target.is_dir():
        strangers = sorted(p.name for p in target.iterdir()
                           if not _CHECKPOINT_FILE.fullmatch(p.name))
        if strangers:
            raise CheckpointError(
                f"{target} holds files that are not a checkpoint's ({', '.join(strangers[:3])}"
                f"{'...' if len(strangers) > 3 else ''}) and a save replaces the whole "
                f"directory: save into a new or empty directory, e.g. {target / 'checkpoint'}"
            )


def _on_every_rank(pipe: Pipeline, what: str, step: Callable[[], Any]) -> Any:
    """Run `step` here; if it raised on any rank, raise on every rank (the rank that
    failed re-raises its own error), so that no rank waits for a failed one. Returns
    rank 0's result on every rank (one collective carries both)."""
    outcome = on_every_rank(pipe.comm, step)
    if outcome.error is not None:
        raise outcome.error
    if outcome.failures:
        rank, kind, message = outcome.failures[0]
        raise CheckpointError(f"checkpoint not saved: rank {rank} failed to {what} "
                              f"({kind}: {message})")
    return outcome.result


def _prepare(target: Path) -> Path:
    """Rank 0: the empty temporary directory next to `target` that a save fills."""
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(target, "tmp", f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return tmp


def _commit(pipe: Pipeline, tmp: Path, target: Path) -> None:
    """Rank 0, once every rank's files are synced: add the manifest, put `tmp` in
    `target`'s place keeping a loadable copy at every instant, then remove the old copy
    and whatever crashed saves left (one save at a time writes a given directory)."""
    manifest = {
        "epochs_done": pipe.epochs_done,
        # Every stage steps once per round, so rank 0's count is every stage's.
        "optimizer_steps": pipe.optimizer_steps,
        "num_layers": pipe.plan.num_layers,
        "plan": pipe.plan.to_dict(),
        "layers": {str(i): f"layer_{i:04d}.pt" for i in range(pipe.plan.num_layers)},
        "optimizer": {str(i): f"optimizer_{i:04d}.pt" for i in range(pipe.plan.num_layers)},
    }
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    _fsync_dir(tmp)
    if target.exists():
        os.rename(target, _sibling(target, "old", tmp.name.rpartition(".tmp-")[2]))
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    for stale in _siblings(target, "old") + _siblings(target, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def save(pipe: Pipeline, directory: str | Path) -> Path:
    """Write every stage's layers and optimizer state to `directory`, replacing the
    checkpoint there atomically (collective over the pipeline; see the module docstring).

    Raises:
        CheckpointError: `directory` holds files that are not a checkpoint's, or a rank
            failed to write (every rank raises; the previous checkpoint stays in place).
    """
    out = Path(directory).absolute()
    tmp = _on_every_rank(pipe, f"prepare {out}",
                         lambda: _prepare(out) if pipe.rank == 0 else None)
    try:
        def write() -> None:
            for name, obj in _stage_files(pipe).items():
                _write_file(tmp / name, obj)

        _on_every_rank(pipe, "write its layers", write)
        _on_every_rank(pipe, f"commit {out}",
                       lambda: _commit(pipe, tmp, out) if pipe.rank == 0 else None)
    finally:
        if pipe.rank == 0:  # gone after a commit; a failed save leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
    return Path(directory)


def _source(directory: Path) -> Path:
    """`directory`, or the copy a save set aside if it crashed between its two renames."""
    if (directory / MANIFEST).exists():
        return directory
    aside = [p for p in _siblings(directory, "old") if (p / MANIFEST).exists()]
    return max(aside, key=lambda p: p.stat().st_mtime) if aside else directory


def load(pipe: Pipeline, directory: str | Path, *, optimizer: bool = True) -> int:
    """Load this stage's layers (any partition of the same model); returns epochs done.

    Raises:
        CheckpointError: no manifest, or the model has a different number of layers.
    """
    src = _source(Path(directory))
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
    pipe.stage.reset_policy(int(manifest.get("optimizer_steps", 0)))
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
