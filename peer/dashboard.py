"""`anchormesh status --watch` on a terminal: a live dashboard drawn with rich.

Everything here works on the status dicts of `peer.status.status_dict` (README, "Status JSON"),
so it can be tested on a recorded status and never touches gRPC. `problems()` turns a status into
plain-language warnings; each rule is one small function whose docstring says why its threshold.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markup import escape
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from peer.status import dp_cell, link_cell

BLOCKS = "▁▂▃▄▅▆▇█"
LIVE_STATES = ("joining", "active", "idle")  # as bootstrap/tracker.py: the tracker routes to these
LABEL_WIDTH = 11  # "stage moves": labels of all summary grids line up
STATE_STYLE = {"active": "green", "idle": "cyan", "joining": "yellow", "dead": "bold red", "left": "dim"}

# thresholds of the rules in `problems()`; each rule's docstring says why
BOTTLENECK_RATIO = 0.5
ANCHOR_CADENCES_LATE = 3
ANCHOR_FALLBACK_STEPS = 200
DEAD_PEER_SHOWN_S = 600.0  # a dead peer is a problem for 10 minutes after its last heartbeat
SILENT_PEER_S = 5.0
NO_LOSS_AFTER_STEPS = 20
STALL_AFTER_UPTIME_S = 60.0


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
            float(status.get("uptime_s") or 0.0), int(status.get("step") or 0),
            _finite(status.get("loss")), _finite(status.get("eval_loss")), float(status.get("tokens_per_s") or 0.0),
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


def _finite(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


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


# -- problems ------------------------------------------------------------------------------


def _stages_without_peer(s: dict) -> list[str]:
    """A stage with no live peer stops the whole pipeline: no threshold, always a problem."""
    if s.get("state") == "done":  # peers leave when the budget is spent; nothing is wrong
        return []
    return [f"stage {st['index']} has no peer: the run is paused until one joins" for st in s.get("stages", []) if not st.get("peers")]


def _bottlenecks(s: dict) -> list[tuple[dict, float]]:
    """(stage, median capacity of the others) for each stage whose capacity is < 0.5x that median.

    The run goes at its slowest stage's pace, so at that ratio the other stages idle at least
    half the time, and adding a peer to that stage is the fix (the tracker moves one itself
    only when a move raises the bottleneck by more than half, so it may not). Stages with
    no peer (reported apart) or not yet measured (capacity 0) are left out."""
    measured = [st for st in s.get("stages", []) if st.get("peers") and st.get("capacity_tokens_per_s", 0) > 0]
    out = []
    for st in measured:
        others = [o["capacity_tokens_per_s"] for o in measured if o is not st]
        if others and st["capacity_tokens_per_s"] < BOTTLENECK_RATIO * statistics.median(others):
            out.append((st, statistics.median(others)))
    return out


def _bottleneck_stages(s: dict) -> list[str]:
    """A stage far slower than the others (rule and threshold: `_bottlenecks`)."""
    return [
        f"stage {st['index']} is the bottleneck: it could do {st['capacity_tokens_per_s']:,.0f} tok/s, "
        f"under half the other stages' {median:,.0f}; add a peer to it"
        for st, median in _bottlenecks(s)
    ]


def _stale_anchor(s: dict) -> list[str]:
    """The newest anchor any optimizer took is older than 3 anchor cadences (200 steps if the
    cadence is unknown), or none was taken that long into a run that launches them.

    Normally the age stays between 1 and 2 cadences (a pass takes a while to cross the
    pipeline); one late or dropped pass (120 s without progress) can push it past 2; past 3
    passes keep failing and the spectral correction works from an old gradient. The status
    JSON does not carry `anchor.every`; an optional `anchor_every` key is used when present,
    else 200 steps = 10 cadences of the recommended `anchor.every = 20`."""
    launched = s.get("anchors_launched") or 0
    if not launched:
        return []  # anchors off, or the first not due yet
    every = s.get("anchor_every")
    limit = ANCHOR_CADENCES_LATE * every if every else ANCHOR_FALLBACK_STEPS
    age = s.get("anchor_age_steps")
    if age is None:
        if (s.get("step") or 0) > limit:
            return [f"no anchor taken yet at step {s['step']} ({launched} launched): anchor passes are not completing"]
        return []
    if age > limit:
        return [f"anchor is stale: {age} steps old (limit {limit}); anchor passes are not completing"]
    return []


def _dead_peers(s: dict) -> list[str]:
    """Peers the tracker declared dead (no heartbeat within its timeout), with its reason.

    `left` (SIGTERM, done, moved to another stage) and `joining` are a peer's normal life and are
    only shown in the peer table; `dead` means a peer vanished and its micro-batches were lost.
    After `DEAD_PEER_SHOWN_S` it stays in the table only: the tracker keeps every record, and a
    death an hour ago is history, not a problem to act on."""
    return [
        f"{p['id']} (stage {p['stage']}) is dead: {p.get('reason') or 'no reason given'}"
        for p in s.get("peers", []) if p.get("state") == "dead" and (p.get("last_seen_s") or 0) <= DEAD_PEER_SHOWN_S
    ]


def _silent_peers(s: dict) -> list[str]:
    """A live peer not heard from for > 5 s: peers heartbeat every 1 s and the tracker declares
    them dead after 10 s, so 5 missed heartbeats means it is hung or its link is failing."""
    return [
        f"{p['id']} (stage {p['stage']}) not seen for {p['last_seen_s']:.0f}s: hung or unreachable?"
        for p in s.get("peers", []) if p.get("state") in LIVE_STATES and (p.get("last_seen_s") or 0) > SILENT_PEER_S
    ]


def _rejected_rounds(s: dict) -> list[str]:
    """A peer refused stage-group averaging results (NaN, or a correction far outside its own
    drift: peer/dp/group.py). Any refusal is shown: honest groups do not produce one, so it
    means a broken or hostile member in that stage group."""
    return [
        f"{p['id']} (stage {p['stage']}) refused {p['dp_rejected']} averaging result(s) of its stage group: a member sends NaN or outsized updates"
        for p in s.get("peers", []) if (p.get("dp_rejected") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _named_by_group(s: dict) -> list[str]:
    """A peer its stage mates name as the sender of a NaN, outsized or sign-flipped averaging
    contribution (peer/dp/group.py's claims). Shown with what they say, so the operator can
    judge and ban it (`anchormesh ban`); nothing bans automatically, since a hostile member
    could name an honest one."""
    out = []
    for p in s.get("peers", []):
        if (p.get("dp_flagged") or 0) > 0 and p.get("state") in LIVE_STATES:
            said = next((x.split(": ", 1)[1] for q in s.get("peers", []) for x in q.get("dp_suspects") or [] if x.startswith(p["id"] + ": ")), "")
            out.append(f"{p['id']} (stage {p['stage']}) is named by {p['dp_flagged']} stage mate(s) as the sender of a bad averaging update: {said}")
    return out


def _excluding(s: dict) -> list[str]:
    """A live peer routes around a next-stage peer whose stream stopped taking messages (it is
    excluded for a while, then tried again): hung, overloaded, or a member that accepts streams
    and never reads them. Shown with the sender's reason so the operator sees who and why."""
    return [
        f"{p['id']} (stage {p['stage']}) routes around {x}"
        for p in s.get("peers", []) if p.get("state") in LIVE_STATES for x in p.get("excluding") or []
    ]


def _refused_calls(s: dict) -> list[str]:
    """Calls refused for bad credentials, bans or rate (peer/auth.py), at the tracker and each
    live peer: honest members never trip the gate, so any refusal means a misconfigured
    volunteer (wrong token, clock far off) or someone probing the run; their logs say which."""
    out = [f"the tracker refused {s['refused_calls']} call(s): wrong tokens, banned keys or too many calls (see its log)"] if s.get("refused_calls") else []
    return out + [
        f"{p['id']} (stage {p['stage']}) refused {p['refused_calls']} call(s) to its Stage service (see its log)"
        for p in s.get("peers", []) if (p.get("refused_calls") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _implausible_reports(s: dict) -> list[str]:
    """Peers whose reports the tracker refused (a step, token count or capacity no honest peer
    reaches): a broken peer or someone trying to end or steer the run."""
    return [
        f"{p['id']} (stage {p['stage']}) sent {p['refused_reports']} implausible report(s) (step, tokens or capacity): the tracker kept its old figures; judge it and ban it if needed"
        for p in s.get("peers", []) if (p.get("refused_reports") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _unfit(s: dict) -> list[str]:
    """Volunteers the tracker turned away because no stage of the run fits their memory: the
    operator may want more stages or activation checkpointing to use them."""
    return [f"no stage fits {u}: refused (more stages or compute.activation_checkpointing would let it in)" for u in s.get("unfit") or []]


def _bad_loss(s: dict) -> list[str]:
    """The training loss is NaN/inf, or none was reported after 20 run steps.

    `status_dict` turns NaN into null and the tracker averages only finite losses, so a
    diverged run shows as a missing loss; 20 steps leaves time for the first steps to reach the
    last stage and be reported, since no loss at all is normal at the start."""
    loss = s.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return [f"training loss is {loss}: the run has diverged"]
    out = [
        f"{p['id']} (stage {p['stage']}) reports a {p['loss']} loss: it has diverged"
        for p in s.get("peers", []) if isinstance(p.get("loss"), float) and not math.isfinite(p["loss"])
    ]
    stages = s.get("stages", [])
    last_has_peer = bool(stages) and bool(stages[-1].get("peers"))
    if loss is None and last_has_peer and (s.get("step") or 0) >= NO_LOSS_AFTER_STEPS:
        out.append(f"no training loss at step {s['step']}: the last stage reports NaN (diverged) or nothing")
    return out


def _stalled(s: dict) -> list[str]:
    """0 tokens/s while the run is `running`, > 60 s after the tracker started, and no peer
    is still joining. Peers load the model and download state in the first minute, and a
    joining peer explains a pause; past that, nothing moving means the pipeline is stuck."""
    peers = s.get("peers", [])
    if s.get("state") != "running" or (s.get("tokens_per_s") or 0) > 0 or (s.get("uptime_s") or 0) <= STALL_AFTER_UPTIME_S:
        return []
    if any(p.get("state") == "joining" for p in peers):
        return []
    return [f"no throughput: 0 tok/s while running (up {_duration(s.get('uptime_s') or 0)}); the pipeline is stuck"]


RULES: tuple[Callable[[dict], list[str]], ...] = (
    _stages_without_peer, _bottleneck_stages, _stale_anchor, _dead_peers, _silent_peers, _rejected_rounds, _named_by_group, _excluding, _refused_calls, _implausible_reports, _unfit, _bad_loss, _stalled,
)


def problems(status: dict) -> list[str]:
    """Every rule's findings, in a stable order (most blocking first)."""
    return [msg for rule in RULES for msg in rule(status)]


# -- rendering -----------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = int(seconds)
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


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
    dp += f" ({s['dp_compression']:.0f}x vs fp32 all-reduce every step)" if s.get("dp_compression") else " (no round yet)"
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
        lines.add_row("model", f"{m['name']}: {m.get('num_layers', '?')} layers, hidden {m.get('hidden_size', '?')}, {m.get('num_stages', '?')} stages, tokenizer {m.get('tokenizer') or '?'}")
    lines.add_row("PP", f"{s.get('pp_bytes_per_token', 0):.1f} B/token ({s.get('pp_compression', 0):.1f}x vs dense fp16)")
    lines.add_row("DP", dp)
    lines.add_row("anchor", _anchor_text(s))
    return Group(pairs, lines)


class Curves:
    """Sparklines of train loss, eval loss and tokens/s with now/min/max, as wide as the space
    rich gives them (a fixed width would be cut off on a narrow terminal)."""

    ROWS = (("train loss", "loss", "{:.3f}", "magenta"), ("eval loss", "eval_loss", "{:.3f}", "blue"), ("tok/s", "tokens_per_s", "{:,.0f}", "cyan"))
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
            span = f"now {fmt.format(vals[-1])}  min {fmt.format(min(vals))}  max {fmt.format(max(vals))}" if vals else "no data yet"
            grid.add_row(label, Text(sparkline(vals, width) or "·", style=style), span)
        yield grid


def _stage_table(s: dict) -> Table:
    """One row per stage; no peer in red, a bottleneck (the `problems` rule) in yellow."""
    table = Table(title="stages", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title_style="bold")
    for name, justify in (("stage", "right"), ("peers", "right"), ("tok/s", "right"), ("capacity tok/s", "right"), ("queue", "right"), ("averaging", "left"), ("", "left")):
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
            str(st["index"]), str(st.get("peers", 0)), f"{st.get('tokens_per_s', 0):,.0f}",
            f"{st.get('capacity_tokens_per_s', 0):,.0f}", str(st.get("queue_depth", 0)), st.get("averaging", ""), note, style=style,
        )
    return table


def _peer_table(s: dict, with_address: bool = True) -> Table:
    """One row per peer the tracker knows, state coloured; silent live peers' last-seen in red.

    On a narrow terminal the address column goes, so the others are not cut to "…"."""
    table = Table(title="peers", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title_style="bold", padding=(0, 1))
    cols = [("peer", "left"), ("stage", "right"), ("state", "left"), ("address", "left"), ("seen", "right"), ("step", "right"),
            ("tok/s", "right"), ("MB in", "right"), ("MB out", "right"), ("link", "right"), ("dp", "right"), ("note", "left")]
    if not with_address:
        cols.remove(("address", "left"))
    for name, justify in cols:
        table.add_column(name, justify=justify, no_wrap=name != "note", min_width=12 if name == "note" else None)  # type: ignore[arg-type]
    for p in s.get("peers", []):
        state = p.get("state", "?")
        seen = p.get("last_seen_s") or 0.0
        live = state in LIVE_STATES
        cells: list[str | Text] = [
            p["id"], str(p.get("stage", "")), Text(state, style=STATE_STYLE.get(state, "")), p.get("address", ""),
            Text(f"{seen:.1f}s", style="red" if live and seen > SILENT_PEER_S else "" if live else "dim"),
            f"{p.get('step', 0):,}", f"{p.get('tokens_per_s', 0):,.0f}",
            f"{p.get('bytes_in', 0) / 1e6:,.2f}", f"{p.get('bytes_out', 0) / 1e6:,.2f}", link_cell(p.get("link_mbit"), p.get("pp_keep")), dp_cell(p.get("dp_rounds", 0), p.get("dp_period_s")),
            Text(p.get("reason", ""), style="dim"),
        ]
        if not with_address:
            del cells[3]
        table.add_row(*cells, style="dim" if state == "left" else "")
    return table


def _problems_panel(s: dict) -> Panel:
    found = problems(s)
    if not found:
        return Panel(Text("no problems", style="bold green"), title="problems", border_style="green", title_align="left")
    body = Table.grid(padding=(0, 1))  # a bullet column, so a wrapped message stays indented
    body.add_column(style="red")
    body.add_column(style="red")
    for msg in found:
        body.add_row("•", msg)
    return Panel(body, title=f"problems ({len(found)})", border_style="bold red", title_align="left")


class Dashboard:
    """The whole dashboard for one status; lays itself out for the width rich gives it."""

    NARROW = 110  # below this the peer table drops its address column

    def __init__(self, status: dict, history: History) -> None:
        self.status, self.history = status, history

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        s = self.status
        top = Group(_summary(s), Text(), Curves(self.history))
        yield Panel(top, title=f"anchormesh run [bold]{escape(str(s.get('run_id', '?')))}[/bold]", title_align="left", border_style="blue")
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
