"""The `[pipeline]` section: micro-batching and asynchrony of the fast circuit."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive


@dataclass
class PipelineConfig:
    """Micro-batching and asynchrony of the fast circuit.

    Args:
        micro_batch_size: sequences per micro-batch.
        micro_batches: micro-batches per optimizer step (per replica).
        seq_len: tokens per sequence.
        max_staleness: how many steps a stage may run ahead of the gradients it has applied
            (0 = every forward sees the newest weights, equal to synchronous training).
        staleness_correction: "none" or "lookahead" (forward on weights extrapolated by the
            last update times the delay, so stale gradients are taken near where they apply).
        eval_every: swarm only: run steps between held-out evaluation passes (dense, forward
            only, the same windows each time); 0 disables them.
        eval_batches: micro-batches of held-out windows per evaluation pass.
    """

    micro_batch_size: int = 8
    micro_batches: int = 2
    seq_len: int = 128
    max_staleness: int = 1
    staleness_correction: str = "lookahead"
    eval_every: int = 50
    eval_batches: int = 4

    def __post_init__(self) -> None:
        positive("pipeline.eval_every", self.eval_every, allow_zero=True)
        for name in ("micro_batch_size", "micro_batches", "seq_len", "eval_batches"):
            positive(f"pipeline.{name}", getattr(self, name))
        positive("pipeline.max_staleness", self.max_staleness, allow_zero=True)
        choice("pipeline.staleness_correction", self.staleness_correction, ("none", "lookahead"))
