"""The tracker's run state survives a kill (bootstrap/persist.py): a round trip through
tracker.json keeps the roster, steps, tokens and cadences; a bootstrap killed with SIGKILL and
started again on the same state dir serves the same run on the same address, and the peers carry
on without joining again."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarmkit import status_json, tiny_run_toml, wait_for_status

from bootstrap import persist
from bootstrap.tracker import Tracker
from peer.config import AnchorConfig, ConfigError, ModelConfig, TrainConfig
from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import build_fields


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_round_trip_keeps_the_run() -> None:
    clock = Clock(1000.0)
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4), anchor=AnchorConfig(every=5), token_budget=10**6)
    t = Tracker("run-x", cfg, peer_timeout_s=10.0, clock=clock)
    for pid in ("a", "b", "c"):
        t.join(
            pb.JoinRequest(
                peer_id=pid,
                grpc_address=f"h:{len(t.peers)}",
                **build_fields(),
                dht_maddrs=[f"/ip4/1.2.3.4/tcp/{len(t.peers)}"],
            )
        )
    c = t.peers["c"]
    t.report(
        pb.PeerReport(
            run_id="run-x",
            peer=pb.PeerInfo(peer_id="c", stage=c.stage, address=c.address, state="active", loss=math.nan),
        )
    )
    clock.t += 5
    for pid, step in (("a", 12), ("b", 11)):
        p = t.peers[pid]
        t.report(
            pb.PeerReport(
                run_id="run-x",
                tokens=step * 100,
                peer=pb.PeerInfo(
                    peer_id=pid,
                    stage=p.stage,
                    address=p.address,
                    state="active",
                    step=step,
                    loss=2.5,
                    capacity_tokens_per_s=50.0,
                ),
            )
        )
    clock.t += 7  # "c" has not reported since: dead by now; "a" and "b" are live
    before = t.status()
    assert {p.peer_id: p.state for p in before.peers} == {"a": "active", "b": "active", "c": "dead"}
    data = json.loads(json.dumps(persist.snapshot(t, {"tracker": 7000, "dht": 7001})))
    rclock = Clock(5.0)
    restored = persist.restore(data, peer_timeout_s=10.0, clock=rclock)  # another process: another clock
    after = restored.status()
    assert (after.run_id, after.step, after.tokens, after.anchors_launched) == (
        before.run_id,
        before.step,
        before.tokens,
        before.anchors_launched,
    )
    assert (
        restored.config == cfg
        and restored.anchors.next_at == t.anchors.next_at
        and restored.anchors.launched_at == t.anchors.launched_at
    )
    assert abs(after.uptime_s - before.uptime_s) < 1e-6
    assert {p.peer_id: p.state for p in after.peers} == {p.peer_id: p.state for p in before.peers}
    assert (
        restored.peers["a"].last_seen == 5.0 and restored.peers["c"].last_seen == 5.0 - 12.0
    )  # live: a fresh deadline
    assert math.isnan(restored.peers["c"].loss)
    assert restored.peers["a"].dht_maddrs == t.peers["a"].dht_maddrs and restored.peers["a"].loss == 2.5
    # a peer that was live can report again at once; the roster is not rebuilt from scratch
    p = restored.peers["a"]
    d = restored.report(
        pb.PeerReport(
            run_id="run-x",
            tokens=1300,
            peer=pb.PeerInfo(peer_id="a", stage=p.stage, address=p.address, state="active", step=13),
        )
    )
    assert d.kind == pb.Directive.CONTINUE and restored.status().step == 13
    # "b" does not report: its channel may be in reconnect backoff, so it has the grace on top of the timeout
    rclock.t += persist.RECONNECT_GRACE_S - 1
    assert {p.peer_id: p.state for p in restored.status().peers}["b"] == "active"
    rclock.t += 2
    assert {p.peer_id: p.state for p in restored.status().peers}["b"] == "dead"


def test_steps_trained_while_the_tracker_was_down_are_taken_after_a_restore() -> None:
    """Peers train on while the bootstrap is down: 30 s down at up to 100 steps/s is a step far
    above the last one saved. The bound counts the down time (the wall clock in the state), so
    the first report after the restart is taken, not refused as too far ahead for ever."""
    clock = Clock(1000.0)
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, peer_timeout_s=10.0, clock=clock)
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()))
    per_step = cfg.pipeline.micro_batches * cfg.pipeline.micro_batch_size * cfg.pipeline.seq_len

    def report(tr: Tracker, step: int) -> None:
        tr.report(
            pb.PeerReport(
                run_id="run-x",
                tokens=step * per_step,
                peer=pb.PeerInfo(peer_id="a", stage=0, state="active", step=step),
            )
        )

    report(t, 10)
    data = json.loads(json.dumps(persist.snapshot(t, {})))
    data["saved_at_unix"] -= 30.0  # the bootstrap was down 30 s
    restored = persist.restore(data, peer_timeout_s=10.0, clock=Clock(5.0))
    report(restored, 10 + 2000)  # 20 s of the 30 at the bound's rate: plausible
    assert restored.status().step == 2010 and restored.peers["a"].refused_reports == 0
    fresh = persist.restore(json.loads(json.dumps(persist.snapshot(t, {}))), peer_timeout_s=10.0, clock=Clock(5.0))
    report(fresh, 10 + 2000)  # no down time: too far ahead, refused
    assert fresh.status().step == 10 and fresh.peers["a"].refused_reports == 1


def test_an_unreadable_state_names_the_state_dir(tmp_path: Path) -> None:
    (tmp_path / "tracker.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"^--state-dir=.*tracker.json is unreadable.*--new-run"):
        persist.load(tmp_path)
    assert persist.load(tmp_path / "nothing-here") is None


@pytest.mark.processes
def test_another_config_on_a_run_state_dir_exits_2_until_new_run(tmp_path: Path) -> None:
    persist.save(
        tmp_path, persist.snapshot(Tracker("run-x", TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))), {})
    )
    (tmp_path / "other.toml").write_text("[model]\nnum_stages = 4\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "bootstrap",
            "--config",
            str(tmp_path / "other.toml"),
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "holds run run-x with another config; pass --new-run" in out.stderr, out.stderr


RUN_TOML = tiny_run_toml()


@pytest.mark.processes
def test_a_killed_bootstrap_resumes_its_run_and_the_peers_carry_on(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    boot_args = ["bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "boot")]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start_process(boot_args, tmp_path / "boot.log"))
        info = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")
        tracker = info["tracker"]
        for i in range(2):
            procs.append(
                start_process(
                    ["peer", "--tracker", tracker, "--token", f"@{tmp_path}/boot/bootstrap.json"],
                    tmp_path / f"p{i}.log",
                )
            )
        before = wait_for_status(
            tracker,
            lambda s: s["step"] >= 6 and sorted(p["state"] for p in s["peers"]) == ["active", "active"],
            tmp_path,
            procs,
        )
        time.sleep(persist.SAVE_EVERY_S + 0.5)  # at least one save after that status
        os.killpg(procs[0].pid, signal.SIGKILL)  # the bootstrap and its DHT daemon, no goodbye
        procs[0].wait(10)
        assert status_json(tracker) is None
        time.sleep(3)  # the peers' heartbeats fail meanwhile
        procs.append(start_process(boot_args, tmp_path / "boot2.log"))
        again = wait_for_bootstrap(tmp_path / "boot", procs[-1], tmp_path / "boot2.log")
        assert again == info  # same run id, tracker address and DHT multiaddr (persistent identity)
        # both train on: the stage-0 peer may wait a moment for a shard of the windows it holds (fetched from the new bootstrap)
        after = wait_for_status(
            tracker,
            lambda s: s["step"] >= before["step"] + 5 and all(p["state"] == "active" for p in s["peers"]),
            tmp_path,
            procs,
        )
        assert (
            after["run_id"] == before["run_id"] and after["tokens"] > before["tokens"] and after["state"] == "running"
        )
        assert {p["id"] for p in after["peers"]} == {p["id"] for p in before["peers"]}  # nobody joined again
        assert all(p["state"] == "active" for p in after["peers"]), [
            (p["id"], p["state"], p["reason"]) for p in after["peers"]
        ]
        assert "resumed run " + info["run_id"] in (tmp_path / "boot2.log").read_text()
    finally:
        stop_processes(procs, grace_s=10)
