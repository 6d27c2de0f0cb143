"""Stage optimizer: anchor-prior spectral correction of masked gradients, clip, AdamW (docs/design.md)."""

from peer.optim.spectral import SpectralCorrection, paper_filter
from peer.optim.stage_optimizer import StageOptimizer

__all__ = ["SpectralCorrection", "StageOptimizer", "paper_filter"]
