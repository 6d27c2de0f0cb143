"""`anchormesh bench gpu` on the CPU (what CI can run): the precision part trains the small shape
in fp32, bf16 and bf16 with checkpointing and plans its memory; the memory part's peer exits 2
naming the estimate. The swarm part is the same flow as the swarm tests (test_swarm_*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes


def test_bench_gpu_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--quick",
            "--parts",
            "precision,memory_refusal",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["shape"] == "small" and "swarm" not in r
    modes = r["precision"]
    assert set(modes) == {"fp32", "bf16", "bf16_checkpointing"}
    for name, m in modes.items():
        assert m["tokens_per_s"] > 0 and m["loss_last"] < m["loss_first"], (name, m)
        assert len(m["planned_per_stage_gib"]) == 2 and 0.5 < m["peak_over_plan"] < 2.0, (name, m)
    assert modes["bf16_checkpointing"]["planned_gib"] < modes["bf16"]["planned_gib"]
    assert (
        r["memory_refusal"]["ok"]
        and r["memory_refusal"]["exit_code"] == 2
        and "needs" in r["memory_refusal"]["message"]
    )


def test_bench_gpu_refuses_unknown_parts(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "peer.cli", "bench", "gpu", "--device", "cpu", "--parts", "precision,speed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "--parts" in res.stderr and "precision,swarm,memory_refusal" in res.stderr
