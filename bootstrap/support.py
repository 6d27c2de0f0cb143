"""What several reports support: the run's measured step rate, and a member's step and tokens
clipped to what the other members' reports reach.

Why: the run's step (the highest stage-0 step), the token budget (the sum of stage-0 tokens),
the donor order (most-trained first) and a joiner's `start_step` all come from what members
claim. A constant bound on a claim (steps/s) lets one member report that bound: it ends a run
budgeted at an honest rate of 1 step/s a hundred times too soon and becomes every joiner's first
donor. So the bound on a report's rate comes from the rate the tracker saw the other members
step at (every stage of a pipeline steps together), and a claim no other member's report reaches
counts only as far as the others' (plus a slack for the pipeline's lag).

What stays open: members that collude report alike and support each other; a lone member of
the run (no other reports) is bounded by the constant only.
"""

from __future__ import annotations

from collections.abc import Iterable

from bootstrap.roster import PeerRecord
from peer.capacity import MAX_STEPS_PER_S, STEP_SLACK
from peer.config import PipelineConfig

RATE_WINDOW_S = 10.0  # a member's rate is measured over windows of at least this many seconds of its reports
RATE_FACTOR = 10.0  # a report may step at most this many times the median rate the others were seen at
RATE_FLOOR = 1.0  # plus this many steps/s (a run seen at rest may start again)


def observe(p: PeerRecord, step: int, now: float) -> None:
    """Called with each report taken as true: when a window has passed since the mark, the rate
    over that window becomes the member's measured rate and the window starts again."""
    if p.mark_at <= 0 or step < p.mark_step:
        p.mark_step, p.mark_at = step, now
    elif now - p.mark_at >= RATE_WINDOW_S:
        p.rate = (step - p.mark_step) / (now - p.mark_at)
        p.mark_step, p.mark_at = step, now


def _witnesses(peers: Iterable[PeerRecord], p: PeerRecord | None) -> list[PeerRecord]:
    """The serving members other than `p` that sent a report the tracker took as true."""
    return [q for q in peers if q is not p and q.state in ("active", "idle") and q.accepted_at > 0]


def rate_bound(peers: Iterable[PeerRecord], p: PeerRecord) -> float:
    """The most steps/s a report of `p` may claim: RATE_FACTOR x the median of the rates the other
    members were measured at, plus RATE_FLOOR, at most MAX_STEPS_PER_S (the bound alone while no
    other member has a measured rate: a young run, or a member alone)."""
    rates = sorted(q.rate for q in _witnesses(peers, p) if q.rate >= 0)
    if not rates:
        return MAX_STEPS_PER_S
    median = rates[len(rates) // 2] if len(rates) % 2 else (rates[len(rates) // 2 - 1] + rates[len(rates) // 2]) / 2
    return min(MAX_STEPS_PER_S, RATE_FACTOR * median + RATE_FLOOR)


class Support:
    """The reports taken as true of the serving members at tracker clock `now`: what the others'
    reports reach, for each member (the two highest suffice, so the run's step stays linear). A
    report is as old as its heartbeat: its step is carried forward at the rate the tracker measured
    that member at, so a fast run's lagging reports do not hold back the honest."""

    def __init__(self, peers: Iterable[PeerRecord], now: float) -> None:
        self.peers = list(peers)
        reach = [(q.step + max(q.rate, 0.0) * max(now - q.accepted_at, 0.0), q) for q in _witnesses(self.peers, None)]
        self.top = sorted(reach, key=lambda x: -x[0])[:2]

    def others_step(self, p: PeerRecord) -> int | None:
        """The highest step another member's report reaches now (None when no other member reported)."""
        rest = [int(s) for s, q in self.top if q is not p]
        return rest[0] if rest else None

    def step(self, p: PeerRecord, slack: int = STEP_SLACK) -> int:
        """`p`'s step as far as the others' reports support it: at most their highest plus `slack`."""
        top = self.others_step(p)
        return p.step if top is None else min(p.step, top + slack)

    def tokens(self, p: PeerRecord, per_step: int) -> int:
        """`p`'s tokens as far as its supported step allows: one step's tokens per step since it
        joined, plus the slack."""
        return min(p.tokens, max(self.step(p) - p.start_step + STEP_SLACK, 0) * per_step)

    def run_step(self) -> int:
        """The run's step: the highest supported stage-0 step. Each record keeps the highest it
        was supported at, so a supporting member that leaves never takes the run's step back."""
        for q in self.peers:
            if q.stage == 0:
                q.supported_step = max(q.supported_step, self.step(q))
        return max((q.supported_step for q in self.peers if q.stage == 0), default=0)

    def stage0_tokens(self, pipeline: PipelineConfig) -> int:
        """The run's tokens (what the budget counts): the supported tokens of stage 0's members
        (kept per record, as the step)."""
        per_step = pipeline.micro_batches * pipeline.micro_batch_size * pipeline.seq_len
        for q in self.peers:
            if q.stage == 0:
                q.supported_tokens = max(q.supported_tokens, self.tokens(q, per_step))
        return sum(q.supported_tokens for q in self.peers if q.stage == 0)

    def donor_order(self, serving: Iterable[PeerRecord]) -> list[PeerRecord]:
        """`serving` most-trained first by the step the others' reports support (no slack: a claim
        above every other member's ties with the best of them, and goes after it), then by id."""

        def key(q: PeerRecord) -> tuple[int, int, str]:
            s = self.step(q, slack=0)
            return (-s, q.step - s, q.peer_id)

        return sorted(serving, key=key)


def restore_step(peers: Iterable[PeerRecord], holder: PeerRecord, stage: int) -> int:
    """The step of `holder`'s replica of `stage` that the tracker's own records support: 0 unless the
    tracker told it to copy `stage` (a replica nobody asked for is a claim with no evidence), at
    most the step its source was at when last told plus the slack, and at most the highest step
    a member of `stage` was ever taken at plus the slack."""
    if holder.replica_stage != stage or holder.copy_stage != stage or holder.copy_step <= 0:
        return 0
    reached = max((q.step for q in peers if q.stage == stage), default=0)
    return min(holder.replica_step, holder.copy_step + STEP_SLACK, reached + STEP_SLACK)


def restore_choice(
    peers: Iterable[PeerRecord], serving: Iterable[PeerRecord], stage: int
) -> tuple[PeerRecord, int] | None:
    """The serving holder of the newest replica of `stage` by `restore_step`, and that step (None: no holder)."""
    peers = list(peers)
    scored = [(restore_step(peers, q, stage), q.peer_id, q) for q in serving]
    best = max((x for x in scored if x[0] > 0), key=lambda x: x[:2], default=None)
    return None if best is None else (best[2], best[0])
