"""Admission and bans on a real swarm (bootstrap + peers as processes on loopback), over TLS.

The run sets `security.tls`: the bootstrap is the run's CA. A peer without the token or with a
wrong one is refused and exits 2 saying why; a client without the run's CA cannot talk to the
tracker at all; two peers with the token train. The operator bans one with `anchormesh ban`:
it leaves with exit 2, the status shows it banned and the run paused, the other peer learns the
banned key; restarted with the same key it is refused again; after `--unban` it joins and the
run goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarmkit import logs, status_json, tiny_run_toml, wait_for_status

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

RUN_TOML = tiny_run_toml(extra="[security]\ntls = true\n")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def wait_exit(proc: subprocess.Popen, log: Path, timeout: float = 90) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout}s:\n{log.read_text()[-3000:]}") from None


def test_tokens_tls_and_bans_on_a_real_swarm(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    boot = tmp_path / "boot"
    info_file = boot / "bootstrap.json"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(boot), "--peer-timeout", "5"],
                tmp_path / "boot.log",
            )
        )
        info = wait_for_bootstrap(boot, procs[0], tmp_path / "boot.log")
        tracker, token = info["tracker"], info["token"]
        assert info_file.stat().st_mode & 0o777 == 0o600 and "BEGIN CERTIFICATE" in info["tls_ca"]
        assert token not in (tmp_path / "boot.log").read_text()  # secrets stay out of logs and stdout
        tls = ("--tls-ca", str(info_file))

        # no token: one line naming the flag, exit 2, nothing started
        res = cli("peer", "--tracker", tracker, *tls)
        assert res.returncode == 2 and "--token" in res.stderr and "ANCHORMESH_TOKEN" in res.stderr, res.stderr
        # a wrong token: refused by the tracker, exit 2
        wrong = start_process(
            ["peer", "--tracker", tracker, "--token", "not-the-run-token-at-all", *tls], tmp_path / "wrong.log"
        )
        procs.append(wrong)
        assert wait_exit(wrong, tmp_path / "wrong.log") == 2
        assert "refused this peer: UNAUTHENTICATED wrong run token" in (tmp_path / "wrong.log").read_text()
        assert (
            "refused /anchormesh.v1.Tracker/GetConfig" in (tmp_path / "boot.log").read_text()
        )  # its first call, before Join (the memory plan)
        # without the run's CA the tracker cannot even be read; with it, it can
        res = cli("status", "--tracker", tracker, "--json", timeout=60)
        assert res.returncode == 1 and "pass --tls-ca" in res.stderr, res.stderr  # says what is missing
        assert status_json(tracker, *tls)["refused_calls"] >= 1

        peer_args = lambda name: [
            "peer",
            "--tracker",
            tracker,
            "--token",
            f"@{info_file}",
            *tls,
            "--state-dir",
            str(tmp_path / name),
        ]  # noqa: E731
        procs.append(start_process(peer_args("a"), tmp_path / "a.log"))
        procs.append(start_process(peer_args("b"), tmp_path / "b.log"))
        s = wait_for_status(
            tracker,
            lambda s: s["step"] >= 4 and sorted(p["state"] for p in s["peers"]) == ["active", "active"],
            tmp_path,
            procs,
            extra=tls,
        )
        victim = next(p for p in s["peers"] if p["stage"] == 1)
        victim_proc = (
            procs[-1] if f"{victim['id']} joined" in (tmp_path / "b.log").read_text() else procs[-2]
        )  # the other names it too, in its sends
        victim_log = tmp_path / ("b.log" if victim_proc is procs[-1] else "a.log")
        other_log = tmp_path / ("a.log" if victim_log.name == "b.log" else "b.log")

        # the operator bans the stage-1 peer
        res = cli("ban", victim["id"], "--bootstrap", str(info_file), "--reason", "sent sign-flipped updates")
        assert res.returncode == 0 and f"{victim['key']} ({victim['id']}): sent sign-flipped updates" in res.stdout, (
            res.stdout + res.stderr
        )
        assert wait_exit(victim_proc, victim_log) == 2
        assert "is banned from this run: sent sign-flipped updates" in victim_log.read_text()
        s = wait_for_status(
            tracker, lambda s: s["banned"] == 1 and s["state"] == "paused", tmp_path, procs, timeout=30, extra=tls
        )
        assert next(p for p in s["peers"] if p["id"] == victim["id"])["state"] == "banned"
        assert f"banned keys in this run: {victim['key']}" in other_log.read_text()  # every peer refuses its calls now

        # the same key again (same state dir): refused at Join
        again = start_process(peer_args(victim_log.stem), tmp_path / "again.log")
        procs.append(again)
        assert wait_exit(again, tmp_path / "again.log") == 2
        assert (
            "PERMISSION_DENIED" in (tmp_path / "again.log").read_text()
            and "banned" in (tmp_path / "again.log").read_text()
        )

        # readmitted: it joins and the run goes on
        res = cli("ban", victim["id"], "--bootstrap", str(info_file), "--unban")
        assert res.returncode == 0 and "banned keys now: none" in res.stdout, res.stdout + res.stderr
        procs.append(start_process(peer_args(victim_log.stem), tmp_path / "back.log"))
        step = s["step"]
        wait_for_status(
            tracker, lambda s: s["state"] == "running" and s["step"] >= step + 3, tmp_path, procs, extra=tls
        )
        assert json.loads(info_file.read_text())["run_id"] == info["run_id"]
    except AssertionError:
        print(logs(tmp_path))
        raise
    finally:
        stop_processes(procs)
        time.sleep(0.1)
