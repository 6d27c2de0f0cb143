"""The recommended run: the dataclasses' defaults, and where the tiny built-in models depart from them.

Apart from the sections because it spans several of them (`TINY_RUN` names settings of
`[model]`, `[codec]`, `[dp]` and `[optim]`) and is read by the entry points that build a run.
"""

from __future__ import annotations

from peer.config.codec import MaskConfig
from peer.config.model import TINY_MODEL_PREFIX

# The recommended run is the dataclasses' defaults: what `bench quality` measured best on a real
# model (SmolLM2-135M): the transform codec (2-bit activations with each message's own
# statistics, 1-bit dithered gradients, the massive activations' gradient rows dense), stage 0
# one step ahead on look-ahead weights, anchors and the spectral filter off (every anchor use
# measured so far cost loss), AdamW at lr 1e-4, stage groups averaging 8-bit deltas every 10
# steps. A run.toml that names only its model runs exactly that (`anchormesh config show`).
#
# The tiny built-in models (byte vocabulary, 4 layers of width 128: the demo and most tests)
# depart from it only here, each for a reason measured on them; a run.toml's values still win.
TINY_RUN: dict[str, dict[str, object]] = {
    "model": {"max_seq_len": 128},
    # 2-bit gradients rounded stochastically at twice the Gaussian-optimal step, the coder's own
    # statistics, every gradient row coded: on the byte-level toy 1-bit gradients cost +7.8 %
    # against +1.8 %, and it has no massive activations to send dense
    "mask": {
        "grad_bits": 2.0,
        "grad_rounding": "stochastic",
        "grad_step_scale": 2.0,
        "act_stats": "coder",
        "grad_outliers": 0.0,
    },
    # fp32 parameters: 8-bit deltas showed a +9 % eval-loss gap on the toy at a 5-step cadence
    "dp": {"outer_compression": "none"},
    # a randomly initialised toy learns from scratch: a pretraining lr, not an adaptation one
    "optim": {"lr": 2e-3},
}


def is_tiny(model_name: str) -> bool:
    """A model built from a config (peer/model/loading.py), not loaded: it runs `TINY_RUN`."""
    return model_name.startswith(TINY_MODEL_PREFIX)


def run_profile(model_name: str) -> dict[str, dict[str, object]]:
    """The settings in which the run for `model_name` departs from the dataclasses' defaults."""
    return TINY_RUN if is_tiny(model_name) else {}


def recommended_mask(model_name: str) -> MaskConfig:
    """The recommended run's PP codec for `model_name` (the tiny models: `TINY_RUN`'s)."""
    return MaskConfig(**run_profile(model_name).get("mask", {}))
