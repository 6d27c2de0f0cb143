"""Memory plans on a real swarm (bootstrap + peers as processes on loopback).

A run whose `compute.memory_budget_gib` no stage fits: the peer plans every stage before it
joins, the tracker refuses it naming both figures, the peer exits 2 without loading anything,
and the status lists it under `unfit`. A run that fits: the peer joins, its status row shows
its device and its plan, and it trains in bf16 on the CPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from swarmkit import status_json, tiny_run_toml, wait_for_status

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes


def _boot(tmp_path: Path, compute: str) -> tuple[list[subprocess.Popen], dict]:
    (tmp_path / "run.toml").write_text(tiny_run_toml(extra=f"[compute]\n{compute}\n"))
    procs = [
        start_process(
            [
                "bootstrap",
                "--config",
                str(tmp_path / "run.toml"),
                "--state-dir",
                str(tmp_path / "boot"),
                "--peer-timeout",
                "5",
            ],
            tmp_path / "boot.log",
        )
    ]
    return procs, wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")


def test_a_budget_no_stage_fits_is_refused_before_loading(tmp_path: Path) -> None:
    procs, info = _boot(tmp_path, "memory_budget_gib = 0.0001")
    try:
        peer = start_process(
            ["peer", "--tracker", info["tracker"], "--token", info["token"], "--device", "cpu"], tmp_path / "peer.log"
        )
        procs.append(peer)
        assert peer.wait(timeout=120) == 2
        log = (tmp_path / "peer.log").read_text()
        assert "FAILED_PRECONDITION no stage of this run fits this peer's memory" in log, log[-3000:]
        assert "0.0 GiB, the smallest stage" in log and "activation_checkpointing" in log
        assert "joined" not in log and "Traceback" not in log
        s = status_json(info["tracker"])
        assert s is not None and len(s["unfit"]) == 1 and "on cpu fp32: 0.0 GiB, the smallest stage" in s["unfit"][0], (
            s["unfit"]
        )
    finally:
        stop_processes(procs)


def test_a_peer_reports_its_device_and_plan_and_trains_in_bf16(tmp_path: Path) -> None:
    procs, info = _boot(tmp_path, 'dtype = "bf16"')
    try:
        for i in range(2):
            procs.append(
                start_process(
                    ["peer", "--tracker", info["tracker"], "--token", info["token"], "--device", "cpu"],
                    tmp_path / f"peer{i}.log",
                )
            )
        s = wait_for_status(
            info["tracker"], lambda s: s["step"] >= 3 and s["loss"] is not None, tmp_path, procs, timeout=180
        )
        rows = [p for p in s["peers"] if p["state"] in ("active", "idle")]
        assert len(rows) == 2 and all(p["device"] == "cpu bf16" for p in rows), rows
        assert all(0 < p["memory_plan_bytes"] < p["memory_bytes"] for p in rows), rows
        assert "computing on cpu bf16 (fp32 master)" in (tmp_path / "peer0.log").read_text()
    finally:
        stop_processes(procs)
