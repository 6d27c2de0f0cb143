"""`anchormesh bench boundary`: what a stage-boundary codec does to a real model, forward only.

Why this exists: on a real pretrained model (SmolLM2-135M) the project's boundary codecs ruined
the boundary before any training (element mask M95: eval loss 15 against 1.9 dense; rank-64
low-rank around the token prior: 3.2). Choosing the codec to build needs numbers, taken with
the project's own code, for the codecs we have and for candidates that could cut the boundary's
bytes >= 10x at near-dense quality. No training here: the model's boundary activation after
layer L goes through a codec (fitted on calibration text), the remaining layers run on the
reconstruction, and the eval loss on held-out text says what the codec costs.

What is measured, per boundary L (the hidden state after decoder layer L):

- `stats`: what drives codec design. Per-channel RMS (top channels vs the median channel),
  massive activations (|x| > 100 x the median |x|: where, which channels), the share of the
  energy in the first position of each sequence (the attention sink), token-norm spread, and the
  variance a token prior or a rank-r basis explains.
- `rows`: one per codec. eval_loss through the codec; vs_dense_pct; bytes_per_token on the wire
  (everything a receiver needs per micro-batch: values, coefficients, per-token scales,
  per-sequence sink rows amortised over the sequence; state fitted once and shipped rarely
  -- a basis, a token prior, channel scales -- is reported as `shared_bytes`, not per token;
  token ids travel with every scheme, dense included, and are not counted); the ratio against
  dense fp32 (4 H bytes/token) and dense bf16 (2 H); variance_explained and token_rel_err on
  the non-sink positions; sink_rel_err on the sink position.
- `best_per_boundary` / `best`: the lowest eval loss among rows >= 10x smaller than fp32;
  `smallest_within_1pct_per_boundary`: the fewest bytes among rows within 1% of dense.

Rows named `mask_*`, `lowrank_*` and `sink+lowrank_*` run the project's code (MaskCodec with
its fills, TokenPrior, BasisLearner/BasisState, coefficients through MaskCodec as the runner
sends them). The others are candidates written here as small codecs (fit on calibration rows,
then encode+decode a tensor and count its bytes): per-token quantisers with per-channel scaling,
outlier channels sent dense, PCA bases, residual combinations, and a KLT transform coder (full
PCA rotation, bits allocated per component by reverse water-filling under a per-token bit budget,
one fp16 gain per token), optionally around a per-token prior and in the metric of the loss
gradient (the `fisher` rows: calibration gradients through the remaining layers).

Fitting uses calibration windows from the first half of the corpus, eval windows the second half:
no eval token is seen by any fit.

Where the parts live: the candidate codecs in boundary_codecs.py, the project's codecs and the
row table in boundary_rows.py, the cut model and the text windows in boundary_chain.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from peer.bench.boundary_chain import Chain, split_windows, token_ids
from peer.bench.boundary_codecs import KLT, SINK, Codec, Sink, TokenMean, pca
from peer.bench.boundary_rows import QUICK_ROWS, ProjectLowRank, ProjectMask, row_table
from peer.codec.prior import TokenPrior
from peer.config import ModelConfig
from peer.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_BOUNDARIES = [5, 10, 15, 20, 25]
QUICK_BOUNDARIES = [15]
MASSIVE = 100.0  # a massive activation: |x| > MASSIVE x the median |x|
TARGET_RATIO = 10.0  # `best`: the lowest eval loss among rows at least this many times smaller than fp32
GAP_PCT = 1.0  # `smallest_within_1pct`: the fewest bytes among rows at most this much (%) above dense

# ---- measurements --------------------------------------------------------------------------------


def _sig(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits (stats span 1e-3 to 1e4)."""
    return float(f"{x:.{digits}g}")


def _explained(h: Tensor, approx: Tensor) -> float:
    """1 - |h - approx|^2 / |h - mean(h)|^2 over rows [N, H]."""
    return float(1 - (h - approx).pow(2).sum() / (h - h.mean(0)).pow(2).sum())


