"""The `[anchor]` section: the slow anchor circuit (docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive


@dataclass
class AnchorConfig:
    """The slow anchor circuit: unmasked forward-backward from a K-step-stale snapshot.

    Args:
        every: cadence K in steps (paper: 20); 0 disables anchors. The snapshot an anchor runs
            on is the weights of step s - K when it is launched at step s (K-step stale).
        micro_batches: micro-batches per anchor pass.
        executor: "inline" runs the pass right away in the caller's thread (deterministic,
            for tests and the quality benchmark); "thread" runs it on a background thread at
            low priority so fast steps never wait.
        with_masked: also compute the masked gradient on the anchor batch from the same
            snapshot (needed by the error-feedback correction; doubles anchor compute).
    """

    every: int = 0
    micro_batches: int = 2
    executor: str = "inline"
    with_masked: bool = True

    def __post_init__(self) -> None:
        positive("anchor.every", self.every, allow_zero=True)
        positive("anchor.micro_batches", self.micro_batches)
        choice("anchor.executor", self.executor, ("inline", "thread"))

    @property
    def enabled(self) -> bool:
        return self.every > 0
