"""`anchormesh bench throughput --repeat N`: how interleaved repeats become one result (the
measurements themselves need the namespace bed: tests/test_project.py runs it)."""

from __future__ import annotations

import pytest

from peer.bench.throughput import combine_repeats


def _run(tps: float, loss: float = 3.0) -> dict:
    return {"tokens_per_s": tps, "eval_loss": loss, "wire_bytes_per_token": 100.0}


def test_each_mode_is_its_median_run_and_each_ratio_the_median_of_per_repeat_ratios() -> None:
    repeats = [
        {"compute_bound": _run(1000), "dense": _run(100, 3.1), "masked": _run(400), "masked_dp": _run(900)},
        {"compute_bound": _run(1200), "dense": _run(300, 3.3), "masked": _run(600), "masked_dp": _run(1000)},  # a fast moment for dense
        {"compute_bound": _run(1100), "dense": _run(200, 3.2), "masked": _run(500), "masked_dp": _run(950)},
    ]
    modes, ratios = combine_repeats(repeats)
    assert modes["dense"]["tokens_per_s"] == 200 and modes["dense"]["tokens_per_s_runs"] == [100, 300, 200]
    assert modes["dense"]["eval_loss"] == 3.2 and modes["dense"]["runs"] == 3  # the figures of the median run
    # within each repeat: masked/dense = 4, 2, 2.5 -> median 2.5 (not 500/200 from different repeats by chance)
    r = ratios["masked_vs_dense"]
    assert (r["median"], r["min"], r["max"]) == pytest.approx((2.5, 2.0, 4.0)) and r["runs"] == pytest.approx([4.0, 2.0, 2.5])
    assert ratios["masked_dp_vs_compute_bound"]["median"] == pytest.approx(950 / 1100)


def test_one_repeat_is_that_run_and_missing_modes_give_no_ratio() -> None:
    modes, ratios = combine_repeats([{"dense": _run(100), "masked": _run(300)}])
    assert modes["masked"]["tokens_per_s"] == 300 and modes["masked"]["tokens_per_s_runs"] == [300]
    assert ratios["masked_vs_dense"]["median"] == pytest.approx(3.0) and "masked_dp_vs_dense" not in ratios


def test_an_even_count_takes_the_mean_of_the_middle_two_and_the_lower_run_s_figures() -> None:
    modes, _ = combine_repeats([{"dense": _run(100, 3.0)}, {"dense": _run(200, 2.0)}])
    assert modes["dense"]["tokens_per_s"] == 150 and modes["dense"]["eval_loss"] == 3.0
