"""Steps-to-target: how far behind dense a compressed row ends, read on dense's own eval curve.

A loss gap says little on its own: early in a run dense falls steeply, so a small gap can be many
steps of lost progress, and late in a run a large-looking gap can be a few steps. The step deficit
asks instead at which step dense reached the row's final eval loss, and how many of the row's
steps were spent beyond that:

    deficit = (S - s*) / S,   where dense's interpolated curve reaches the row's loss at step s*

and S is the row's step count (the same token budget as dense's). A row that ends exactly on
dense's final loss has deficit 0; one that ends below it is at least as good as dense, and dense's
curve cannot say by how much (None). Interpolation is linear in steps between evaluations, so the
curve must be evaluated often enough near the end to interpolate.
"""

from __future__ import annotations

from collections.abc import Mapping


def steps_to_reach(curve: Mapping[int, float], loss: float) -> float | None:
    """The first (interpolated) step at which `curve` (step -> eval loss) reaches `loss`.

    Walks the curve in step order and returns the step where a segment first crosses `loss`
    downward; None when the curve never gets that low. A loss above the curve's start is reached
    at its first step."""
    points = sorted(curve.items())
    if not points:
        raise ValueError("an empty eval curve reaches nothing")
    if points[0][1] <= loss:
        return float(points[0][0])
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= loss < l0:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def step_deficit(dense_curve: Mapping[int, float], loss: float, steps: int) -> float | None:
    """(steps - s*) / steps for the step s* where dense's curve reaches `loss`; None when dense
    never gets that low (the row ended below dense: no deficit to measure).

    Args:
        dense_curve: dense's eval loss by step, its final step included (evaluate at least every
            ~10 % of the run, more often near the end, so the interpolation is close).
        loss: the compressed row's final eval loss on the same eval set.
        steps: the row's step count, the same as dense's."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    reached = steps_to_reach(dense_curve, loss)
    return None if reached is None else (steps - reached) / steps
