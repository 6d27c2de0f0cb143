"""What a peer's report may claim: the bounds on its step, tokens, rate and capacity that keep one
broken or lying member from ending the run or drawing all the routing, and on the length of every
text and list it declares."""

from __future__ import annotations

import logging
import math

from bootstrap.roster import LIVE, PeerRecord
from bootstrap.support import observe
from peer.capacity import MAX_CAPACITY_FACTOR, STEP_SLACK, step_ceiling
from peer.config import PipelineConfig
from peer.daemon.startup import MAX_PHASES
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.tracker")
MAX_SUSPECTS = 4  # averaging suspects (and excluded next hops) kept per peer report
MAX_TEXT = 300  # characters kept of a text a peer reports (a reason, a suspect, an excluded hop)
MAX_NAME = 32  # characters kept of a startup phase's name


def _plausible_s(seconds: float) -> bool:
    """A duration a peer reports (its startup, a phase of it): finite, not negative, under 1e7 s."""
    return math.isfinite(seconds) and 0 <= seconds < 1e7


def take_report(
    p: PeerRecord, info: pb.PeerInfo, tokens: int, now: float, pipeline: PipelineConfig, run_step: int, max_rate: float
) -> bool:
    """Take a report's step, tokens and (clipped) rates into `p`, or, when its step or tokens
    cannot be true, keep the old ones and count and log the refusal (a broken or lying member:
    its figures would end the run). Returns whether it was taken."""
    why = implausible(p, info, tokens, now, pipeline, run_step, max_rate)
    if why:
        p.refused_reports += 1
        p.last_refusal = why
        if p.refused_reports in (1, 10, 100) or p.refused_reports % 1000 == 0:
            log.warning("implausible report from %s (%d so far): %s", p.peer_id, p.refused_reports, why)
        return False
    p.step, p.tokens = info.step, tokens
    p.tokens_per_s, p.capacity = bounded_rates(info, pipeline, max_rate)
    p.accepted_at = now
    observe(p, info.step, now)
    return True


def implausible(
    p: PeerRecord, info: pb.PeerInfo, tokens: int, now: float, pipeline: PipelineConfig, run_step: int, max_rate: float
) -> str:
    """Why a report's step or tokens cannot be true, or "". Why: the run's step is the highest
    stage-0 step and its token budget sums stage-0 tokens, so one member reporting step 2^40 or
    10^12 tokens would end the run. Bounds: a step never goes back and grows at most `max_rate`
    steps/s (the rate the other members were measured at, bootstrap/support.py `rate_bound`) x
    the seconds since its last report taken as true (plus a slack; counted from that report, not
    the last one seen, so a peer that trained on while the tracker was down or refused it catches
    up instead of being refused for ever); tokens grow at most one step's tokens per step.
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
    return ""


def bounded_rates(info: pb.PeerInfo, pipeline: PipelineConfig, max_rate: float) -> tuple[float, float]:
    """(tokens/s, capacity) of a report, clipped: tokens/s to `max_rate` steps' tokens per second,
    capacity to MAX_CAPACITY_FACTOR times that (a tiny model's stage alone computes faster than
    the pipeline steps). Why clipped, not refused: both are honest far past the bound right after
    a stall (the run's measured rate is near 0 then, the stage computes as fast as ever), and a
    refused report kept the step and tokens too, so the run never saw itself move again. A liar
    gains no more than reporting the bound itself."""
    limit = max_rate * pipeline.micro_batches * pipeline.micro_batch_size * pipeline.seq_len

    def clip(x: float, hi: float) -> float:
        return min(max(x, 0.0), hi) if x == x else 0.0  # NaN: nothing

    return clip(info.tokens_per_s, limit), clip(info.capacity_tokens_per_s, MAX_CAPACITY_FACTOR * limit)


def take_fields(
    p: PeerRecord, info: pb.PeerInfo, now: float, anchors_launched: int, num_stages: int, replica_ceiling: float
) -> None:
    """Take the rest of a heartbeat's report into `p`, each text and list cut to its bound (a peer
    declares them; the status and every Directive repeat them). `replica_ceiling`: the highest
    step a replica may claim now (a newer one cannot exist)."""
    p.state = info.state if info.state in LIVE else p.state
    p.last_seen, p.loss, p.reported = now, info.loss, True
    p.bytes_in, p.bytes_out, p.queue_depth, p.reason = (
        info.bytes_in,
        info.bytes_out,
        info.queue_depth,
        info.reason[:MAX_TEXT],
    )
    p.dp_rounds, p.anchor_id, p.anchor_bytes_out = (
        info.dp_rounds,
        min(info.anchor_id, anchors_launched),
        info.anchor_bytes_out,
    )
    p.pp_state_bytes_out = min(info.pp_state_bytes_out, info.bytes_out)
    p.dp_bytes_out, p.dp_dense_bytes, p.dp_rejected = info.dp_bytes_out, info.dp_dense_bytes, info.dp_rejected
    p.eval_id, p.eval_loss, p.refused_calls = info.eval_id, info.eval_loss, info.refused_calls
    p.link_mbit, p.pp_keep, p.dp_period_s = info.link_mbit, info.pp_keep, info.dp_period_s
    p.dp_suspects = tuple(x[:MAX_TEXT] for x in info.dp_suspects[:MAX_SUSPECTS])
    p.excluding = tuple(x[:MAX_TEXT] for x in info.excluding[:MAX_SUSPECTS])
    p.refused_donors = tuple(x[:MAX_TEXT] for x in info.refused_donors[:MAX_SUSPECTS])
    p.refused_senders = tuple(x[:MAX_TEXT] for x in info.refused_senders[:MAX_SUSPECTS])
    p.dropped_steps = info.dropped_steps
    p.links_held = tuple(x[:MAX_TEXT] for x in info.links_held[:MAX_SUSPECTS])
    p.startup_s = info.startup_s if _plausible_s(info.startup_s) else 0.0
    p.startup_phases = tuple(
        (x.name[:MAX_NAME], x.seconds) for x in info.startup_phases[:MAX_PHASES] if _plausible_s(x.seconds)
    )
    # a claimed replica newer than the run is a lie: a joiner would only refuse it after the download
    ok = info.replica_stage < num_stages and info.replica_step <= replica_ceiling
    p.replica_stage, p.replica_step = (info.replica_stage, info.replica_step) if ok else (0, 0)
    p.resumed_from = info.resumed_from[:200]
