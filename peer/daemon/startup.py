"""Where a peer's startup goes: named phases from its process's start to its first optimizer step.

A peer that has not stepped yet says in its status what it is doing and for how long (a joiner
that waits on a state download looks like a stuck one otherwise), and once it steps it reports
each phase's seconds, so `bench throughput` and the status can say which phase to cut instead of
one opaque figure. The clock is the process's age (`process_age_s`), so the interpreter's start
and the imports count as the first phase.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("anchormesh.peer")
STARTED_ENV = "ANCHORMESH_STARTED_AT"  # set by a MOVE's exec: the new life's start (wall clock), since the process's start is the old one's
_IMPORTED = time.monotonic()

# what each phase is doing, as a joining peer's status says it
DOING = {
    "imports": "starting Python and importing torch, hivemind and transformers",
    "tracker": "asking the tracker for the run's DHT addresses",
    "dht": "starting its DHT node (hivemind, p2pd)",
    "find_tracker": "looking the tracker up in the DHT",
    "grpc": "starting its gRPC server",
    "join": "joining: the run's config, its memory plan, the tracker's assignment",
    "stage": "building its stage's layers",
    "averager": "starting its stage group's averager (hivemind)",
    "checkpoint": "checking its checkpoints",
    "state": "downloading its stage's state from its group",
    "restore": "restoring its stage's state from a replica",
    "first_step": "serving, waiting for its first step's gradients",
}
MAX_PHASES = 16  # what a report may carry (the tracker keeps at most this many)


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc, so imports and the DHT's start count;
    after a MOVE's exec: since the exec; elsewhere: since this module was imported)."""
    try:
        if STARTED_ENV in os.environ:
            return max(time.time() - float(os.environ[STARTED_ENV]), 0.0)
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
        with open("/proc/uptime") as f:
            return max(float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class StartupClock:
    """Phase marks on the process clock; `begin` ends the phase before. Thread-safe: the main
    thread marks, the heartbeat thread reads."""

    def __init__(self, age_s: Callable[[], float]) -> None:
        self._age = age_s
        self._lock = threading.Lock()
        self._marks: list[tuple[str, float]] = [("imports", 0.0)]
        self._done: float | None = None

    def begin(self, phase: str) -> None:
        """Start `phase` now (a name from DOING); ignored after the first step."""
        if phase not in DOING:
            raise ValueError(f"unknown startup phase {phase!r}: one of {', '.join(DOING)}")
        with self._lock:
            if self._done is None:
                self._marks.append((phase, self._age()))

    def done(self) -> float:
        """The first step: ends the last phase, logs each phase's seconds (once), returns the
        process's age then."""
        with self._lock:
            first = self._done is None
            if first:
                self._done = self._age()
        if first:
            log.info(
                "first step %.1f s after the process started: %s",
                self._done,
                ", ".join(f"{n} {s:.1f} s" for n, s in self.phases()),
            )
        return self._done

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds) in order, the current one counted to now (or to the first step);
        a phase entered twice (a retried join) is one entry with both spans summed."""
        with self._lock:
            end = self._done if self._done is not None else self._age()
            marks = list(self._marks)
        out: dict[str, float] = {}
        for (name, t0), (_, t1) in zip(marks, [*marks[1:], ("end", end)]):
            out[name] = out.get(name, 0.0) + max(t1 - t0, 0.0)
        return list(out.items())

    def waiting(self, detail: str = "") -> str:
        """A joining peer's status reason: what it is doing (`detail` when the phase said more,
        e.g. which replica it restores from), for how long, since when."""
        with self._lock:
            name, t0 = self._marks[-1]
        age = self._age()
        return f"{detail or DOING[name]} ({age - t0:.0f} s; {age:.0f} s since start)"
