"""Crash-safe file writes: a reader sees the old file or the new one, never half of one.

Why one helper: checkpoints, their manifests, the tracker's run state and bootstrap.json are all
read back after a kill, so all go through the same temp file, fsync, rename.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, content: bytes | Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """Write `content` (bytes, or a function writing to the open file) to a temp name beside
    `path`, fsync it, and rename it over `path`. `mode` applies from the file's creation on
    (0o600 for secrets: never readable by others, not even for a moment)."""
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)  # a leftover of a kill may carry another mode
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # os.open's mode is masked by the umask
        os.replace(tmp, path)
    except BaseException:  # a full disk, a failed writer: no half file is left to fill the disk further
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def temp_path(path: Path) -> Path:
    """The temp name `write_atomic` writes `path` under (never read as a real file)."""
    return path.with_name(f".{path.name}.tmp")


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
