"""Crash-safe file writes: a reader sees the old file or the new one, never half of one.

Why one helper: checkpoints, their manifests, the tracker's run state and bootstrap.json are all
read back after a kill, so all go through the same temp file, fsync, rename.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, content: bytes | Callable[[BinaryIO], object]) -> None:
    """Write `content` (bytes, or a function writing to the open file) to a temp name beside
    `path`, fsync it, and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if callable(content):
            content(f)
        else:
            f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
