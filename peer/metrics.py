"""A Prometheus scrape endpoint (GET /metrics, text exposition format 0.0.4) for a run's status.

Stdlib `http.server` only: one gauge family per status figure is a few lines of text, not worth a
client library. `collect` returns a status dict (docs/status.md; `peer.client.view.status_dict`)
and is called once per scrape, so the numbers are as fresh as the tracker's.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LIVE_STATES = ("joining", "active", "idle")  # as bootstrap/tracker.py

# (name, type, help, status key) of the run-wide figures
RUN_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("anchormesh_step", "gauge", "Run step: the highest step any stage-0 peer has reported.", "step"),
    (
        "anchormesh_tokens_total",
        "counter",
        "Tokens stage 0 has sent into the pipeline since the run started.",
        "tokens",
    ),
    ("anchormesh_loss", "gauge", "Newest training loss (under the PP codec).", "loss"),
    ("anchormesh_eval_loss", "gauge", "Held-out loss of the newest evaluation pass.", "eval_loss"),
    ("anchormesh_tokens_per_second", "gauge", "Run throughput: tokens/s of the live stage-0 peers.", "tokens_per_s"),
    ("anchormesh_pp_bytes_per_token", "gauge", "Fast-circuit pipeline bytes per token.", "pp_bytes_per_token"),
    ("anchormesh_dp_bytes_per_token", "gauge", "Stage-group averaging bytes per token.", "dp_bytes_per_token"),
    (
        "anchormesh_refused_calls_total",
        "counter",
        "gRPC calls the tracker refused (credentials, bans, rate).",
        "refused_calls",
    ),
    ("anchormesh_banned_keys", "gauge", "Identity keys banned from the run.", "banned"),
)


def _value(x: object) -> str | None:
    """Prometheus sample text, or None for a figure to leave out (missing, NaN or infinite).

    A missing figure is omitted rather than sent as NaN: "no loss yet" is not a loss, and an
    absent sample keeps dashboards' min/max and alerts clean."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x) if isinstance(x, int) else repr(float(x))


