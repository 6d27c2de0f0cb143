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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from peer.codec.basis import BasisLearner, BasisState
from peer.codec.fill import USES_PRIOR, reconstruct
from peer.codec.mask import MaskCodec
from peer.codec.prior import TokenPrior
from peer.config import MaskConfig, ModelConfig
from peer.errors import ConfigError
from peer.model.stages import StageModule, lm_loss

log = logging.getLogger(__name__)

DEFAULT_BOUNDARIES = [5, 10, 15, 20, 25]
QUICK_BOUNDARIES = [15]
SINK = 1  # leading positions of each sequence that the sink-aware codecs send dense (bf16)
MASSIVE = 100.0  # a massive activation: |x| > MASSIVE x the median |x|
TARGET_RATIO = 10.0  # `best`: the lowest eval loss among rows at least this many times smaller than fp32
GAP_PCT = 1.0  # `smallest_within_1pct`: the fewest bytes among rows at most this much (%) above dense

# Uniform quantiser of a unit Gaussian with 2**b levels (mid-rise): MSE-optimal step and its MSE
# (J. Max, "Quantizing for minimum distortion", 1960). MSE[0] = 1: the component is not sent.
STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0568, 8: 0.0307}
MSE = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.00349, 6: 0.001035, 7: 0.000306, 8: 0.0000876}
TERNARY_STEP = 1.224  # 3-level (mid-tread) optimum for a unit Gaussian; 5 trits pack in one byte


# ---- codecs --------------------------------------------------------------------------------------


