"""Reading the JSON files users hand the library: networks, profiles, topologies, plans.

One reader, so that every such file is refused alike when it is missing, is not JSON or
holds the wrong thing: a `ValueError` naming the file and what it should hold, which the
command-line tools print as their one-line error (never a traceback).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in `path`; `what` says what the file should hold ("a network
    description from `pipesgd timing measure --json`").

    Raises:
        ValueError: no such file, unreadable, or not JSON; the message names the file.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; expected {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc}); expected {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno}); expected {what}") from None


def load_json(path: str | Path, what: str, build: Callable[[dict[str, Any]], T]) -> T:
    """`build` applied to the JSON object in `path`.

    Raises:
        ValueError: as `read_json`; the file holds no JSON object; or `build` refuses it
            (its ValueError, TypeError or KeyError), with the file's name in front.
    """
    data = read_json(path, what)
    if not isinstance(data, dict):
        kind = _JSON_TYPES.get(type(data), type(data).__name__)
        raise ValueError(f"{path}: holds a JSON {kind}, expected {what}")
    try:
        return build(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{path}: not {what} ({exc})") from exc


def dataclass_from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """The dataclass `cls` from the keys of `data` that name its fields; other keys are
    ignored (a file written by a newer version may carry more).

    Raises:
        ValueError: a field without a default is missing; the message names them all.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{what} needs {', '.join(missing)}; it has "
                         f"{', '.join(sorted(data)) or 'nothing'}")
    names = {f.name for f in fields}
    return cls(**{k: v for k, v in data.items() if k in names})