def _label(v: object) -> str:
    """A label value escaped as the text format requires: backslash, double quote, newline."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, object], object]]) -> list[str]:
    """HELP and TYPE lines and one line per sample that has a value (none: the family is left out)."""
    lines = []
    for labels, value in samples:
        text = _value(value)
        if text is None:
            continue
        lbl = "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{lbl} {text}")
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines] if lines else []


def exposition(status: dict) -> str:
    """The status as Prometheus text: run figures, peers per stage, tokens/s per live peer.

    Only live peers get a tokens/s series: a dead or departed peer's series ends instead of
    staying at 0 forever (its record stays in the tracker's roster)."""
    out: list[str] = []
    for name, kind, help_text, key in RUN_METRICS:
        out += _family(name, kind, help_text, [({}, status.get(key))])
    out += _family(
        "anchormesh_stage_peers",
        "gauge",
        "Live peers serving each pipeline stage.",
        [({"stage": st["index"]}, st.get("peers")) for st in status.get("stages", [])],
    )
    out += _family(
        "anchormesh_peer_tokens_per_second",
        "gauge",
        "Tokens/s of each live peer.",
        [
            ({"peer": p["id"], "stage": p.get("stage")}, p.get("tokens_per_s"))
            for p in status.get("peers", [])
            if p.get("state") in LIVE_STATES
        ],
    )
    return "\n".join(out) + "\n"


# (name, type, help, key) of one peer's own figures (PeerDaemon.metrics)
PEER_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("anchormesh_peer_step", "gauge", "Optimizer steps this peer's stage has reached.", "step"),
    ("anchormesh_peer_tokens_total", "counter", "Tokens this peer has stepped on since it started.", "tokens"),
    ("anchormesh_peer_tokens_per_second", "gauge", "This peer's tokens/s over the last ~2 s.", "tokens_per_s"),
    (
        "anchormesh_peer_capacity_tokens_per_second",
        "gauge",
        "Tokens/s this peer could do if it never waited.",
        "capacity_tokens_per_s",
    ),
    ("anchormesh_peer_loss", "gauge", "Newest training loss (last stage only).", "loss"),
    ("anchormesh_peer_queue_depth", "gauge", "Messages waiting in this peer's fast-circuit inboxes.", "queue_depth"),
    ("anchormesh_peer_bytes_in_total", "counter", "Bytes this peer received on its Stage service.", "bytes_in"),
    ("anchormesh_peer_bytes_out_total", "counter", "Bytes this peer sent to other peers.", "bytes_out"),
    ("anchormesh_peer_dp_rounds_total", "counter", "Stage-group averaging rounds this peer took part in.", "dp_rounds"),
    (
        "anchormesh_peer_dp_rejected_total",
        "counter",
        "Stage-group averaging results this peer refused as implausible.",
        "dp_rejected",
    ),
    (
        "anchormesh_peer_dp_partial_total",
        "counter",
        "Stage-group averaging rounds of which some results never came back (those values kept this peer's own).",
        "dp_partial",
    ),
    (
        "anchormesh_peer_dp_leaning_total",
        "counter",
        "Stage-group members this peer named for updates that lean one way over many rounds.",
        "dp_leaning",
    ),
    (
        "anchormesh_peer_refused_calls_total",
        "counter",
        "gRPC calls this peer's Stage service refused (credentials, bans, rate, impersonation).",
        "refused_calls",
    ),
    (
        "anchormesh_peer_dropped_messages_total",
        "counter",
        "Messages dropped after they failed in the stage loop.",
        "dropped",
    ),
    (
        "anchormesh_peer_checkpoint_step",
        "gauge",
        "Step of the newest shard checkpoint this peer wrote.",
        "checkpoint_step",
    ),
    (
        "anchormesh_peer_link_mbit",
        "gauge",
        "Its slowest measured outbound pipeline link, Mbit/s (0: not measured).",
        "link_mbit",
    ),
    (
        "anchormesh_peer_pp_keep",
        "gauge",
        "Fraction of the codec's configured payload it sends on its most constrained link (0: sends no activations).",
        "pp_keep",
    ),
    (
        "anchormesh_peer_dp_period_seconds",
        "gauge",
        "Seconds between the wall-clock slots at which it offers averaging rounds.",
        "dp_period_s",
    ),
)


def peer_exposition(figures: dict) -> str:
    """One peer's figures as Prometheus text, labelled with its id and stage, plus
    `anchormesh_peer_state{state=...} 1` for its current state."""
    labels = {"peer": figures.get("id", ""), "stage": figures.get("stage", "")}
    out: list[str] = []
    for name, kind, help_text, key in PEER_METRICS:
        out += _family(name, kind, help_text, [(labels, figures.get(key))])
    out += _family(
        "anchormesh_peer_state",
        "gauge",
        "1 for the state the peer is in (joining, active, idle, left).",
        [({**labels, "state": figures.get("state", "")}, 1)],
    )
    return "\n".join(out) + "\n"


def _handler(collect: Callable[[], dict], render: Callable[[dict], str]) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self._send(404, "text/plain; charset=utf-8", "not found: the metrics are at /metrics\n")
                return
            try:
                body = render(collect())
            except Exception as exc:  # a failed scrape shows as down in Prometheus; the server lives on
                log.warning("metrics: collect failed: %s", exc)
                self._send(503, "text/plain; charset=utf-8", f"collect failed: {exc}\n")
                return
            self._send(200, CONTENT_TYPE, body)

        def _send(self, code: int, content_type: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            """Quiet: a scrape every few seconds would flood the bootstrap's log."""

    return MetricsHandler


def serve_metrics(
    port: int, collect: Callable[[], dict], host: str = "127.0.0.1", render: Callable[[dict], str] = exposition
) -> ThreadingHTTPServer:
    """Serve GET /metrics on host:port (0 = any free port; see `server.server_address`) from a
    daemon thread: `render(collect())` per scrape (the run's status by default, or a peer's
    figures with `peer_exposition`). Stop it with `server.shutdown(); server.server_close()`."""
    server = ThreadingHTTPServer((host, port), _handler(collect, render))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
