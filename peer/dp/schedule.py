"""When a stage group's averaging rounds are offered: wall-clock slots the group shares.

Members of a group have different local step counts (they joined at different times), so "every
`every` local steps" fires at different wall times, and the first member to offer sat in
matchmaking (hivemind polls the DHT without pause: the largest non-model CPU cost of a swarm)
until the others came. Rounds are therefore offered at wall-clock slot boundaries the group
shares (`RoundSchedule`): a peer offers at its first step at which at least `every` local steps
have passed since its last offer (or its start) *and* the clock has passed a multiple of
`period_s` since then (boundaries passed while it could not offer: alone, its last round
pending, or short of its first `every` steps, do not count). `period_s` is the longer of
`every` steps at this peer's step time and the time that keeps the round's bytes to
`link_share` of the link, rounded UP to a power of two seconds: powers of two nest, so members
whose estimates differ by up to 2x still meet at every boundary of the longer period, without
talking. Members then arrive within about a step of each other (their clocks must agree to well
under a step: NTP): the group forms a step after the boundary (`GroupAverager.match_window_s`,
peer/dp/group.py), and a round that has found nobody after half a period gives up
(`GroupAverager.match_timeout_s`) instead of polling on.

No hivemind in here: the rule is tested with a fake clock.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

log = logging.getLogger(__name__)

# bytes per averaged element on the wire (hivemind's 8-bit quantizer adds a 1 KiB codebook per part)
WIRE_BYTES = {"none": 4, "int8": 1}

MIN_PERIOD_S = 1.0  # the shortest slot hivemind allows (a round takes min_matchmaking_time anyway); the run's floor is dp.min_period_s
STEP_EMA = 0.1  # weight of the newest step time in the step-time average (damps a one-off pause)
PERIOD_HYSTERESIS = (
    0.9  # the period halves only once the need is below 0.9x the shorter period: no flapping at a power of two
)


def round_bytes(numel: int, group_size: int, compression: str) -> int:
    """Bytes one peer uploads (and downloads) in one averaging round of `numel` elements.

    Butterfly all-reduce in a group of n: each peer sends (n-1)/n of its tensors to scatter and
    its averaged 1/n part to the n-1 others: 2 (n-1)/n of the tensors. One formula for the
    averager's counter and for `anchormesh bench project`."""
    n = group_size
    return int(2 * (n - 1) / n * numel * WIRE_BYTES[compression])


def _period_need(
    every: int,
    step_s: float | None,
    nbytes: int,
    link_bps: float | None,
    link_share: float,
    measured: bool = False,
    min_period_s: float = MIN_PERIOD_S,
) -> tuple[float, str]:
    """Seconds between rounds before rounding, and what sets them (for `period_reason`);
    `measured`: the link rate comes from this peer's own rounds."""
    steps_s = every * step_s if step_s is not None else 0.0
    link_s = nbytes / (link_share * link_bps) if link_share > 0 and link_bps is not None and link_bps > 0 else 0.0
    steps = f"{every} steps x {step_s:.2f} s" if step_s is not None else "no step time yet"
    if link_s > max(steps_s, min_period_s):
        return link_s, f"link{' (measured)' if measured else ''} {link_bps / 1e6:.3g} MB/s, share {link_share:g}"
    if steps_s >= min_period_s:
        return steps_s, steps
    return min_period_s, f"the minimum ({steps})"


def _pow2_at_least(seconds: float, min_period_s: float = MIN_PERIOD_S) -> float:
    return 2.0 ** math.ceil(math.log2(max(seconds, min_period_s)))


def slot_period(
    every: int,
    step_s: float | None,
    round_bytes: int,
    link_bps: float | None,
    link_share: float,
    min_period_s: float = MIN_PERIOD_S,
) -> float:
    """Seconds between a group's round slots: the longer of `every` steps of `step_s` and the time
    in which `round_bytes` take `link_share` of a `link_bps` link (no bound when either is 0 or
    unknown), rounded UP to a power of two (at least `MIN_PERIOD_S`). Why a power of two: members
    estimate the period each on its own; two estimates within 2x round to periods of which one is
    a multiple of the other, so the longer one's boundaries are boundaries of both."""
    return _pow2_at_least(
        _period_need(every, step_s, round_bytes, link_bps, link_share, min_period_s=min_period_s)[0], min_period_s
    )


def offer_due(steps: int, every: int, since: float, now: float, period_s: float) -> bool:
    """Whether a round is due: at least `every` steps were taken, and a multiple of `period_s`
    (a boundary of the group's slots) lies in (since, now]."""
    return steps >= every and math.floor(now / period_s) > math.floor(since / period_s)


