"""Steps-to-target: how far behind dense a compressed row ends, read on dense's own eval curve.

A loss gap says little on its own: early in a run dense falls steeply, so a small gap can be many
steps of lost progress, and late in a run a large-looking gap can be a few steps. The step deficit
asks instead how many of dense's steps separate where dense ended from where dense stood when it
had the row's final eval loss:

    deficit = (s*(dense's final loss) - s*(row's final loss)) / S

with s*(L) the first (interpolated) step at which dense's best-so-far eval loss reaches L and S
the run's steps. Dense against itself is 0; a row that ends worse than dense is behind by a share
of the run. Best-so-far, not the raw curve: near its end a run's eval loss wanders by its own
noise, and a raw curve that rises again would map one loss to two steps. When dense stops
improving long before its end (`dense_settled_at` well below 1), a small loss gap spans many
steps: the deficit is then a poor measure and the gap says more. A row that ends below dense's
best has no deficit to measure (None).
"""

from __future__ import annotations

from collections.abc import Mapping


def best_so_far(curve: Mapping[int, float]) -> dict[int, float]:
    """The curve's running minimum, in step order: monotone, so each loss maps to one step."""
    out, best = {}, float("inf")
    for step, loss in sorted(curve.items()):
        best = min(best, loss)
        out[step] = best
    return out


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
    """The row's deficit (see the module docstring) for its final `loss`; None below dense's best.

    Args:
        dense_curve: dense's eval loss by step, its final step included (evaluate at least every
            ~10 % of the run, more often near the end, so the interpolation is close).
        loss: the compressed row's final eval loss on the same eval set.
        steps: the run's step count, the same for the row and dense."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if steps not in dense_curve:
        raise ValueError(f"dense's curve must hold its final step {steps}")
    envelope = best_so_far(dense_curve)
    row, dense_end = steps_to_reach(envelope, loss), steps_to_reach(envelope, dense_curve[steps])
    return None if row is None else (dense_end - row) / steps


def settled_at(dense_curve: Mapping[int, float], steps: int) -> float:
    """The share of the run after which dense's best-so-far was already as good as its final
    loss: near 1 while dense still improves at the end, well below it once it has settled."""
    return steps_to_reach(best_so_far(dense_curve), dense_curve[steps]) / steps


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
        "dense_settled_at": settled_at(dense_curve, steps),
        "gap_at": {s: row_curve[s] / dense_curve[s] - 1 for s in shared},
    }
