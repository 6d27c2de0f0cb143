"""The `[optim]` section: AdamW and its learning-rate schedule (peer/optim/)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive
from peer.errors import ConfigError

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class OptimConfig:
    """AdamW after the correction, with an lr schedule (peer/optim/schedule.py).

    Args:
        lr: the peak learning rate.
        schedule: "constant", or "cosine" / "linear" decay from `lr` to `min_lr_ratio * lr` over
            `decay_steps` steps (held there after). Why: adaptation runs of a known length
            usually end on a decayed lr. (On `bench quality --quick`'s 40 steps it neither helped
            dense nor shrank the compressed rows' gap.)
        warmup_steps: linear warmup from lr / warmup_steps to `lr` over the first steps.
        decay_steps: the horizon of a decaying schedule, counted from step 0 (warmup included); a
            swarm runs until stopped, so a decaying schedule needs it said.
        min_lr_ratio: where the decay ends, as a fraction of `lr`.
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        positive("optim.lr", self.lr)
        choice("optim.schedule", self.schedule, LR_SCHEDULES)
        positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        positive("optim.decay_steps", self.decay_steps, allow_zero=True)
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError("optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.schedule != "constant" and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                "optim.decay_steps",
                self.decay_steps,
                f"must exceed optim.warmup_steps ({self.warmup_steps}) with optim.schedule={self.schedule!r}: the steps over which lr falls to min_lr_ratio * lr (a swarm runs until stopped, so its horizon must be said)",
            )
        positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not (0.0 <= getattr(self, name) < 1.0):
                raise ConfigError(f"optim.{name}", getattr(self, name), "must be in [0, 1)")