def boundary_stats(
    h: Tensor, ids: Tensor, h_cal: Tensor, ids_cal: Tensor, decode: Callable[[list[int]], str] | None = None
) -> dict:
    """What the boundary activation looks like (eval windows h [N, T, H]; calibration for fits)."""
    H = h.shape[-1]
    rest = h[:, SINK:].reshape(-1, H)
    ch_rms = rest.pow(2).mean(0).sqrt()
    med_ch = float(ch_rms.median())
    top = ch_rms.topk(min(10, H))
    energy = h.pow(2).sum(-1)  # [N, T]
    norms = energy.sqrt()
    absx = h.abs()
    med_abs = float(absx.median())
    big = (absx > MASSIVE * med_abs).nonzero()
    at_sink = int((big[:, 1] < SINK).sum())
    elsewhere = big[big[:, 1] >= SINK]
    massive_tokens = sorted({int(ids[n, t]) for n, t in elsewhere[:, :2].tolist()})
    sink_vec = h[:, 0]
    sink_top = sink_vec.abs().mean(0).topk(min(5, H))
    cal_rest, ids_rest = h_cal[:, SINK:].reshape(-1, H), ids_cal[:, SINK:].reshape(-1)
    tm = TokenMean()
    tm.fit(cal_rest, ids_rest)
    project_prior = TokenPrior(int(max(ids.max(), ids_cal.max())) + 1, H)
    project_prior.observe_dense(ids_cal[:, SINK:], h_cal[:, SINK:])
    prior_all = TokenPrior(project_prior.vocab_size, H)  # as the project learns it: every position, sink included
    prior_all.observe_dense(ids_cal, h_cal)
    mu = cal_rest.mean(0)
    _, vecs = pca(cal_rest - mu)
    ids_eval = ids[:, SINK:].reshape(-1)
    pca_explained = {
        str(r): round(_explained(rest, mu + (rest - mu) @ vecs[:, :r] @ vecs[:, :r].T), 4)
        for r in (16, 32, 64, 128, 256)
        if r <= H
    }
    return {
        "channel_rms_median": _sig(med_ch),
        "channel_rms_top10": [
            {"channel": int(c), "rms": _sig(float(v)), "x_median_channel": _sig(float(v) / med_ch, 3)}
            for v, c in zip(top.values, top.indices)
        ],
        "massive": {
            "threshold_abs": _sig(MASSIVE * med_abs),
            "median_abs": _sig(med_abs),
            "max_abs": _sig(float(absx.max())),
            "max_x_median": round(float(absx.max()) / med_abs, 1),
            "count": len(big),
            "at_sink_position": at_sink,
            "elsewhere": len(elsewhere),
            "elsewhere_positions_frac": round(
                len({(n, t) for n, t in elsewhere[:, :2].tolist()}) / max(1, rest.shape[0]), 5
            ),
            "channels": sorted({int(c) for c in big[:, 2].tolist()}),
            "elsewhere_tokens": [decode([t]) for t in massive_tokens[:12]] if decode else massive_tokens[:12],
        },
        "sink": {
            "energy_frac_pos0": round(float(energy[:, 0].sum() / energy.sum()), 4),
            "energy_frac_pos1_3": round(float(energy[:, 1:4].sum() / energy.sum()), 4),
            "uniform_share_per_position": round(1 / h.shape[1], 5),
            "pos0_norm_x_median_token": round(float(norms[:, 0].median() / norms[:, SINK:].median()), 1),
            "pos0_top_channels": [
                {"channel": int(c), "mean_abs": _sig(float(v)), "x_median_abs": _sig(float(v) / med_abs, 3)}
                for v, c in zip(sink_top.values, sink_top.indices)
            ],
        },
        "token_norm_quantiles_nonsink": {
            q: _sig(float(v))
            for q, v in zip(
                ("p01", "p50", "p99", "max"),
                (
                    *norms[:, SINK:].flatten().quantile(torch.tensor([0.01, 0.5, 0.99])).tolist(),
                    float(norms[:, SINK:].max()),
                ),
            )
        },
        "project_token_prior_variance_explained_all_positions": round(
            _explained(h.reshape(-1, H), prior_all.fill(ids).reshape(-1, H)), 4
        ),
        "variance_explained_nonsink": {
            "project_token_prior": round(_explained(rest, project_prior.fill(ids[:, SINK:]).reshape(-1, H)), 4),
            "shrunk_token_mean": round(_explained(rest, tm(ids_eval)), 4),
            "pca_rank": pca_explained,
        },
    }


