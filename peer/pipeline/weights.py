"""Which weights a stage worker's forward runs on: the live ones, the mixed-precision working
copy, or a stash taken for a forward ahead of the optimizer.

A forward that runs ahead is taken on stashed weights (PipeDream-style weight stashing, so its
backward is exact for the weights it saw); with `staleness_correction="lookahead"` those weights
are extrapolated by the last update times the delay, so the stale gradient is taken near the
point where it will be applied.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from peer.model.placement import Placement
from peer.model.stages import StageModule


def swarm_stashes(stage: StageModule, max_staleness: int) -> bool:
    """Whether a swarm stage runs its forwards on a stash of its weights, so a step may land
    between a forward and its backward: a middle stage always; stage 0 when it runs ahead
    (`max_staleness` > 0: it starts the next step's micro-batches before applying the last); never
    the last stage, whose backward follows its forward at once. The memory plan counts the stashes."""
    return not stage.is_last and (not stage.is_first or max_staleness > 0)


def keeps_last_update(stage: StageModule, max_staleness: int, lookahead: bool, swarm: bool) -> bool:
    """Whether a worker keeps its last optimizer update for the look-ahead: it may run ahead
    (`max_staleness` > 0) with the correction on, and in the swarm only a stage that stashes
    (`swarm_stashes`). One fp32 copy of the stage's weights; the memory plan counts it."""
    return lookahead and max_staleness > 0 and (not swarm or swarm_stashes(stage, max_staleness))


class ForwardWeights:
    """The weights of one worker's forwards, in the compute dtype (the masters stay float32).

    Args:
        local_steps: swarm: a step is M micro-batches of any sender; middle stages run forwards
            on a stashed copy of the weights so a step may land between forward and backward.
        lookahead: extrapolate stashed weights by the last update (`last_delta`) times the delay.
        max_staleness: `pipeline.max_staleness`: with local steps, stage 0 stashes too when it
            runs ahead (`swarm_stashes`; on the live weights its optimizer step would change what
            the pending backwards need).
    """

    def __init__(
        self, stage: StageModule, placement: Placement, local_steps: bool, lookahead: bool, max_staleness: int = 0
    ) -> None:
        self.stage, self.placement, self.local_steps, self.lookahead = stage, placement, local_steps, lookahead
        self.stashes = local_steps and swarm_stashes(stage, max_staleness)
        self.max_staleness = max_staleness
        self.keeps_update = keeps_last_update(stage, max_staleness, lookahead, local_steps)
        self.last_delta: dict[str, torch.Tensor] | None = None  # the last optimizer step's update
        self.forwards_ahead = 0  # forwards that ran on stashed weights (staleness > 0)
        self._stash: tuple[int, dict[int, dict[str, torch.Tensor]]] | None = None  # swarm: (version, delay -> stash)
        self.work: dict[str, torch.Tensor] | None = None  # mixed precision: the persistent low-precision working copy
        self._work_of: tuple[int, ...] = ()  # the master weights' version counters the working copy was taken at

    def for_step(self, step: int, version: int) -> dict[str, torch.Tensor] | None:
        """None: run on the live weights. Else the low-precision working copy (mixed precision),
        or stashed (optionally look-ahead) weights, in the compute dtype, for a forward of `step`
        ahead of the optimizer (at `version`)."""
        if self.local_steps:
            if not self.stashes:
                return (
                    self.working()
                )  # stage 0 not running ahead keeps its own step order; the last stage's backward is immediate
            delay = self._swarm_delay(step, version)
            if self._stash is None or self._stash[0] != version:
                self._stash = (version, {})
            stashes = self._stash[1]
            if delay not in stashes:  # one stash per delay at this version (at most max_staleness + 1)
                stashes[delay] = self._stashed(delay)
            if step > version:
                self.forwards_ahead += 1
            return stashes[delay]
        delay = step - version
        if delay == 0:
            return self.working()
        self.forwards_ahead += 1
        return self._stashed(delay)

    def _swarm_delay(self, step: int, version: int) -> int:
        """How many of this stage's steps the swarm forward of `step` runs ahead, for the look-ahead.
        Stage 0 counts steps in its own versions, so `step - version` is exact; a middle stage's
        steps are its senders', so the look-ahead applies only while they agree within
        `max_staleness` (else a plain stash: an extrapolation by a wrong delay would add error)."""
        delay = step - version
        return delay if self.lookahead and self.last_delta is not None and 0 < delay <= self.max_staleness else 0

    def _stashed(self, delay: int) -> dict[str, torch.Tensor]:
        """A copy of the weights in the compute dtype, extrapolated by `delay` times the last
        update with the look-ahead: the stale gradient is then taken near where it is applied
        (on SmolLM2, dense training with stage 0 one step ahead: +0.40 / +0.48 % eval loss at two
        seeds with plain stashing, +0.05 / +0.10 % with the look-ahead; bench quality)."""
        out = {}
        for name, p in self.stage.named_parameters():
            w = p.detach()
            if delay and self.lookahead and self.last_delta is not None:
                w = w + delay * self.last_delta[name]
            out[name] = w.to(self.placement.compute_dtype, copy=True).requires_grad_(True)
        return out

    def before_step(self) -> None:
        """Called before an optimizer step: keep the weights, so `after_step` can take the update
        (in one persistent buffer in the master dtype, no transient copy; the memory plan counts it)."""
        if not self.keeps_update:
            return
        params = list(self.stage.named_parameters())
        if self.last_delta is None:
            self.last_delta = {n: p.detach().clone() for n, p in params}
        else:
            with torch.no_grad():
                for n, p in params:
                    self.last_delta[n].copy_(p)

    def after_step(self) -> None:
        """The update the optimizer just applied (new - old), the look-ahead's extrapolation."""
        if not self.keeps_update:
            return
        with torch.no_grad():
            for n, p in self.stage.named_parameters():
                self.last_delta[n].sub_(p).neg_()

    def working(self) -> dict[str, torch.Tensor] | None:
        """Mixed precision: one persistent low-precision copy of the master weights, refreshed in
        place whenever a master weight changed (an optimizer step, an averaging round, a loaded
        state: each bumps the tensor's version counter). None in full precision: the live weights."""
        if not self.placement.mixed:
            return None
        params = list(self.stage.named_parameters())
        versions = tuple(p._version for _, p in params)
        if self.work is None:
            self.work = {
                n: p.detach().to(self.placement.compute_dtype, copy=True).requires_grad_(True) for n, p in params
            }
        elif versions != self._work_of:
            with torch.no_grad():
                for n, p in params:
                    self.work[n].copy_(p)
        self._work_of = versions
        return self.work

    def run(self, x: torch.Tensor, stash: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The stage's forward of `x` on `stash` (None: the live weights)."""
        if stash is None:
            return self.stage(x)
        return functional_call(self.stage, stash, (x,), strict=False)
