"""The `status --watch` dashboard: a recorded status renders every figure and every problem;
a healthy one says "no problems"; sparklines and history handle their edge cases."""

from __future__ import annotations

import copy
import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from peer.client import dashboard
from peer.client.dashboard import BLOCKS, History, problems, render, sparkline

SAMPLE = json.loads((Path(__file__).parent / "data" / "status_sample.json").read_text())


def _sample() -> dict:
    return copy.deepcopy(SAMPLE)


def _healthy() -> dict:
    """The sample with its faults repaired: both stages balanced, every peer live and heard from."""
    s = _sample()
    s["peers"] = [p for p in s["peers"] if p["state"] != "dead"]
    s["peers"][1]["last_seen_s"] = 0.6
    s["stages"][1].update(peers=2, capacity_tokens_per_s=2100.0)
    s["anchor_step"], s["anchor_age_steps"] = 460, 20
    return s


def _text(status: dict, history: History | None = None, width: int = 160) -> str:
    if history is None:
        history = History()
        history.add(status)
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(status, history))
    return console.export_text()


def _history(n: int) -> History:
    """n statuses with a falling loss and a wavy throughput, one second apart."""
    h = History()
    for i in range(n):
        s = _sample()
        s["uptime_s"] = 100.0 + i
        s["loss"] = 4.0 - 2.0 * i / max(n - 1, 1)
        s["tokens_per_s"] = 1000.0 + 500.0 * math.sin(i / 3)
        h.add(s)
    return h


# -- render ----------------------------------------------------------------------------------


def test_render_shows_run_stages_and_every_peer() -> None:
    out = _text(_sample())
    assert "anchormesh run run-7f3a" in out
    assert "RUNNING" in out and "12m34s" in out and "1,966,080" in out
    assert "train loss  2.734" in out and "eval loss  2.811 (at step 450)" in out
    assert "3,412 tok/s" in out
    assert (
        "43.5 B/token (11.8x vs dense fp16; codec state 3.2 of it)" in out
        and "12.4 B/token (38x vs fp32 all-reduce every step)" in out
    )
    assert "260 steps old (9 launched, 6.2 B/token)" in out
    lines = out.splitlines()
    stage_rows = [ln.split() for ln in lines if ln.split()[:1] in (["0"], ["1"])]
    assert ["0", "2", "3,412", "2,400", "1"] in stage_rows
    assert ["1", "1", "1,720", "900", "9", "bottleneck"] in stage_rows
    for peer in SAMPLE["peers"]:
        row = next((ln for ln in lines if ln.strip().startswith(peer["id"] + " ")), None)
        assert row is not None, (peer["id"], out)
        assert peer["state"] in row and peer["address"] in row
    delta = next(ln for ln in lines if ln.strip().startswith("peer-delta "))
    assert "41.8s" in delta and "51.00" in delta and "no heartbeat for 10.2s (timeout 10s)" in delta


def test_peer_rows_show_the_measured_link_the_kept_share_and_the_averaging_period() -> None:
    s = _sample()
    s["peers"][0].update(link_mbit=0.684, pp_keep=0.125, dp_period_s=32.0, dp_rounds=7)
    s["peers"][2].update(link_mbit=27.4, pp_keep=None, dp_period_s=None, dp_rounds=0)
    rows = {ln.split()[0]: ln for ln in _text(s).splitlines() if ln.strip().startswith("peer-")}
    assert "0.684M 12%" in rows["peer-alpha"] and "7/32s" in rows["peer-alpha"]
    assert "27.4M " in rows["peer-charlie"] and "%" not in rows["peer-charlie"].split("27.4M")[1].split()[0]
    assert " — " in rows["peer-bravo"]  # not measured yet


def test_render_draws_sparklines_of_the_history() -> None:
    h = _history(30)
    out = _text(_sample(), h)
    loss_line = next(ln for ln in out.splitlines() if "train loss  " in ln and "now" in ln)
    assert "█" in loss_line and "▁" in loss_line  # falling loss: from the top block to the bottom one
    assert loss_line.index("█") < loss_line.index("▁")
    assert "now 2.000  min 2.000  max 4.000" in loss_line
    tok_line = next(ln for ln in out.splitlines() if "tok/s  " in ln and "now" in ln)
    assert any(b in tok_line for b in BLOCKS[1:-1])


