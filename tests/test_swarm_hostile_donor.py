"""Real processes: a hostile member (tests/hostile_donor.py), alone in its stage of a two-stage
run, serves its state negated with zeroed moments to a joiner of its stage, its only donor. The
joiner refuses it (far from its own weights, nothing to compare with: the single-donor policy),
keeps its own weights, names the donor in its log and its report, and the status shows the
donor flagged. (Joiners are started until one lands in the hostile member's stage: the tracker
places them by measured capacity.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from swarmkit import status_json, tiny_run_toml, wait_for_status

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
RUN_TOML = tiny_run_toml(
    extra="""
[optim]
lr = 1e-4
"""
)  # a fine-tuning lr: a lone donor's state may be about lr x steps per value from the joiner's own weights


def serving(s: dict) -> list[dict]:
    return [p for p in s["peers"] if p["state"] in ("active", "idle")]


def test_a_joiner_refuses_a_hostile_donors_negated_state_and_names_it(tmp_path: Path) -> None:
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
                    "5",
                ],
                tmp_path / "boot.log",
            )
        )
        tracker = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")["tracker"]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "hostile_donor.py"),
                    "peer",
                    "--tracker",
                    tracker,
                    "--token",
                    token,
                ],
                stdout=open(tmp_path / "hostile.log", "w"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        s = wait_for_status(tracker, lambda s: len(serving(s)) == 1, tmp_path, procs, timeout=120)
        bad, stage = serving(s)[0]["id"], serving(s)[0]["stage"]
        procs.append(start_process(["peer", "--tracker", tracker, "--token", token], tmp_path / "other.log"))
        s = wait_for_status(
            tracker,
            lambda s: len(serving(s)) == 2 and min(p["step"] for p in serving(s)) >= 10,
            tmp_path,
            procs,
            timeout=240,
        )
        joiner = None
        for i in range(3):  # until one joins the hostile member's stage (its only donor there)
            known = {p["id"] for p in status_json(tracker)["peers"]}
            procs.append(start_process(["peer", "--tracker", tracker, "--token", token], tmp_path / f"joiner{i}.log"))
            s = wait_for_status(
                tracker, lambda s: any(p["id"] not in known for p in s["peers"]), tmp_path, procs, timeout=120
            )
            new = next(p for p in s["peers"] if p["id"] not in known)
            if new["stage"] == stage:
                joiner, log_path = new["id"], tmp_path / f"joiner{i}.log"
                break
        assert joiner is not None, "no joiner was placed in the hostile member's stage"
        s = wait_for_status(
            tracker,
            lambda s: any(p["id"] == bad and p["donor_flagged"] for p in s["peers"]),
            tmp_path,
            procs,
            timeout=240,
        )
        joiner = next(p for p in s["peers"] if p["id"] == joiner)
        # refused by the state check, or first by the step check when the hostile donor ran ahead of what the run supports
        why = joiner["refused_donors"][0] if joiner["refused_donors"] else ""
        assert why.startswith(f"{bad}: no stage mate to compare with, and it is far from this peer's own weights") or (
            why.startswith(f"{bad}: step ") and "past the run's" in why
        ), joiner
        assert (
            "cosine -" in why or "past the run's" in why
        )  # its trained weights negated, against the joiner's initial ones
        assert joiner["resumed_from"] == "initial weights", joiner
        log = log_path.read_text()
        assert (
            f"refused the stage state of {bad} (1 donors refused so far)" in log and "took the stage state" not in log
        ), log[-3000:]
    finally:
        stop_processes(procs)
