"""The run's status as data: `status_dict` (the JSON of `anchormesh status --json`,
docs/status.md) and the small table cells both the plain table (status.py) and the dashboard draw. No I/O,
so the tracker's /metrics endpoint, the CLI and the dashboard share one view without a cycle."""

from __future__ import annotations

import math

from peer.wire import anchormesh_pb2 as pb


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def status_dict(s: pb.RunStatus) -> dict:
    """The documented JSON schema (docs/status.md)."""
    return {
        "run_id": s.run_id,
        "config_digest": s.config_digest,
        "wire_version": s.wire_version,
        "state": s.state,
        "reason": s.reason,
        "step": s.step,
        "tokens": s.tokens,
        "loss": _num(s.loss),
        "eval_loss": _num(s.eval_loss),
        "eval_step": s.eval_step if s.eval_step >= 0 else None,
        "tokens_per_s": s.tokens_per_s,
        "pp_bytes_per_token": s.pp_bytes_per_token,
        "pp_state_bytes_per_token": s.pp_state_bytes_per_token,
        "pp_compression": s.pp_compression,
        "uptime_s": s.uptime_s,
        "dht_maddrs": list(s.dht_maddrs),
        "anchor_step": s.anchor_step if s.anchor_step >= 0 else None,
        "anchor_age_steps": s.anchor_age_steps if s.anchor_age_steps >= 0 else None,
        "anchors_launched": s.anchors_launched,
        "anchor_bytes_per_token": s.anchor_bytes_per_token,
        "stage_moves": s.stage_moves,
        "dp_bytes_per_token": s.dp_bytes_per_token,
        "dp_compression": s.dp_compression,
        "refused_calls": s.refused_calls,
        "banned": s.banned,
        "unfit": list(s.unfit),
        "data": data_dict(s.data) if s.HasField("data") else None,
        "model": {
            "name": s.model.name,
            "num_layers": s.model.num_layers,
            "hidden_size": s.model.hidden_size,
            "num_stages": s.model.num_stages,
            "tokenizer": s.model.tokenizer,
        },
        "stages": [
            {
                "index": st.index,
                "peers": st.peers,
                "tokens_per_s": st.tokens_per_s,
                "queue_depth": st.queue_depth,
                "capacity_tokens_per_s": st.capacity_tokens_per_s,
                "averaging": averaging_cell(st.peers),
            }
            for st in s.stages
        ],
        "peers": [
            {
                "id": p.peer_id,
                "stage": p.stage,
                "state": p.state,
                "address": p.address,
                "last_seen_s": p.last_seen_s,
                "tokens_per_s": p.tokens_per_s,
                "step": p.step,
                "loss": _num(p.loss),
                "bytes_in": p.bytes_in,
                "bytes_out": p.bytes_out,
                "queue_depth": p.queue_depth,
                "dp_rounds": p.dp_rounds,
                "reason": p.reason,
                "anchor_id": p.anchor_id or None,
                "eval_id": p.eval_id or None,
                "eval_loss": _num(p.eval_loss) if p.eval_id else None,
                "anchor_bytes_out": p.anchor_bytes_out,
                "pp_state_bytes_out": p.pp_state_bytes_out,
                "capacity_tokens_per_s": p.capacity_tokens_per_s,
                "dp_bytes_out": p.dp_bytes_out,
                "dp_rejected": p.dp_rejected,
                "refused_calls": p.refused_calls,
                "key": p.key_fingerprint or None,
                "dp_suspects": list(p.dp_suspects),
                "dp_flagged": p.dp_flagged,
                "refused_donors": list(p.refused_donors),
                "donor_flagged": p.donor_flagged,
                "refused_senders": list(p.refused_senders),
                "dropped_steps": p.dropped_steps,
                "links_held": list(p.links_held),
                "link_mbit": p.link_mbit or None,
                "pp_keep": p.pp_keep or None,
                "dp_period_s": p.dp_period_s or None,
                "device": p.device or None,
                "build": p.build or None,
                "memory_bytes": p.memory_bytes or None,
                "memory_plan_bytes": p.memory_plan_bytes or None,
                "refused_reports": p.refused_reports,
                "excluding": list(p.excluding),
                "startup_s": round(p.startup_s, 1) or None,
                "startup_phases": {x.name: round(x.seconds, 2) for x in p.startup_phases} or None,
                "resumed_from": p.resumed_from or None,
                "replica": {"stage": p.replica_stage, "step": p.replica_step} if p.replica_step else None,
            }
            for p in s.peers
        ],
    }


def data_dict(d: pb.DataStatus) -> dict:
    return {
        "source": d.source,
        "epoch": d.epoch,
        "windows": d.windows,
        "position": d.position,
        "done": d.done,
        "tokens_seen": d.tokens_seen,
        "in_flight": d.in_flight,
        "returned": d.returned,
        "eval_windows": d.eval_windows,
    }


def data_cell(d: pb.DataStatus) -> str:
    """ "epoch 0, window 1,234 of 60,000 (2.1 %), 39,488 tokens seen, 64 in flight": where the run is in its data."""
    share = 100.0 * d.position / d.windows if d.windows else 0.0
    back = f", {d.returned:,} given back" if d.returned else ""
    return f"epoch {d.epoch}, window {d.position:,} of {d.windows:,} ({share:.1f} %), {d.tokens_seen:,} tokens seen, {d.in_flight:,} in flight{back}"


def model_cell(m: pb.ModelInfo) -> str:
    """ "smollm2-135m: 30 layers, hidden 576, 2 stages, tokenizer model": what is trained, at a glance."""
    return f"{m.name or '?'}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_stages} stages, tokenizer {m.tokenizer or '?'}"


def averaging_cell(peers: int) -> str:
    """How far a stage group's averaging resists a hostile member (peer/dp/robust.py): a pair
    has nothing to outvote it with, so only the audit and drift checks guard it."""
    if peers < 2:
        return "none (alone)"
    if peers == 2:
        return "pair: audit and drift checks only"
    return f"trimmed mean of {peers}"


def link_cell(mbit: float | None, keep: float | None) -> str:
    """A peer's slowest measured pipeline link and the share of the codec's payload it sends there."""
    if not mbit:
        return "—"
    return f"{mbit:,.3g}M" + (f" {keep:.0%}" if keep else "")


def dp_cell(rounds: int, period_s: float | None) -> str:
    """Averaging rounds done, and the slot period it offers them at."""
    return f"{rounds}" + (f"/{period_s:.0f}s" if period_s else "")


def finite(x: object) -> float | None:
    """A status figure as a float, or None when absent or not finite (JSON carries NaN as null)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def duration(seconds: float) -> str:
    """1h02m03s, 2m03s or 3s: uptimes and ages as people read them."""
    s = int(seconds)
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"
