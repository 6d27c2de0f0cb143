"""`anchormesh status --tracker H:P [--json] [--watch]`: one gRPC query (a stream with --watch).

`--watch` on a terminal draws the rich dashboard of `peer/client/dashboard.py`; into a pipe or a file it
prints plain snapshots a blank line apart (no screen-clearing escape codes), or one JSON object a line."""

from __future__ import annotations

import json
import math
import sys

import grpc

from peer.client.view import averaging_cell, data_cell, dp_cell, link_cell, model_cell, status_dict
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg


def render(s: pb.RunStatus) -> str:
    """A plain-text table for people."""
    loss = "—" if math.isnan(s.loss) else f"{s.loss:.3f}"
    eval_loss = "—" if math.isnan(s.eval_loss) else f"{s.eval_loss:.3f} (at step {s.eval_step})"
    anchor = (
        "off" if not s.anchors_launched else "none yet" if s.anchor_age_steps < 0 else f"{s.anchor_age_steps} steps old"
    )
    lines = [
        f"run {s.run_id}  {s.state.upper()}{'  (' + s.reason + ')' if s.reason else ''}  up {s.uptime_s:.0f}s",
        f"model {model_cell(s.model)}"
        + (f"  config {s.config_digest}" if s.config_digest else "")
        + (f"  wire {s.wire_version}" if s.wire_version else ""),
        f"step {s.step}  tokens {s.tokens:,}  train loss {loss}  eval loss {eval_loss}  {s.tokens_per_s:,.0f} tok/s",
        f"data {data_cell(s.data)}" if s.HasField("data") else "data: no prepared data",
        f"PP {s.pp_bytes_per_token:.1f} B/token ({s.pp_compression:.1f}x vs dense fp16; codec state {s.pp_state_bytes_per_token:.1f})  "
        f"DP {s.dp_bytes_per_token:.1f} B/token"
        + (f" ({s.dp_compression:.0f}x vs fp32 all-reduce every step)" if s.dp_compression else " (no round yet)"),
        f"anchor: {anchor} ({s.anchors_launched} launched, {s.anchor_bytes_per_token:.1f} B/token)  stage moves: {s.stage_moves}"
        + (f"  refused calls: {s.refused_calls}" if s.refused_calls else "")
        + (f"  banned keys: {s.banned}" if s.banned else ""),
        "",
        f"{'stage':>5} {'peers':>5} {'tok/s':>9} {'could':>9} {'queue':>5}  {'averaging':<33}",
    ]
    bottleneck = min(range(len(s.stages)), key=lambda i: s.stages[i].capacity_tokens_per_s) if s.stages else -1
    lines += [
        f"{st.index:>5} {st.peers:>5} {st.tokens_per_s:>9,.0f} {st.capacity_tokens_per_s:>9,.0f} {st.queue_depth:>5}  {averaging_cell(st.peers):<33}"
        + (
            "  <- no peer"
            if not st.peers
            else "  <- bottleneck"
            if st.index == bottleneck and len(s.stages) > 1
            else ""
        )
        for st in s.stages
    ]
    lines += [
        "",
        f"{'peer':<14} {'stage':>5} {'state':<7} {'address':<21} {'build':<15} {'seen':>6} {'step':>6} {'tok/s':>8} {'in MB':>7} {'out MB':>7} {'link':>10} {'dp':>6}  note",
    ]
    for p in s.peers:
        lines.append(
            f"{p.peer_id:<14} {p.stage:>5} {p.state:<7} {p.address:<21} {p.build or '?':<15} {p.last_seen_s:>5.1f}s {p.step:>6} {p.tokens_per_s:>8,.0f} "
            f"{p.bytes_in / 1e6:>7.2f} {p.bytes_out / 1e6:>7.2f} {link_cell(p.link_mbit, p.pp_keep):>10} {dp_cell(p.dp_rounds, p.dp_period_s):>6}  {p.reason}"
        )
    return "\n".join(lines)


def run_status(
    tracker: str,
    as_json: bool,
    watch: bool,
    interval: float = 1.0,
    token: str | None = None,
    tls_ca: bytes | None = None,
) -> None:
    from peer.security.auth import Credentials, tls_hint, tracker_channel

    with tracker_channel(tracker, Credentials(token=token) if token else None, tls_ca=tls_ca) as channel:
        stub = pbg.StatusStub(channel)
        try:
            if not watch:
                s = stub.GetStatus(pb.StatusRequest(), timeout=10)
                print(json.dumps(status_dict(s)) if as_json else render(s))
                return
            if not as_json and sys.stdout.isatty():  # a person at a terminal: the live dashboard
                from peer.client.dashboard import watch as live_dashboard

                live_dashboard(status_dict(s) for s in stub.WatchStatus(pb.StatusRequest(interval_s=interval)))
                return
            # a pipe or a file: one JSON a line, or plain snapshots a blank line apart (no escape codes)
            for s in stub.WatchStatus(pb.StatusRequest(interval_s=interval)):
                print(json.dumps(status_dict(s)) if as_json else render(s) + "\n", flush=True)
        except grpc.RpcError as exc:
            print(
                f"anchormesh status: cannot reach the tracker at {tracker}: {exc.code().name} {exc.details()}{tls_hint(exc.details(), tls_ca is not None)}",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
