"""Per-link codec tuning: send as much of a boundary tensor as the link can carry in time.

A pipeline runs at the pace of its slowest part. A link is never the slowest part as long as one
micro-batch's bytes cross it in less time than the sender needs to compute the next one, so the
sender picks, per destination, the largest payload that fits

    bytes(f) <= target * measured_bandwidth * compute_seconds_per_micro_batch

where f in [min_keep, 1] is the kept fraction of the configured payload (the low-rank codec sends
round(f * rank) coefficients per token, the best rank-k part of its basis since the basis columns
come in singular-value order). Fast links get the full payload (the best fidelity the config
allows), slow ones less; nobody tunes by hand, and the bounds stay the operator's.

The link is measured from the acks of its own gRPC stream (`LinkMeter`), in BBR's model: a
message is acknowledged R after the link delivered its last byte (the way back plus the
receiver's time to answer), so a message sent onto an idle stream takes bytes / bw + R from send
to ack, and a slow answer would read as a slow link. The two are estimated apart:

    bw  delivery rate: over a run of messages each sent before the previous one was acked,
        bytes(j..k) / (ack_k - sent_j - R), a lower bound whatever the acks' timing; the max
        over `bw_window_s`
    R   round trip: send-to-ack less bytes / bw of a message sent onto an idle stream; the min
        over `rtt_window_s` (what `pipe` keeps in flight: bw * R, and the stall rule allows)

A run's sample measures the link only if the sender outran it: its acks came back spread wider
than it sent them (by BUSY, and by more than the answers' own jitter). A run the sender paced
(acks as far apart as its sends) measures the sender, not the link (BBR calls it
application-limited): its sample, R left in, may raise the estimate, never lower it. Lowering
takes busy acks at CONFIRM and at half of the window's acks (answers that come late at random make
a paced run look busy now and then; a slower link, at every ack). A lone message gives no rate
(a shaper's burst lets it through faster than the link's sustained rate). Once the tuner fits the
payload to the link every run is paced and the estimate holds; a link that slows makes the
messages back up and measures again. A link that never backs up is not measured (None): it
carries the full payload. Stalls, acks twice or out of order, a clock that steps back: no sample
(never a division by zero or an infinite rate), the estimate holds, and `held` says why.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

# acks spread this much wider than the sends: the sender outran the link, which was busy throughout
BUSY = 1.1
# busy acks a window needs before its max may lower the estimate (a stray one, a sender that stalled
# for a moment, does not); and round-trip samples before the least of them is trusted
CONFIRM = 4


class LinkMeter:
    """Delivery rate and round trip of one outbound stream, from its acks, estimated apart
    (thread-safe: the sender thread acks, the worker reads). See the module docstring.

    Args:
        bw_window_s: seconds a delivery-rate sample counts toward the estimate (max filter).
        rtt_window_s: seconds a round-trip sample counts toward the estimate (min filter).
        run: most messages of a run one delivery-rate sample spans.
    """

    def __init__(self, bw_window_s: float = 10.0, rtt_window_s: float = 10.0, run: int = 16) -> None:
        self._lock = threading.Lock()
        self.bw_window_s, self.rtt_window_s = bw_window_s, rtt_window_s
        self._queued: deque[tuple[int, float, object]] = deque()  # (bytes, sent at, key), not yet acked, in order
        self._run: deque[tuple[int, float, float]] = deque(maxlen=run)  # (bytes, sent, acked): the current run's latest
        self._bw: deque[tuple[float, float]] = deque()  # (when, bytes/s) delivery-rate samples
        self._rtt: deque[tuple[float, float]] = deque()  # (when, seconds) round-trip samples
        self._acks: deque[tuple[float, bool]] = deque()  # (when, whether it found the link busy) per ack
        self._bw_est: float | None = None  # the last estimate: held while no sample is in the window
        self._last_ack: float | None = None
        self._size = 0.0  # mean bytes of the messages acked lately (EMA)
        self.why = ""  # why the last ack gave no sample ("" when it did or needed none)

    def sent(self, nbytes: int, now: float | None = None, key: object = None) -> None:
        """A message of `nbytes` left for the link; `key` (optional) names it in its ack."""
        with self._lock:
            self._queued.append((nbytes, time.monotonic() if now is None else now, key))

    def acked(self, now: float | None = None, key: object = None) -> None:
        """A message arrived: the oldest queued one, or the one `key` names. An ack for no message
        in flight (twice, or after `lost`) is ignored; one out of order is taken without a sample."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if key is not None and not (self._queued and self._queued[0][2] == key):
                hit = next((i for i, q in enumerate(self._queued) if q[2] == key), None)
                if hit is not None:
                    del self._queued[hit]
                    self._run.clear()
                self.why = "an ack out of order: sample dropped" if hit is not None else "an ack for no message in flight: ignored"
                return
            if not self._queued:
                self.why = "an ack for no message in flight: ignored"
                return
            nbytes, sent, _ = self._queued.popleft()
            last, self._last_ack = self._last_ack, now
            if now < sent or (last is not None and now < last):
                self._run.clear()
                self.why = "the clock went backwards: sample dropped"
                return
            self.why = ""
            self._size = nbytes if not self._size else 0.8 * self._size + 0.2 * nbytes
            if not (self._run and last is not None and sent < last):  # sent onto an idle stream: a new run
                self._run.clear()
                self._lone(nbytes, now - sent, now)
            self._run.append((nbytes, sent, now))
            self._acks.append((now, self._busy(now)))

    def _lone(self, nbytes: int, elapsed: float, now: float) -> None:
        """A message that had the stream to itself: elapsed = nbytes / bw + R, a round-trip
        sample once bw is known. Not a rate sample: a shaper's token bucket lets a lone
        message through faster than the link's sustained rate (tbf's burst read 1.5x on the bed)."""
        if elapsed <= 0:
            self.why = "acks at their messages' send time: sample dropped"
        elif self._bw_est is not None:
            self._rtt.append((now, max(0.0, elapsed - nbytes / self._bw_est)))

    def _busy(self, now: float) -> bool:
        """A run: messages j..k each sent before the previous one was acked (j: the oldest the
        window keeps). The link delivered their bytes between sent_j and ack_k - R, so
        bytes(j..k) / (ack_k - sent_j - R) is a lower bound of its rate, and the rate itself if it
        was busy from sent_j on: acks that bunch up (a receiver short of CPU answering several at
        once) cannot raise it. The link was busy if the acks fell behind the sends by BUSY and by
        more than the answers' own jitter; a run that was not is taken without R, a strict lower
        bound. Taken from the second message of a run on (a pipeline stage may send only two
        micro-batches a step)."""
        if len(self._run) < 2:
            return False
        rtt = self._least_rtt(now)
        jitter = max(r for _, r in self._rtt) - rtt if rtt is not None else 0.0  # how much the answers alone vary
        _, sent_j, ack_j = self._run[0]
        elapsed = now - sent_j - (rtt or 0.0)
        if elapsed <= 0:
            self.why = "acks at their messages' send time: sample dropped"
            return False
        busy = now - ack_j >= BUSY * (self._run[-1][1] - sent_j) + jitter
        nbytes = sum(b for b, _, _ in self._run)
        self._add(nbytes / elapsed if busy else nbytes / (now - sent_j), now, busy)  # R's error may not raise it
        return busy

    def _add(self, bps: float, now: float, busy: bool) -> None:
        """Busy samples always count; others only raise the estimate (they measure the sender,
        and with R left in: a strict lower bound)."""
        est = self._estimate(now)
        if busy or (est is not None and bps > est):
            self._bw.append((now, bps))
            self._estimate(now)

    @staticmethod
    def _windowed(xs: deque, now: float, window: float, pick):
        """Drop the samples older than `window`; `pick` (min or max) of the rest, None if none."""
        while xs and now - xs[0][0] > window:
            xs.popleft()
        return pick(v for _, v in xs) if xs else None

    def _estimate(self, now: float) -> float | None:
        """The max of the window's samples. It lowers the held estimate only if the link was seen
        busy at CONFIRM acks of the window and at least half of them: answers that come late at
        random make a paced run look busy now and then, a slower link makes it so at every ack."""
        best = self._windowed(self._bw, now, self.bw_window_s, max)
        self._windowed(self._acks, now, self.bw_window_s, max)
        busy = sum(b for _, b in self._acks)
        if best is not None and (self._bw_est is None or best >= self._bw_est or (busy >= CONFIRM and 2 * busy >= len(self._acks))):
            self._bw_est = best
        return self._bw_est

    def lost(self, n: int) -> None:
        """The stream broke: the `n` oldest queued messages it had taken are gone (never acked)."""
        with self._lock:
            for _ in range(min(n, len(self._queued))):
                self._queued.popleft()
            self._run.clear()

    def bps(self, now: float | None = None) -> float | None:
        """The link's bytes/s: the largest delivery-rate sample of the window, else the last
        estimate held; None until the link was first seen busy."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._estimate(now)

    def _least_rtt(self, now: float) -> float | None:
        least = self._windowed(self._rtt, now, self.rtt_window_s, min)
        return least if len(self._rtt) >= CONFIRM else None

    def rtt(self, now: float | None = None) -> float | None:
        """Seconds from a message's last byte on the link to its ack (the least of the window,
        once it holds CONFIRM samples), or None until measured."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._least_rtt(now)

    def pipe(self, now: float | None = None) -> int:
        """Messages to keep in flight so the round trip costs the link no time: one more than fit
        in bw * R (the bandwidth-delay product) at the recent message size; 1 while unknown."""
        bw, rtt = self.bps(now), self.rtt(now)
        if bw is None or rtt is None or self._size <= 0:
            return 1
        return 1 + math.ceil(bw * rtt / self._size - 1e-9)

    def held(self, now: float | None = None) -> str:
        """Why the estimate is held rather than measured now ("" when nothing is wrong): no ack
        for longer than the window, or the last ack gave no sample (see `acked`)."""
        now = time.monotonic() if now is None else now
        n, age = self.waiting(now)
        if n and age > self.bw_window_s:
            return f"no ack for {age:.0f} s ({n} messages in flight)"
        return self.why

    def backlog(self) -> int:
        """Bytes queued and not acknowledged yet."""
        with self._lock:
            return sum(q[0] for q in self._queued)

    def waiting(self, now: float | None = None) -> tuple[int, float]:
        """(messages sent and not acknowledged yet, seconds the oldest of them has waited)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return len(self._queued), (now - self._queued[0][1]) if self._queued else 0.0

    def clear(self) -> None:
        """Forget every unacknowledged message (the stream was cut and its queue dropped)."""
        with self._lock:
            self._queued.clear()
            self._run.clear()


def keep_fraction(bytes_full: float, bytes_fixed: float, link_bps: float | None, compute_s: float | None, target: float, min_keep: float) -> float:
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
            self.per_micro_batch = x if self.per_micro_batch is None else (1 - self.alpha) * self.per_micro_batch + self.alpha * x
        self._busy, self._count = 0.0, 0


def coefficients(rank: int, fraction: float, min_keep: float) -> int:
    """Coefficients per token for a kept fraction of `rank`: at least ceil(min_keep * rank), >= 1."""
    floor = max(1, math.ceil(min_keep * rank - 1e-9))
    return max(floor, min(rank, int(fraction * rank + 1e-9)))
