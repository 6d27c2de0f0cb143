"""The `[compute]` section: how each peer computes its stage (precision, memory)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive
from peer.errors import ConfigError

COMPUTE_DTYPES = ("auto", "fp32", "bf16")


@dataclass
class ComputeConfig:
    """How each peer computes its stage (peer/model/placement.py); the device itself is per peer
    (`anchormesh peer --device`).

    Args:
        dtype: the layers' compute precision: "fp32", "bf16" (fp32 master weights and AdamW
            state, one persistent bf16 working copy; GPUs since Ampere, and CPUs) or "auto"
            (bf16 on a CUDA device that supports it, else fp32). "fp16" is refused with the
            reason: it needs a loss scaler shared by every stage, which is not built. Link tensors travel as `mask.values` whatever this is, so
            peers of one run may compute in different precisions.
        activation_checkpointing: recompute each decoder layer's activations in the backward
            instead of keeping them (about a third more compute, a fraction of the memory).
        memory_budget_gib: the most memory a peer may plan its stage for; 0 = what the device
            has free when the peer starts. A stage whose plan exceeds it is refused before
            anything loads (peer/daemon/memory.py).
        anchor_snapshot_share: the share of the memory left after the plan that anchor weight
            snapshots (bf16) may take; the number of snapshots kept follows from it.
    """

    dtype: str = "auto"
    activation_checkpointing: bool = False
    memory_budget_gib: float = 0.0
    anchor_snapshot_share: float = 0.25

    def __post_init__(self) -> None:
        if self.dtype == "fp16":  # named apart: a user coming from AMP expects it
            raise ConfigError(
                "compute.dtype",
                "fp16",
                "fp16 needs a loss scaler shared by every pipeline stage, which is not built; use bf16 (GPUs since Ampere, and CPUs) or fp32",
            )
        choice("compute.dtype", self.dtype, COMPUTE_DTYPES)
        positive("compute.memory_budget_gib", self.memory_budget_gib, allow_zero=True)
        if not (0.0 <= self.anchor_snapshot_share <= 1.0):
            raise ConfigError("compute.anchor_snapshot_share", self.anchor_snapshot_share, "must be in [0, 1]")
