"""Config dataclasses for the training core, with defaults that run: the run.toml schema.

Every dataclass validates itself in `__post_init__` and raises `ConfigError` naming the field and
the value; nothing is silently clamped. The entry points build one `TrainConfig` (from a
run.toml or the tracker's JSON: peer/runtoml.py) and hand its parts to the components (codec,
DP sync, anchor scheduler, optimizer, runner).

One module per run.toml section, each dataclass's docstring the reference for its settings:
`model` ([model]), `codec` ([codec], `MaskConfig`), `dp`, `anchor`, `spectral`, `optim`,
`pipeline`, `data`, `checkpoint`, `security`, `compute`; `run` holds `TrainConfig` and the rules
that span sections (`check_swarm`, `LOCAL_ONLY`); `recommended` the recommended run and the tiny
models' departures from it (`TINY_RUN`). This package re-exports them all: import from
`peer.config`.
"""

from __future__ import annotations

from peer.config.anchor import AnchorConfig
from peer.config.checkpoint import CheckpointConfig
from peer.config.codec import (
    ACT_ROUNDINGS,
    ACT_STATS,
    CODEC_SETTINGS,
    CODEC_SHARED,
    GRAD_RATES,
    GRAD_ROTATIONS,
    GRAD_ROUNDINGS,
    MASK_FILLS,
    MASK_SCHEMES,
    VALUE_DTYPES,
    MaskConfig,
    codec_key,
)
from peer.config.compute import COMPUTE_DTYPES, ComputeConfig
from peer.config.data import DATA_TOKENIZERS, DataConfig
from peer.config.dp import DILOCO_COMPRESSIONS, DP_SCHEMES, DPConfig
from peer.config.model import TINY_MODEL_PREFIX, ModelConfig
from peer.config.optim import LR_SCHEDULES, OptimConfig
from peer.config.pipeline import PipelineConfig
from peer.config.recommended import TINY_RUN, is_tiny, recommended_mask, run_profile
from peer.config.run import LOCAL_ONLY, TrainConfig, check_swarm
from peer.config.security import SecurityConfig
from peer.config.spectral import SPECTRAL_MODES, SpectralConfig
from peer.errors import ConfigError

__all__ = [
    "ACT_ROUNDINGS",
    "ACT_STATS",
    "CODEC_SETTINGS",
    "CODEC_SHARED",
    "COMPUTE_DTYPES",
    "DATA_TOKENIZERS",
    "DILOCO_COMPRESSIONS",
    "DP_SCHEMES",
    "GRAD_RATES",
    "GRAD_ROTATIONS",
    "GRAD_ROUNDINGS",
    "LOCAL_ONLY",
    "LR_SCHEDULES",
    "MASK_FILLS",
    "MASK_SCHEMES",
    "SPECTRAL_MODES",
    "TINY_MODEL_PREFIX",
    "TINY_RUN",
    "VALUE_DTYPES",
    "AnchorConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DPConfig",
    "DataConfig",
    "MaskConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "SecurityConfig",
    "SpectralConfig",
    "TrainConfig",
    "check_swarm",
    "codec_key",
    "is_tiny",
    "recommended_mask",
    "run_profile",
]
