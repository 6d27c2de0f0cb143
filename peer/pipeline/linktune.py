"""Per-link codec tuning: send as much of a boundary tensor as the link can carry in time.

A pipeline runs at the pace of its slowest part. A link is never the slowest part as long as one
micro-batch's bytes cross it in less time than the sender needs to compute the next one, so the
sender picks, per destination, the largest payload that fits

    bytes(f) <= target * measured_bandwidth * compute_seconds_per_micro_batch

where f in [min_keep, 1] is the kept fraction of the configured payload (the low-rank codec sends
round(f * rank) coefficients per token, the best rank-k part of its basis since the basis columns
come in singular-value order). Fast links get the full payload (the best fidelity the config
allows), slow ones less; nobody tunes by hand, and the bounds stay the operator's.

The link's rate comes from `peer.pipeline.linkmeter.LinkMeter`.
"""

from __future__ import annotations

import math


def keep_fraction(
    bytes_full: float,
    bytes_fixed: float,
    link_bps: float | None,
    compute_s: float | None,
    target: float,
    min_keep: float,
) -> float:
    """The largest f in [min_keep, 1] whose payload `bytes_fixed + f * bytes_full` crosses the
    link within `target` of a micro-batch's compute time; 1 while either figure is unknown."""
    if not link_bps or not compute_s or bytes_full <= 0:
        return 1.0
    budget = target * link_bps * compute_s - bytes_fixed
    return min(1.0, max(min_keep, budget / bytes_full))


class ComputeClock:
    """Seconds of this worker's compute per micro-batch: an EMA over steps, so one slow step
    (a checkpoint, a GC pause) does not swing the codec."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._busy = 0.0
        self._count = 0
        self.per_micro_batch: float | None = None

    def add(self, seconds: float) -> None:
        self._busy += seconds

    def micro_batch_done(self) -> None:
        self._count += 1

    def step(self) -> None:
        """Fold the work since the last step into the estimate."""
        if self._count:
            x = self._busy / self._count
            self.per_micro_batch = (
                x if self.per_micro_batch is None else (1 - self.alpha) * self.per_micro_batch + self.alpha * x
            )
        self._busy, self._count = 0.0, 0


def coefficients(rank: int, fraction: float, min_keep: float) -> int:
    """Coefficients per token for a kept fraction of `rank`: at least ceil(min_keep * rank), >= 1."""
    floor = max(1, math.ceil(min_keep * rank - 1e-9))
    return max(floor, min(rank, int(fraction * rank + 1e-9)))