def test_render_lists_every_problem_of_the_sample() -> None:
    out = " ".join(_text(_sample()).split())  # the panel may wrap a long message
    assert "problems (4)" in out
    assert "stage 1 is the bottleneck: it could do 900 tok/s, under half the other stages' 2,400" in out
    assert "anchor is stale: 260 steps old (limit 200)" in out
    assert "peer-delta (stage 1) is dead: no heartbeat for 10.2s (timeout 10s)" in out
    assert "peer-bravo (stage 0) not seen for 7s" in out
    assert "no problems" not in out


def test_a_healthy_run_has_no_problems() -> None:
    s = _healthy()
    assert problems(s) == []
    out = _text(s)
    assert "no problems" in out and "bottleneck" not in out


def test_a_paused_run_marks_the_stage_without_peer() -> None:
    s = _healthy()
    s["state"], s["reason"] = "paused", "no live peer for stage 1"
    s["stages"][1].update(peers=0, tokens_per_s=0.0, capacity_tokens_per_s=0.0, queue_depth=0)
    for p in s["peers"]:
        if p["stage"] == 1:
            p["state"], p["reason"] = "left", "SIGTERM"
    out = _text(s)
    assert "PAUSED  (no live peer for stage 1)" in out
    assert problems(s) == ["stage 1 has no peer: the run is paused until one joins"]
    assert ["1", "0", "0", "0", "0", "no", "peer"] in [ln.split() for ln in out.splitlines()]


# -- problem rules ---------------------------------------------------------------------------


def test_anchor_staleness_uses_the_cadence_when_known() -> None:
    s = _healthy()
    s["anchor_age_steps"] = 70
    assert problems(s) == []  # 200-step fallback
    s["anchor_every"] = 20
    assert problems(s) == ["anchor is stale: 70 steps old (limit 60); anchor passes are not completing"]
    s["anchor_age_steps"], s["anchor_step"] = None, None
    assert problems(s) == ["no anchor taken yet at step 480 (9 launched): anchor passes are not completing"]
    s["anchors_launched"] = 0  # anchors off
    assert problems(s) == []


def test_nan_or_missing_loss_is_a_problem() -> None:
    s = _healthy()
    s["loss"] = float("nan")
    assert problems(s) == ["training loss is nan: the run has diverged"]
    s["loss"] = None  # what status_dict makes of NaN
    assert problems(s) == ["no training loss at step 480: the last stage reports NaN (diverged) or nothing"]
    s["step"] = 5  # early: no loss yet is normal
    assert problems(s) == []
    assert "train loss  —" in _text(s)


def test_zero_throughput_while_running_is_a_problem_unless_a_peer_is_joining() -> None:
    s = _healthy()
    s["tokens_per_s"] = 0.0
    assert problems(s) == ["no throughput: 0 tok/s while running (up 12m34s); the pipeline is stuck"]
    s["peers"][0]["state"] = "joining"
    assert problems(s) == []
    s["peers"][0]["state"], s["uptime_s"] = "active", 30.0  # peers still loading
    assert problems(s) == []


def test_left_peers_are_not_problems_but_dead_and_silent_ones_are() -> None:
    s = _healthy()
    s["peers"][0].update(state="left", reason="SIGTERM", last_seen_s=30.0)
    s["stages"][0]["peers"] = 1
    assert problems(s) == []
    s["peers"][2]["last_seen_s"] = 5.5
    assert problems(s) == ["peer-charlie (stage 1) not seen for 6s: hung or unreachable?"]


# -- sparkline and history -------------------------------------------------------------------


