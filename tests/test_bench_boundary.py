"""`bench boundary` (peer/bench/boundary.py): the cut chain computes the unsplit model's loss, the
codecs reconstruct what they should, and their wire bytes are what a hand count says."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from peer.bench.boundary import boundary_stats, run_boundary
from peer.bench.boundary_chain import Chain, split_windows
from peer.bench.boundary_codecs import KLT, MSE, PCA, Dense, Outliers, Quant, Residual, Sink, uniform_quantize
from peer.bench.boundary_rows import ProjectLowRank, ProjectMask
from peer.config import ModelConfig
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm
from peer.model.stages import lm_loss

TINY = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=4, num_heads=4, max_seq_len=128)


@pytest.fixture(scope="module")
def tiny():
    """(chain cut after layers 1 and 3, the unsplit model, windows [6, 33]) on a seeded tiny model."""
    torch.manual_seed(0)
    model = load_causal_lm(TINY, seed=3)
    windows = torch.randint(0, 256, (6, 33), generator=torch.Generator().manual_seed(1))
    return Chain(model, [1, 3]), model, windows


def _low_rank(n: int, width: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(width, rank, generator=g))
    return 3.0 + torch.randn(n, rank, generator=g) * torch.linspace(4, 1, rank) @ basis.T


def test_chain_dense_loss_equals_the_unsplit_model(tiny) -> None:
    chain, model, windows = tiny
    x, y = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        ref = float(lm_loss(model(input_ids=x).logits, y))
    assert chain.dense_loss(x, y) == pytest.approx(ref, rel=1e-5, abs=1e-5)
    hidden = chain.hidden(x)
    assert [tuple(h.shape) for h in hidden] == [(6, 32, 64), (6, 32, 64)]
    for j in range(2):  # resuming from either boundary with the true hidden state is the same loss
        assert chain.loss_from(j, hidden[j], y) == pytest.approx(ref, rel=1e-5, abs=1e-5)
    # and a damaged hidden state is not
    assert abs(chain.loss_from(0, hidden[0] * 0, y) - ref) > 1e-3


def test_chain_refuses_bad_boundaries(tiny) -> None:
    _, model, _ = tiny
    for bad in ([0], [4], [2, 1], [2, 2]):
        with pytest.raises(ConfigError):
            Chain(model, bad)


def test_lossless_settings_reproduce_dense(tiny) -> None:
    """Dense fp32 and a full-rank basis with fp32 coefficients are the identity; 8-bit KLT and a
    mask that drops nothing come within a hair of it."""
    chain, _, windows = tiny
    x, y = windows[:, :-1], windows[:, 1:]
    h = chain.hidden(x)[0]
    dense = chain.loss_from(0, h, y)
    for codec, tol in ((Dense(), 1e-6), (PCA(64, "fp32"), 1e-4), (KLT(8.0), 2e-3), (ProjectMask(0.0), 1e-3)):
        codec.fit(h, x)
        approx, _ = codec.code(h, x)
        assert chain.loss_from(0, approx, y) == pytest.approx(dense, abs=tol), type(codec).__name__


def test_pca_is_exact_on_a_rank_r_signal_and_not_below() -> None:
    x = _low_rank(600, 32, 5)
    ids = torch.zeros(600, dtype=torch.long)
    exact = PCA(5, "fp32")
    exact.fit(x, ids)
    approx, nbytes = exact.code(x, ids)
    assert (approx - x).norm() / x.norm() < 1e-4
    assert nbytes == 600 * 4 * 5
    short = PCA(4, "fp32")
    short.fit(x, ids)
    assert (short.code(x, ids)[0] - x).norm() / (x - x.mean(0)).norm() > 0.05
    # the project's BasisState around the mean: same subspace, fp16 coefficients through MaskCodec
    proj = ProjectLowRank(5, center="mean")
    proj.fit(x[None], ids[None])
    papprox, pbytes = proj.code(x[None], ids[None])
    assert (papprox[0] - x).norm() / x.norm() < 2e-3
    assert pbytes == 600 * 5 * 2


def test_bytes_per_token_match_a_hand_count() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g)
    ids = torch.randint(0, 256, (50,), generator=g)

    def nbytes(codec, h=x, t=ids):
        codec.fit(h, t)
        return codec.code(h, t)[1]

    assert nbytes(Dense()) == 50 * 64 * 4
    assert nbytes(Dense(torch.bfloat16)) == 50 * 64 * 2
    assert nbytes(Quant(8, channel_scale=False)) == 50 * (64 + 2)
    assert nbytes(Quant(4)) == 50 * (32 + 2)
    assert nbytes(Quant(3)) == 50 * (24 + 2)
    assert nbytes(Quant("ternary")) == 50 * (13 + 2)  # ceil(64 / 5) bytes of trits + fp16 scale
    assert nbytes(PCA(10)) == 50 * 20
    assert nbytes(PCA(10, "int8")) == 50 * 12
    assert nbytes(KLT(2.0)) == 50 * (16 + 2)  # 128 bits + fp16 gain
    assert nbytes(KLT(1.5)) == 50 * (12 + 2)  # 96 bits
    assert nbytes(Outliers(4, Quant(2))) == 50 * (4 * 2 + 15 + 2)  # 4 bf16 channels + 60 2-bit values + scale
    assert nbytes(Residual(PCA(8, "int8"), Quant(2))) == 50 * ((8 + 2) + (16 + 2))
    # the sink row: H bf16 values per sequence, then the inner codec on T - 1 positions
    h3, t3 = x.reshape(5, 10, 64), ids.reshape(5, 10)
    assert nbytes(Sink(PCA(10, "int8")), h3, t3) == 5 * 64 * 2 + 5 * 9 * 12
    # the project's mask: fp16 values for the kept entries, whatever the draw kept
    mask = ProjectMask(0.9)
    mask.fit(h3, t3)
    approx, mbytes = mask.code(h3, t3)
    assert mbytes == 2 * int((approx != 0).sum())
    assert 0.05 < mbytes / (2 * h3.numel()) < 0.15


def test_fp16_ints_and_klt_budget_are_spent_where_the_variance_is() -> None:
    var = torch.tensor([100.0, 10.0, 1.0, 0.1, 0.0])
    bits = KLT.allocate(var, 12)
    assert int(bits.sum()) == 12
    assert bits.tolist() == sorted(bits.tolist(), reverse=True)
    assert bits[0] > bits[2] and bits[-1] == 0
    # each extra bit of a Gaussian-model component buys var * MSE[b]-MSE[b+1]: 10x variance ~ 1.66 more bits
    assert 1 <= int(bits[0] - bits[1]) <= 3


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_uniform_quantizer_meets_the_gaussian_table(bits: int) -> None:
    z = torch.randn(200_000, generator=torch.Generator().manual_seed(bits))
    zq, q = uniform_quantize(z, bits)
    assert int(q.min()) >= -(2 ** (bits - 1)) and int(q.max()) <= 2 ** (bits - 1) - 1
    assert len(q.unique()) <= 2**bits
    mse = float((z - zq).pow(2).mean())
    assert mse == pytest.approx(MSE[bits], rel=0.08)


def test_klt_beats_plain_quantisation_at_equal_bytes_on_correlated_data() -> None:
    x = _low_rank(2000, 64, 12) + 0.05 * torch.randn(2000, 64, generator=torch.Generator().manual_seed(5))
    ids = torch.zeros(2000, dtype=torch.long)
    klt, quant = KLT(2.0), Quant(2)
    klt.fit(x, ids)
    quant.fit(x, ids)
    (a, na), (b, nb) = klt.code(x, ids), quant.code(x, ids)
    assert na == nb
    assert (a - x).norm() < 0.3 * (b - x).norm()
    assert klt.entropy_bytes is not None and klt.entropy_bytes < na / 2000


def test_fisher_metric_keeps_the_codec_invertible_and_spends_bits_on_sensitive_directions() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 16, generator=g)  # isotropic data: plain KLT has no preference
    ids = torch.zeros(3000, dtype=torch.long)
    grad = torch.zeros(3000, 16)
    grad[:, 0] = torch.randn(3000, generator=g)  # the loss only feels channel 0
    fine = KLT(8.0, fisher=0.01)
    fine.fit(x, ids, grad)
    assert (fine.code(x, ids)[0] - x).norm() / x.norm() < 0.02
    coarse, plain = KLT(1.0, fisher=0.01), KLT(1.0)
    coarse.fit(x, ids, grad)
    plain.fit(x, ids)
    err_f, err_p = coarse.code(x, ids)[0] - x, plain.code(x, ids)[0] - x
    assert err_f[:, 0].pow(2).mean() < 0.2 * err_p[:, 0].pow(2).mean()
    assert Sink(KLT(1.0, fisher=0.1)).needs_grad and not Sink(KLT(1.0)).needs_grad
    with pytest.raises(ValueError):
        KLT(1.0, fisher=0.1).fit(x, ids)


def test_stats_find_a_planted_sink_and_outlier_channel() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 40, 32, generator=g)
    h[:, :, 7] *= 20  # an outlier channel everywhere
    h[:, 0, 3] = 5000.0  # a massive activation at the sink
    ids = torch.randint(0, 50, (4, 40), generator=g)
    s = boundary_stats(h, ids, h.clone(), ids.clone())
    assert s["channel_rms_top10"][0]["channel"] == 7
    assert s["channel_rms_top10"][0]["x_median_channel"] > 10
    assert s["massive"]["at_sink_position"] == 4 and s["massive"]["elsewhere"] == 0
    assert s["massive"]["channels"] == [3]
    assert s["sink"]["energy_frac_pos0"] > 0.5
    assert s["sink"]["pos0_top_channels"][0]["channel"] == 3


def test_windows_keep_calibration_and_eval_apart() -> None:
    ids = torch.arange(10_000)
    cal, ev = split_windows(ids, 99, 8, 4)
    assert cal.shape == (8, 100) and ev.shape == (4, 100)
    assert int(cal.max()) < 5000 <= int(ev.min())
    assert len(torch.cat([cal.flatten(), ev.flatten()]).unique()) == 1200  # no window overlaps another
    with pytest.raises(ConfigError):
        split_windows(ids, 999, 8, 1)


def test_run_boundary_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"\n".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("test_*.py"))[:6])[:60_000])
    rows = [
        "dense_bf16",
        "mask_m95_zero",
        "lowrank_prior_r64",
        "sink+int3_ch",
        "sink+klt_2.0b",
        "sink+prior+fisher_klt_1.5b",
    ]
    result = run_boundary(
        TINY, boundaries="1,3", eval_tokens=128, calib_tokens=512, seq_len=64, corpus=corpus, rows=rows
    )
    json.dumps(result)  # JSON-able
    assert result["setup"]["boundaries"] == [1, 3] and result["setup"]["eval_tokens"] == 128
    for b in ("1", "3"):
        r = result["rows"][b]
        assert list(r) == ["dense_fp32", *rows]
        assert r["dense_fp32"]["vs_dense_pct"] == 0.0 and r["dense_fp32"]["bytes_per_token"] == 256
        assert r["dense_bf16"]["ratio_vs_fp32"] == 2.0 and abs(r["dense_bf16"]["vs_dense_pct"]) < 0.1
        assert r["sink+klt_2.0b"]["bytes_per_token"] == pytest.approx(64 * 2 / 64 + 63 * (16 + 2) / 64, abs=0.01)
        assert math.isclose(
            r["sink+klt_2.0b"]["ratio_vs_fp32"], 256 / r["sink+klt_2.0b"]["bytes_per_token"], rel_tol=1e-3
        )
        best = result["best_per_boundary"][b]
        eligible = {n: x["eval_loss"] for n, x in r.items() if x["ratio_vs_fp32"] >= 10}
        assert best["name"] == min(eligible, key=eligible.get)
        smallest = result["smallest_within_1pct_per_boundary"][b]
        close = {n: x["bytes_per_token"] for n, x in r.items() if x["vs_dense_pct"] <= 1.0}
        assert smallest["bytes_per_token"] == min(close.values()) <= 128  # dense_bf16 at least qualifies
        assert "stats" in result and set(result["stats"][b]) >= {"channel_rms_top10", "massive", "sink"}
    assert result["best"]["eval_loss"] == min(result["best_per_boundary"][b]["eval_loss"] for b in ("1", "3"))
    with pytest.raises(ConfigError):
        run_boundary(TINY, boundaries=[1], rows=["no_such_row"], corpus=corpus)
    with pytest.raises(ConfigError):
        run_boundary(TINY, boundaries=[1], seq_len=1, corpus=corpus)
    with pytest.raises(ConfigError):
        run_boundary(TINY, boundaries="1,x", corpus=corpus)
