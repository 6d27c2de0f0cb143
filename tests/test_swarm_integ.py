"""A real swarm on loopback: bootstrap + peers as separate processes, gRPC between them.

Checks: peers find the tracker (through the DHT or given), a joiner takes the stage nobody
serves, 2 stages x 2 peers train, the loss falls, a stage group averages, anchor priors reach
every peer's optimizer, status lists every peer with its address; when every peer of one stage
exits they are marked left, the starving stage pulls a peer from the other one (it restarts in
its process and keeps its id) and the run goes on (the moved peer finds no donor in the emptied
stage and starts from the initial weights); a newcomer then joins, downloads its stage group's
state and works.
"""

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

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Swarm:
    """Starts processes, remembers their pids, and kills exactly those at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    def start(self, *args: str, log: str) -> subprocess.Popen:
        token = (
            ["--token", f"@{self.tmp}/boot/bootstrap.json"] if args[0] == "peer" else []
        )  # every peer joins with the run token
        proc = start_process([*args, *token], self.tmp / log)
        self.procs.append(proc)
        return proc

    def status(self, tracker: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "peer.cli", "status", "--tracker", tracker, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            env=ENV,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_for(self, tracker: str, what, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status(tracker)
            if what(s):
                return s
            time.sleep(1.0)
        for p in self.procs:  # each peer dumps its threads' stacks into its log (faulthandler on SIGUSR1)
            if p.poll() is None and p.args[3] == "peer":
                p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in self.tmp.glob("*.log"))
        raise AssertionError(f"timed out; last status {json.dumps(s)[:1500]}\n{logs}")

    def close(self) -> None:
        stop_processes(self.procs, grace_s=15.0)


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    yield s
    s.close()


RUN_TOML = """
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = 128
num_layers = 4
num_heads = 4
max_seq_len = 128
[codec]
scheme = "lowrank"
[codec.lowrank]
rank = 20
values = "int8"
[anchor]
every = 5
micro_batches = 2
[spectral]
mode = "paper"
[optim]
lr = 2e-3
[pipeline]
max_staleness = 0
micro_batch_size = 8
micro_batches = 2
seq_len = 128
eval_every = 10
"""


def test_two_stages_of_two_peers_train_anchor_rebalance_and_survive_churn(swarm: Swarm, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    boot = swarm.start(
        "bootstrap",
        "--config",
        str(tmp_path / "run.toml"),
        "--state-dir",
        str(tmp_path / "boot"),
        "--peer-timeout",
        "8",
        log="bootstrap.log",
    )
    info = wait_for_bootstrap(tmp_path / "boot", boot, tmp_path / "bootstrap.log")
    assert (
        set(info) == {"run_id", "dht_maddrs", "tracker", "address", "tracker_key", "token", "operator"}
        and info["dht_maddrs"]
    )
    assert (tmp_path / "boot" / "bootstrap.json").stat().st_mode & 0o777 == 0o600  # it holds the run's secrets
    tracker = info["tracker"]

    peers = []
    for i in range(4):
        how = (
            ["--initial-peers", info["dht_maddrs"][0]] if i % 2 == 0 else ["--tracker", tracker]
        )  # via the DHT, or named
        peers.append(swarm.start("peer", *how, log=f"peer{i}.log"))
        s = swarm.wait_for(tracker, lambda s, n=i + 1: len(s["peers"]) == n, timeout=60)
        if i == 1:  # the second peer gets the stage nobody serves yet
            assert sorted(p["stage"] for p in s["peers"]) == [0, 1]

    early = swarm.wait_for(tracker, lambda s: s["step"] >= 3 and s["loss"] is not None)

    # stage-group averaging is best effort (a round that finds no group in time is skipped), so on
    # a loaded 2-core machine ask for one completed round in the swarm, not one per peer. Anchor
    # priors must have reached the optimizer of every peer (each computes or receives them).
    # The tracker may move a peer while capacities settle; wait for 4 live peers covering both stages.
    def settled(s: dict) -> bool:
        live = [p for p in s["peers"] if p["state"] in ("active", "idle", "joining")]
        return s["state"] == "running" and len(live) == 4 and all(st["peers"] for st in s["stages"])

    late = swarm.wait_for(
        tracker,
        lambda s: (
            s["step"] >= early["step"] + 30
            and settled(s)
            and any(p["dp_rounds"] > 0 for p in s["peers"])
            and all(p["anchor_id"] for p in s["peers"] if p["state"] == "active")
            and all(p["state"] == "active" for p in s["peers"])
        ),
        timeout=300,
    )
    # an untrained byte model scores ln(256) = 5.55; the status poll is too slow to see the first steps
    assert late["loss"] < 0.75 * math.log(256), (early["loss"], late["loss"])
    assert (
        late["state"] == "running"
        and sum(st["peers"] for st in late["stages"]) == 4
        and all(st["peers"] for st in late["stages"])
    )
    for p in late["peers"]:
        assert p["state"] == "active" and p["address"].startswith("127.0.0.1:") and p["last_seen_s"] < 5
        assert (
            p["bytes_out"] > 0 and p["step"] > 0
        )  # (tokens/s is a 2 s window: a busy box may stall one peer that long)
    assert all(st["tokens_per_s"] > 0 for st in late["stages"]) or late["tokens_per_s"] > 0
    startups = [
        p["startup_s"] for p in late["peers"] if p["startup_s"] is not None
    ]  # (a peer that just moved has not stepped again)
    assert startups and all(0 < x < 600 for x in startups), startups
    for p in late["peers"]:  # where each startup went: the phases from the process's start to its first step
        if p["startup_s"] is not None:
            assert list(p["startup_phases"])[0] == "imports" and {"dht", "join", "stage", "first_step"} <= set(
                p["startup_phases"]
            ), p["startup_phases"]
            assert abs(sum(p["startup_phases"].values()) - p["startup_s"]) < 0.5, (p["startup_phases"], p["startup_s"])
    assert late["eval_loss"] is not None and late["eval_loss"] < math.log(256) and late["eval_step"] >= 10
    assert late["anchors_launched"] >= 2 and late["anchor_age_steps"] is not None and late["anchor_bytes_per_token"] > 0
    assert 0 < late["pp_bytes_per_token"] < 100, (
        "the low-rank codec should send far fewer bytes than dense (512 B/token)"
    )
    assert (
        late["dp_bytes_per_token"] > 0
    )  # (its ratio is a formula of the config; the tracker's unit test checks the sums)

    # every peer of the stage with fewer peers leaves: it starves, and pulls a peer from the other stage
    by_stage = {st["index"]: st["peers"] for st in late["stages"]}
    poor = min(by_stage, key=lambda s: (by_stage[s], -s))
    gone = {p["id"] for p in late["peers"] if p["stage"] == poor}
    rich_ids = {p["id"] for p in late["peers"] if p["stage"] != poor}
    for i, proc in enumerate(peers):  # a peer's own id is in its "<id> joined run-..." line
        if any(f"{pid} joined run-" in (tmp_path / f"peer{i}.log").read_text() for pid in gone):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    after = swarm.wait_for(tracker, lambda s: all(p["state"] == "left" for p in s["peers"] if p["id"] in gone))
    assert all(p["reason"] == "SIGTERM" for p in after["peers"] if p["id"] in gone)
    moved = swarm.wait_for(
        tracker,
        lambda s: (
            s["stage_moves"] >= 1
            and s["state"] == "running"
            and any(p["id"] in rich_ids and p["stage"] == poor and p["state"] == "active" for p in s["peers"])
        ),
        timeout=120,
    )
    # the last stage's loss reaches the tracker in its peers' heartbeats, which may lag the step count
    resumed = swarm.wait_for(
        tracker,
        lambda s: s["state"] == "running" and s["step"] >= moved["step"] + 5 and s["loss"] is not None,
        timeout=120,
    )
    assert resumed["loss"] is not None and not math.isnan(resumed["loss"])

    # a newcomer joins the run and works
    swarm.start("peer", "--tracker", tracker, log="peer4.log")
    swarm.wait_for(tracker, lambda s: sum(p["state"] == "active" for p in s["peers"]) == 3, timeout=120)
    # ... starting from its stage group's state, not from the initial weights
    assert "took the stage state of a group member" in (tmp_path / "peer4.log").read_text()


def test_status_of_an_unreachable_tracker_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "status", "--tracker", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert out.returncode == 1 and "cannot reach the tracker" in out.stderr
