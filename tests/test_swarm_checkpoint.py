"""Real processes: a peer killed with SIGKILL and started again on the same `--state-dir` resumes
from its newest shard checkpoint (not the initial weights), the run goes on, and the tracker ends
the run at its token budget: status "done", every peer writes a final checkpoint and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from swarmkit import TOKENS_PER_STEP, status_json, tiny_run_toml, wait_for_status

from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
from peer.store.checkpoint import ShardCheckpoints

pytestmark = pytest.mark.processes

BUDGET_STEPS = 60
RUN_TOML = tiny_run_toml(
    top=f"token_budget = {BUDGET_STEPS * TOKENS_PER_STEP}\n",
    extra="""
[optim]
lr = 3e-3
[checkpoint]
every = 4
keep = 2
""",
)


def test_a_killed_peer_resumes_from_its_checkpoint_and_the_run_ends_at_its_budget(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    procs: list[subprocess.Popen] = []
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
        boot = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")
        tracker, run_id = boot["tracker"], boot["run_id"]
        procs.append(
            start_process(
                [
                    "peer",
                    "--tracker",
                    tracker,
                    "--token",
                    f"@{tmp_path}/boot/bootstrap.json",
                    "--state-dir",
                    str(tmp_path / "p0"),
                ],
                tmp_path / "p0.log",
            )
        )
        wait_for_status(tracker, lambda s: any(p["state"] in ("active", "idle") for p in s["peers"]), tmp_path)
        # from here stage 0 runs in short bursts (SIGSTOP between them): on an idle machine the
        # tiny run does its whole budget in about a second, faster than a poll would catch it mid-run
        procs[1].send_signal(signal.SIGSTOP)
        procs.append(
            start_process(
                [
                    "peer",
                    "--tracker",
                    tracker,
                    "--token",
                    f"@{tmp_path}/boot/bootstrap.json",
                    "--state-dir",
                    str(tmp_path / "p1"),
                ],
                tmp_path / "p1.log",
            )
        )
        stage1 = ShardCheckpoints(tmp_path / "p1", run_id, 1)
        deadline = time.monotonic() + 120
        while not stage1.steps() or stage1.steps()[0] < 8:  # two checkpoints of stage 1 on disk
            assert time.monotonic() < deadline, (tmp_path / "p1.log").read_text()[-3000:]
            procs[1].send_signal(signal.SIGCONT)
            time.sleep(0.05)
            procs[1].send_signal(signal.SIGSTOP)
            time.sleep(0.1)  # stage 1 finishes what it holds and writes its checkpoint
        procs[2].send_signal(signal.SIGKILL)  # mid-run, no goodbye
        procs[2].wait(10)
        procs[1].send_signal(signal.SIGCONT)
        killed_at = stage1.steps()[0]
        assert killed_at < BUDGET_STEPS - 8
        wait_for_status(tracker, lambda s: s["state"] == "paused", tmp_path)  # stage 1 has no live peer
        procs.append(
            start_process(
                [
                    "peer",
                    "--tracker",
                    tracker,
                    "--token",
                    f"@{tmp_path}/boot/bootstrap.json",
                    "--state-dir",
                    str(tmp_path / "p1"),
                ],
                tmp_path / "p1b.log",
            )
        )
        s = wait_for_status(tracker, lambda s: s["state"] == "done", tmp_path, timeout=180)
        assert "token budget" in s["reason"] and s["tokens"] >= BUDGET_STEPS * TOKENS_PER_STEP
        for p in procs[1:]:
            if p is not procs[2]:
                assert p.wait(60) == 0
        restarted = (tmp_path / "p1b.log").read_text()
        assert f"took the stage state of checkpoint {stage1.dir} at step" in restarted, restarted[-3000:]
        resumed = int(restarted.split(f"took the stage state of checkpoint {stage1.dir} at step ")[1].split()[0])
        assert (
            resumed >= 8 and resumed <= killed_at + 4
        )  # its newest whole checkpoint (one may have landed while it died)
        s = status_json(tracker)
        assert 0 < s["pp_state_bytes_per_token"] < s["pp_bytes_per_token"]  # the low-rank bases shipped, counted apart
        left = {p["id"]: p for p in s["peers"] if p["state"] == "left"}
        assert len(left) == 2 and all(p["reason"] == "done" for p in left.values()), left
        # both stages wrote a final checkpoint at the step they ended on; stage 1 counts its own
        # steps, so it ends behind stage 0 by the steps it lost to the kill
        newest = {}
        for peer_dir, log_name, stage in (("p0", "p0.log", 0), ("p1", "p1b.log", 1)):
            ck = ShardCheckpoints(tmp_path / peer_dir, run_id, stage)
            ended = int((tmp_path / log_name).read_text().split(" left after ")[1].split()[0])
            assert len(ck.steps()) == 2 and ck.newest().step == ended
            newest[stage] = ck.newest()
        assert newest[0].step >= BUDGET_STEPS and newest[1].step > resumed
        # the run is over and its peers gone: its checkpoints still make a model
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "export",
                "--checkpoints",
                str(tmp_path / "p0"),
                str(tmp_path / "p1"),
                "--out",
                str(tmp_path / "model"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        from transformers import AutoModelForCausalLM

        params = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "model").named_parameters())
        for ck in newest.values():
            n = len(ck.tensors) // 3
            assert all(torch.equal(params[name], t) for name, t in zip(ck.hf_names, ck.tensors[:n]))
        assert sum(len(ck.hf_names) for ck in newest.values()) == len(params)
        record = json.loads((tmp_path / "model" / "anchormesh_export.json").read_text())
        assert [st["step"] for st in record["stages"]] == [newest[0].step, newest[1].step]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "export",
                "--checkpoints",
                str(tmp_path / "p0"),
                "--out",
                str(tmp_path / "m2"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1 and "anchormesh export: error: stage 1: no checkpoint that fits" in out.stderr
    finally:
        stop_processes(procs, grace_s=10)
