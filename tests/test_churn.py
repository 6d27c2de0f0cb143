"""Churn: for about 100 s a random peer of a 2-stage x 2-peer swarm is killed every ~12 s
(SIGKILL mostly, sometimes SIGTERM) and started again on its own --state-dir a few seconds later.

Checks: the run's step never goes back; every reported loss is finite; the run is never stuck for
good (once the chaos stops, both stages have live peers again and the run moves on); a restarted
peer continues the run's step numbering (resuming from its checkpoint or its group) instead of
starting over at 0.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from swarmkit import logs, status_json, tiny_run_toml

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

RUN_TOML = tiny_run_toml(
    extra="""
[dp]
inner_steps = 5
outer_compression = "none"
[optim]
lr = 3e-3
[checkpoint]
every = 5
keep = 2
"""
)
CHAOS_S, KILL_EVERY_S = 100.0, 12.0


def test_random_kills_and_restarts_lose_nothing(tmp_path: Path) -> None:
    rng = random.Random(7)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    procs: dict[str, subprocess.Popen] = {}
    everything: list[subprocess.Popen] = []

    def start_peer(name: str) -> None:
        n = sum(1 for f in tmp_path.glob(f"{name}*.log"))
        procs[name] = start_process(
            [
                "peer",
                "--tracker",
                tracker,
                "--token",
                f"@{tmp_path}/boot/bootstrap.json",
                "--state-dir",
                str(tmp_path / name),
            ],
            tmp_path / f"{name}.{n}.log",
        )
        everything.append(procs[name])

    try:
        boot = start_process(
            [
                "bootstrap",
                "--config",
                str(tmp_path / "run.toml"),
                "--state-dir",
                str(tmp_path / "boot"),
                "--peer-timeout",
                "4",
            ],
            tmp_path / "boot.log",
        )
        everything.append(boot)
        tracker = wait_for_bootstrap(tmp_path / "boot", boot, tmp_path / "boot.log")["tracker"]
        for name in ("p0", "p1", "p2", "p3"):
            start_peer(name)
        deadline = time.monotonic() + 180
        while True:
            s = status_json(tracker)
            if (
                s
                and s["step"] >= 10
                and sorted(p["stage"] for p in s["peers"] if p["state"] == "active") == [0, 0, 1, 1]
            ):
                break
            assert time.monotonic() < deadline, f"the swarm did not start: {json.dumps(s)[:800]}\n{logs(tmp_path)}"
            time.sleep(1)
        start_step = s["step"]
        steps, kills, next_kill, down = [s["step"]], 0, time.monotonic() + KILL_EVERY_S, {}
        t_end = time.monotonic() + CHAOS_S
        while time.monotonic() < t_end or (
            kills < 7 and time.monotonic() < t_end + 60
        ):  # a slow graceful leave can delay the schedule
            now = time.monotonic()
            if now >= next_kill:
                name = rng.choice(sorted(set(procs) - set(down)))
                procs[name].send_signal(signal.SIGKILL if rng.random() < 0.75 else signal.SIGTERM)
                procs[name].wait(30)
                down[name], kills, next_kill = now + rng.uniform(2, 6), kills + 1, now + KILL_EVERY_S
            for name, back_at in list(down.items()):
                if now >= back_at:
                    start_peer(name)
                    del down[name]
            s = status_json(tracker)
            if s is not None:
                assert s["step"] >= steps[-1], f"the run's step went back: {steps[-1]} -> {s['step']}"
                steps.append(s["step"])
                for p in s["peers"]:
                    assert p["loss"] is None or math.isfinite(p["loss"]), p
            time.sleep(1)
        for name in list(down):
            start_peer(name)
        # after the chaos: both stages served again, the run moves on, and every live peer is past
        # the step the chaos started at (a restarted peer continued the numbering)
        deadline, chaos_end_step = time.monotonic() + 150, steps[-1]
        while True:
            s = status_json(tracker)
            live = [p for p in (s or {}).get("peers", []) if p["state"] == "active"]
            if (
                s
                and s["state"] == "running"
                and {p["stage"] for p in live} == {0, 1}
                and s["step"] >= chaos_end_step + 10
                and all(p["step"] > start_step for p in live)
            ):
                break
            assert time.monotonic() < deadline, f"no recovery after the chaos: {json.dumps(s)[:1500]}\n{logs(tmp_path)}"
            time.sleep(1)
        assert kills >= 7
        resumed = sum(f.read_text().count("took the stage state of checkpoint") for f in tmp_path.glob("p*.log"))
        assert resumed >= 1, "no restarted peer resumed from its checkpoint"
    finally:
        stop_processes(everything, grace_s=10)
