"""Steps-to-target on dense's eval curve (peer/bench/deficit.py)."""

from __future__ import annotations

import pytest

from peer.bench.deficit import against_dense, best_so_far, curve_steps, settled_at, step_deficit, steps_to_reach

CURVE = {0: 4.0, 10: 3.0, 20: 2.6, 30: 2.4, 40: 2.3}


def test_a_row_on_dense_s_final_loss_has_no_deficit() -> None:
    assert step_deficit(CURVE, 2.3, 40) == 0.0


def test_the_step_is_interpolated_between_evaluations() -> None:
    # 2.35 is halfway between step 30 (2.4) and step 40 (2.3): dense got there at 35, 5 of 40 steps early
    assert steps_to_reach(CURVE, 2.35) == pytest.approx(35.0)
    assert step_deficit(CURVE, 2.35, 40) == pytest.approx(0.125)


def test_a_row_below_dense_has_no_deficit_to_measure() -> None:
    assert step_deficit(CURVE, 2.2, 40) is None


def test_a_loss_above_the_start_is_reached_at_once() -> None:
    assert steps_to_reach(CURVE, 5.0) == 0.0
    assert step_deficit(CURVE, 5.0, 40) == 1.0


def test_a_curve_that_rises_again_is_read_at_its_first_crossing() -> None:
    assert steps_to_reach({0: 3.0, 10: 2.0, 20: 2.5, 30: 1.5}, 2.2) == pytest.approx(8.0)


def test_a_dense_run_that_settled_and_wandered_is_read_on_its_best_so_far() -> None:
    # dense's best comes at step 30 and its last point is noise above it: dense against itself is
    # still 0, a row between dense's end and its step-20 loss is behind by its share of the run
    wandering = {0: 4.0, 10: 3.0, 20: 2.6, 30: 2.4, 40: 2.45}
    assert best_so_far(wandering) == {0: 4.0, 10: 3.0, 20: 2.6, 30: 2.4, 40: 2.4}
    assert step_deficit(wandering, 2.45, 40) == 0.0
    assert step_deficit(wandering, 2.55, 40) == pytest.approx((27.5 - 22.5) / 40)
    assert settled_at(wandering, 40) == pytest.approx(27.5 / 40)
    assert settled_at(CURVE, 40) == 1.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        steps_to_reach({}, 1.0)
    with pytest.raises(ValueError, match="positive"):
        step_deficit(CURVE, 2.3, 0)
    with pytest.raises(ValueError, match="final step"):
        step_deficit(CURVE, 2.3, 50)


def test_dense_is_evaluated_more_often_near_the_end_than_the_rows() -> None:
    assert curve_steps(200, dense=False) == (25, 50, 100, 150)
    assert curve_steps(200, dense=True) == (25, 50, 100, 125, 150, 175, 188)
    assert curve_steps(4, dense=True) == (1, 2, 3)  # a short run: no duplicate, none at the end


def test_a_row_against_dense_gives_its_deficit_and_its_gaps() -> None:
    row = {10: 3.3, 20: 2.6, 40: 2.35}
    got = against_dense(CURVE, row, 40)
    assert got["step_deficit"] == pytest.approx(0.125)
    assert got["gap_at"] == pytest.approx({10: 0.1, 20: 0.0, 40: 2.35 / 2.3 - 1})
    with pytest.raises(ValueError, match="final step"):
        against_dense(CURVE, {10: 3.3}, 40)
