"""`anchormesh export` on a real swarm (bootstrap + one peer per stage, as processes on loopback):
the folder loads with `AutoModelForCausalLM.from_pretrained` and computes what the stages compute
on the downloaded weights. And its errors: tracker unreachable, a stage with no live peer, a
shard that does not fit (the next peer of the stage is tried first)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from peer.client.export import ExportError, export, gather
from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
from peer.security.auth import read_token
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.version import build_fields

pytestmark = pytest.mark.processes  # all but the shard test (0.2 s) start a CLI or a swarm

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MIN_STEPS = 3
RUN_TOML = """
seed = 5
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = 64
num_layers = 2
num_heads = 4
max_seq_len = 64
[codec]
scheme = "mask"
[optim]
lr = 3e-3
[pipeline]
max_staleness = 0
micro_batch_size = 4
micro_batches = 2
seq_len = 32
"""


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
    )


def status(tracker: str) -> pb.RunStatus:
    with grpc.insecure_channel(tracker) as ch:
        return pbg.StatusStub(ch).GetStatus(pb.StatusRequest(), timeout=5)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("anchormesh export: error:")]


# -- errors ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracker_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    tracker = f"127.0.0.1:{free_port()}"
    res = cli("export", "--tracker", tracker, "--token", TOKEN, "--out", str(tmp_path / "m"))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"anchormesh export: error: tracker {tracker} unreachable (UNAVAILABLE: "
    ), res.stderr
    assert not (tmp_path / "m").exists()


TOKEN = "export-test-token-0123456789"


@pytest.fixture
def tracker(tmp_path: Path):
    """An in-process tracker of the default run with its gate, served on loopback; peers are joined by hand."""
    from bootstrap import keys
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker

    t = Tracker(
        "run-export", default_run(), peer_timeout_s=600.0
    )  # hand-joined peers stay live while a loaded machine imports torch
    server, address = serve_tracker(t, "127.0.0.1", 0, keys.load_or_create(tmp_path / "boot", TOKEN))
    yield t, address
    server.stop(grace=0).wait()


def test_no_token_is_a_usage_error_and_a_wrong_one_a_refusal(tracker, tmp_path: Path) -> None:
    """No token: exit 2 before anything is dialled; a wrong token: the tracker refuses, exit 1."""
    _, address = tracker
    res = cli("export", "--tracker", address, "--out", str(tmp_path / "m"), env={"ANCHORMESH_TOKEN": ""})
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        'anchormesh: error: --token=None: exporting a live run needs its token: pass --token or set ANCHORMESH_TOKEN (the "token" in the bootstrap\'s bootstrap.json)'
    ], res.stderr
    res = cli("export", "--tracker", address, "--token", "not-the-token-of-this-run", "--out", str(tmp_path / "m"))
    lines = error_lines(res.stderr)
    assert (
        res.returncode == 1
        and len(lines) == 1
        and lines[0].startswith(
            f"anchormesh export: error: tracker {address} refused: UNAUTHENTICATED: wrong run token"
        )
    ), res.stderr
    assert not (tmp_path / "m").exists()


def add_peer(t, peer_id: str, address: str, step: int, stage: int | None = None) -> None:
    t.join(pb.JoinRequest(peer_id=peer_id, grpc_address=address, **build_fields()))
    if stage is not None:
        t.peers[peer_id].stage = stage
    t.report(pb.PeerReport(run_id=t.run_id, peer=pb.PeerInfo(peer_id=peer_id, state="idle", step=step)))


def test_a_stage_with_no_live_peer_is_one_error_line_and_exit_1(tracker, tmp_path: Path) -> None:
    t, address = tracker
    add_peer(t, "peer-s0", "127.0.0.1:1", step=4)  # the first joiner gets stage 0; stage 1 has nobody
    res = cli("export", "--tracker", address, "--token", TOKEN, "--out", str(tmp_path / "m"))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr) == [
        "anchormesh export: error: stage 1 has no live peer (run run-export is paused): nothing to export from"
    ]
    assert not (tmp_path / "m").exists()


def test_a_shard_that_does_not_fit_is_refused_and_the_next_peer_tried(tracker) -> None:
    from peer.model.loading import load_causal_lm
    from peer.model.stages import split_model
    from peer.pipeline.grpc_transport import GrpcTransport
    from peer.store.shard import shard_chunks, snapshot

    t, address = tracker
    stages = split_model(load_causal_lm(t.config.model, seed=0), t.config.model.num_stages)
    bad = {"peer-bad"}

    def source(addr: str, req: pb.ShardRequest):
        s = t.peers[addr].stage
        tensors = snapshot(stages[s])
        if addr in bad:
            tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :100].contiguous()
        return shard_chunks(
            tensors, run_id=t.run_id, peer_id=addr, stage=s, num_stages=len(stages), step=t.peers[addr].step
        )

    served = GrpcTransport(t.run_id, shard_source=source)
    try:
        add_peer(t, "peer-s0", served.attach("peer-s0"), step=6)
        add_peer(t, "peer-bad", served.attach("peer-bad"), step=6, stage=1)
        with pytest.raises(
            ExportError,
            match=r"^stage 1: the shard of peer peer-bad does not fit the run's model: lm_head.weight is torch.float32 \[256, 100\], the model needs a float \[256, 128\]$",
        ):
            gather(address, progress=False, token=TOKEN)
        add_peer(t, "peer-good", served.attach("peer-good"), step=5, stage=1)  # less trained: tried second
        _, _, shards = gather(address, progress=False, token=TOKEN)
        assert [(sh.stage, sh.peer_id, sh.step) for sh in shards] == [(0, "peer-s0", 6), (1, "peer-good", 5)]
    finally:
        served.close()


# -- a real swarm -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    """A live swarm whose two stages have each taken at least MIN_STEPS steps; yields the tracker."""
    tmp = tmp_path_factory.mktemp("swarm")
    (tmp / "run.toml").write_text(RUN_TOML)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(tmp / "run.toml"), "--state-dir", str(tmp / "boot")], tmp / "boot.log"
            )
        )
        tracker = wait_for_bootstrap(tmp / "boot", procs[0], tmp / "boot.log", timeout_s=60)["tracker"]
        for i in range(2):
            procs.append(
                start_process(
                    ["peer", "--tracker", tracker, "--token", f"@{tmp}/boot/bootstrap.json"], tmp / f"p{i}.log"
                )
            )
        deadline = time.monotonic() + 150
        while True:
            peers = [p for p in status(tracker).peers if p.state in ("active", "idle")]
            if sorted(p.stage for p in peers) == [0, 1] and min(p.step for p in peers) >= MIN_STEPS:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(tmp.glob("*.log")))
                pytest.fail(
                    f"the swarm did not train {MIN_STEPS} steps: {[(p.stage, p.state, p.step) for p in peers]}\n{logs}"
                )
            time.sleep(0.5)
        yield tracker, f"@{tmp}/boot/bootstrap.json"
    finally:
        stop_processes(procs, grace_s=10)


def test_export_loads_in_transformers_and_equals_the_stages(swarm: tuple[str, str], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.model.loading import load_causal_lm
    from peer.model.stages import split_model

    out = tmp_path / "model"
    result = export(swarm[0], out, progress=False, token=read_token(swarm[1]))
    assert {"config.json", "model.safetensors", "tokenizer.json", "anchormesh_export.json"} <= {
        p.name for p in out.iterdir()
    }
    assert [sh.stage for sh in result.shards] == [0, 1] and min(sh.step for sh in result.shards) >= MIN_STEPS

    # the stages of the run's model, on the downloaded weights
    initial = split_model(load_causal_lm(result.config.model, seed=result.config.seed), 2)
    stages = split_model(load_causal_lm(result.config.model, seed=result.config.seed), 2)
    changed = 0
    with torch.no_grad():
        for stage, init, shard in zip(stages, initial, result.shards):
            for (name, p), (_, p0) in zip(stage.named_parameters(), init.named_parameters()):
                p.copy_(shard.tensors[stage.hf_names[name]])
                changed += not torch.equal(p, p0)
    assert changed > 0, "the exported weights are the initial ones: nothing trained?"

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and not model.config.tie_word_embeddings
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = stages[1](stages[0](tokens))
        got = model(tokens).logits
    assert got.shape == want.shape == (2, 24, 256)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()

    tok = AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld\n\tdef f(): pass"
    assert tok.encode(text) == list(text.encode()) and tok.decode(list(text.encode())) == text


def test_the_cli_exports_the_live_swarm(
    swarm: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    from peer.cli import main

    out = tmp_path / "cli-model"
    with caplog.at_level(logging.INFO, logger="anchormesh.export"), pytest.raises(SystemExit) as done:
        main(
            ["export", "--tracker", swarm[0], "--token", swarm[1], "--out", str(out)]
        )  # in-process: a subprocess would import torch again
    assert done.value.code == 0, capsys.readouterr().err[-3000:]
    assert f"exported to {out}" in capsys.readouterr().out
    per_stage = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stage ")]
    assert [m.split(":")[0] for m in per_stage] == ["stage 0", "stage 1"], per_stage  # a log line per stage
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "config.json").is_file()