def _measure(codec: Codec, chain: Chain, j: int, h: Tensor, ids: Tensor, targets: Tensor, dense: float) -> dict:
    t0 = time.monotonic()
    approx, nbytes = codec.code(h, ids)
    loss = chain.loss_from(j, approx, targets)
    H = h.shape[-1]
    bpt = nbytes / (h.shape[0] * h.shape[1])
    rest, arest = h[:, SINK:].reshape(-1, H), approx[:, SINK:].reshape(-1, H)
    row = {
        "eval_loss": round(loss, 4),
        "vs_dense_pct": round(100 * (loss - dense) / dense, 2),
        "bytes_per_token": round(bpt, 2),
        "ratio_vs_fp32": round(4 * H / bpt, 2),
        "ratio_vs_bf16": round(2 * H / bpt, 2),
        "variance_explained": round(_explained(rest, arest), 4),
        "token_rel_err": round(float(((rest - arest).norm(dim=1) / rest.norm(dim=1).clamp(min=1e-12)).mean()), 4),
        "sink_rel_err": round(float((h[:, 0] - approx[:, 0]).norm() / h[:, 0].norm().clamp(min=1e-12)), 4),
        "shared_bytes": int(codec.shared_bytes),
    }
    coder = codec.inner if isinstance(codec, Sink) else codec
    if isinstance(coder, KLT):  # what entropy-coding its symbols would send instead
        coded = h.shape[0] * (h.shape[1] - (codec.n if coder is not codec else 0))
        row["entropy_bytes_per_token"] = round(
            (nbytes - coded * coder.row_bytes() + coded * coder.entropy_bytes) / (h.shape[0] * h.shape[1]), 2
        )
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def _best(rows: dict[str, dict]) -> dict | None:
    """The lowest eval loss among rows at least TARGET_RATIO x smaller than fp32."""
    ok = [(r["eval_loss"], name) for name, r in rows.items() if r["ratio_vs_fp32"] >= TARGET_RATIO]
    if not ok:
        return None
    _, name = min(ok)
    return {"name": name, **rows[name]}


def _smallest(rows: dict[str, dict], gap_pct: float = GAP_PCT) -> dict | None:
    """The fewest bytes per token among rows within `gap_pct` of the dense loss."""
    ok = [(r["bytes_per_token"], r["eval_loss"], name) for name, r in rows.items() if r["vs_dense_pct"] <= gap_pct]
    if not ok:
        return None
    *_, name = min(ok)
    return {"name": name, **rows[name]}