class Codec:
    """Fit once on calibration activations, then encode+decode a tensor and count its wire bytes.

    `fit(h, ids)` and `code(h, ids) -> (reconstruction, wire bytes of the whole tensor)` take h
    [..., W] and ids [...]. Subclasses that work row by row implement `_fit` / `_code` on
    [N, W] rows. `shared_bytes`: state fitted once and shipped to the receiver (amortised).
    """

    shared_bytes: int = 0

    @property
    def needs_grad(self) -> bool:
        """Whether `fit` wants the loss gradient w.r.t. the calibration activations."""
        return False

    def fit(self, h: Tensor, ids: Tensor, grad: Tensor | None = None) -> None:
        self._fit(h.reshape(-1, h.shape[-1]), ids.reshape(-1), None if grad is None else grad.reshape(-1, grad.shape[-1]))

    def code(self, h: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        out, nbytes = self._code(h.reshape(-1, h.shape[-1]), ids.reshape(-1))
        return out.reshape(h.shape), nbytes

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        pass

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        raise NotImplementedError


class Dense(Codec):
    """Every value, in `dtype` (fp32: the reference; bf16: what a half-precision link sends)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        return x.to(self.dtype).float(), x.numel() * torch.finfo(self.dtype).bits // 8


def _fp16(x: Tensor) -> Tensor:
    """`x` as it arrives after travelling as fp16 (per-token scales, coefficients)."""
    return x.half().float()


def uniform_quantize(z: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Mid-rise uniform quantiser with 2**bits levels at the Gaussian-optimal step, for values
    already divided by their scale: (reconstruction, integer level index)."""
    step, half = STEP[bits], 2 ** (bits - 1)
    q = torch.floor(z / step).clamp_(-half, half - 1)
    return (q + 0.5) * step, q


class Quant(Codec):
    """Every value quantised, one fp16 scale per token.

    bits 8: absmax int8 per token (after the channel scale, if any). bits 2..4 or "ternary": the value divided by its channel's
    calibration RMS (when `channel_scale`; those H fp16 scales are shared state), then by the
    token's RMS (the per-token scale), then the Gaussian-optimal uniform quantiser. Wire:
    ceil(W * bits / 8) + 2 bytes per token (ternary: ceil(W / 5) + 2, five trits a byte).
    """

    def __init__(self, bits: int | str, channel_scale: bool = True) -> None:
        self.bits, self.channel_scale = bits, channel_scale
        self.scale: Tensor | None = None

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        if self.channel_scale:
            self.scale = _fp16(x.pow(2).mean(0).sqrt().clamp(min=1e-6))
            self.shared_bytes = 2 * x.shape[1]

    def row_bytes(self, width: int) -> int:
        body = math.ceil(width / 5) if self.bits == "ternary" else math.ceil(width * int(self.bits) / 8)
        return body + 2

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        y = x / self.scale if self.scale is not None else x
        if self.bits == 8:
            g = _fp16(y.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
            yq = torch.round(y / g).clamp_(-127, 127) * g
        else:
            g = _fp16(y.pow(2).mean(1, keepdim=True).sqrt()).clamp(min=1e-12)
            if self.bits == "ternary":
                zq = torch.round(y / g / TERNARY_STEP).clamp_(-1, 1) * TERNARY_STEP
            else:
                zq, _ = uniform_quantize(y / g, int(self.bits))
            yq = zq * g
        out = yq * self.scale if self.scale is not None else yq
        return out, x.shape[0] * self.row_bytes(x.shape[1])


class TokenMean:
    """Per-token mean of calibration rows, shrunk towards the overall mean: p_t = (sum_t + k mu) /
    (n_t + k), so a token seen once does not bring its one context along. Unseen tokens get mu.
    Shared state: one fp16 row per seen token plus its int32 id, and the fp16 overall mean."""

    def __init__(self, shrink: float = 4.0) -> None:
        self.shrink = shrink

    def fit(self, x: Tensor, ids: Tensor) -> None:
        self.mu = _fp16(x.mean(0))
        self.uniq, inv = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(len(self.uniq), x.shape[1]).index_add_(0, inv, x)
        n = torch.zeros(len(self.uniq)).index_add_(0, inv, torch.ones(len(ids)))
        self.rows = _fp16((sums + self.shrink * self.mu) / (n[:, None] + self.shrink))
        self.shared_bytes = (self.rows.numel() + len(self.mu)) * 2 + len(self.uniq) * 4

    def __call__(self, ids: Tensor) -> Tensor:
        pos = torch.searchsorted(self.uniq, ids).clamp(max=len(self.uniq) - 1)
        hit = self.uniq[pos] == ids
        return torch.where(hit[:, None], self.rows[pos], self.mu)


class _Centered(Codec):
    """Base of the basis codecs: subtracts the overall mean or a `TokenMean` prior."""

    def __init__(self, center: str = "mean") -> None:
        if center not in ("mean", "token"):
            raise ValueError(f"center={center!r}: must be 'mean' or 'token'")
        self.center = center

    def _fit_center(self, x: Tensor, ids: Tensor, exact: bool = False) -> Tensor:
        if self.center == "token":
            self.prior = TokenMean()
            self.prior.fit(x, ids)
            self._center_bytes = self.prior.shared_bytes
        else:
            self.mu = x.mean(0) if exact else _fp16(x.mean(0))
            self._center_bytes = 2 * x.shape[1]
        return x - self._prior(ids, x.shape[0])

    def _prior(self, ids: Tensor, n: int) -> Tensor:
        return self.prior(ids) if self.center == "token" else self.mu.expand(n, -1)


def pca(x: Tensor) -> tuple[Tensor, Tensor]:
    """(eigenvalues descending, eigenvectors as columns) of the second moment of the rows of x."""
    cov = x.T.double() @ x.double() / max(1, x.shape[0])
    evals, evecs = torch.linalg.eigh(cov)
    return evals.flip(0).clamp(min=0).float(), evecs.flip(1).float()


class PCA(_Centered):
    """The top-`rank` principal directions of the calibration rows (fp16 basis, shared state);
    sends rank coefficients per token as fp16 (2 r bytes), int8 with one fp16 absmax scale per
    token (r + 2) or fp32 (4 r, lossless transport)."""

    def __init__(self, rank: int, coef: str = "fp16", center: str = "mean") -> None:
        super().__init__(center)
        if coef not in ("fp16", "int8", "fp32"):
            raise ValueError(f"coef={coef!r}: must be fp16, int8 or fp32")
        self.rank, self.coef = rank, coef

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        resid = self._fit_center(x, ids, exact=self.coef == "fp32")
        _, vecs = pca(resid)
        self.rank = min(self.rank, x.shape[1])
        self.basis = vecs[:, : self.rank] if self.coef == "fp32" else _fp16(vecs[:, : self.rank])
        self.shared_bytes = self._center_bytes + self.basis.numel() * 2

    def coef_bytes(self) -> int:
        return {"fp16": 2 * self.rank, "int8": self.rank + 2, "fp32": 4 * self.rank}[self.coef]

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        p = self._prior(ids, x.shape[0])
        c = (x - p) @ self.basis
        if self.coef == "fp16":
            c = _fp16(c)
        elif self.coef == "int8":
            g = _fp16(c.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
            c = torch.round(c / g).clamp_(-127, 127) * g
        return p + c @ self.basis.T, x.shape[0] * self.coef_bytes()


class KLT(_Centered):
    """Transform coder: rotate into the full PCA basis of the calibration rows, give each
    component a fixed number of bits by reverse water-filling (greedy: the next bit goes where it
    removes the most expected squared error, Gaussian model), quantise each component with the
    Gaussian-optimal uniform step for its bits, scaled by its calibration std and the token's gain
    (the RMS of the centred row, fp16, per token). Wire: ceil(budget / 8) + 2 bytes per token, with
    budget = round(bits_per_value * W) bits. Shared state: the H x H basis, the centre, the stds.
    `entropy_bytes`: what an entropy coder of the same symbols would need (measured on the coded
    tensor), a bound on what variable-length coding could add.

    `fisher` (a ridge, e.g. 0.1): measure the error in the metric of the loss instead of plain
    squared error. With G = E[g g^T] of the loss gradient g = dL/dh on calibration (normalised to
    mean eigenvalue 1), rows are mapped by W = (G + fisher I)^(1/2) before the KLT and back by W^-1
    after, so bits go where the next stage is sensitive. In a pipeline the sender receives dL/dh in
    every backward pass, so it can keep G itself.
    """

    def __init__(self, bits_per_value: float, center: str = "mean", max_bits: int = 8, fisher: float | None = None) -> None:
        super().__init__(center)
        self.bits_per_value, self.max_bits, self.fisher = bits_per_value, max_bits, fisher
        self.entropy_bytes: float | None = None

    @property
    def needs_grad(self) -> bool:
        return self.fisher is not None

    @staticmethod
    def allocate(var: Tensor, budget: int, max_bits: int = 8) -> Tensor:
        """Bits per component (a greedy reverse water-filling of `budget` bits over variances `var`)."""
        bits = torch.zeros(len(var), dtype=torch.long)
        mse = torch.tensor([MSE[b] for b in range(max_bits + 1)] + [MSE[max_bits]])
        for _ in range(budget):
            gain = var * (mse[bits] - mse[bits + 1])
            i = int(gain.argmax())
            if gain[i] <= 0:
                break
            bits[i] += 1
        return bits

    def _metric(self, g: Tensor | None, width: int) -> tuple[Tensor, Tensor]:
        """(W, W^-1): identity, or the square root of the ridged gradient second moment."""
        eye = torch.eye(width)
        if self.fisher is None:
            return eye, eye
        if g is None:
            raise ValueError("KLT(fisher=...) needs the calibration gradient: fit(h, ids, grad)")
        G = g.T.double() @ g.double() / len(g)
        G = G / (G.trace() / width) + self.fisher * torch.eye(width, dtype=torch.float64)
        evals, evecs = torch.linalg.eigh(G)
        root = evals.clamp(min=1e-12).sqrt()
        return (evecs * root) @ evecs.T, (evecs / root) @ evecs.T

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        resid = self._fit_center(x, ids)
        w, w_inv = self._metric(g, x.shape[1])
        z = resid / resid.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-12) @ w.float()
        var, vecs = pca(z)
        self.fwd = _fp16(w.float() @ vecs)  # sender: rows -> components
        self.inv = _fp16(vecs.T @ w_inv.float())  # receiver: components -> rows (the shipped matrix)
        self.std = _fp16(var.sqrt().clamp(min=1e-12))
        self.budget = round(self.bits_per_value * x.shape[1])
        self.bits = self.allocate(var, self.budget, self.max_bits)
        self.shared_bytes = self._center_bytes + self.inv.numel() * 2 + self.std.numel() * 2

    def row_bytes(self) -> int:
        return math.ceil(int(self.bits.sum()) / 8) + 2

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        p = self._prior(ids, x.shape[0])
        resid = x - p
        g = _fp16(resid.pow(2).mean(1, keepdim=True).sqrt()).clamp(min=1e-12)  # the token's gain
        c = (resid / g) @ self.fwd / self.std
        cq = torch.zeros_like(c)
        entropy_bits = 0.0
        for b in self.bits.unique().tolist():
            if b == 0:
                continue
            cols = (self.bits == b).nonzero().flatten()
            cq[:, cols], q = uniform_quantize(c[:, cols], b)
            for j in range(q.shape[1]):
                freq = torch.unique(q[:, j], return_counts=True)[1].float() / q.shape[0]
                entropy_bits += float(-(freq * freq.log2()).sum())
        self.entropy_bytes = entropy_bits / 8 + 2
        return p + g * ((cq * self.std) @ self.inv), x.shape[0] * self.row_bytes()


class Outliers(Codec):
    """The `k` channels of largest calibration RMS travel dense (bf16, 2 k bytes per token; their
    indices are shared state); the other channels go through `inner`."""

    def __init__(self, k: int, inner: Codec) -> None:
        self.k, self.inner = k, inner

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        rms = x.pow(2).mean(0)
        self.out = rms.topk(self.k).indices.sort().values
        self.rest = torch.tensor([c for c in range(x.shape[1]) if c not in set(self.out.tolist())], dtype=torch.long)
        self.inner._fit(x[:, self.rest], ids, None if g is None else g[:, self.rest])
        self.shared_bytes = 2 * self.k + self.inner.shared_bytes

    @property
    def needs_grad(self) -> bool:
        return self.inner.needs_grad

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        out = torch.empty_like(x)
        out[:, self.out] = x[:, self.out].bfloat16().float()
        out[:, self.rest], nbytes = self.inner._code(x[:, self.rest], ids)
        return out, nbytes + x.shape[0] * 2 * self.k


class Residual(Codec):
    """`first`, then `second` on what `first` missed (fitted on first's calibration residual); the
    bytes add up."""

    def __init__(self, first: Codec, second: Codec) -> None:
        self.first, self.second = first, second

    def _fit(self, x: Tensor, ids: Tensor, g: Tensor | None = None) -> None:
        self.first._fit(x, ids, g)
        approx, _ = self.first._code(x, ids)
        self.second._fit(x - approx, ids, g)
        self.shared_bytes = self.first.shared_bytes + self.second.shared_bytes

    @property
    def needs_grad(self) -> bool:
        return self.first.needs_grad or self.second.needs_grad

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        a, na = self.first._code(x, ids)
        b, nb = self.second._code(x - a, ids)
        return a + b, na + nb


class Sink(Codec):
    """The first `n` positions of every sequence (the attention sink, where the massive
    activations sit) travel dense in bf16 (n H 2 bytes per sequence); `inner` codes the rest and
    is fitted on non-sink positions only. Works on [B, T, H]."""

    def __init__(self, inner: Codec, n: int = SINK) -> None:
        self.inner, self.n = inner, n

    @property
    def needs_grad(self) -> bool:
        return self.inner.needs_grad

    def fit(self, h: Tensor, ids: Tensor, grad: Tensor | None = None) -> None:
        self.inner.fit(h[:, self.n :], ids[:, self.n :], None if grad is None else grad[:, self.n :])
        self.shared_bytes = self.inner.shared_bytes

    def code(self, h: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        head = h[:, : self.n].bfloat16().float()
        rest, nbytes = self.inner.code(h[:, self.n :], ids[:, self.n :])
        return torch.cat([head, rest], dim=1), nbytes + head.numel() * 2


class ProjectMask(Codec):
    """The project's element mask (peer/codec/mask.py) with one of its fills (peer/codec/fill.py),
    decoded as the runner does; the token prior is fitted densely on calibration (the best case of
    the receiver-learned TokenPrior). Bytes: the MaskCodec payload."""

    def __init__(self, drop: float, fill: str = "zero", values: str = "fp16") -> None:
        self.cfg = MaskConfig(drop=drop, fill=fill, values=values)
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
        self.coef_codec = MaskCodec(MaskConfig(values=values))
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
            self.state = BasisState(1, _fp16(mu[None]), _fp16(vecs[:, : self.rank]).contiguous(), torch.zeros(0, dtype=torch.int32), vocab)
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
        "mask_m90_token_prior": R(lambda: ProjectMask(0.90, "token_prior"), "project: M90, dropped entries from the TokenPrior (fitted densely on calibration)"),
        "mask_m90_prior_rescale": R(lambda: ProjectMask(0.90, "prior_rescale"), "project: M90, unbiased around the TokenPrior"),
        "lowrank_mean_r64": R(lambda: ProjectLowRank(64, "mean"), "project BasisState: rank 64 around the calibration mean, fp16 coefficients"),
        "lowrank_prior_r64": R(lambda: ProjectLowRank(64, "token"), "project BasisLearner: token prior + rank 64, fp16 coefficients"),
        "lowrank_prior_r128": R(lambda: ProjectLowRank(128, "token"), "project BasisLearner: token prior + rank 128, fp16 coefficients"),
        # the same project codec once the sink position travels dense and is kept out of the fit
        "sink+lowrank_prior_r128": R(lambda: Sink(ProjectLowRank(128, "token")), "project BasisLearner fitted without the sink; sink row dense bf16"),
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
        "sink+out8+pca_r128_int8": R(lambda: Sink(Outliers(8, PCA(128, "int8"))), "8 channels bf16, rank 128 int8 on the rest"),
        "sink+prior+pca_r128_int8": R(lambda: Sink(PCA(128, "int8", center="token")), "rank 128 int8 around a shrunk per-token mean"),
        # low rank + quantised residual
        "sink+pca_r64_int8+int2_ch": R(lambda: Sink(Residual(PCA(64, "int8"), Quant(2))), "rank 64 int8, then the residual 2-bit"),
        "sink+pca_r128_int8+ternary_ch": R(lambda: Sink(Residual(PCA(128, "int8"), Quant("ternary"))), "rank 128 int8, then the residual ternary"),
        # transform coding: all components, bits where the variance is
        "sink+klt_1.0b": R(lambda: Sink(KLT(1.0)), "KLT, 1.0 bit/value on average (water-filled)"),
        "sink+klt_1.5b": R(lambda: Sink(KLT(1.5)), "KLT, 1.5 bits/value"),
        "sink+klt_2.0b": R(lambda: Sink(KLT(2.0)), "KLT, 2.0 bits/value"),
        "sink+klt_2.5b": R(lambda: Sink(KLT(2.5)), "KLT, 2.5 bits/value"),
        "sink+klt_3.0b": R(lambda: Sink(KLT(3.0)), "KLT, 3.0 bits/value"),
        "sink+klt_4.0b": R(lambda: Sink(KLT(4.0)), "KLT, 4.0 bits/value"),
        "sink+prior+klt_1.5b": R(lambda: Sink(KLT(1.5, center="token")), "KLT 1.5 bits/value around a shrunk per-token mean"),
        "sink+prior+klt_2.0b": R(lambda: Sink(KLT(2.0, center="token")), "KLT 2.0 bits/value around a shrunk per-token mean"),
        "sink+prior+klt_3.0b": R(lambda: Sink(KLT(3.0, center="token")), "KLT 3.0 bits/value around a shrunk per-token mean"),
        "sink+fisher_klt_2.0b": R(lambda: Sink(KLT(2.0, fisher=0.01)), "KLT 2.0 bits/value in the loss-gradient metric (ridge 0.01)"),
        "sink+fisher_klt_2.5b": R(lambda: Sink(KLT(2.5, fisher=0.01)), "KLT 2.5 bits/value in the loss-gradient metric"),
        "sink+prior+fisher_klt_1.5b": R(lambda: Sink(KLT(1.5, center="token", fisher=0.01)), "KLT 1.5 bits/value, token prior, gradient metric"),
        "sink+prior+fisher_klt_2.0b": R(lambda: Sink(KLT(2.0, center="token", fisher=0.01)), "KLT 2.0 bits/value, token prior, gradient metric"),
        "sink+prior+fisher_klt_2.5b": R(lambda: Sink(KLT(2.5, center="token", fisher=0.01)), "KLT 2.5 bits/value, token prior, gradient metric"),
        # outlier channels dense, then the KLT on the rest (bits/value of the other W - 8 channels)
        "sink+out8+klt_2.75b": R(lambda: Sink(Outliers(8, KLT(2.75))), "8 largest-RMS channels bf16, KLT 2.75 bits/value on the rest"),
        "sink+out8+prior+klt_1.25b": R(lambda: Sink(Outliers(8, KLT(1.25, center="token"))), "8 channels bf16, KLT 1.25 bits/value around a per-token mean (>= 10x vs bf16)"),
        "sink+out8+prior+klt_2.25b": R(lambda: Sink(Outliers(8, KLT(2.25, center="token"))), "8 channels bf16, KLT 2.25 bits/value around a per-token mean"),
        "sink+out8+prior+klt_2.75b": R(lambda: Sink(Outliers(8, KLT(2.75, center="token"))), "8 channels bf16, KLT 2.75 bits/value around a per-token mean"),
        "klt_2.0b": R(lambda: KLT(2.0), "KLT 2.0 bits/value WITHOUT the sink split (fitted on all positions)"),
    }


QUICK_ROWS = ("dense_fp32", "mask_m95_zero", "lowrank_prior_r64", "sink+lowrank_prior_r128", "sink+int3_ch", "sink+pca_r64", "sink+klt_2.0b", "sink+out8+prior+klt_2.25b", "klt_2.0b")


# ---- the model, cut at the boundaries ------------------------------------------------------------


class Chain:
    """The model as StageModules cut after each boundary layer, so one pass yields every
    boundary's hidden state and a loss can resume from any boundary."""

    def __init__(self, model, boundaries: list[int]) -> None:
        n = model.config.num_hidden_layers
        if not boundaries or sorted(set(boundaries)) != list(boundaries) or boundaries[0] < 1 or boundaries[-1] >= n:
            raise ConfigError("boundaries", boundaries, f"must be increasing layer counts in [1, {n - 1}]")
        edges = [0, *boundaries, n]
        self.boundaries = list(boundaries)
        self.segments = [StageModule(model, i, edges[i], edges[i + 1], len(edges) - 1).eval() for i in range(len(edges) - 1)]

    @torch.no_grad()
    def hidden(self, ids: Tensor, batch: int = 4) -> list[Tensor]:
        """The hidden state after each boundary layer, [N, T, H] each, for token windows ids [N, T]."""
        outs: list[list[Tensor]] = [[] for _ in self.boundaries]
        for i in range(0, len(ids), batch):
            h = ids[i : i + batch]
            for j, seg in enumerate(self.segments[:-1]):
                h = seg(h)
                outs[j].append(h)
        return [torch.cat(o) for o in outs]

    @torch.no_grad()
    def loss_from(self, j: int, h: Tensor, targets: Tensor, batch: int = 2) -> float:
        """Mean next-token loss when the hidden state after boundary j is `h` [N, T, H]."""
        total = 0.0
        for i in range(0, len(h), batch):
            x = h[i : i + batch]
            for seg in self.segments[j + 1 :]:
                x = seg(x)
            total += float(lm_loss(x, targets[i : i + batch])) * len(x)
        return total / len(h)

    def grad_from(self, j: int, h: Tensor, targets: Tensor, batch: int = 1) -> Tensor:
        """dL/dh [N, T, H] of the mean next-token loss of each window w.r.t. the hidden state after
        boundary j (what the receiving stage sends back in a backward pass)."""
        grads = []
        for i in range(0, len(h), batch):
            x = h[i : i + batch].detach().clone().requires_grad_(True)
            y = x
            for seg in self.segments[j + 1 :]:
                y = seg(y)
            lm_loss(y, targets[i : i + batch]).backward()
            grads.append(x.grad)
        return torch.cat(grads)

    @torch.no_grad()
    def dense_loss(self, ids: Tensor, targets: Tensor, batch: int = 2) -> float:
        total = 0.0
        for i in range(0, len(ids), batch):
            x = ids[i : i + batch]
            for seg in self.segments:
                x = seg(x)
            total += float(lm_loss(x, targets[i : i + batch])) * len(x)
        return total / len(ids)


# ---- text ----------------------------------------------------------------------------------------


def token_ids(model: str, corpus: Path | None) -> tuple[Tensor, str, Callable[[list[int]], str]]:
    """(every token id of the corpus, where it came from, a decoder for reports). Byte ids for the
    tiny models, the model's own tokenizer otherwise; default corpus: the built-in Python one."""
    from peer.data import default_corpus, read_path

    if corpus is not None:
        data, source = read_path(corpus, name="corpus"), str(corpus)
    else:
        data, source = default_corpus("b")
    if model.startswith("tiny-"):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), source, lambda ids: bytes(ids).decode("utf-8", "replace")
    from peer.model.source import load_tokenizer

    tok = load_tokenizer(model)
    ids = torch.tensor(tok(data.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"], dtype=torch.long)
    return ids, source, lambda t: tok.decode(t)


def split_windows(ids: Tensor, seq_len: int, n_calib: int, n_eval: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping [n, seq_len + 1] windows: calibration spread over the first half of the
    corpus, eval over the second half (so no fit sees an eval token)."""
    half, w = len(ids) // 2, seq_len + 1

    def spread(part: Tensor, n: int, what: str) -> Tensor:
        slots = len(part) // w
        if slots < n:
            raise ConfigError("corpus", None, f"its {what} half holds {slots} windows of {w} tokens; need {n} (use a larger corpus or fewer tokens)")
        starts = [(k * slots // n) * w for k in range(n)]
        return torch.stack([part[s : s + w] for s in starts])

    return spread(ids[:half], n_calib, "first"), spread(ids[half:], n_eval, "second")


# ---- measurements --------------------------------------------------------------------------------


def _sig(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits (stats span 1e-3 to 1e4)."""
    return float(f"{x:.{digits}g}")


def _explained(h: Tensor, approx: Tensor) -> float:
    """1 - |h - approx|^2 / |h - mean(h)|^2 over rows [N, H]."""
    return float(1 - (h - approx).pow(2).sum() / (h - h.mean(0)).pow(2).sum())


def boundary_stats(h: Tensor, ids: Tensor, h_cal: Tensor, ids_cal: Tensor, decode: Callable[[list[int]], str] | None = None) -> dict:
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
    pca_explained = {str(r): round(_explained(rest, mu + (rest - mu) @ vecs[:, :r] @ vecs[:, :r].T), 4) for r in (16, 32, 64, 128, 256) if r <= H}
    return {
        "channel_rms_median": _sig(med_ch),
        "channel_rms_top10": [{"channel": int(c), "rms": _sig(float(v)), "x_median_channel": _sig(float(v) / med_ch, 3)} for v, c in zip(top.values, top.indices)],
        "massive": {
            "threshold_abs": _sig(MASSIVE * med_abs),
            "median_abs": _sig(med_abs),
            "max_abs": _sig(float(absx.max())),
            "max_x_median": round(float(absx.max()) / med_abs, 1),
            "count": len(big),
            "at_sink_position": at_sink,
            "elsewhere": len(elsewhere),
            "elsewhere_positions_frac": round(len({(n, t) for n, t in elsewhere[:, :2].tolist()}) / max(1, rest.shape[0]), 5),
            "channels": sorted({int(c) for c in big[:, 2].tolist()}),
            "elsewhere_tokens": [decode([t]) for t in massive_tokens[:12]] if decode else massive_tokens[:12],
        },
        "sink": {
            "energy_frac_pos0": round(float(energy[:, 0].sum() / energy.sum()), 4),
            "energy_frac_pos1_3": round(float(energy[:, 1:4].sum() / energy.sum()), 4),
            "uniform_share_per_position": round(1 / h.shape[1], 5),
            "pos0_norm_x_median_token": round(float(norms[:, 0].median() / norms[:, SINK:].median()), 1),
            "pos0_top_channels": [{"channel": int(c), "mean_abs": _sig(float(v)), "x_median_abs": _sig(float(v) / med_abs, 3)} for v, c in zip(sink_top.values, sink_top.indices)],
        },
        "token_norm_quantiles_nonsink": {q: _sig(float(v)) for q, v in zip(("p01", "p50", "p99", "max"), (*norms[:, SINK:].flatten().quantile(torch.tensor([0.01, 0.5, 0.99])).tolist(), float(norms[:, SINK:].max())))},
        "project_token_prior_variance_explained_all_positions": round(_explained(h.reshape(-1, H), prior_all.fill(ids).reshape(-1, H)), 4),
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
        row["entropy_bytes_per_token"] = round((nbytes - coded * coder.row_bytes() + coded * coder.entropy_bytes) / (h.shape[0] * h.shape[1]), 2)
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
    for flag, value, least in (("--seq-len", seq_len, 2), ("--eval-tokens", eval_tokens, 1), ("--calib-tokens", calib_tokens, 1)):
        if value < least:
            raise ConfigError(flag, value, f"must be >= {least}")
    cfg = model if isinstance(model, ModelConfig) else ModelConfig(name=model)
    if isinstance(boundaries, str):
        try:
            boundaries = [int(b) for b in boundaries.split(",") if b.strip()]
        except ValueError:
            raise ConfigError("--boundaries", boundaries, "must be comma-separated layer counts, e.g. 5,10,15") from None
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
        log.warning("boundaries at or beyond the model's %d layers dropped: %s", n_layers, [b for b in boundaries if b >= n_layers])
        boundaries = [b for b in boundaries if b < n_layers]
    chain = Chain(lm, boundaries)
    vocab, hidden = lm.config.vocab_size, lm.config.hidden_size
    del lm
    ids, source, decode = token_ids(cfg.name, Path(corpus) if corpus is not None else None)
    calib, evals = split_windows(ids, seq_len, n_calib, n_eval)
    log.info("%s: %d layers, hidden %d; %d calibration and %d eval windows of %d tokens from %s", cfg.name, n_layers, hidden, n_calib, n_eval, seq_len, source)
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
                row = {"eval_loss": round(dense, 4), "vs_dense_pct": 0.0, "bytes_per_token": 4 * hidden, "ratio_vs_fp32": 1.0, "ratio_vs_bf16": 0.5,
                       "variance_explained": 1.0, "token_rel_err": 0.0, "sink_rel_err": 0.0, "shared_bytes": 0}
            else:
                row = _measure(codec, chain, j, h_eval[j], x_eval, y_eval, dense)
            row["note"] = table[name].note
            out[name] = row
            log.info("L%d %-32s loss %.4f (%+.1f%%)  %7.1f B/token  %5.1fx fp32  ve %.3f  (%.0fs)", b, name, row["eval_loss"], row["vs_dense_pct"], row["bytes_per_token"], row["ratio_vs_fp32"], row["variance_explained"], time.monotonic() - t0)
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
