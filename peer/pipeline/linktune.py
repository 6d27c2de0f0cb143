"""Per-link codec tuning: send as much of a boundary tensor as the link can carry in time.

A pipeline runs at the pace of its slowest part. A link is never the slowest part as long as one
micro-batch's bytes cross it in less time than the sender needs to compute the next one, so the
sender picks, per destination, the largest payload that fits

    bytes(f) <= target * measured_bandwidth * compute_seconds_per_micro_batch

where f in [min_keep, 1] is the kept fraction of the configured payload (the low-rank codec sends
round(f * rank) coefficients per token, the best rank-k part of its basis since the basis columns
come in singular-value order). Fast links get the full payload (the best fidelity the config
allows), slow ones less; nobody tunes by hand, and the bounds stay the operator's.

Bandwidth is measured from the acks of the link's own gRPC stream (`LinkMeter`): a message's
service time runs from when the link could start on it (it was queued, and the previous one was
acknowledged) to its ack. Messages queued behind another measure the link's rate itself; a lone
message measures its rate plus one round trip, which understates a link whose round trip is
long next to a micro-batch's transfer (more in flight would hide it). The estimate is the
larger of the two: the rate of backlogged messages, when there were enough of them, and that of
all messages (a lower bound of the rate).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque


class LinkMeter:
    """Bytes/s one outbound stream carries, from its acks (thread-safe: the sender thread acks,
    the worker reads).

    Args:
        window: how many recent messages the estimate averages over.
        min_samples: messages needed before there is an estimate.
    """

    def __init__(self, window: int = 32, min_samples: int = 4) -> None:
        self._lock = threading.Lock()
        self._queued: deque[tuple[int, float]] = deque()  # (bytes, queued at), not yet acked, in order
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)  # (bytes, service seconds)
        self._backlogged: deque[tuple[int, float]] = deque(maxlen=window)  # of those, messages queued behind another
        self._last_ack = 0.0
        self.min_samples = min_samples

    def sent(self, nbytes: int, now: float | None = None) -> None:
        with self._lock:
            self._queued.append((nbytes, time.monotonic() if now is None else now))

    def acked(self, now: float | None = None) -> None:
        """The oldest queued message arrived (acks come in order on one stream)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._queued:
                return
            nbytes, queued_at = self._queued.popleft()
            sample = (nbytes, max(now - max(queued_at, self._last_ack), 1e-6))
            self._samples.append(sample)
            if queued_at < self._last_ack:  # it waited for the previous one: no round trip in it
                self._backlogged.append(sample)
            self._last_ack = now

    def lost(self, n: int) -> None:
        """The stream broke: the `n` oldest queued messages it had taken are gone (never acked)."""
        with self._lock:
            for _ in range(min(n, len(self._queued))):
                self._queued.popleft()

    def bps(self) -> float | None:
        """Measured bytes/s, or None until `min_samples` messages were acked (see the module
        docstring)."""
        with self._lock:
            rates = [
                sum(b for b, _ in xs) / sum(s for _, s in xs)
                for xs in (self._samples, self._backlogged)
                if len(xs) >= self.min_samples
            ]
            return max(rates) if rates else None

    def backlog(self) -> int:
        """Bytes queued and not acknowledged yet."""
        with self._lock:
            return sum(b for b, _ in self._queued)

    def waiting(self, now: float | None = None) -> tuple[int, float]:
        """(messages sent and not acknowledged yet, seconds the oldest of them has waited)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return len(self._queued), (now - self._queued[0][1]) if self._queued else 0.0

    def clear(self) -> None:
        """Forget every unacknowledged message (the stream was cut and its queue dropped)."""
        with self._lock:
            self._queued.clear()


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
