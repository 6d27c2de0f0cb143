"""The candidate codecs of `bench boundary` (peer/bench/boundary.py), written here as small
codecs: fit on calibration rows, then encode+decode a tensor and count its wire bytes. Per-token
quantisers, PCA bases, a KLT transform coder, outlier channels, residual combinations and the
sink split; the Gaussian quantiser tables they share."""

from __future__ import annotations

import math

import torch
from torch import Tensor

SINK = 1  # leading positions of each sequence that the sink-aware codecs send dense (bf16)

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
        self._fit(
            h.reshape(-1, h.shape[-1]), ids.reshape(-1), None if grad is None else grad.reshape(-1, grad.shape[-1])
        )

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


def to_fp16(x: Tensor) -> Tensor:
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
            self.scale = to_fp16(x.pow(2).mean(0).sqrt().clamp(min=1e-6))
            self.shared_bytes = 2 * x.shape[1]

    def row_bytes(self, width: int) -> int:
        body = math.ceil(width / 5) if self.bits == "ternary" else math.ceil(width * int(self.bits) / 8)
        return body + 2

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        y = x / self.scale if self.scale is not None else x
        if self.bits == 8:
            g = to_fp16(y.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
            yq = torch.round(y / g).clamp_(-127, 127) * g
        else:
            g = to_fp16(y.pow(2).mean(1, keepdim=True).sqrt()).clamp(min=1e-12)
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
        self.mu = to_fp16(x.mean(0))
        self.uniq, inv = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(len(self.uniq), x.shape[1]).index_add_(0, inv, x)
        n = torch.zeros(len(self.uniq)).index_add_(0, inv, torch.ones(len(ids)))
        self.rows = to_fp16((sums + self.shrink * self.mu) / (n[:, None] + self.shrink))
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
            self.mu = x.mean(0) if exact else to_fp16(x.mean(0))
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
        self.basis = vecs[:, : self.rank] if self.coef == "fp32" else to_fp16(vecs[:, : self.rank])
        self.shared_bytes = self._center_bytes + self.basis.numel() * 2

    def coef_bytes(self) -> int:
        return {"fp16": 2 * self.rank, "int8": self.rank + 2, "fp32": 4 * self.rank}[self.coef]

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        p = self._prior(ids, x.shape[0])
        c = (x - p) @ self.basis
        if self.coef == "fp16":
            c = to_fp16(c)
        elif self.coef == "int8":
            g = to_fp16(c.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
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

    def __init__(
        self, bits_per_value: float, center: str = "mean", max_bits: int = 8, fisher: float | None = None
    ) -> None:
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
        self.fwd = to_fp16(w.float() @ vecs)  # sender: rows -> components
        self.inv = to_fp16(vecs.T @ w_inv.float())  # receiver: components -> rows (the shipped matrix)
        self.std = to_fp16(var.sqrt().clamp(min=1e-12))
        self.budget = round(self.bits_per_value * x.shape[1])
        self.bits = self.allocate(var, self.budget, self.max_bits)
        self.shared_bytes = self._center_bytes + self.inv.numel() * 2 + self.std.numel() * 2

    def row_bytes(self) -> int:
        return math.ceil(int(self.bits.sum()) / 8) + 2

    def _code(self, x: Tensor, ids: Tensor) -> tuple[Tensor, float]:
        p = self._prior(ids, x.shape[0])
        resid = x - p
        g = to_fp16(resid.pow(2).mean(1, keepdim=True).sqrt()).clamp(min=1e-12)  # the token's gain
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
