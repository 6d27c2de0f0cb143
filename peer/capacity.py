"""Capacity readings: tokens/s a peer could do if it never waited (tokens/s over busy fraction).

The tracker balances stages with them and stage 0 routes by them. A peer not measured yet (0)
counts as the median of the measured ones, 1.0 when none is: a newcomer is neither favoured nor
starved before its first reading.
"""

from __future__ import annotations

# the fastest a stage can plausibly step (a tiny model on a GPU does a few tens a second) and
# the slack around it: a report or a downloaded state claiming more is refused (the tracker's
# report checks, the daemon's state checks), since a huge step or token count ends or hijacks a run
MAX_STEPS_PER_S = 100.0
STEP_SLACK = 50
# a capacity (tokens/s if it never waited) may exceed the step bound's rate: one stage of a tiny
# model computes far faster than the whole pipeline steps; 10x still refuses absurd claims
MAX_CAPACITY_FACTOR = 10.0


def step_ceiling(known: int, seconds: float, rate: float = MAX_STEPS_PER_S) -> float:
    """The highest step honest training can have reached `seconds` after being at step `known`,
    stepping at most `rate` steps/s (the tracker passes the rate it measured the run at)."""
    return known + STEP_SLACK + rate * max(seconds, 0.0)


def fill_unmeasured(values: list[float]) -> list[float]:
    """`values` with every reading <= 0 replaced by the median of the positive ones (1.0 if none)."""
    measured = sorted(v for v in values if v > 0)
    default = measured[len(measured) // 2] if measured else 1.0
    return [v if v > 0 else default for v in values]
