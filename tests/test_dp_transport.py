"""The DP transport benchmark at a tiny size: its JSON shape, and that every transport's round
really leaves both peers holding the mean of their inputs (fp16 on the wire)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from peer.bench.dp_transport import peer_vector, random_base, run_benchmark, true_mean

SHAPES = [(12, 16), (16,), (4, 4, 3)]


@pytest.mark.timeout(120)
def test_grpc_and_hivemind_rounds_give_the_true_mean() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    base = random_base(12 * 16 + 16 + 48, seed=3)
    out = run_benchmark({"tiny": (SHAPES, base)}, rounds=2, warmup=0, hivemind_cases=((0.5, None),), keep_values=True)
    json.dumps(out)  # JSON-ready

    assert out["benchmark"] == "dp_transport"
    assert out["setup"]["sizes"] == {"tiny": {"floats": 256, "tensors": 3}}
    results = {r["transport"]: r for r in out["results"]}
    assert set(results) == {"grpc", "grpc-stream", "hivemind"}

    mean = true_mean(base)
    inputs = [peer_vector(base, i) for i in range(2)]
    # the check below can fail: a peer that kept its own input would be this far off
    assert min(float((x - mean).abs().max()) for x in inputs) > 0.02
    for name, r in results.items():
        assert r["rounds"] == 2 and r["failed_rounds"] == 0, (name, r["errors"])
        assert 0 < r["round_s"]["median"] <= r["round_s"]["p90"] <= r["round_s"]["max"]
        assert r["bytes_per_round_per_peer"]["fp16_payload_computed"] == 2 * 256
        measured = r["bytes_per_round_per_peer"]["tcp_acked_measured"]
        assert measured is None or measured >= 2 * 256
        assert len(r["values"]) == 2 and len(r["max_abs_err_per_round"]) == 2
        dev = max(float((torch.tensor(v) - mean).abs().max()) for v in r["values"])  # last round, both peers
        assert dev == pytest.approx(r["max_abs_err_per_round"][-1], rel=1e-2, abs=1e-6)  # the bench reports what happened
        if name == "hivemind" and r["inexact_rounds"]:
            # hivemind can finish a round with a failed reducer's part left un-averaged and still
            # report success; the bench must flag it (seen about once in 100 rounds under load)
            assert r["max_abs_err_vs_true_mean"] > 1e-2 and r["errors"]
            continue
        assert r["inexact_rounds"] == 0 and r["max_abs_err_vs_true_mean"] < 1e-3, (name, r["errors"])
        assert dev < 1e-3, name
        for values in r["values"]:
            assert torch.allclose(torch.tensor(values), mean, atol=1e-3, rtol=0)

    hm = results["hivemind"]
    assert hm["min_matchmaking_time"] == 0.5 and hm["request_timeout"] < 0.5
    assert hm["matchmaking_s"]["median"] >= 0.4  # hivemind waits min_matchmaking_time before the all-reduce
    assert 0 < hm["matchmaking_share_median"] < 1
    assert results["grpc"]["matchmaking_s"] is None
