"""One progress bar for long byte-counted work (checkpoints, data, export).

Why one helper: every long job should show bytes done, rate and ETA the same way, on a terminal
only; in a log file a bar is noise, so the callers log a summary line when they finish.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def byte_bar(desc: str, total: int | None = None, show: bool | None = None) -> tqdm:
    """A bytes bar (KiB/MiB units, rate, ETA when `total` is known) on stderr; `show=None` means
    "only when stderr is a terminal"."""
    visible = sys.stderr.isatty() if show is None else show
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not visible,
        leave=False,
        file=sys.stderr,
    )
