"""How a stage group's averaging rounds share the links with the pipeline, for `bench project`.

Three models, each fed `run(rate)`: the pipeline's schedule (project_sim.simulate) when its
transfers get `rate` bytes/s of every link.

- `dp_kept`: DP must keep its cadence (synchronous data parallelism); its bytes per step take
  bandwidth from every link: the step time T with T = run(rate - DP bytes per step / T).
- `dp_greedy` (`dp.link_share = 0`, the throughput bench's modes): rounds run in the background
  as often as the averager manages. While DP needs at most half a link at its cadence that is
  `dp_kept`; beyond, the PP and DP TCP flows share the link (PP sees rate / 2; an assumption:
  equal TCP shares) and rounds come only as often as what PP leaves of the link carries them.
- `dp_shared` (`dp.link_share > 0`, the swarm's default 0.2): what the app's RoundSchedule does
  (peer/dp/schedule.py: `slot_period`): a group offers rounds at slot boundaries `period` apart,
  the longer of `inner_steps` steps and the time in which a round's bytes take `link_share` of
  the link, rounded up to a power of two (at least `dp.min_period_s`). While a round is on the
  link (for `busy` of the time) PP and DP share it as above (PP sees rate / 2, DP gets what PP
  leaves); between rounds PP has the whole link. Tokens/s are the time-weighted mix of the two
  schedules: a round of a real model's stage lasts tens of seconds, many steps, so each part of
  the time runs at its own steady rate (a fluid average of the rates would hide that the
  pipeline is link-bound while a round runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from peer.bench.project_sim import Schedule
from peer.dp.schedule import slot_period

Run = Callable[[float], Schedule]


@dataclass
class SharedLink:
    schedule: Schedule
    every: float  # steps per round achieved
    busy: float  # fraction of the time a round is on the link
    period_s: float  # seconds between the rounds a group makes


def dp_kept(run: Run, rate: float, dp_bps_step: float, bound_s: float, tokens_step: float) -> Schedule:
    """The step time T with T = run(rate - dp_bps_step / T).step_s (bisection: the right side
    falls as T grows); `dp_bps_step`: DP's wire bytes per step on the busiest link."""
    lo = max(run(rate).step_s, dp_bps_step / rate * (1 + 1e-9))
    hi = max(2 * lo, bound_s)
    while run(rate - dp_bps_step / hi).step_s > hi:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        if run(rate - dp_bps_step / mid).step_s > mid:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-4 * hi:
            break
    return Schedule(hi, tokens_step / hi)


def dp_greedy(
    run: Run, kept: Schedule, rate: float, dp_bps_step: float, pp_up_step: float, inner_steps: int
) -> tuple[Schedule, float, bool]:
    """Rounds as often as they manage (`dp.link_share = 0`): the schedule, steps per round, and
    whether the link is split (DP needs more than half of it at its cadence)."""
    if rate - dp_bps_step / kept.step_s >= rate / 2:
        return kept, float(inner_steps), False
    app = run(rate / 2)
    dp_rate = max(rate - pp_up_step / app.step_s, 1e-9)
    return app, max(float(inner_steps), dp_bps_step * inner_steps / (dp_rate * app.step_s)), True


def dp_shared(
    run: Run,
    rate: float,
    round_app: float,
    round_wire: float,
    pp_up_step: float,
    inner_steps: int,
    link_share: float,
    min_period_s: float,
    tokens_step: float,
) -> SharedLink:
    """Rounds spaced by `link_share` (module docstring); `round_app` / `round_wire`: one round's
    bytes per peer each way, as the averager counts them / on the wire; `pp_up_step`: the
    busiest host's PP upload per step."""
    full, half = run(rate), run(rate / 2)
    pp_during = min(pp_up_step / half.step_s, rate / 2)  # PP's bytes/s while a round shares the link
    duration = round_wire / (rate - pp_during)
    step_s, period, busy = full.step_s, 0.0, 0.0
    for _ in range(8):  # the period depends on the step time through `inner_steps` steps: settle it
        slot = slot_period(inner_steps, step_s, int(round_app), rate, link_share, min_period_s)
        period = slot * math.ceil(
            duration / slot - 1e-9
        )  # a round longer than a slot holds the group until the next boundary
        busy = duration / period
        new = tokens_step / (busy * half.tokens_per_s + (1 - busy) * full.tokens_per_s)
        if abs(new - step_s) <= 1e-6 * step_s:
            step_s = new
            break
        step_s = new
    return SharedLink(Schedule(step_s, tokens_step / step_s), period / step_s, busy, period)