def test_sparkline_edge_cases() -> None:
    assert sparkline([], 10) == ""
    assert sparkline([None, float("nan")], 10) == ""
    assert sparkline([1.0, 2.0], 0) == ""
    assert sparkline([3.0, 3.0, 3.0], 10) == "▄▄▄"  # constant: mid-height, not stretched
    assert sparkline([0.0, 0.0], 10) == "▁▁"  # constant 0: at the bottom
    assert sparkline([0.0, None, float("nan"), 7.0], 10) == "▁█"
    assert sparkline(list(range(8)), 8) == BLOCKS
    assert sparkline([float(i) for i in range(100)], 10) == "▁▂▃▃▄▅▆▆▇█"  # bucket means 4.5, 14.5, ..., 94.5
    assert len(sparkline([math.sin(i) for i in range(500)], 37)) == 37


def test_history_is_bounded_and_ignores_duplicates() -> None:
    h = History(maxlen=5)
    s = _sample()
    assert h.add(s) is True
    assert h.add(s) is False  # the same status again
    assert h.add({**s, "uptime_s": s["uptime_s"] - 1}) is False  # older: out of order
    for i in range(1, 10):
        assert h.add({**s, "uptime_s": s["uptime_s"] + i, "step": 480 + i})
    assert len(h) == 5
    assert [x.step for x in h.samples] == [485, 486, 487, 488, 489]
    assert h.samples[-1].loss == pytest.approx(2.7341)
    h.add({**s, "uptime_s": 3.0, "step": 1, "loss": None})  # the tracker restarted: a new curve
    assert len(h) == 1 and h.series("loss") == [None]


def test_watch_draws_each_status_and_keeps_the_history() -> None:
    statuses = []
    for i in range(3):
        s = _sample()
        s["uptime_s"], s["step"] = 800.0 + i, 480 + i
        statuses.append(s)
    statuses.append(statuses[-1])  # a repeat is drawn but not recorded
    console = Console(record=True, width=160, file=io.StringIO())
    h = dashboard.watch(iter(statuses), console=console)
    assert [x.step for x in h.samples] == [480, 481, 482]
    out = console.export_text()
    assert "anchormesh run run-7f3a" in out and "peer-delta" in out and "step  482" in out


# -- `anchormesh status --watch`: a terminal gets the dashboard, a pipe the plain text -------


class _FakeChannel:
    def __enter__(self) -> _FakeChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _run_status_with(monkeypatch: pytest.MonkeyPatch, tty: bool) -> str:
    from peer.client import status as status_mod
    from peer.wire import anchormesh_pb2 as pb

    msg = pb.RunStatus(
        run_id="run-fake",
        state="running",
        step=12,
        tokens=4096,
        loss=3.25,
        eval_loss=math.nan,
        eval_step=-1,
        tokens_per_s=640.0,
        uptime_s=20.0,
        anchor_step=-1,
        anchor_age_steps=-1,
        stages=[pb.StageStatus(index=0, peers=1, tokens_per_s=640.0), pb.StageStatus(index=1, peers=0)],
        peers=[
            pb.PeerInfo(
                peer_id="peer-only",
                stage=0,
                state="active",
                address="127.0.0.1:5001",
                last_seen_s=0.2,
                build="0.1.0+abcdef0",
            )
        ],
    )

    class FakeStub:
        def __init__(self, channel: object) -> None:
            pass

        def WatchStatus(self, request: object) -> list:  # noqa: N802 (the gRPC method's name)
            return [msg]

    class Out(io.StringIO):
        def isatty(self) -> bool:
            return tty

    out = Out()
    monkeypatch.setenv("COLUMNS", "140")  # rich's width for a terminal it cannot measure (wide enough for every column)
    monkeypatch.setattr(status_mod.grpc, "insecure_channel", lambda target, options=None: _FakeChannel())
    monkeypatch.setattr(status_mod.pbg, "StatusStub", FakeStub)
    monkeypatch.setattr("sys.stdout", out)
    status_mod.run_status("127.0.0.1:1", as_json=False, watch=True)
    return out.getvalue()


def test_status_watch_on_a_terminal_draws_the_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", _run_status_with(monkeypatch, tty=True))  # drop colours
    assert "anchormesh run" in out and "run-fake" in out and "peer-only" in out
    assert "stage 1 has no peer" in out
    assert "0.1.0+abcdef0" in out  # each peer's build


