"""Files that survive a crash: written and fsynced before they are renamed into place,
and the rename itself made durable by syncing the directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def write_file(path: Path, obj: Any) -> None:
    """Write `obj` (torch.save, or text for a str) to `path` and fsync it."""
    with open(path, "wb") as f:
        if isinstance(obj, str):
            f.write(obj.encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, obj: Any) -> None:
    """Replace `path` with `obj` atomically: a crash leaves the old file or the new one,
    whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_file(tmp, obj)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


__all__ = ["fsync_dir", "replace_file", "write_file"]
