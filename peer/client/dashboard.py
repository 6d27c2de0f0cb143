"""`anchormesh status --watch` on a terminal: a live dashboard drawn with rich.

Everything here works on the status dicts of `peer.client.view.status_dict` (docs/status.md),
so it can be tested on a recorded status and never touches gRPC. `problems()` turns a status into
plain-language warnings; each rule is one small function whose docstring says why its threshold.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markup import escape
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from peer.client.problems import LIVE_STATES, SILENT_PEER_S, _bottlenecks, problems
from peer.client.view import dp_cell, link_cell
from peer.client.view import duration as _duration
from peer.client.view import finite as _finite

BLOCKS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 11  # "stage moves": labels of all summary grids line up
STATE_STYLE = {"active": "green", "idle": "cyan", "joining": "yellow", "dead": "bold red", "left": "dim"}


# -- history and sparklines ----------------------------------------------------------------


class Sample(NamedTuple):
    uptime_s: float
    step: int
    loss: float | None
    eval_loss: float | None
    tokens_per_s: float


class History:
    """The last `maxlen` samples of the run's curves, for sparklines.

    A watch stream may repeat a status (same uptime), which would flatten the curves, so a
    sample no newer than the last one is ignored; an uptime that goes back by more than a few
    seconds means the tracker restarted, and the old curve belongs to another run."""

    def __init__(self, maxlen: int = 120) -> None:
        self.samples: deque[Sample] = deque(maxlen=maxlen)

    def add(self, status: dict) -> bool:
        """Record one status; False if it was a duplicate and ignored."""
        s = Sample(
            float(status.get("uptime_s") or 0.0),
            int(status.get("step") or 0),
            _finite(status.get("loss")),
            _finite(status.get("eval_loss")),
            float(status.get("tokens_per_s") or 0.0),
        )
        if self.samples:
            last = self.samples[-1]
            if s.uptime_s < last.uptime_s - 5.0:
                self.samples.clear()
            elif s.uptime_s <= last.uptime_s:
                return False
        self.samples.append(s)
        return True

    def __len__(self) -> int:
        return len(self.samples)

    def series(self, field: str) -> list[float | None]:
        return [getattr(s, field) for s in self.samples]


def sparkline(values: Iterable[float | None], width: int) -> str:
    """One block character per point, lowest value ▁, highest █; None/NaN points are skipped.

    Longer series are averaged down to `width` buckets. Shorter ones are not stretched: a line
    as long as the history says how much history there is. A constant series has no range to
    scale to: it draws at the bottom (▁) if it is 0 (no throughput yet must not look like some),
    else mid-height (▄)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals or width <= 0:
        return ""
    if len(vals) > width:
        n = len(vals)
        vals = [statistics.fmean(vals[i * n // width : (i + 1) * n // width]) for i in range(width)]
    lo, hi = min(vals), max(vals)
    if hi - lo <= 1e-12 * max(abs(hi), 1.0):
        return (BLOCKS[0] if hi == 0 else BLOCKS[3]) * len(vals)
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[round((v - lo) / (hi - lo) * top)] for v in vals)


# -- rendering -----------------------------------------------------------------------------


def _loss(x: float | None) -> str:
    return "—" if _finite(x) is None else f"{x:.3f}"


def _anchor_text(s: dict) -> str:
    if not s.get("anchors_launched"):
        return "off / none launched"
    age = s.get("anchor_age_steps")
    age_txt = "none taken yet" if age is None else f"{age} steps old"
    return f"{age_txt} ({s['anchors_launched']} launched, {s.get('anchor_bytes_per_token', 0):.1f} B/token)"


def _summary(s: dict) -> Group:
    """Key figures: short ones two to a line (room for the tables), byte counts one a line."""
    state = s.get("state", "?")
    state_txt = Text(state.upper(), style="bold green" if state == "running" else "bold yellow")
    if s.get("reason"):
        state_txt.append(f"  ({s['reason']})", style="yellow")
    eval_txt = _loss(s.get("eval_loss"))
    if s.get("eval_step") is not None and _finite(s.get("eval_loss")) is not None:
        eval_txt += f" (at step {s['eval_step']})"
    dp = f"{s.get('dp_bytes_per_token', 0):.1f} B/token"
    dp += (
        f" ({s['dp_compression']:.0f}x vs fp32 all-reduce every step)" if s.get("dp_compression") else " (no round yet)"
    )
    pairs = Table.grid(padding=(0, 2))
    for style in ("dim", "", "dim", ""):
        pairs.add_column(style=style, justify="right" if style else "left", min_width=LABEL_WIDTH if style else None)
    pairs.add_row("state", state_txt, "uptime", _duration(s.get("uptime_s", 0)))
    pairs.add_row("step", f"{s.get('step', 0):,}", "tokens", f"{s.get('tokens', 0):,}")
    pairs.add_row("train loss", _loss(s.get("loss")), "eval loss", eval_txt)
    pairs.add_row("throughput", f"{s.get('tokens_per_s', 0):,.0f} tok/s", "stage moves", str(s.get("stage_moves", 0)))
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="dim", justify="right", min_width=LABEL_WIDTH)
    lines.add_column()
    m = s.get("model") or {}
    if m.get("name"):
        lines.add_row(
            "model",
            f"{m['name']}: {m.get('num_layers', '?')} layers, hidden {m.get('hidden_size', '?')}, {m.get('num_stages', '?')} stages, tokenizer {m.get('tokenizer') or '?'}",
        )
    lines.add_row(
        "PP",
        f"{s.get('pp_bytes_per_token', 0):.1f} B/token ({s.get('pp_compression', 0):.1f}x vs dense fp16; codec state {s.get('pp_state_bytes_per_token', 0):.1f} of it)",
    )
    lines.add_row("DP", dp)
    lines.add_row("anchor", _anchor_text(s))
    return Group(pairs, lines)


class Curves:
    """Sparklines of train loss, eval loss and tokens/s with now/min/max, as wide as the space
    rich gives them (a fixed width would be cut off on a narrow terminal)."""

    ROWS = (
        ("train loss", "loss", "{:.3f}", "magenta"),
        ("eval loss", "eval_loss", "{:.3f}", "blue"),
        ("tok/s", "tokens_per_s", "{:,.0f}", "cyan"),
    )
    SPAN, MIN_SPARK = 38, 8

    def __init__(self, history: History) -> None:
        self.history = history

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        fixed = LABEL_WIDTH + self.SPAN + 4
        return Measurement(fixed + self.MIN_SPARK, fixed + max(len(self.history), self.MIN_SPARK))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(self.MIN_SPARK, options.max_width - LABEL_WIDTH - self.SPAN - 4)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right", min_width=LABEL_WIDTH)
        grid.add_column(no_wrap=True)
        grid.add_column(style="dim", no_wrap=True)
        for label, field, fmt, style in self.ROWS:
            vals = [v for v in self.history.series(field) if v is not None]
            span = (
                f"now {fmt.format(vals[-1])}  min {fmt.format(min(vals))}  max {fmt.format(max(vals))}"
                if vals
                else "no data yet"
            )
            grid.add_row(label, Text(sparkline(vals, width) or "·", style=style), span)
        yield grid


def _stage_table(s: dict) -> Table:
    """One row per stage; no peer in red, a bottleneck (the `problems` rule) in yellow."""
    table = Table(title="stages", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title_style="bold")
    for name, justify in (
        ("stage", "right"),
        ("peers", "right"),
        ("tok/s", "right"),
        ("capacity tok/s", "right"),
        ("queue", "right"),
        ("averaging", "left"),
        ("", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    slow = {st["index"] for st, _ in _bottlenecks(s)}
    for st in s.get("stages", []):
        if not st.get("peers"):
            style, note = "red", "no peer"
        elif st["index"] in slow:
            style, note = "yellow", "bottleneck"
        else:
            style, note = "", ""
        table.add_row(
            str(st["index"]),
            str(st.get("peers", 0)),
            f"{st.get('tokens_per_s', 0):,.0f}",
            f"{st.get('capacity_tokens_per_s', 0):,.0f}",
            str(st.get("queue_depth", 0)),
            st.get("averaging", ""),
            note,
            style=style,
        )
    return table


def _peer_table(s: dict, with_address: bool = True) -> Table:
    """One row per peer the tracker knows, state coloured; silent live peers' last-seen in red.

    On a narrow terminal the address column goes, so the others are not cut to "…"."""
    table = Table(
        title="peers", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title_style="bold", padding=(0, 1)
    )
    cols = [
        ("peer", "left"),
        ("stage", "right"),
        ("state", "left"),
        ("address", "left"),
        ("build", "left"),
        ("seen", "right"),
        ("step", "right"),
        ("tok/s", "right"),
        ("MB in", "right"),
        ("MB out", "right"),
        ("link", "right"),
        ("dp", "right"),
        ("note", "left"),
    ]
    if not with_address:  # a narrow terminal: the address and the build go
        cols.remove(("address", "left"))
        cols.remove(("build", "left"))
    for name, justify in cols:
        table.add_column(name, justify=justify, no_wrap=name != "note", min_width=12 if name == "note" else None)  # type: ignore[arg-type]
    for p in s.get("peers", []):
        state = p.get("state", "?")
        seen = p.get("last_seen_s") or 0.0
        live = state in LIVE_STATES
        cells: list[str | Text] = [
            p["id"],
            str(p.get("stage", "")),
            Text(state, style=STATE_STYLE.get(state, "")),
            p.get("address", ""),
            p.get("build") or "?",
            Text(f"{seen:.1f}s", style="red" if live and seen > SILENT_PEER_S else "" if live else "dim"),
            f"{p.get('step', 0):,}",
            f"{p.get('tokens_per_s', 0):,.0f}",
            f"{p.get('bytes_in', 0) / 1e6:,.2f}",
            f"{p.get('bytes_out', 0) / 1e6:,.2f}",
            link_cell(p.get("link_mbit"), p.get("pp_keep")),
            dp_cell(p.get("dp_rounds", 0), p.get("dp_period_s")),
            Text(p.get("reason", ""), style="dim"),
        ]
        if not with_address:
            del cells[3:5]
        table.add_row(*cells, style="dim" if state == "left" else "")
    return table


def _problems_panel(s: dict) -> Panel:
    found = problems(s)
    if not found:
        return Panel(
            Text("no problems", style="bold green"), title="problems", border_style="green", title_align="left"
        )
    body = Table.grid(padding=(0, 1))  # a bullet column, so a wrapped message stays indented
    body.add_column(style="red")
    body.add_column(style="red")
    for msg in found:
        body.add_row("•", msg)
    return Panel(body, title=f"problems ({len(found)})", border_style="bold red", title_align="left")


class Dashboard:
    """The whole dashboard for one status; lays itself out for the width rich gives it."""

    NARROW = 126  # below this the peer table drops its address and build columns

    def __init__(self, status: dict, history: History) -> None:
        self.status, self.history = status, history

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        s = self.status
        top = Group(_summary(s), Text(), Curves(self.history))
        config = f"  config {escape(str(s['config_digest']))}" if s.get("config_digest") else ""
        yield Panel(
            top,
            title=f"anchormesh run [bold]{escape(str(s.get('run_id', '?')))}[/bold]{config}",
            title_align="left",
            border_style="blue",
        )
        yield _stage_table(s)
        yield Text()
        yield _peer_table(s, with_address=options.max_width >= self.NARROW)
        yield Text()
        yield _problems_panel(s)


def render(status: dict, history: History) -> RenderableType:
    """The dashboard for one status: summary and curves, stages, peers, problems."""
    return Dashboard(status, history)


def watch(statuses: Iterable[dict], console: Console | None = None) -> History:
    """Redraw the dashboard in place on each status from `statuses` until it ends.

    Refreshes only when a status arrives (the tracker's stream sets the pace), and leaves the
    last frame on screen when the stream ends or on Ctrl-C."""
    history = History()
    with Live(console=console, auto_refresh=False, transient=False) as live:
        for status in statuses:
            history.add(status)
            live.update(render(status, history), refresh=True)
    return history
