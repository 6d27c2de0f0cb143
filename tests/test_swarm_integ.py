"""A real swarm on loopback: bootstrap + peers as separate processes, gRPC between them.

Checks: peers find the tracker (through the DHT or given), the pipeline trains and the loss
falls, status lists every peer with its address, a peer that exits is marked left and its stage
pauses the run, and a newly joining peer takes the starving stage so the run resumes.
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

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Swarm:
    """Starts processes, remembers their pids, and kills exactly those at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    def start(self, *args: str, log: str) -> subprocess.Popen:
        out = open(self.tmp / log, "w")
        proc = subprocess.Popen([sys.executable, "-m", "peer.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        self.procs.append(proc)
        return proc

    def status(self, tracker: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "peer.cli", "status", "--tracker", tracker, "--json"], capture_output=True, text=True, timeout=30, env=ENV)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_for(self, tracker: str, what, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status(tracker)
            if what(s):
                return s
            time.sleep(1.0)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.tmp.glob("*.log"))
        raise AssertionError(f"timed out; last status {json.dumps(s)[:1500]}\n{logs}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    yield s
    s.close()


def test_two_stage_swarm_trains_reports_and_survives_a_peer_leaving(swarm: Swarm, tmp_path: Path) -> None:
    swarm.start("bootstrap", "--state-dir", str(tmp_path / "boot"), "--peer-timeout", "6", log="bootstrap.log")
    info_path = tmp_path / "boot" / "bootstrap.json"
    deadline = time.monotonic() + 60
    while not info_path.exists():
        assert time.monotonic() < deadline, (tmp_path / "bootstrap.log").read_text()
        time.sleep(0.2)
    info = json.loads(info_path.read_text())
    assert set(info) == {"run_id", "dht_maddrs", "tracker"} and info["dht_maddrs"]
    tracker = info["tracker"]

    first = swarm.start("peer", "--initial-peers", info["dht_maddrs"][0], log="peer1.log")  # finds the tracker via the DHT
    swarm.start("peer", "--tracker", tracker, log="peer2.log")

    early = swarm.wait_for(tracker, lambda s: s["step"] >= 3 and s["loss"] is not None)
    late = swarm.wait_for(tracker, lambda s: s["step"] >= early["step"] + 40)
    assert late["loss"] < early["loss"] - 0.5, (early["loss"], late["loss"])
    assert late["state"] == "running" and [st["peers"] for st in late["stages"]] == [1, 1]
    assert {p["stage"] for p in late["peers"]} == {0, 1}
    for p in late["peers"]:
        assert p["state"] == "active" and p["address"].startswith("127.0.0.1:") and p["last_seen_s"] < 5
        assert p["tokens_per_s"] > 0 and p["bytes_out"] > 0
    assert 0 < late["pp_bytes_per_token"] < 100, "the low-rank codec should send far fewer bytes than dense (512 B/token)"

    # the peer that found the tracker through the DHT leaves: it is marked left, its stage starves
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(timeout=30)
    after = swarm.wait_for(tracker, lambda s: any(p["state"] == "left" for p in s["peers"]))
    left = [p for p in after["peers"] if p["state"] == "left"]
    assert len(left) == 1 and left[0]["reason"] == "SIGTERM"
    first_id, starving = left[0]["id"], left[0]["stage"]
    assert after["state"] == "paused" and str(starving) in after["reason"]

    # a new peer gets the starving stage and the run goes on
    swarm.start("peer", "--tracker", tracker, log="peer3.log")
    resumed = swarm.wait_for(tracker, lambda s: s["state"] == "running" and s["step"] >= after["step"] + 10)
    newcomer = [p for p in resumed["peers"] if p["state"] == "active" and p["id"] != first_id and p["stage"] == starving]
    assert len(newcomer) == 1
    assert not math.isnan(resumed["loss"])


def test_status_of_an_unreachable_tracker_says_so() -> None:
    out = subprocess.run([sys.executable, "-m", "peer.cli", "status", "--tracker", "127.0.0.1:9"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 1 and "cannot reach the tracker" in out.stderr
