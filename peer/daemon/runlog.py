"""`metrics.jsonl`, the last stage's loss per step, written so that its failures never stop training.

Why its own class: the file is a by-product. A full disk, a removed folder or an I/O error used
to raise out of the step loop and end the peer. Here a failed write is counted and logged (the
first one, then at most one line a minute with the count), the file is closed, and the next
step opens it again, so the log resumes by itself once the disk has room.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0


class MetricsLog:
    """Appends one JSON object per line to `path`; `write` never raises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failures = 0  # lines that failed to reach the file
        self._f: BinaryIO | None = None
        self._logged_at = -float("inf")
        self._unlogged = 0  # failures since the last log line

    def write(self, record: dict) -> bool:
        """Append `record`; returns whether it reached the file (a failure is counted and logged)."""
        start: int | None = None
        try:
            if self._f is None:
                self._f = self._open()
            line = (json.dumps(record) + "\n").encode()
            start = self._f.tell()
            if self._f.write(line) != len(line):  # unbuffered: one write(2) per line, a short one is a failure
                raise OSError(errno.ENOSPC, "short write (disk full?)")
            return True
        except Exception as exc:  # OSError, or a ValueError from a file closed under it
            self._cut(start)
            self._failed(exc)
            return False

    def _cut(self, start: int | None) -> None:
        """All or nothing: drop the part of a failed line that reached the file."""
        if self._f is not None and start is not None:
            try:
                self._f.truncate(start)
            except Exception:
                pass

    def _open(self) -> BinaryIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "ab", buffering=0)
        try:
            if f.tell() > 0:  # end a line an earlier failure cut short, so the next one parses
                with open(self.path, "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        f.write(b"\n")
        except BaseException:
            f.close()
            raise
        return f

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self._unlogged += 1
        self.close()  # the next write opens the file again
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "cannot write %s (%d failed writes so far, %d since the last message; training goes on): %s",
                self.path,
                self.failures,
                self._unlogged,
                exc,
            )
            self._logged_at, self._unlogged = now, 0

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass
