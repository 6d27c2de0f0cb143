"""The run's status report, built from a tracker's records.

Apart from the tracker (bootstrap/tracker.py) because it only reads: sums and views over the
roster for `anchormesh status`, the dashboard and /metrics; the tracker's decisions do not use it.
"""

from __future__ import annotations

import math

from bootstrap.peer_view import peer_info, suspects
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import wire_version


def run_status(t) -> pb.RunStatus:
    """The run as `anchormesh status` shows it: per-stage peers and throughput, loss, bytes per
    token by kind, anchors, evaluations, the roster. The caller holds the tracker's lock and has
    expired the silent peers (Tracker.status).

    Args:
        t: the bootstrap.tracker.Tracker (not imported: the tracker imports this module).
    """
    K = t.config.model.num_stages
    stages = []
    scores = t.scores()
    for s in range(K):
        up = t.live(s)
        stages.append(
            pb.StageStatus(
                index=s,
                peers=len(up),
                tokens_per_s=sum(p.tokens_per_s for p in up),
                queue_depth=sum(p.queue_depth for p in up),
                capacity_tokens_per_s=scores[s],
            )
        )
    first, last = t.live(0), t.live(K - 1)
    tokens = t._tokens()
    losses = [p.loss for p in last if not math.isnan(p.loss)]
    step = t._run_step()
    anchor_bytes = sum(p.anchor_bytes_out for p in t.peers.values())
    dp_bytes = sum(p.dp_bytes_out for p in t.peers.values())
    newest_eval = max((p for p in t.peers.values() if p.eval_id), key=lambda p: p.eval_id, default=None)
    pp_bytes = sum(p.bytes_out for p in t.peers.values()) - anchor_bytes
    newest = max((p.anchor_id for p in t.peers.values()), default=0)
    anchor_step = t.anchors.launched_at.get(newest, -1)
    missing = [s for s in range(K) if not t.live(s)]
    named = suspects(t.peers.values())
    state, reason = "running", ""
    if t._budget_spent():
        state, reason = "done", f"token budget of {t.config.token_budget} tokens spent"
    elif missing:
        state, reason = "paused", "no live peer for stage " + ", ".join(map(str, missing))
    pp_bpt = pp_bytes / tokens if tokens else 0.0
    state_bpt = sum(p.pp_state_bytes_out for p in t.peers.values()) / tokens if tokens else 0.0
    dense = 2 * 2 * t.config.model.hidden_size * (K - 1)
    return pb.RunStatus(
        run_id=t.run_id,
        step=step,
        tokens=tokens,
        loss=sum(losses) / len(losses) if losses else math.nan,
        tokens_per_s=sum(p.tokens_per_s for p in first),
        pp_bytes_per_token=pp_bpt,
        pp_state_bytes_per_token=state_bpt,
        pp_compression=dense / pp_bpt if pp_bpt else 0.0,
        uptime_s=t.clock() - t.started,
        state=state,
        reason=reason,
        stages=stages,
        peers=[peer_info(p, t.clock(), named) for p in sorted(t.peers.values(), key=lambda p: (p.stage, p.peer_id))],
        dht_maddrs=t.dht_maddrs,
        anchor_step=anchor_step,
        anchor_age_steps=max(step - anchor_step, 0) if anchor_step >= 0 else -1,
        anchors_launched=t.anchors.launched,
        anchor_bytes_per_token=anchor_bytes / tokens if tokens else 0.0,
        stage_moves=t.moves,
        dp_bytes_per_token=dp_bytes / tokens if tokens else 0.0,
        dp_compression=sum(p.dp_dense_bytes for p in t.peers.values()) / dp_bytes if dp_bytes else 0.0,
        eval_loss=newest_eval.eval_loss if newest_eval else math.nan,
        eval_step=t.evals.launched_at.get(newest_eval.eval_id, -1) if newest_eval else -1,
        banned=len(t.banned),
        config_digest=t.digest,
        wire_version=wire_version(),
        unfit=list(t.unfit),
        model=pb.ModelInfo(
            name=t.config.model.name,
            num_layers=t.config.model.num_layers,
            hidden_size=t.config.model.hidden_size,
            num_stages=K,
            tokenizer=t.config.data.tokenizer,
        ),
        data=t.data.status(t.eval_windows) if t.data is not None else None,
    )