def test_status_watch_in_a_pipe_prints_plain_text(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run_status_with(monkeypatch, tty=False)
    assert "run run-fake  RUNNING" in out and "<- no peer" in out and "0.1.0+abcdef0" in out
    assert "anchormesh run" not in out and "╭" not in out
    assert "\x1b" not in out  # no screen-clearing escape codes into a pipe or a file


def test_refused_averaging_results_and_a_finished_run() -> None:
    s = _healthy()
    live = next(p for p in s["peers"] if p["state"] in ("active", "idle"))
    live["dp_rejected"] = 2
    assert problems(s) == [
        f"{live['id']} (stage {live['stage']}) refused 2 averaging result(s) of its stage group: a member sends NaN or outsized updates"
    ]
    s = _healthy()  # a run whose budget is spent: its peers left, and that is no problem
    s["state"], s["reason"] = "done", "token budget of 1000 tokens spent"
    for st in s["stages"]:
        st.update(peers=0, tokens_per_s=0.0)
    for p in s["peers"]:
        p["state"], p["reason"] = "left", "done"
    assert problems(s) == [] and "DONE" in _text(s)


def test_a_long_dead_peer_is_history_not_a_problem() -> None:
    s = _healthy()
    p = next(p for p in s["peers"] if p["state"] in ("active", "idle"))
    p["state"], p["reason"], p["last_seen_s"] = "dead", "no heartbeat for 10.1s (timeout 10s)", 30.0
    assert problems(s) == [f"{p['id']} (stage {p['stage']}) is dead: no heartbeat for 10.1s (timeout 10s)"]
    p["last_seen_s"] = 3600.0
    assert problems(s) == [] and p["id"] in _text(s)  # still in the peer table


def test_refused_calls_are_a_problem_to_look_at() -> None:
    s = _healthy()
    assert problems(s) == []
    s["refused_calls"] = 3
    live = next(p for p in s["peers"] if p["state"] in ("active", "idle"))
    live["refused_calls"] = 1
    assert problems(s) == [
        "the tracker refused 3 call(s): wrong tokens, banned keys or too many calls (see its log)",
        f"{live['id']} (stage {live['stage']}) refused 1 call(s) to its Stage service (see its log)",
    ]


def test_a_peer_its_stage_mates_name_is_shown_with_what_they_say() -> None:
    s = _healthy()
    live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
    bad, accuser = live[0], live[1]
    bad["dp_flagged"] = 1
    accuser["dp_suspects"] = [f"{bad['id']}: its update is 99.0x the others' (limit 4x)"]
    assert problems(s) == [
        f"{bad['id']} (stage {bad['stage']}) is named by 1 stage mate(s) as the sender of a bad averaging update: its update is 99.0x the others' (limit 4x)"
    ]


def test_a_peer_routing_around_a_next_stage_peer_says_which_and_why() -> None:
    s = _healthy()
    live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
    why = f"{live[1]['id']}: its forward stream took 64 messages without acknowledging them, the oldest 3s ago (117 s left)"
    live[0]["excluding"] = [why]
    assert problems(s) == [f"{live[0]['id']} (stage {live[0]['stage']}) routes around {why}"]
    live[0]["state"] = "dead"  # a dead peer's old view is not news
    assert [m for m in problems(s) if "routes around" in m] == []


def test_the_plain_status_table_shows_link_and_averaging_period_too() -> None:
    from peer.client.status import render as plain
    from peer.wire import anchormesh_pb2 as pb

    s = pb.RunStatus(
        run_id="r",
        peers=[
            pb.PeerInfo(peer_id="peer-1", state="active", link_mbit=0.684, pp_keep=0.125, dp_rounds=7, dp_period_s=32),
            pb.PeerInfo(peer_id="peer-2", stage=1, state="active"),
        ],
    )
    rows = {ln.split()[0]: ln for ln in plain(s).splitlines() if ln.startswith("peer-")}
    assert "0.684M 12%" in rows["peer-1"] and "7/32s" in rows["peer-1"]
    assert "—" in rows["peer-2"] and "/" not in rows["peer-2"]
