"""The rate and round trip of one outbound stream, from its acks (the tuner in
`peer.pipeline.linktune` budgets bytes from them).

The link is measured from the acks of its own gRPC stream (`LinkMeter`), in BBR's model: a
message is acknowledged r after the link delivered its last byte (the way back plus the
receiver's time to answer), so a message sent onto an idle stream takes bytes / bw + r from send
to ack, and a slow answer would read as a slow link. The two are estimated apart:

    bw  delivery rate: over a run of messages j..k (each sent before the previous one was acked,
        so the link carries them in order from send_j on), (bytes(j..k) - BURST) /
        (ack_k - send_j - R), the best over the run's recent messages as j; the max of the
        samples kept. A lower bound whatever the answers' timing: acks that bunch up cannot
        raise it, nor can a shaper's token bucket of up to BURST bytes (tbf passes it at line
        rate after an idle spell, so a short run would read several times the rate). A run
        under TIGHT buckets' worth gives none, so a lone message does not.
    R   round trip: ack_k less when a link at the estimated rate, bucket and all, would have
        delivered message k after the ones it queued behind; the min over `rtt_window_s`. Every
        message gives one, so a receiver that answers so late that every message queues behind
        the last one's ack teaches it too. Each errs short while bw is a lower bound (a round
        trip too long would over-read the rate), and a sample subtracts no more than its own
        message's.

Samples are kept raw and read at the current estimates, so a rate sampled before the round
trip was known counts in full once it is. The estimate holds what it read while nothing
contradicts it: once the tuner fits the payload to the link every message goes out alone and the
link is no longer sampled. It falls only when every ack of `bw_window_s` came later than a link
at the estimate could have answered (its bytes and those ahead of it, plus R, counted from its
send or from the previous ack, whichever is later: acks come in order, so one late answer delays
the next ack too): a link that slowed, not a receiver slow now and then. A link that never backs
up is not measured (None) and carries the full payload. Stalls, acks twice or out of order, a
clock that steps back: no sample (never a division by zero or an infinite rate), the estimate
holds, and `held` says why.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

# bytes a shaper's token bucket may pass at line rate after the link idled (tbf's on the test bed);
# every rate sample discounts them
BURST = 32 * 1024
# a rate sample spans at least this many buckets' worth: where no shaper is, the discount takes at
# most 1 / TIGHT of it, and a bucket twice the assumed one over-reads by at most 1 / (TIGHT - 2)
TIGHT = 4
# an ack is late when it came this many times later than a link at the estimate could carry its
# message and those ahead of it, beyond the round trip
BUSY = 1.1
# late acks a window needs before the estimate may fall (and all of the window's acks late)
CONFIRM = 4
# round-trip samples before their least is used: the least of a few answers is too long (a receiver
# short of CPU answers one in ten at once), and a round trip too long over-reads the rate
RTT_SAMPLES = 16
# messages back a round-trip sample models the link over (the ones it may have queued behind)
PATH = 8
# acks whose samples are kept, at most (the windows are shorter where acks come faster)
ACKS = 256


class LinkMeter:
    """Delivery rate and round trip of one outbound stream, from its acks, estimated apart
    (thread-safe: the sender thread acks, the worker reads). See the module docstring.

    Args:
        bw_window_s: seconds of acks that must all be late before the estimate falls.
        rtt_window_s: seconds a sample counts toward the estimates (rate: max, round trip: min).
        anchors: the run's latest messages a sample may start from.
        burst: bytes a shaper may pass at line rate, discounted from every sample.
    """

    def __init__(
        self, bw_window_s: float = 10.0, rtt_window_s: float = 30.0, anchors: int = 32, burst: int = BURST
    ) -> None:
        self._lock = threading.Lock()
        self.bw_window_s, self.rtt_window_s, self.burst = bw_window_s, rtt_window_s, burst
        # (bytes, sent at, key, bytes unacknowledged ahead of it), not yet acked, in order
        self._queued: deque[tuple[int, float, object, int]] = deque()
        self._ahead = 0  # bytes sent and not acknowledged
        # (run bytes before it, sent at, bytes, acked at) per message of the current run
        self._run: deque[tuple[int, float, int, float]] = deque(maxlen=anchors)
        self._run_bytes = 0  # bytes of the current run acked so far
        self._run_idle = 0.0  # seconds the stream had been idle when the run's first message was sent
        # per ack: (acked at, later than the estimate allows, how the link carried it (`_delivered`'s
        # idle, after, msgs, and the previous ack), rate anchors ((send_j, bytes(j..k) - burst), ...),
        # its number), over rtt_window_s
        self._acks: deque[tuple[float, bool, tuple, tuple, int]] = deque(maxlen=ACKS)
        self._taken = 0  # acks taken so far: names each
        self._read_at = (0, 0.0)  # (acks taken, when) at the last estimate
        self._rtt_at: tuple = ()  # (acks taken, estimate, acks kept) at the last round trip
        self._acked: deque[tuple[float, int, bool]] = deque()  # (acked at, bytes, late) over bw_window_s
        # each ack's round-trip and rate samples as last read, and the estimates they were read at
        self._read: dict[str, tuple] = {"rtt": (None, {}), "bw": (None, {})}
        self._rtt_est: float | None = None  # the round trip: held while the window has too few samples
        self._bw_est: float | None = None  # the rate: held while nothing contradicts it
        self._last_ack: float | None = None
        self.why = ""  # why the last ack gave no sample ("" when it did or needed none)

    def sent(self, nbytes: int, now: float | None = None, key: object = None) -> None:
        """A message of `nbytes` left for the link; `key` (optional) names it in its ack."""
        with self._lock:
            self._queued.append((nbytes, time.monotonic() if now is None else now, key, self._ahead))
            self._ahead += nbytes

    def acked(self, now: float | None = None, key: object = None) -> None:
        """A message arrived: the oldest queued one, or the one `key` names. An ack for no message
        in flight (twice, or after `lost`) is ignored; one out of order is taken without a sample."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if key is not None and not (self._queued and self._queued[0][2] == key):
                hit = next((i for i, q in enumerate(self._queued) if q[2] == key), None)
                self.why = "an ack for no message in flight: ignored"
                if hit is not None:
                    self._ahead -= self._queued[hit][0]
                    del self._queued[hit]
                    self._new_run()
                    self.why = "an ack out of order: sample dropped"
                return
            if not self._queued:
                self.why = "an ack for no message in flight: ignored"
                return
            nbytes, sent, _, ahead = self._queued.popleft()
            self._ahead -= nbytes
            last, self._last_ack = self._last_ack, now
            if now <= sent or (last is not None and now < last):
                self._new_run()
                back = now < sent or (last is not None and now < last)
                self.why = f"{'the clock went backwards' if back else 'an ack at its send time'}: sample dropped"
                return
            self.why = ""
            if last is None or sent >= last:  # sent onto an idle stream: the link idled, a new run
                self._new_run()
                self._run_idle = math.inf if last is None else sent - last
            self._run.append((self._run_bytes, sent, nbytes, now))
            self._run_bytes += nbytes
            run = list(self._run)
            idle, after = (self._run_idle, None) if len(run) <= PATH else (0.0, run[-PATH - 1][3])
            path = (idle, after, tuple((s, n) for _, s, n, _ in run[-PATH:]), last)
            # anchors from half the window back (older ones would hold up a rate from before the link
            # changed), or as far as a link at the estimate needs to carry TIGHT buckets twice over
            back = self.rtt_window_s if self._bw_est is None else 2 * TIGHT * self.burst / self._bw_est
            pairs = tuple(
                (s, self._run_bytes - before - self.burst)
                for before, s, _, _ in run[:-1]
                if now - s <= max(self.bw_window_s / 2, back) and self._run_bytes - before >= TIGHT * self.burst
            )
            rtt, est = self._round_trip(now), self._bw_est
            late = None not in (rtt, est) and now - rtt > self._due(sent, ahead, nbytes, last, rtt, est)
            self._taken += 1
            self._acks.append((now, late, path, pairs, self._taken))
            self._acked.append((now, nbytes, late))
            self._estimate(now)
            self._read_at = (self._taken, now)

    @staticmethod
    def _free(sent: float, last: float | None, rtt: float) -> float:
        """The latest the link can have begun a message sent at `sent`: then, or once it had
        delivered the one before (by that one's ack `last` less the round trip)."""
        return sent if last is None else max(sent, last - rtt)

    @staticmethod
    def _due(sent: float, ahead: int, nbytes: int, last: float | None, rtt: float, est: float) -> float:
        """The latest a link at `est` (BUSY times slower) can have delivered a message of `nbytes`
        sent at `sent` behind `ahead` bytes unacknowledged: all of them from its send, or its own
        from the previous one's delivery (`_free`), whichever is later. A receiver that answered
        the previous one late delays this ack too (acks come in order): not late; a link that
        slowed makes it late either way."""
        return max(sent + BUSY * (ahead + nbytes) / est, LinkMeter._free(sent, last, rtt) + BUSY * nbytes / est)

    def _new_run(self) -> None:
        self._run.clear()
        self._run_bytes = 0

    def _delivered(self, path: tuple, bps: float, rtt: float) -> tuple[float, float]:
        """(when a link of `bps` behind a token bucket of `burst` bytes delivered the last of
        `msgs`, since when it had been busy). `path` is (idle, after, msgs, _): msgs are (sent,
        bytes) in order, the first sent onto a link idle for `idle` seconds or, when its run
        began before them, not before the ack `after` of the message before them less `rtt`
        (the latest that one was delivered). Where the rate is a lower bound and `rtt` one of
        the round trip, no earlier than the link delivered it."""
        idle, after, msgs, _ = path
        done = start = msgs[0][0] if after is None else max(msgs[0][0], after - rtt)
        tokens = min(self.burst, idle * bps)
        for sent, nbytes in msgs:
            if sent > done:
                tokens, done, start = min(self.burst, tokens + (sent - done) * bps), sent, sent
            use = min(tokens, nbytes)
            tokens -= use
            done += (nbytes - use) / bps
        return done, start

    def _round_trip(self, now: float) -> float | None:
        """The least of the window's round-trip samples, ack_k less when the link, at the
        estimated rate, delivered message k (`_delivered`): short rather than long (a round trip
        too long over-reads the rate), a queued message's wait left out. Their error grows with
        the time the modelled link was busy, so only messages it carried with about one other
        in the way count, of those the ones it was busy with the shortest, and no late ones (a
        link slower than the estimate). Read at the current estimate (one taken at an older,
        lower estimate would stay too short); once RTT_SAMPLES, else the last such; None before
        the first rate. While every ack of the window comes late it may only shrink: a model at a
        rate the link no longer has delivers too early."""
        while self._acks and now - self._acks[0][0] > self.rtt_window_s:
            self._acks.popleft()
        est = self._bw_est
        if est is None or self._rtt_at == (self._taken, est, len(self._acks)):
            return self._rtt_est
        self._rtt_at = (self._taken, est, len(self._acks))
        rtt = self._rtt_est or 0.0
        got = sorted(  # (seconds the modelled link was busy, sample)
            x
            for x in self._each(
                "rtt", (est, rtt), lambda ack, late, path, pairs: self._rtt_sample(ack, late, path, rtt)
            )
            if x is not None
        )
        # the least biased: those the link was busy with the shortest (at least RTT_SAMPLES of them)
        short = got[: max(RTT_SAMPLES, sum(1 for busy, _ in got if busy <= 1.5 * got[0][0]))] if got else []
        read = max(0.0, min(x for _, x in short)) if len(short) >= RTT_SAMPLES else None
        if read is not None:
            # a window of late acks (the evidence the rate falls on) holds it from growing; one late ack
            # does not: a round trip read short makes acks look late, and would stay short for good
            late = self._rtt_est is not None and len(self._acked) >= CONFIRM and all(a[2] for a in self._acked)
            self._rtt_est = min(read, self._rtt_est) if late else read
        return self._rtt_est

    def _each(self, what: str, at: tuple, read) -> list:
        """`read(ack...)` of every ack of the window, each read once per value of `at` (the
        estimates it depends on): the models are not rerun on every call."""
        tag, vals = self._read[what]
        if tag != at or len(vals) > 2 * len(self._acks) + 64:
            vals = {} if tag != at else {a[4]: vals[a[4]] for a in self._acks if a[4] in vals}
            self._read[what] = (at, vals)
        return [vals[a[4]] if a[4] in vals else vals.setdefault(a[4], read(*a[:4])) for a in self._acks]

    def _rtt_sample(self, ack: float, late: bool, path: tuple, rtt: float) -> tuple[float, float] | None:
        """(how long the modelled link was busy with it, the sample), or None (see `_round_trip`)."""
        done, start = self._delivered(path, self._bw_est, rtt)
        return (done - start, ack - done) if not late and done - start <= 2 * path[2][-1][1] / self._bw_est else None

    def _sample(self, ack: float, path: tuple, pairs: tuple, rtt: float) -> float | None:
        """An ack's rate sample (module docstring): the best over its anchors j of bytes(j..k)
        less a bucket's worth over ack_k - send_j - R, at most twice bytes(j..k) / (ack_k -
        send_j). R is the round trip, but at most message k's own bound (ack_k less the latest
        the link can have delivered it: as the model has it, or its bytes at the estimate after
        the previous one's delivery, by that one's ack less R): the best of many samples favours
        the answers that came quickest, for which the window's least round trip could be too long."""
        if not pairs:
            return None
        own = 0.0
        if self._bw_est:
            (sent, nbytes), last = path[2][-1], path[3]
            step = self._free(sent, last, rtt) + nbytes / self._bw_est  # after the previous one
            own = ack - min(self._delivered(path, self._bw_est, rtt)[0], step)
        r = max(0.0, min(rtt, own))
        return max(n / max(ack - s - r, (ack - s) / 2) for s, n in pairs)

    def _estimate(self, now: float) -> float | None:
        """The best sample kept (`rtt_window_s`: one read again at a round trip learnt since still
        counts) when it is higher than the estimate. Lower only when every ack of the last
        `bw_window_s` (CONFIRM at least) came later than a link at the estimate could have
        delivered it (`_due`), plus the round trip: a receiver slow to answer now and then, or a
        sender the tuner fitted to the link, holds it; a link that slowed makes them all late.
        Then to the window's delivery rate (bytes acked over its acks' spread: the link was busy
        throughout) or the best sample of its second half (runs that began within it), if
        higher; samples above that are dropped."""
        while self._acked and now - self._acked[0][0] > self.bw_window_s:
            self._acked.popleft()
        rtt = self._round_trip(now) or 0.0
        at = (self._bw_est, rtt)
        rates = [
            (a[0], x, a[4])
            for a, x in zip(self._acks, self._each("bw", at, lambda a, _, p, pairs: self._sample(a, p, pairs, rtt)))
            if x is not None
        ]
        lates = [a[2] for a in self._acked]
        best = max((x for _, x, _ in rates), default=None)
        if best is not None and (self._bw_est is None or best >= self._bw_est):
            self._bw_est = best
        elif len(lates) >= CONFIRM and all(lates):
            spread = self._acked[-1][0] - self._acked[0][0]
            rate = sum(a[1] for a in list(self._acked)[1:]) / spread if spread > 0 else 0.0
            recent = max((x for ack, x, _ in rates if now - ack <= self.bw_window_s / 2), default=0.0)
            self._bw_est = max(recent, rate) or self._bw_est
            over = {n for _, x, n in rates if x > self._bw_est}  # what the late acks contradict
            for i, a in enumerate(self._acks):
                if a[4] in over:
                    self._acks[i] = (*a[:3], (), a[4])
        return self._bw_est

    def lost(self, n: int) -> None:
        """The stream broke: the `n` oldest queued messages it had taken are gone (never acked)."""
        with self._lock:
            for _ in range(min(n, len(self._queued))):
                self._ahead -= self._queued.popleft()[0]
            self._new_run()

    def bps(self, now: float | None = None) -> float | None:
        """The link's bytes/s (see `_estimate`); None until the link was first seen backed up."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._read_at[0] != self._taken or not 0 <= now - self._read_at[1] < 0.05:  # else as just read
                self._estimate(now)
            return self._bw_est

    def rtt(self, now: float | None = None) -> float | None:
        """Seconds from a message's last byte on the link to its ack (see `_round_trip`), or None
        until measured."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._round_trip(now)

    def held(self, now: float | None = None) -> str:
        """Why the estimate is held rather than measured now ("" when nothing is wrong): no ack
        for longer than the window, or the last ack gave no sample (see `acked`)."""
        now = time.monotonic() if now is None else now
        n, age = self.waiting(now)
        if n and age > self.bw_window_s:
            return f"no ack for {age:.0f} s: {n} messages in flight"
        return self.why

    def backlog(self) -> int:
        """Bytes queued and not acknowledged yet."""
        with self._lock:
            return self._ahead

    def waiting(self, now: float | None = None) -> tuple[int, float]:
        """(messages sent and not acknowledged yet, seconds the oldest of them has waited)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return len(self._queued), (now - self._queued[0][1]) if self._queued else 0.0

    def clear(self) -> None:
        """Forget every unacknowledged message (the stream was cut and its queue dropped)."""
        with self._lock:
            self._queued.clear()
            self._ahead = 0
            self._new_run()