def run_boundary(
    model: str | ModelConfig = "smollm2-135m",
    boundaries: list[int] | str | None = None,
    eval_tokens: int = 2048,
    calib_tokens: int = 8192,
    seq_len: int = 512,
    quick: bool = False,
    corpus: Path | str | None = None,
    rows: list[str] | None = None,
    threads: int | None = None,
) -> dict:
    """Measure every codec row at every boundary (see the module docstring); a JSON-able dict.

    Args:
        model: a model name as `model.name` takes it (tiny-* models are built seeded, byte tokens),
            or a ModelConfig.
        boundaries: layer counts L (the boundary after decoder layer L), a list or "5,10,15";
            default 5,10,15,20,25 (quick: 15).
        eval_tokens, calib_tokens: rounded down to whole windows of `seq_len` tokens (at least one).
        quick: one boundary, a quarter of the tokens, a few rows.
        corpus: a text file or folder; default the built-in Python corpus (peer/data.py, "b").
        rows: names from `row_table()` to run (default all; quick: QUICK_ROWS).
        threads: torch threads (default: leave as is).
    """
    from peer.model.loading import load_causal_lm

    if threads is not None:
        torch.set_num_threads(threads)
    for flag, value, least in (
        ("--seq-len", seq_len, 2),
        ("--eval-tokens", eval_tokens, 1),
        ("--calib-tokens", calib_tokens, 1),
    ):
        if value < least:
            raise ConfigError(flag, value, f"must be >= {least}")
    cfg = model if isinstance(model, ModelConfig) else ModelConfig(name=model)
    if isinstance(boundaries, str):
        try:
            boundaries = [int(b) for b in boundaries.split(",") if b.strip()]
        except ValueError:
            raise ConfigError(
                "--boundaries", boundaries, "must be comma-separated layer counts, e.g. 5,10,15"
            ) from None
    if boundaries is None:
        boundaries = QUICK_BOUNDARIES if quick else DEFAULT_BOUNDARIES
    if quick:
        eval_tokens, calib_tokens = max(seq_len, eval_tokens // 4), max(seq_len, calib_tokens // 4)
    table = row_table()
    names = list(rows) if rows else list(QUICK_ROWS if quick else table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ConfigError("rows", ",".join(unknown), f"unknown; known: {', '.join(table)}")
    if "dense_fp32" not in names:
        names.insert(0, "dense_fp32")
    n_eval, n_calib = max(1, eval_tokens // seq_len), max(1, calib_tokens // seq_len)

    t0 = time.monotonic()
    lm = load_causal_lm(cfg)
    boundaries = sorted({int(b) for b in boundaries})
    n_layers = lm.config.num_hidden_layers
    if boundaries and boundaries[-1] >= n_layers:
        log.warning(
            "boundaries at or beyond the model's %d layers dropped: %s",
            n_layers,
            [b for b in boundaries if b >= n_layers],
        )
        boundaries = [b for b in boundaries if b < n_layers]
    chain = Chain(lm, boundaries)
    vocab, hidden = lm.config.vocab_size, lm.config.hidden_size
    del lm
    ids, source, decode = token_ids(cfg.name, Path(corpus) if corpus is not None else None)
    calib, evals = split_windows(ids, seq_len, n_calib, n_eval)
    log.info(
        "%s: %d layers, hidden %d; %d calibration and %d eval windows of %d tokens from %s",
        cfg.name,
        n_layers,
        hidden,
        n_calib,
        n_eval,
        seq_len,
        source,
    )
    h_cal = chain.hidden(calib[:, :-1])
    h_eval = chain.hidden(evals[:, :-1])
    x_cal, x_eval, y_eval = calib[:, :-1], evals[:, :-1], evals[:, 1:]
    dense = chain.dense_loss(x_eval, y_eval)
    log.info("dense eval loss %.4f (%.0fs so far)", dense, time.monotonic() - t0)

    stats, results, best, smallest = {}, {}, {}, {}
    for j, b in enumerate(boundaries):
        stats[str(b)] = boundary_stats(h_eval[j], x_eval, h_cal[j], x_cal, decode)
        out, grad = {}, None
        for name in names:
            codec = table[name].make()
            for c in (codec, getattr(codec, "inner", None)):
                if isinstance(c, (ProjectMask, ProjectLowRank)):
                    c.vocab = vocab
            if codec.needs_grad and grad is None:
                grad = chain.grad_from(j, h_cal[j], calib[:, 1:])
                log.info("L%d: calibration gradients (%.0fs)", b, time.monotonic() - t0)
            codec.fit(h_cal[j], x_cal, grad if codec.needs_grad else None)
            if name == "dense_fp32":  # the unsplit chain's loss, measured once
                row = {
                    "eval_loss": round(dense, 4),
                    "vs_dense_pct": 0.0,
                    "bytes_per_token": 4 * hidden,
                    "ratio_vs_fp32": 1.0,
                    "ratio_vs_bf16": 0.5,
                    "variance_explained": 1.0,
                    "token_rel_err": 0.0,
                    "sink_rel_err": 0.0,
                    "shared_bytes": 0,
                }
            else:
                row = _measure(codec, chain, j, h_eval[j], x_eval, y_eval, dense)
            row["note"] = table[name].note
            out[name] = row
            log.info(
                "L%d %-32s loss %.4f (%+.1f%%)  %7.1f B/token  %5.1fx fp32  ve %.3f  (%.0fs)",
                b,
                name,
                row["eval_loss"],
                row["vs_dense_pct"],
                row["bytes_per_token"],
                row["ratio_vs_fp32"],
                row["variance_explained"],
                time.monotonic() - t0,
            )
        results[str(b)] = out
        best[str(b)] = _best(out)
        smallest[str(b)] = _smallest(out)
    overall = [dict(boundary=int(b), **r) for b, r in best.items() if r is not None]
    return {
        "setup": {
            "model": cfg.name,
            "num_layers": n_layers,
            "hidden_size": hidden,
            "vocab_size": vocab,
            "boundaries": boundaries,
            "seq_len": seq_len,
            "eval_tokens": n_eval * seq_len,
            "calib_tokens": n_calib * seq_len,
            "corpus": source,
            "split": "calibration windows from the first half of the corpus tokens, eval windows from the second half",
            "dense_eval_loss": round(dense, 4),
            "dense_fp32_bytes_per_token": 4 * hidden,
            "dense_bf16_bytes_per_token": 2 * hidden,
            "sink_positions": SINK,
            "bytes_rule": "per token: all values, coefficients, per-token scales and (sink+ rows) the sink row amortised over seq_len; "
            "shared_bytes (basis, prior, channel scales, indices: fitted once) are not per token; token ids are sent by every scheme and not counted",
            "quick": quick,
            "seconds": round(time.monotonic() - t0, 1),
        },
        "stats": stats,
        "rows": results,
        "best_per_boundary": best,
        "smallest_within_1pct_per_boundary": smallest,
        "best": min(overall, key=lambda r: r["eval_loss"]) if overall else None,
    }


def main_json(path: Path | None, **kwargs) -> dict:
    """`anchormesh bench boundary`: run_boundary(**kwargs) as JSON to `path` (stdout when None)."""
    from peer.bench import emit_json

    return emit_json(run_boundary(**kwargs), path)
