"""`bench throughput --dp-like MODEL`: the DP class's rate (peer/bench/dp_shape.py) and how the
bench finds each stage's hosts. Pure: no bed is made here (tests/test_netbed.py shapes one)."""

from __future__ import annotations

import pytest

from peer.bench.dp_shape import (
    bed_tokens_per_step,
    dp_factor,
    dp_like_setup,
    scenario_like,
    shape_groups,
    step_bytes,
    swarm_groups,
    sync_groups,
)
from peer.bench.project_model import KNOWN_MODELS, resolve_model
from peer.bench.throughput_modes import GpuScenario
from peer.errors import ConfigError

TINY, _, _ = resolve_model("tiny-llama", 2)
ONE_B, EIGHT_B = KNOWN_MODELS["llama-3.2-1b"], KNOWN_MODELS["llama-3.1-8b"]


def test_the_factor_is_one_for_the_tiny_model_and_falls_as_the_model_grows() -> None:
    tokens = bed_tokens_per_step()
    assert tokens == 8 * 128 * 2  # the bed's micro-batch (8 x 128) times its 2 micro-batches
    for s in (0, 1):
        assert dp_factor(TINY, TINY, s, 2, tokens) == pytest.approx(1.0)
        f1, f8 = dp_factor(TINY, ONE_B, s, 2, tokens), dp_factor(TINY, EIGHT_B, s, 2, tokens)
        assert 0 < f8 < f1 < 1, (s, f1, f8)
        # the tokens cancel: the factor is the ratio of parameters per hidden unit
        assert dp_factor(TINY, ONE_B, s, 2, 4 * tokens) == pytest.approx(f1)
        per_h = (TINY.stage_params(s, 2) / TINY.hidden) / (ONE_B.stage_params(s, 2) / ONE_B.hidden)
        assert f1 == pytest.approx(per_h)


def test_step_bytes_are_the_fp32_all_reduce_and_fp16_activations_both_ways() -> None:
    dp, pp = step_bytes(TINY, 0, 2, 2048)
    assert dp == 2 * 4 * TINY.stage_params(0, 2)
    assert pp == 2 * 2 * 128 * 2048


def test_the_setup_declares_shape_factors_rates_and_formula() -> None:
    got = dp_like_setup("llama-3.1-8b", 2, 10.0)
    assert got["model"]["name"] == "Llama-3.1-8B" and got["model"]["params"] == EIGHT_B.params()
    assert [r["stage"] for r in got["stages"]] == [0, 1]
    for row in got["stages"]:
        assert row["dp_rate_mbit"] == pytest.approx(10.0 * row["factor"])
        assert row["factor"] == pytest.approx(row["tiny_dp_over_pp"] / row["real_dp_over_pp"])
        assert row["real_params"] == EIGHT_B.stage_params(row["stage"], 2)
    assert got["dp_rates_mbit"] == [r["dp_rate_mbit"] for r in got["stages"]]
    assert "2 * 4 * params[s]" in got["formula"] and got["tokens_per_step_per_replica"] == bed_tokens_per_step()
    with pytest.raises(ConfigError, match="--dp-like"):
        dp_like_setup("gpt-9", 2, 10.0)


def test_the_scenario_takes_the_model_s_shape() -> None:
    s = scenario_like(EIGHT_B)
    assert (s.hidden, s.layers, s.params) == (4096, 32, float(EIGHT_B.params()))
    assert s.link_mbit == GpuScenario().link_mbit and s.gpu == GpuScenario().gpu
    assert scenario_like(ONE_B).params == pytest.approx(GpuScenario().params, rel=1e-3)  # the default's model


def test_stage_groups_of_the_swarm_and_of_dense_sync() -> None:
    status = {
        "peers": [
            {"id": "bed-peer1", "stage": 1, "state": "active"},
            {"id": "bed-peer2", "stage": 0, "state": "idle"},
            {"id": "bed-peer3", "stage": 0, "state": "active"},
            {"id": "bed-peer4", "stage": 1, "state": "active"},
            {"id": "bed-peer5", "stage": 1, "state": "gone"},
            {"id": "someone", "stage": 0, "state": "active"},
        ]
    }
    assert swarm_groups(status, 2) == [[2, 3], [1, 4]]
    assert sync_groups(2, 2) == [[0, 1], [2, 3]] and sync_groups(3, 1) == [[0], [1], [2]]

    calls = []

    class Bed:
        def set_rate(self, index, rate_mbit, dp_mbit=None, dp_hosts=()):
            calls.append((index, rate_mbit, dp_mbit, list(dp_hosts)))

    shape_groups(Bed(), [[2, 3], [1, 4]], 8.0, [0.5, 0.25])
    assert calls == [(2, 8.0, 0.5, [3]), (3, 8.0, 0.5, [2]), (1, 8.0, 0.25, [4]), (4, 8.0, 0.25, [1])]


def test_an_unknown_model_fails_before_any_bed() -> None:
    from peer.bench.throughput import run_throughput

    with pytest.raises(ConfigError, match="--dp-like"):
        run_throughput(quick=True, bandwidth_mbit=None, stages=2, replicas=2, dp_like="gpt-9")


def test_the_flag_parses() -> None:
    from peer.cli.parser import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--dp-like", "llama-3.1-8b", "--out", "x.json"])
    assert args.dp_like == "llama-3.1-8b"
    assert build_parser().parse_args(["bench", "throughput", "--out", "x.json"]).dp_like is None
