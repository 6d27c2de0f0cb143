"""The correctness contract across processes: with masking off, one peer per stage and no
staleness, the swarm (bootstrap + 2 peers over gRPC) trains exactly as the core's local runner
does on the same batches — the per-step loss curves agree to float tolerance, in fp32 and in
bf16 compute with fp32 master weights (`compute.dtype`)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.dataset.shards import PreparedData
from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
from peer.model.loading import load_causal_lm
from peer.model.placement import resolve_placement
from peer.pipeline.local import LocalPipelineRunner
from peer.runtoml import load_run_toml

pytestmark = pytest.mark.processes

STEPS = 12
RUN_TOML = """
seed = 3
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = 64
num_layers = 2
num_heads = 4
max_seq_len = 64
[codec]
scheme = "mask"
[codec.mask]
drop = 0.0
values = "fp32"
[optim]
lr = 3e-3
[pipeline]
micro_batch_size = 4
micro_batches = 2
seq_len = 64
max_staleness = 0
"""
STAGE0_ID = "peer-equiv000"


def swarm_losses(tmp: Path, dtype: str) -> list[float]:
    (tmp / "run.toml").write_text(RUN_TOML + f'[compute]\ndtype = "{dtype}"\n')
    procs: list[subprocess.Popen] = []

    def start(*args: str, log: str, **env: str) -> subprocess.Popen:
        procs.append(start_process(list(args), tmp / log, **env))
        return procs[-1]

    try:
        boot = start("bootstrap", "--config", str(tmp / "run.toml"), "--state-dir", str(tmp / "boot"), log="boot.log")
        tracker = wait_for_bootstrap(tmp / "boot", boot, tmp / "boot.log", timeout_s=90)["tracker"]
        deadline = time.monotonic() + 90
        # the first peer to join gets stage 0; its state dir keeps the ids of the windows it trains (windows.log)
        p0 = start(
            "peer",
            "--tracker",
            tracker,
            "--token",
            f"@{tmp}/boot/bootstrap.json",
            "--max-steps",
            str(STEPS),
            "--state-dir",
            str(tmp / "p0"),
            log="p0.log",
            ANCHORMESH_PEER_ID=STAGE0_ID,
        )
        while "joined" not in (tmp / "p0.log").read_text():
            assert time.monotonic() < deadline and p0.poll() is None, (tmp / "p0.log").read_text()
            time.sleep(0.2)
        # stage 1 has no step limit: it must stay to answer stage 0's retries until stage 0 is done
        start(
            "peer",
            "--tracker",
            tracker,
            "--token",
            f"@{tmp}/boot/bootstrap.json",
            "--state-dir",
            str(tmp / "p1"),
            log="p1.log",
        )
        p0.wait(timeout=240)
        assert "stage 0" in (tmp / "p0.log").read_text() and "stage 1" in (tmp / "p1.log").read_text()
        metrics = tmp / "p1" / "metrics.jsonl"
        deadline = time.monotonic() + 30  # stage 1 steps right after sending the last gradients
        while len(metrics.read_text().splitlines()) < STEPS and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = metrics.read_text().splitlines()
    finally:
        stop_processes(procs, grace_s=10)
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return [r["loss"] for r in rows]


def runner_losses(tmp: Path) -> list[float]:
    """The local runner on the very windows the swarm's stage 0 trained, in its order: the ids it
    logged (one micro-batch a line), read from the data the bootstrap prepared."""
    cfg = load_run_toml(str(tmp / "run.toml"))
    p = cfg.pipeline
    windows = PreparedData(tmp / "boot" / "data").windows(p.seq_len)
    logged = [
        [int(i) % len(windows) for i in line.split()] for line in (tmp / "p0" / "windows.log").read_text().splitlines()
    ]
    assert len(logged) >= STEPS * p.micro_batches and all(len(ids) == p.micro_batch_size for ids in logged), logged

    def batch_fn(step: int, replica: int, j: int) -> torch.Tensor:
        return torch.from_numpy(windows.batch(logged[step * p.micro_batches + j]).astype(np.int64))

    runner = LocalPipelineRunner(
        cfg, load_causal_lm(cfg.model, seed=cfg.seed), batch_fn, placement=resolve_placement("cpu", cfg.compute)
    )
    try:
        return [r.loss for r in runner.run(STEPS)]
    finally:
        runner.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_masking_off_swarm_loss_curve_equals_the_local_runner(tmp_path: Path, dtype: str) -> None:
    swarm = swarm_losses(tmp_path, dtype)
    local = runner_losses(tmp_path)
    assert local[-1] < local[0]  # it trains
    for step, (a, b) in enumerate(zip(swarm, local)):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-5, (
            f"step {step}: swarm {a} vs local runner {b}\nswarm {swarm}\nlocal {local}"
        )
