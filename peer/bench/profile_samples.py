"""py-spy's raw output read as samples, and which innermost frames are waits.

Why a module of its own: `bench profile`'s parts (peer/bench/profile.py) and the security
checks' attribution (peer/bench/profile_checks.py) read the same samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

IDLE_LEAVES = (
    "Condition.wait",
    "channel_spin",
    "Event.wait",
    "sleep",
    "select",
    "poll (",
    "_recv",
    "recv (",
    "epoll",
    "_run_once",
    "run_forever",
    "readinto",
    "_wait_for_tstate_lock",
)


def samples(raw_files: list[Path]) -> Iterator[tuple[list[str], int, bool]]:
    """(frames root first, sample count, idle) per line of py-spy's raw output; idle: the innermost
    frame is a wait (IDLE_LEAVES)."""
    for f in raw_files:
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            yield frames, int(n), any(k in frames[-1] for k in IDLE_LEAVES)
