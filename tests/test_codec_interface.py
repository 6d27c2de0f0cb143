"""One codec interface: the worker, the inbound checks, the memory plan and the demo talk to a
`LinkCodec` and never ask which one; a codec added through the interface alone (tests/plain_codec.py:
bf16 both ways) trains in the local runner and in a real 2-peer swarm."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peer.config import MASK_SCHEMES, MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.model.loading import load_causal_lm
from peer.pipeline.codecs import CODECS, codec_class
from peer.pipeline.local import LocalPipelineRunner
from tests.test_runner import windows  # a learnable stream: repeated phrases under noise

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "tests" / "plain_codec.py"
MODEL = ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)
PIPE = PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=32, max_staleness=0, eval_every=0)


@pytest.fixture
def plain():
    """The plain codec registered for one test, and gone after it (the table is process-wide)."""
    try:
        yield importlib.import_module("plain_codec").PlainLink  # tests/ is on the path, as for swarmkit
    finally:
        sys.modules.pop("plain_codec", None)
        CODECS.pop("plain", None)
        if "plain" in MASK_SCHEMES:
            MASK_SCHEMES.remove("plain")


@pytest.mark.parametrize(
    "path", ["peer/pipeline/worker.py", "peer/pipeline/inbound.py", "peer/daemon/memory.py", "peer/demo/local.py"]
)
def test_the_worker_the_checks_the_memory_plan_and_the_demo_never_branch_on_the_codec(path: str) -> None:
    code = "\n".join(
        line.split("#")[0]
        for line in (ROOT / path).read_text().splitlines()
        if not line.lstrip().startswith(("#", '"""'))
    )
    assert not re.search(r"scheme\s*[!=]=|\bTransformLinks\b|\bcoef_codec\b|\bbasis_out\b", code), path


def test_each_built_in_codec_is_one_class_in_the_table() -> None:
    assert set(CODECS) >= {"mask", "lowrank", "transform"} and all(codec_class(s).scheme == s for s in CODECS)
    assert codec_class("transform").label(MaskConfig()) == "transform 2 bits/value forward, 1 backward"


def test_a_codec_added_through_the_interface_alone_trains_in_the_local_runner(plain) -> None:
    cfg = TrainConfig(model=MODEL, mask=MaskConfig(scheme="plain"), pipeline=PIPE, optim=OptimConfig(lr=3e-3), steps=12)
    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows)
    try:
        reports = runner.run(12)
    finally:
        runner.close()
    losses = [r.loss for r in reports]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    per_token = runner.transport.total_bytes() / sum(r.tokens for r in reports)
    H = MODEL.hidden_size
    assert 2 * 2 * H <= per_token < 2 * 2 * H * 1.5, per_token  # bf16 both ways, plus headers and token ids


@pytest.mark.processes
def test_a_codec_added_through_the_interface_alone_trains_in_a_two_peer_swarm(tmp_path: Path, plain) -> None:
    """Bootstrap and both peers run `tests/plain_codec.py` (anchormesh with the codec registered
    first); nothing else in the package knows the codec."""
    from swarmkit import logs, wait_for_status

    from peer.demo.swarm import stop_processes, wait_for_bootstrap

    (tmp_path / "run.toml").write_text(f"""
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = {MODEL.hidden_size}
num_layers = 2
num_heads = 2
max_seq_len = 32
[codec]
scheme = "plain"
[pipeline]
micro_batch_size = 4
micro_batches = 2
seq_len = 32
eval_every = 0
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def start(name: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(PLAIN), *args],
            stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    procs = [start("boot", "bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "boot"))]
    try:
        info = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")
        for i in range(2):
            procs.append(
                start(f"peer{i}", "peer", "--tracker", info["tracker"], "--token", f"@{tmp_path}/boot/bootstrap.json")
            )
        s = wait_for_status(
            info["tracker"], lambda s: s["step"] >= 3 and s["pp_bytes_per_token"] > 0, tmp_path, procs, timeout=150
        )
        H = MODEL.hidden_size
        # bf16 activations at least (the last stage's gradient bytes reach the tracker with its next heartbeat)
        assert 2 * H <= s["pp_bytes_per_token"] < 2 * 2 * H * 1.5, (s["pp_bytes_per_token"], logs(tmp_path))
    finally:
        stop_processes(procs, grace_s=10)
