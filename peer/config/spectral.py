"""The `[spectral]` section: the spectral correction of masked gradients with anchor priors."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive
from peer.errors import ConfigError

SPECTRAL_MODES = ("off", "paper", "ef", "paper_ef")


@dataclass
class SpectralConfig:
    """Spectral correction of masked gradients with anchor priors (docs/design.md).

    Args:
        mode: "off" (plain AdamW), "paper" (two-sided Tikhonov filter in the anchor EMA's
            singular basis, blended with alpha), "ef" (delayed error feedback:
            G + lam * (M - M_masked), the anchor's estimate of what the mask removes),
            "paper_ef" (the filter, then the error feedback).
        beta: EMA momentum of the anchor gradient M (paper 0.95).
        alpha: weight of the raw masked gradient in the blend (paper 0.3).
        tau: Tikhonov constant of the weights d_i = s_i / (s_i + tau) (paper 1e-3).
        rank: keep the top-`rank` singular triplets of M; 0 keeps the full thin SVD (paper).
        ef_lambda: weight of the error-feedback term.
    """

    mode: str = "off"
    beta: float = 0.95
    alpha: float = 0.3
    tau: float = 1e-3
    rank: int = 0
    ef_lambda: float = 1.0

    def __post_init__(self) -> None:
        choice("spectral.mode", self.mode, SPECTRAL_MODES)
        if not (0.0 <= self.beta < 1.0):
            raise ConfigError("spectral.beta", self.beta, "must be in [0, 1)")
        if not (0.0 <= self.alpha <= 1.0):
            raise ConfigError("spectral.alpha", self.alpha, "must be in [0, 1]")
        positive("spectral.tau", self.tau)
        positive("spectral.rank", self.rank, allow_zero=True)
        positive("spectral.ef_lambda", self.ef_lambda, allow_zero=True)
