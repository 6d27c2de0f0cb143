"""The gradients' coder (`codec.scheme = "transform"`, peer/codec/transform.py): a fixed random
rotation at `codec.transform.grad_bits` per value. Nothing about it depends on the data, so it is
made once, and its rotation is the run's (from `codec.seed`): each end of a gradient link makes
it, and the coder ships without it (its stds and bits travel: peer/codec/transform_wire.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from peer.codec.transform import GRAD_STEP_SCALE, MAX_BITS, TransformState, row_budget


def random_coder(
    hidden_size: int, budget: int, seed: int, version: int = 1, step_scale: float = GRAD_STEP_SCALE
) -> TransformState:
    """The gradients' coder: a random orthogonal rotation (QR of a seeded Gaussian matrix), no
    mean, `budget` bits spread evenly (the first components take the remainder). Its stds are
    `step_scale` for components of about unit variance: the steps widen by that much (the stds
    travel with the coder, so a receiver needs no setting of its own)."""
    H = hidden_size
    bits = torch.full((H,), max(1, budget // H), dtype=torch.long)
    bits[: max(0, budget - int(bits.sum()))] += 1
    rotation_q, scale = run_rotation(H, seed)
    return TransformState(
        version,
        torch.zeros(H),
        rotation_q,
        scale,
        torch.full((H,), float(step_scale)).half().float(),
        bits.clamp(max=MAX_BITS),
    )


@functools.lru_cache(maxsize=4)
def run_rotation(hidden_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """(int8 columns, per-column scale) of the run's fixed random rotation: the QR of a seeded
    Gaussian matrix, signs fixed (Haar-distributed), rounded as a shipped rotation is. Both ends
    of a gradient link make it from the run's codec seed instead of shipping it; made once per
    process (a QR of H x H). Read-only: every coder shares it."""
    H = hidden_size
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    rotation = (q * torch.sign(torch.diagonal(r))).float()
    scale = (rotation.abs().amax(0) / 127).clamp(min=1e-12)
    return torch.round(rotation / scale).clamp_(-127, 127).to(torch.int8), scale


class FixedCoder:
    """The gradients' producer: one `random_coder`, made at once and never refitted (nothing
    about it depends on the data), with the learner's interface."""

    def __init__(self, hidden_size: int, bits_per_value: float, seed: int, step_scale: float = GRAD_STEP_SCALE) -> None:
        self.budget = row_budget(bits_per_value, hidden_size)
        self.current = random_coder(hidden_size, self.budget, seed, step_scale=step_scale)

    def observe(self, x: Tensor, sink: int) -> None:
        pass

    def maybe_refresh(self, step: int) -> None:
        return None
