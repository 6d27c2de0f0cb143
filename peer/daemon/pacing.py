"""How the main loop waits after an error, so a failure that repeats cannot spin a core.

Why: one bad or late message is dropped and the loop goes on at once (`PeerDaemon.run`); a
failure that comes back on every pass (a step that raised each time, before such steps were
dropped) made the loop spin the CPU and log one warning per pass. Errors apart from each other
cost nothing; a run of them in quick succession waits longer each time (up to `max_s`), and the
log gets the first ten of a run, then every hundredth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

FREE = 3  # errors in quick succession before the loop starts to wait


class ErrorPacing:
    """Backoff for a loop's repeated errors: call `failed(exc)` from its except clause."""

    def __init__(
        self,
        log: logging.Logger,
        first_s: float = 0.05,
        max_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.first_s, self.max_s, self.sleep, self.clock = log, first_s, max_s, sleep, clock
        self.run = 0  # errors in the current run
        self._last = -1e9
        self.delay = 0.0

    def failed(self, exc: BaseException) -> float:
        """Log `exc` and wait as the current run of errors says; returns the seconds waited."""
        now = self.clock()
        if now - self._last > 2 * self.delay + 1.0:  # the last error is long past: a new run
            self.run, self.delay = 0, 0.0
        self._last = now
        self.run += 1
        if self.run <= 10 or self.run % 100 == 0:
            pace = f" ({self.run} errors in a row; waiting {self.delay:.2f}s between them)" if self.run > FREE else ""
            self.log.warning("dropped a message: %s%s", exc, pace)
        if self.run > FREE:
            self.delay = min(self.max_s, max(self.first_s, 2 * self.delay))
            self.sleep(self.delay)
            self._last = self.clock()
            return self.delay
        return 0.0
