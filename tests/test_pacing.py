"""The main loop's backoff (peer/daemon/pacing.py): a failure that repeats waits longer each time
instead of spinning a core, and logs the first ten of a run, then every hundredth; errors apart
from each other cost nothing."""

from __future__ import annotations

import logging

from peer.daemon.pacing import FREE, ErrorPacing


def test_an_error_that_repeats_waits_longer_each_time_and_a_lone_one_does_not(caplog) -> None:
    now = [0.0]
    waited: list[float] = []

    def sleep(s: float) -> None:
        waited.append(s)
        now[0] += s

    p = ErrorPacing(logging.getLogger("pacing-test"), sleep=sleep, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pacing-test"):
        for _ in range(300):  # a step that fails on every pass of the loop
            p.failed(RuntimeError("same error"))
    assert waited[:3] == [0.05, 0.1, 0.2] and max(waited) == 2.0 and len(waited) == 300 - FREE
    assert len(caplog.records) == 10 + 3  # the first ten, then the 100th, 200th and 300th
    now[0] += 60.0  # much later: a lone error costs nothing
    assert p.failed(RuntimeError("another")) == 0.0 and p.run == 1
