"""The rows of `bench boundary` (peer/bench/boundary.py): the project's own codecs wrapped as
boundary codecs (MaskCodec with its fills, BasisLearner/BasisState) and the table of every codec
the bench measures, in report order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.bench.boundary_codecs import KLT, PCA, Codec, Dense, Outliers, Quant, Residual, Sink, pca, to_fp16
from peer.codec.basis import BasisLearner, BasisState
from peer.codec.fill import USES_PRIOR, reconstruct
from peer.codec.mask import MaskCodec
from peer.codec.prior import TokenPrior
from peer.config import MaskConfig


class ProjectMask(Codec):
    """The project's element mask (peer/codec/mask.py) with one of its fills (peer/codec/fill.py),
    decoded as the runner does; the token prior is fitted densely on calibration (the best case of
    the receiver-learned TokenPrior). Bytes: the MaskCodec payload."""

    def __init__(self, drop: float, fill: str = "zero", values: str = "fp16") -> None:
        self.cfg = MaskConfig(scheme="mask", drop=drop, fill=fill, values=values)
        self.prior: TokenPrior | None = None
        self.vocab: int | None = None  # the model's vocabulary (the TokenPrior's table size)

    def fit(self, h: Tensor, ids: Tensor, grad: Tensor | None = None) -> None:
        if self.cfg.fill in USES_PRIOR:
            self.prior = TokenPrior(int(ids.max()) + 1 if self.vocab is None else self.vocab, h.shape[-1])
            self.prior.observe_dense(ids.reshape(1, -1), h.reshape(1, -1, h.shape[-1]))

    def code(self, h: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        codec = MaskCodec(self.cfg)
        msg = codec.encode(h, boundary=0, step=0, micro_batch=0)
        x = codec.decode(msg, expect_shape=tuple(h.shape))
        keep = codec.keep_mask(tuple(h.shape), boundary=0, step=0, micro_batch=0)
        prior = self.prior.fill(ids) if self.prior is not None else None
        return reconstruct(x, keep, self.cfg.keep, self.cfg.fill, prior), len(msg.payload)


class ProjectLowRank(Codec):
    """The project's low-rank scheme (peer/codec/basis.py): BasisLearner's token prior + rank-r
    basis (center "token"), or a BasisState around the calibration mean (center "mean"); the
    coefficients travel through MaskCodec in `values` as the runner sends them. Shared state: the
    prior rows and basis as the runner ships them (fp16, plus int32 row ids)."""

    def __init__(self, rank: int, center: str = "token", values: str = "fp16", prior_rows: int = 8192) -> None:
        self.rank, self.center, self.prior_rows = rank, center, prior_rows
        self.coef_codec = MaskCodec(MaskConfig(scheme="mask", values=values))
        self.vocab: int | None = None

    def fit(self, h: Tensor, ids: Tensor, grad: Tensor | None = None) -> None:
        vocab = self.vocab or int(ids.max()) + 1
        x, t = h.reshape(-1, h.shape[-1]).float(), ids.reshape(-1)
        self.rank = min(self.rank, x.shape[1])  # a narrower model than the row assumes: all of it
        if self.center == "token":
            learner = BasisLearner(vocab, h.shape[-1], self.rank, buffer_tokens=len(t), max_rows=self.prior_rows)
            learner.observe(x, t)
            self.state = learner.maybe_refresh(0)
        else:
            mu = x.mean(0)
            _, vecs = pca(x - mu)
            self.state = BasisState(
                1,
                to_fp16(mu[None]),
                to_fp16(vecs[:, : self.rank]).contiguous(),
                torch.zeros(0, dtype=torch.int32),
                vocab,
            )
        s = self.state
        self.shared_bytes = (s.prior.numel() + s.basis.numel()) * 2 + (0 if s.row_ids is None else len(s.row_ids) * 4)

    def code(self, h: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        c = self.state.project(h.float(), ids)
        msg = self.coef_codec.encode(c, boundary=0, step=0, micro_batch=0)
        c = self.coef_codec.decode(msg, expect_shape=tuple(c.shape))
        return self.state.lift(c, ids), len(msg.payload)


# ---- the rows ------------------------------------------------------------------------------------


@dataclass
class Row:
    make: Callable[[], Codec]
    note: str


def row_table() -> dict[str, Row]:
    """Every codec the bench measures, in report order."""
    R = Row
    return {
        # the reference and the project's codecs, as they are
        "dense_fp32": R(lambda: Dense(torch.float32), "reference: every value in fp32"),
        "dense_bf16": R(lambda: Dense(torch.bfloat16), "every value in bf16 (2x)"),
        "mask_m95_zero": R(lambda: ProjectMask(0.95, "zero"), "project: the paper's M95, fp16 values, zero fill"),
        "mask_m90_zero": R(lambda: ProjectMask(0.90, "zero"), "project: M90, fp16 values, zero fill"),
        "mask_m90_token_prior": R(
            lambda: ProjectMask(0.90, "token_prior"),
            "project: M90, dropped entries from the TokenPrior (fitted densely on calibration)",
        ),
        "mask_m90_prior_rescale": R(
            lambda: ProjectMask(0.90, "prior_rescale"), "project: M90, unbiased around the TokenPrior"
        ),
        "lowrank_mean_r64": R(
            lambda: ProjectLowRank(64, "mean"),
            "project BasisState: rank 64 around the calibration mean, fp16 coefficients",
        ),
        "lowrank_prior_r64": R(
            lambda: ProjectLowRank(64, "token"), "project BasisLearner: token prior + rank 64, fp16 coefficients"
        ),
        "lowrank_prior_r128": R(
            lambda: ProjectLowRank(128, "token"), "project BasisLearner: token prior + rank 128, fp16 coefficients"
        ),
        # the same project codec once the sink position travels dense and is kept out of the fit
        "sink+lowrank_prior_r128": R(
            lambda: Sink(ProjectLowRank(128, "token")),
            "project BasisLearner fitted without the sink; sink row dense bf16",
        ),
        # per-token quantisers
        "sink+int8": R(lambda: Sink(Quant(8, channel_scale=False)), "int8 absmax per token"),
        "sink+int4_ch": R(lambda: Sink(Quant(4)), "per-channel scale, then 4-bit per token (RMS scale)"),
        "sink+int3": R(lambda: Sink(Quant(3, channel_scale=False)), "3-bit per token, no channel scaling"),
        "sink+int3_ch": R(lambda: Sink(Quant(3)), "per-channel scale, then 3-bit per token"),
        "sink+int2_ch": R(lambda: Sink(Quant(2)), "per-channel scale, then 2-bit per token"),
        "sink+ternary_ch": R(lambda: Sink(Quant("ternary")), "per-channel scale, then ternary per token (1.6 bits)"),
        "sink+out8+int3_ch": R(lambda: Sink(Outliers(8, Quant(3))), "8 largest-RMS channels bf16, the rest 3-bit"),
        "sink+out8+int2_ch": R(lambda: Sink(Outliers(8, Quant(2))), "8 largest-RMS channels bf16, the rest 2-bit"),
        # low rank: rank sweep, coefficient precision, outliers removed first, around a token prior
        "sink+pca_r32": R(lambda: Sink(PCA(32)), "rank 32 around the mean, fp16 coefficients"),
        "sink+pca_r64": R(lambda: Sink(PCA(64)), "rank 64 around the mean, fp16 coefficients"),
        "sink+pca_r128": R(lambda: Sink(PCA(128)), "rank 128 around the mean, fp16 coefficients"),
        "sink+pca_r256": R(lambda: Sink(PCA(256)), "rank 256 around the mean, fp16 coefficients"),
        "sink+pca_r128_int8": R(lambda: Sink(PCA(128, "int8")), "rank 128, int8 coefficients"),
        "sink+pca_r200_int8": R(lambda: Sink(PCA(200, "int8")), "rank 200, int8 coefficients"),
        "sink+out8+pca_r128_int8": R(
            lambda: Sink(Outliers(8, PCA(128, "int8"))), "8 channels bf16, rank 128 int8 on the rest"
        ),
        "sink+prior+pca_r128_int8": R(
            lambda: Sink(PCA(128, "int8", center="token")), "rank 128 int8 around a shrunk per-token mean"
        ),
        # low rank + quantised residual
        "sink+pca_r64_int8+int2_ch": R(
            lambda: Sink(Residual(PCA(64, "int8"), Quant(2))), "rank 64 int8, then the residual 2-bit"
        ),
        "sink+pca_r128_int8+ternary_ch": R(
            lambda: Sink(Residual(PCA(128, "int8"), Quant("ternary"))), "rank 128 int8, then the residual ternary"
        ),
        # transform coding: all components, bits where the variance is
        "sink+klt_1.0b": R(lambda: Sink(KLT(1.0)), "KLT, 1.0 bit/value on average (water-filled)"),
        "sink+klt_1.5b": R(lambda: Sink(KLT(1.5)), "KLT, 1.5 bits/value"),
        "sink+klt_2.0b": R(lambda: Sink(KLT(2.0)), "KLT, 2.0 bits/value"),
        "sink+klt_2.5b": R(lambda: Sink(KLT(2.5)), "KLT, 2.5 bits/value"),
        "sink+klt_3.0b": R(lambda: Sink(KLT(3.0)), "KLT, 3.0 bits/value"),
        "sink+klt_4.0b": R(lambda: Sink(KLT(4.0)), "KLT, 4.0 bits/value"),
        "sink+prior+klt_1.5b": R(
            lambda: Sink(KLT(1.5, center="token")), "KLT 1.5 bits/value around a shrunk per-token mean"
        ),
        "sink+prior+klt_2.0b": R(
            lambda: Sink(KLT(2.0, center="token")), "KLT 2.0 bits/value around a shrunk per-token mean"
        ),
        "sink+prior+klt_3.0b": R(
            lambda: Sink(KLT(3.0, center="token")), "KLT 3.0 bits/value around a shrunk per-token mean"
        ),
        "sink+fisher_klt_2.0b": R(
            lambda: Sink(KLT(2.0, fisher=0.01)), "KLT 2.0 bits/value in the loss-gradient metric (ridge 0.01)"
        ),
        "sink+fisher_klt_2.5b": R(
            lambda: Sink(KLT(2.5, fisher=0.01)), "KLT 2.5 bits/value in the loss-gradient metric"
        ),
        "sink+prior+fisher_klt_1.5b": R(
            lambda: Sink(KLT(1.5, center="token", fisher=0.01)), "KLT 1.5 bits/value, token prior, gradient metric"
        ),
        "sink+prior+fisher_klt_2.0b": R(
            lambda: Sink(KLT(2.0, center="token", fisher=0.01)), "KLT 2.0 bits/value, token prior, gradient metric"
        ),
        "sink+prior+fisher_klt_2.5b": R(
            lambda: Sink(KLT(2.5, center="token", fisher=0.01)), "KLT 2.5 bits/value, token prior, gradient metric"
        ),
        # outlier channels dense, then the KLT on the rest (bits/value of the other W - 8 channels)
        "sink+out8+klt_2.75b": R(
            lambda: Sink(Outliers(8, KLT(2.75))), "8 largest-RMS channels bf16, KLT 2.75 bits/value on the rest"
        ),
        "sink+out8+prior+klt_1.25b": R(
            lambda: Sink(Outliers(8, KLT(1.25, center="token"))),
            "8 channels bf16, KLT 1.25 bits/value around a per-token mean (>= 10x vs bf16)",
        ),
        "sink+out8+prior+klt_2.25b": R(
            lambda: Sink(Outliers(8, KLT(2.25, center="token"))),
            "8 channels bf16, KLT 2.25 bits/value around a per-token mean",
        ),
        "sink+out8+prior+klt_2.75b": R(
            lambda: Sink(Outliers(8, KLT(2.75, center="token"))),
            "8 channels bf16, KLT 2.75 bits/value around a per-token mean",
        ),
        "klt_2.0b": R(lambda: KLT(2.0), "KLT 2.0 bits/value WITHOUT the sink split (fitted on all positions)"),
    }


QUICK_ROWS = (
    "dense_fp32",
    "mask_m95_zero",
    "lowrank_prior_r64",
    "sink+lowrank_prior_r128",
    "sink+int3_ch",
    "sink+pca_r64",
    "sink+klt_2.0b",
    "sink+out8+prior+klt_2.25b",
    "klt_2.0b",
)
