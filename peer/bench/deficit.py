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


ROW_POINTS = (1 / 8, 1 / 4, 1 / 2, 3 / 4)  # every row is evaluated there: the gap along the run
DENSE_POINTS = ROW_POINTS + (5 / 8, 7 / 8, 15 / 16)  # and dense more densely near the end, to interpolate


def curve_steps(steps: int, dense: bool) -> tuple[int, ...]:
    """The steps (before the final one) at which a row evaluates: dense's curve near its end is
    what the step deficit is read on."""
    points = DENSE_POINTS if dense else ROW_POINTS
    return tuple(sorted({s for f in points if 0 < (s := round(steps * f)) < steps}))


def against_dense(dense_curve: Mapping[int, float], row_curve: Mapping[int, float], steps: int) -> dict:
    """The row's step deficit at its end and its loss gap (row / dense - 1) at each step both
    curves hold. Both curves must include the final step."""
    if steps not in row_curve or steps not in dense_curve:
        raise ValueError(f"both curves must hold the final step {steps}")
    shared = sorted(set(dense_curve) & set(row_curve) - {0})
    return {
        "step_deficit": step_deficit(dense_curve, row_curve[steps], steps),
        "gap_at": {s: row_curve[s] / dense_curve[s] - 1 for s in shared},
    }
