"""Naming a model on the command line: "mlp", "cnn", a network of the Pipe-SGD paper
("paper-mnist-mlp", "paper-cifar100-cnn", "alexnet", "resnet18"), or MODULE:FUNCTION for
your own.

MODULE is an importable module (`mypackage.models`) or the path of a Python file
(`./models.py`); FUNCTION takes no arguments and returns a `torch.nn.Module`. An
`nn.Sequential` keeps its children as layers, so a pipeline plan can cut between them;
any other module is one layer. The built-in MLP takes its input size and class count
from the data it will see, so `pipesgd timing predict` and `pipesgd train` name the same
network for the same data. The paper's networks take the samples they were published
for (`pipesgd.paper_models`) and the data's class count.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from pipesgd.paper_models import PAPER_NETWORKS
from pipesgd.pipeline.models import LayerModel, cnn, from_modules, mlp, paper

BUILTIN = ("mlp", "cnn", *PAPER_NETWORKS)
HELP = ("mlp (input-500-500-classes), cnn (the small AlexNet-style CNN), a network of the "
        "Pipe-SGD paper (" + ", ".join(PAPER_NETWORKS) + "), or MODULE:FUNCTION, a function "
        "of a module or .py file that returns a torch.nn.Module")


_FILE_MODULES: dict[Path, ModuleType] = {}


def _load_file(path: Path) -> ModuleType:
    """The module of a .py file, run once per process however often it is named (as
    `import` does for a module name): a user's file may be slow or print."""
    if path not in _FILE_MODULES:
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None or not path.is_file():
            raise FileNotFoundError(f"no Python file at {path}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
        _FILE_MODULES[path] = module
    return _FILE_MODULES[path]


def check_model_name(spec: str) -> tuple[str, str]:
    """(MODULE, FUNCTION) of a MODULE:FUNCTION spec, ("", spec) of a built-in name.

    Raises:
        ValueError: neither: the message lists what --model takes.
    """
    if spec in BUILTIN:
        return "", spec
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function.isidentifier():
        raise ValueError(f"--model {spec!r}: expected one of mlp, cnn or MODULE:FUNCTION "
                         "(e.g. mymodels:resnet or ./models.py:build), or a network of the "
                         f"Pipe-SGD paper: {', '.join(PAPER_NETWORKS)}")
    return module_name, function


def load_model_function(spec: str) -> Callable[[], nn.Module]:
    """The FUNCTION of a MODULE:FUNCTION spec, imported.

    Raises:
        ValueError: the spec is malformed, the module cannot be imported or has no such
            function (the message names which).
    """
    module_name, function = check_model_name(spec)
    if not module_name:
        raise ValueError(f"--model {spec!r} is built in, not MODULE:FUNCTION")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            module = _load_file(Path(module_name).expanduser().resolve())
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing the user's code
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no function {function!r}")
    return fn


def layer_model(spec: str, input_shape: tuple[int, ...], num_classes: int,
                seed: int = 0) -> LayerModel:
    """The model `spec` names, for samples of `input_shape` and `num_classes` classes.

    A MODULE:FUNCTION model is built once, under `torch.manual_seed(seed)` so that every
    rank builds the same weights; `input_shape` and `num_classes` only describe its data.
    A network of the paper keeps its published shapes, with `num_classes` outputs.

    Raises:
        ValueError: an unknown or broken spec, a function that returns no module, or a
            paper's network given samples of another shape.
    """
    if spec == "mlp":
        return mlp((math.prod(input_shape), 500, 500, num_classes))
    if spec == "cnn":
        return cnn(num_classes, channels=input_shape[0])
    if spec in PAPER_NETWORKS:
        net = PAPER_NETWORKS[spec]
        if not net.accepts(tuple(input_shape)):
            want = "x".join(map(str, net.input_shape))
            raise ValueError(f"--model {spec!r} takes samples of {want} (the paper's "
                             f"{net.title}); the data's are {'x'.join(map(str, input_shape))}")
        return dataclasses.replace(paper(spec, num_classes), input_shape=tuple(input_shape))
    fn = load_model_function(spec)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        module = fn()
    finally:
        torch.random.set_rng_state(state)
    if not isinstance(module, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(module).__name__}, not a "
                         "torch.nn.Module")
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    return from_modules(layers, tuple(input_shape), num_classes, name=spec)


def parse_shape(text: str) -> tuple[int, ...]:
    """'1,28,28' -> (1, 28, 28) (for --input-shape).

    Raises:
        ValueError: not a comma-separated list of positive integers.
    """
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"--input-shape {text!r}: expected positive integers separated by "
                         "commas, e.g. 784 or 3,32,32")
    return shape


def add_model_arguments(parser: argparse.ArgumentParser, model_default: str | None = "mlp",
                        model_help: str = HELP) -> None:
    """--model, --data, --input-shape and --classes, as the tools that profile a model
    without training it take them (`model_shape` reads them)."""
    parser.add_argument("--model", default=model_default, help=model_help)
    parser.add_argument("--data", help="size the model for this data set, as `pipesgd train "
                        "--data` does (digits, synthetic or an MNIST folder)")
    parser.add_argument("--input-shape", type=parse_shape,
                        help="shape of one sample, e.g. 784 or 3,32,32 (instead of --data)")
    parser.add_argument("--classes", type=int, default=10, help="output classes (default 10)")


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The sample shape and classes to size the model for: from --data as `pipesgd train`
    loads it, from --input-shape, or (neither) the built-in models' defaults."""
    check_model_name(args.model)
    if args.data and args.input_shape:
        raise ValueError("give --data or --input-shape, not both")
    if args.data:
        from pipesgd.train.data import load

        dataset = load(args.data, args.model)
        return {"input_shape": dataset.input_shape, "num_classes": dataset.num_classes}
    if args.input_shape:
        return {"input_shape": args.input_shape, "num_classes": args.classes}
    if args.model not in BUILTIN:
        raise ValueError(f"--model {args.model!r} needs --data or --input-shape to profile it")
    return {}
