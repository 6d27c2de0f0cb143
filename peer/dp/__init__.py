"""Compressed data-parallel sync inside one stage group (docs/design.md, "Averaging inside a stage group").

`build_dp_sync(cfg, shapes)` returns the `DPSync` for `cfg.scheme`; see each class's docstring
for what to tune and what it costs. Bytes are counted as the raw payload buffers one replica
uploads (see `peer.dp.base`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer.config import DPConfig
from peer.dp.base import DPSync, MeanSync, Reduction, mean_of_payloads, payload_bytes
from peer.dp.dense import DenseSync
from peer.dp.diloco import DiLoCoSync
from peer.dp.int8 import Int8Sync
from peer.dp.powersgd import PowerSGDSync

SCHEMES: dict[str, type[DPSync]] = {
    DenseSync.scheme: DenseSync,
    PowerSGDSync.scheme: PowerSGDSync,
    Int8Sync.scheme: Int8Sync,
    DiLoCoSync.scheme: DiLoCoSync,
}


def build_dp_sync(cfg: DPConfig, shapes: Sequence[torch.Size]) -> DPSync:
    """The DP sync for `cfg.scheme` over parameters of `shapes` (in order); validates against them."""
    return SCHEMES[cfg.scheme](cfg, [torch.Size(s) for s in shapes])


__all__ = [
    "SCHEMES",
    "DPSync",
    "DenseSync",
    "DiLoCoSync",
    "Int8Sync",
    "MeanSync",
    "PowerSGDSync",
    "Reduction",
    "build_dp_sync",
    "mean_of_payloads",
    "payload_bytes",
]
