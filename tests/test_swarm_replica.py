"""Real processes: the whole group of a stage dies (its only peer, SIGKILLed, without a
checkpoint), and its replacement comes back from the replica the other stage's peer keeps: it
resumes at that replica's step with the trained weights (its first loss is near the loss before
the kill, far from an untrained model's), and status says where it resumed from. The holder
keeps its copy in memory, the replacement (with --state-dir) keeps the one it pulls on disk."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
from swarmkit import status_json, tiny_run_toml, wait_for_status

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

RUN_TOML = tiny_run_toml(
    extra="""
[optim]
lr = 3e-3
[checkpoint]
replicate_every_s = 1.0
"""
)
UNTRAINED = math.log(256)  # a byte-level model before training: about the uniform loss


def peers(s: dict, stage: int) -> list[dict]:
    return [p for p in s["peers"] if p["stage"] == stage and p["state"] in ("active", "idle")]


def test_a_stage_whose_whole_group_died_comes_back_from_the_replica_another_stage_keeps(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    procs: list[subprocess.Popen] = []
    token = f"@{tmp_path}/boot/bootstrap.json"
    try:
        procs.append(
            start_process(
                [
                    "bootstrap",
                    "--config",
                    str(tmp_path / "run.toml"),
                    "--state-dir",
                    str(tmp_path / "boot"),
                    "--peer-timeout",
                    "3",
                ],
                tmp_path / "boot.log",
            )
        )
        tracker = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")["tracker"]
        procs.append(start_process(["peer", "--tracker", tracker, "--token", token], tmp_path / "p0.log"))
        wait_for_status(tracker, lambda s: bool(peers(s, 0)), tmp_path, procs)
        procs.append(start_process(["peer", "--tracker", tracker, "--token", token], tmp_path / "p1.log"))
        # trained a while, and stage 0's peer holds a recent copy of stage 1's state
        s = wait_for_status(
            tracker,
            lambda s: (
                bool(peers(s, 1))
                and peers(s, 1)[0]["step"] >= 40
                and (peers(s, 0)[0]["replica"] or {}).get("step", 0) >= 30
            ),
            tmp_path,
            procs,
            timeout=240,
        )
        assert peers(s, 0)[0]["replica"]["stage"] == 1
        killed = peers(s, 1)[0]
        procs[2].send_signal(signal.SIGKILL)  # the whole stage-1 group, no goodbye, no checkpoint
        procs[2].wait(10)
        s = wait_for_status(tracker, lambda s: s["state"] == "paused", tmp_path, procs)
        held = peers(s, 0)[0]["replica"]["step"]
        assert held >= 30
        procs.append(
            start_process(
                ["peer", "--tracker", tracker, "--token", token, "--state-dir", str(tmp_path / "p1b")],
                tmp_path / "p1b.log",
            )
        )
        holder = peers(s, 0)[0]["id"]
        s = wait_for_status(
            tracker,
            lambda s: any(p["id"] != killed["id"] and (p["replica"] or {}).get("stage") == 0 for p in peers(s, 1)),
            tmp_path,
            procs,
            timeout=240,
        )
        new = next(p for p in peers(s, 1) if p["id"] != killed["id"])
        restored = int(new["resumed_from"].split()[2]) if new["resumed_from"].startswith("replica step ") else -1
        assert new["resumed_from"] == f"replica step {restored} from {holder}", new
        assert held <= restored <= max(held, killed["step"]) + 50, (
            held,
            restored,
            killed["step"],
        )  # the status snapshot of the killed peer may lag its last steps
        log = (tmp_path / "p1b.log").read_text()
        assert f"took the stage state of the replica {holder} holds at step {restored}" in log, log[-3000:]
        # trained weights: its first loss is near the one before the kill, not an untrained model's (about 5.5)
        first = json.loads((tmp_path / "p1b" / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] > restored and first["loss"] < (killed["loss"] + UNTRAINED) / 2, (first, killed["loss"])
        # and it keeps a copy of stage 0 in turn, on its disk
        assert list((tmp_path / "p1b" / "replica").glob("*/stage0.safetensors"))
        assert status_json(tracker)["state"] == "running"
    finally:
        stop_processes(procs)
