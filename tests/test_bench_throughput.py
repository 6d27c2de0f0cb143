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
        {
            "compute_bound": _run(1200),
            "dense": _run(300, 3.3),
            "masked": _run(600),
            "masked_dp": _run(1000),
        },  # a fast moment for dense
        {"compute_bound": _run(1100), "dense": _run(200, 3.2), "masked": _run(500), "masked_dp": _run(950)},
    ]
    modes, ratios = combine_repeats(repeats)
    assert modes["dense"]["tokens_per_s"] == 200 and modes["dense"]["tokens_per_s_runs"] == [100, 300, 200]
    assert modes["dense"]["eval_loss"] == 3.2 and modes["dense"]["runs"] == 3  # the figures of the median run
    # within each repeat: masked/dense = 4, 2, 2.5 -> median 2.5 (not 500/200 from different repeats by chance)
    r = ratios["masked_vs_dense"]
    assert (r["median"], r["min"], r["max"]) == pytest.approx((2.5, 2.0, 4.0)) and r["runs"] == pytest.approx(
        [4.0, 2.0, 2.5]
    )
    assert ratios["masked_dp_vs_compute_bound"]["median"] == pytest.approx(950 / 1100)


def test_one_repeat_is_that_run_and_missing_modes_give_no_ratio() -> None:
    modes, ratios = combine_repeats([{"dense": _run(100), "masked": _run(300)}])
    assert modes["masked"]["tokens_per_s"] == 300 and modes["masked"]["tokens_per_s_runs"] == [300]
    assert ratios["masked_vs_dense"]["median"] == pytest.approx(3.0) and "masked_dp_vs_dense" not in ratios


def test_an_even_count_takes_the_mean_of_the_middle_two_and_the_lower_run_s_figures() -> None:
    modes, _ = combine_repeats([{"dense": _run(100, 3.0)}, {"dense": _run(200, 2.0)}])
    assert modes["dense"]["tokens_per_s"] == 150 and modes["dense"]["eval_loss"] == 3.0


@pytest.mark.processes
@pytest.mark.skipif(
    bool(__import__("peer.bench.netbed", fromlist=["available"]).available()), reason="needs network namespaces (root)"
)
def test_dense_sync_runs_gpipe_and_an_all_reduce_that_keeps_replicas_identical(tmp_path) -> None:
    """The baseline a user would run instead, on the bed: 2 stages x 2 replicas of the modes'
    tiny model over gloo. Each stage group's replicas end with identical weights (the fp32
    all-reduce ran every step) and at least the gradients of every stage crossed the links."""
    from peer.bench.project_model import resolve_model
    from peer.bench.sync_baseline import measure_sync
    from peer.bench.throughput_modes import mode_config

    cfg = mode_config("dense", 2, 3, 1)
    got = measure_sync(cfg, None, 2, 2, 1, 2, tmp_path, 47, 240.0)
    assert got["tokens_per_s"] > 0 and got["tokens_measured"] == 2 * 2 * 2 * 8 * 128  # steps x replicas x M x B x T
    by_stage = {s: [r for r in got["ranks"] if r["stage"] == s] for s in (0, 1)}
    for ranks in by_stage.values():
        assert len(ranks) == 2 and ranks[0]["weights_sum"] == pytest.approx(ranks[1]["weights_sum"], rel=1e-9, abs=1e-9)
        assert ranks[0]["weights_abs_sum"] == pytest.approx(ranks[1]["weights_abs_sum"], rel=1e-9)
    assert all(r["last_loss"] is not None and r["last_loss"] > 0 for r in by_stage[1])
    dims, _, _ = resolve_model("tiny-llama", 2)
    grads = (
        sum(dims.stage_params(s, 2) for s in (0, 1)) * 4
    )  # one fp32 copy of every stage's gradients per step, at least
    assert got["wire_bytes_per_token"] * 2 * 8 * 128 * 2 > grads


def test_the_window_opens_once_every_peer_has_warmed_not_the_run_s_step_alone() -> None:
    """The run's step is the fastest stage-0 peer's: 10 steps past it, a slow peer still at its
    first step keeps the window shut until it too has done 10."""
    from peer.bench.throughput_measure import warmed

    def status(run: int, *steps: int, dead: int | None = None) -> dict:
        peers = [{"id": f"p{i}", "state": "dead" if i == dead else "active", "step": x} for i, x in enumerate(steps)]
        return {"step": run, "peers": peers}

    up = status(3, 3, 0, 2, 1)
    assert not warmed(status(13, 13, 1, 12, 11), up, 10, 4)  # p1 is one step in
    assert not warmed(status(12, 12, 10, 12, 11), up, 10, 4)  # the run itself is not 10 past
    assert warmed(status(30, 30, 10, 12, 11), up, 10, 4)
    assert not warmed(status(30, 30, 10, 12, 11, dead=3), up, 10, 4)  # a peer down: not every peer live


def test_the_compared_evaluation_is_the_first_pass_even_when_a_later_one_is_newer() -> None:
    """A pass through a slow last-stage peer may end after the next pass: the status's eval_loss
    is then the later pass's; the first one is read from the peer that reported it."""
    from peer.bench.throughput_measure import first_evaluation

    peers = [{"eval_id": 2, "eval_loss": 2.46}, {"eval_id": 0, "eval_loss": None}]
    assert first_evaluation({"peers": peers}) is None
    assert first_evaluation({"peers": [*peers, {"eval_id": 1, "eval_loss": 2.78}]}) == 2.78
