"""The data plane with real processes: a bootstrap that prepares the built-in corpus and serves its
shards, two stage-0 peers (one killed and restarted), the bootstrap killed and restarted. Every
stage-0 peer appends the ids of the windows it trains to its windows.log: no window is trained
twice, and the run loses none beyond those in flight (released to a peer that was then killed
or stopped before training them)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from swarmkit import status_json, tiny_run_toml, wait_for_status

from bootstrap import persist
from peer.daemon.feed import READY_STEPS
from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

PER_STEP = 2 * 4  # micro_batches * micro_batch_size of the tiny run: windows per step


def _trained(tmp: Path) -> list[int]:
    ids: list[int] = []
    for log in tmp.glob("p*/windows.log"):
        for line in log.read_text().splitlines():
            ids += [int(x) for x in line.split()]
    return ids


def test_two_stage0_peers_and_a_bootstrap_killed_and_restarted_train_no_window_twice(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(tiny_run_toml())
    boot_args = ["bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "boot")]
    procs: list[subprocess.Popen] = [start_process(boot_args, tmp_path / "boot.log")]
    peers: dict[str, subprocess.Popen] = {}
    try:
        info = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")
        tracker = info["tracker"]

        def start_peer(name: str) -> None:
            args = [
                "peer",
                "--tracker",
                tracker,
                "--token",
                f"@{tmp_path}/boot/bootstrap.json",
                "--state-dir",
                str(tmp_path / name),
            ]
            peers[name] = start_process(args, tmp_path / f"{name}.log")
            procs.append(peers[name])

        for i in range(4):
            start_peer(f"p{i}")
        s = wait_for_status(
            tracker,
            lambda s: s["step"] >= 4 and sum(p["stage"] == 0 and p["state"] == "active" for p in s["peers"]) == 2,
            tmp_path,
            procs,
        )
        assert s["data"]["windows"] > 1000 and s["data"]["source"].endswith("builtin-corpus.txt")
        victim = next(p["id"] for p in s["peers"] if p["stage"] == 0 and p["state"] == "active")
        name = next(
            n
            for n in peers
            if (tmp_path / n / "windows.log").exists() and victim in (tmp_path / f"{n}.log").read_text()
        )
        os.killpg(peers[name].pid, signal.SIGKILL)
        peers[name].wait(10)
        start_peer(name)  # the same state dir: the same identity, its old process's unstarted work goes back

        def rejoined(s: dict) -> bool:
            states = {p["id"]: p["state"] for p in s["peers"]}
            return (
                states.get(victim) == "active"
                and any(k.startswith(victim + "~") for k in states)
                and s["data"]["returned"] < s["data"]["done"]
            )

        before = wait_for_status(tracker, rejoined, tmp_path, procs)["data"]
        time.sleep(persist.SAVE_EVERY_S)
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        time.sleep(2)  # the peers train on what they hold meanwhile
        procs[0] = start_process(boot_args, tmp_path / "boot2.log")
        wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot2.log")
        restored = wait_for_status(tracker, lambda s: True, tmp_path, procs)["data"]  # as saved before the kill
        assert (
            restored["position"] >= before["position"] and restored["epoch"] == before["epoch"]
        )  # resumed, not started over
        grown = restored["done"] + 4 * PER_STEP
        after = wait_for_status(tracker, lambda s: s["data"]["done"] >= grown and rejoined(s), tmp_path, procs)["data"]
        assert after["position"] > restored["position"]  # the peers train on after the restart
    finally:
        stop_processes(procs[1:], grace_s=10)  # the peers first: they give back what they hold
    final = status_json(tracker)["data"]
    stop_processes(procs[:1], grace_s=10)
    trained = _trained(tmp_path)
    assert len(trained) == len(set(trained)), f"{len(trained) - len(set(trained))} windows trained twice"
    # released but never trained: what the killed peer and the stopped ones had ready or in flight
    lost = final["done"] - len(trained)
    assert 0 <= lost <= 3 * (READY_STEPS + 2) * PER_STEP, (final, len(trained))
    assert final["returned"] >= 2 * PER_STEP  # the stopped peers gave their held work back
