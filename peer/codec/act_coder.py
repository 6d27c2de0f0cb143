"""The activations' coder (`codec.scheme = "transform"`, peer/codec/transform.py): the KLT of a
producer's recent outputs, refitted as they drift. Why a module of its own: the coder's format
and its encode/decode are the transform module's; what data a coder is fitted on, how its bits
are spread and when it is refitted is the producer's side only (the gradients' counterpart is
peer/codec/grad_coder.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from peer.codec.transform import TransformState, allocate, row_budget

BUFFER_ROWS_PER_H = 4  # a learner keeps its newest 4 H rows: a covariance of H dimensions wants several times H samples


def _state(version: int, mean: Tensor, rotation: Tensor, std: Tensor, bits: Tensor) -> TransformState:
    """A coder with its rotation rounded to int8 per column and its std to fp16, as they travel."""
    rotation = rotation.float()
    scale = (rotation.abs().amax(0) / 127).clamp(min=1e-12)
    rotation_q = torch.round(rotation / scale).clamp_(-127, 127).to(torch.int8)
    return TransformState(version, mean.float(), rotation_q, scale, std.clamp(min=1e-6).half().float(), bits)


def fit(rows: Tensor, budget: int, version: int) -> TransformState:
    """The activations' coder for `rows` [N, H]: centre, per-row gain normalisation, PCA, bits
    by reverse water-filling, at least one per component (a budget of at least H bits)."""
    H = rows.shape[1]
    rows = rows.double()
    mean = rows.mean(0)
    resid = rows - mean
    z = resid / resid.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
    var, vecs = torch.linalg.eigh(z.T @ z / len(z))
    var, vecs = var.flip(0).clamp(min=0), vecs.flip(1)
    return _state(version, mean, vecs, var.sqrt(), allocate(var, max(budget, H), min_bits=1))


class TransformLearner:
    """The activations' producer: keeps its recent rows (sink positions excluded) and fits a new
    `TransformState` every `refresh` steps. The first fit comes as soon as `min_rows` rows were
    seen (H / 4: usually the first micro-batch; until then the tensor travels dense), a second
    one when the buffer first holds `2 H` rows (the first saw too few rows to span every
    direction), then one per `refresh` steps."""

    def __init__(
        self,
        hidden_size: int,
        bits_per_value: float,
        refresh: int,
        *,
        buffer_rows: int | None = None,
        min_rows: int | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.budget = row_budget(bits_per_value, hidden_size)
        self.refresh = refresh
        self.min_rows = min_rows or max(1, hidden_size // 4)
        self.full_rows = 2 * hidden_size
        self._fitted_full = False
        self.buffer_rows = buffer_rows or BUFFER_ROWS_PER_H * hidden_size
        self.rows: list[Tensor] = []
        self.current: TransformState | None = None
        self._last_fit: int | None = None

    def observe(self, x: Tensor, sink: int) -> None:
        rows = x.detach()[:, min(sink, x.shape[1]) :].reshape(-1, x.shape[-1]).float()
        self.rows.append(rows)
        total = sum(len(r) for r in self.rows)
        while len(self.rows) > 1 and total - len(self.rows[0]) >= self.buffer_rows:
            total -= len(self.rows.pop(0))

    def maybe_refresh(self, step: int) -> TransformState | None:
        """A new state when due and enough rows were seen (returned: the caller ships it)."""
        rows = sum(len(r) for r in self.rows)
        early = self.current is not None and not self._fitted_full and rows >= self.full_rows
        if not early and self._last_fit is not None and step - self._last_fit < self.refresh:
            return None
        if rows < self.min_rows:
            return None
        self.current = fit(torch.cat(self.rows), self.budget, 1 if self.current is None else self.current.version + 1)
        self._fitted_full = self._fitted_full or rows >= self.full_rows
        self._last_fit = step
        return self.current
