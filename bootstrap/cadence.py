"""Anchor and evaluation passes: the tracker launches one every `every` run steps, handing it to
the next stage-0 peer that reports once it is due."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Cadence:
    """Jobs the tracker hands to stage 0 every `every` run steps (anchor or evaluation passes).

    Ids count from 1 in launch order; `launched_at` maps an id to the run step it was launched at."""

    every: int
    next_at: int = 0
    launched: int = 0
    launched_at: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.next_at = self.every  # the first at step `every`, as in the local runner

    def due(self, run_step: int) -> int:
        """A new job id when one is due at `run_step` (and record it), else 0."""
        if not self.every or run_step < self.next_at:
            return 0
        self.launched += 1
        self.launched_at[self.launched] = run_step
        self.next_at = run_step + self.every
        return self.launched
