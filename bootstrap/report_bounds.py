"""What a peer's report may claim: the bounds on its step, tokens, rate and capacity that keep one
broken or lying member from ending the run or drawing all the routing."""

from __future__ import annotations

from bootstrap.roster import PeerRecord
from peer.capacity import MAX_CAPACITY_FACTOR, STEP_SLACK, step_ceiling
from peer.config import PipelineConfig
from peer.wire import anchormesh_pb2 as pb


def implausible(p: PeerRecord, info: pb.PeerInfo, tokens: int, now: float, pipeline: PipelineConfig, run_step: int, max_rate: float) -> str:
    """Why a report's step, tokens or capacity cannot be true, or "". Why: the run's step is
    the highest stage-0 step and its token budget sums stage-0 tokens, so one member reporting
    step 2^40 or 10^12 tokens would end the run, and a huge capacity draws all the routing.
    Bounds: a step never goes back and grows at most `max_rate` steps/s (the rate the other
    members were measured at, bootstrap/support.py `rate_bound`) x the seconds since its
    last report taken as true (plus a slack; counted from that report, not the last one seen,
    so a peer that trained on while the tracker was down or refused it catches up instead of
    being refused for ever); tokens grow at most one step's tokens per step; tokens/s stays
    under `max_rate` steps' tokens per second and capacity under MAX_CAPACITY_FACTOR
    times that (a tiny model's stage alone can compute faster than the pipeline steps).
    `run_step`: the run's step now (the highest stage-0 step)."""
    per_step = pipeline.micro_batches * pipeline.micro_batch_size * pipeline.seq_len
    ceiling = step_ceiling(max(p.step, p.start_step, run_step), now - (p.accepted_at or p.joined_at), max_rate)
    if info.step < p.step:
        return f"step {info.step} is below its last reported step {p.step}"
    if info.step > ceiling:
        return f"step {info.step} is over {ceiling:.0f} ({max_rate:.3g} steps/s, what the run was measured at allows, since its last report taken as true)"
    if tokens < p.tokens:
        return f"tokens {tokens} below its last report's {p.tokens}"
    if tokens - p.tokens > (info.step - p.step + STEP_SLACK) * per_step:
        return f"tokens grew by {tokens - p.tokens} over {info.step - p.step} steps of {per_step} tokens"
    rate_limit = max_rate * per_step
    if not 0 <= info.tokens_per_s <= rate_limit:
        return f"rate {info.tokens_per_s:.3g} tokens/s outside [0, {rate_limit:.3g}]"
    if not 0 <= info.capacity_tokens_per_s <= MAX_CAPACITY_FACTOR * rate_limit:
        return f"capacity {info.capacity_tokens_per_s:.3g} tokens/s outside [0, {MAX_CAPACITY_FACTOR * rate_limit:.3g}]"
    return ""
