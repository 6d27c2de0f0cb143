"""The learning rate of each step: warmup, then constant or a cosine / linear decay.

Why a schedule: an adaptation run of known length usually ends on a decayed lr, which averages
out the last steps' gradient noise instead of leaving it in the weights. Measured on the quick
quality bench (40 steps, `--schedule cosine`) it did not help: too short a run.
"""

from __future__ import annotations

import math

from peer.config import OptimConfig


def lr_at(optim: OptimConfig, step: int) -> float:
    """The lr of optimizer step `step` (0-based): linear warmup to `optim.lr` over
    `warmup_steps`, then `schedule` down to `min_lr_ratio * lr` at `decay_steps`, held after."""
    scale = 1.0
    if step < optim.warmup_steps:
        scale = (step + 1) / optim.warmup_steps
    elif optim.schedule != "constant":
        t = min(1.0, (step - optim.warmup_steps) / (optim.decay_steps - optim.warmup_steps))
        fall = 0.5 * (1.0 + math.cos(math.pi * t)) if optim.schedule == "cosine" else 1.0 - t
        scale = optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * fall
    return optim.lr * scale
