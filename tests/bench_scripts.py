"""Load a script of bench/ as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from mpirun import ROOT


def load_bench(script: str, name: str | None = None) -> ModuleType:
    """bench/<script>.py as the module `name` (default: the script's own name), entered
    in sys.modules so its dataclasses, and scripts importing it, find it."""
    name = name or script
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