class RoundSchedule:
    """When this peer offers a round (see the module docstring). No hivemind in here: the rule is
    tested with a fake clock. `tick` once per step, `offered` when a round was offered.

    A round is due at the first tick at which (a) at least `every` local steps were taken since
    the last offer (or the start), and (b) a multiple of `period_s` has passed since the peer
    was last held: its last offer, its last tick with `hold` (its previous round still pending,
    or it was alone) or, before its first offer, its last tick short of `every` steps. Why
    boundaries during a hold do not count: an offer right after it would be off the group's grid
    and meet nobody (a round that spanned a boundary met the members offering there, or none
    offered there).

    `period_s` is `slot_period` of the step-time average, with hysteresis: it grows as soon as
    the need exceeds it, and halves only once the need is below `PERIOD_HYSTERESIS` times the
    shorter period (a need hovering at a power of two would flip it, and log, every few steps).

    Args:
        every: local steps between rounds at least (DiLoCo H).
        round_bytes: what one round uploads (`round_bytes(numel, 2, compression)`).
        link_bps: bytes/s the uplink is measured to carry, or None (unknown): then `measured_bps`.
            Called once per tick: keep it cheap.
        link_share: fraction of the link's time the rounds may take; 0: no bound.
        min_period_s: the shortest period (`dp.min_period_s`; rounded up to a power of two).
    """

    def __init__(
        self,
        every: int,
        round_bytes: int,
        link_bps: Callable[[], float | None] | None = None,
        link_share: float = 0.0,
        min_period_s: float = MIN_PERIOD_S,
    ) -> None:
        if every < 1:
            raise ValueError(f"every (local steps between rounds) must be >= 1, not {every}")
        if not 0.0 <= link_share <= 1.0:
            raise ValueError(
                f"link_share (fraction of the link's time for averaging) must be in [0, 1], not {link_share}"
            )
        self.every, self.round_bytes, self.link_bps, self.link_share = every, round_bytes, link_bps, link_share
        self.step_s: float | None = None  # EMA of the wall time between ticks
        self.measured_bps: float | None = None  # from this peer's own rounds, used when link_bps says nothing
        self.min_period_s = _pow2_at_least(min_period_s, min_period_s)
        self.period_s = self.min_period_s
        self.period_reason = f"{self.period_s:g} s: the minimum (no step time yet)"
        self._last_tick: float | None = None
        self._since_step = 0  # (a) counts steps after this one
        self._since_t = 0.0  # (b) counts boundaries after this time (both set by the first tick)
        self._first = True  # no offer yet

    def tick(self, local_step: int, now: float, hold: bool = False) -> bool:
        """Record a step that ended at `now`; whether a round is due now. `hold`: this peer cannot
        offer now (its last round is pending, or it is alone in its group)."""
        if self._last_tick is None:  # the start; the first tick follows one step
            self._since_step, self._since_t = local_step - 1, now
        else:
            dt = now - self._last_tick
            self.step_s = dt if self.step_s is None else (1 - STEP_EMA) * self.step_s + STEP_EMA * dt
        self._last_tick = now
        self._update_period()
        if hold or (self._first and local_step - self._since_step < self.every):
            self._since_t = now  # wait for a boundary after this one
        return offer_due(local_step - self._since_step, self.every, self._since_t, now, self.period_s)

    def offered(self, local_step: int, now: float) -> None:
        self._since_step, self._since_t, self._first = local_step, now, False

    def _update_period(self) -> None:
        link = self.link_bps() if self.link_bps is not None else None
        measured = not (link is not None and link > 0) and self.measured_bps is not None
        need, why = _period_need(
            self.every,
            self.step_s,
            self.round_bytes,
            self.measured_bps if measured else link,
            self.link_share,
            measured,
            self.min_period_s,
        )
        period = _pow2_at_least(need, self.min_period_s)
        if period < self.period_s and need > PERIOD_HYSTERESIS * self.period_s / 2:  # not clearly shorter: keep it
            self.period_reason = (
                f"{self.period_s:g} s: {why} (held until under {PERIOD_HYSTERESIS * self.period_s / 2:.3g} s)"
            )
            return
        reason = f"{period:g} s: {why}"
        if period != self.period_s:
            log.info("stage-group averaging: a round every %s (was %g s)", reason, self.period_s)
        self.period_s, self.period_reason = period, reason
