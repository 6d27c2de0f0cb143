"""One run.toml for a run: the `[data]`, `[checkpoint]` and `token_budget` settings, the example
configs for real models, reading a run's data (local path, a `datasets` dataset, the model's own
tokenizer), a pretrained model's real dimensions, and the tracker ending a run at its budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bootstrap.run_data import open_run_data
from bootstrap.tracker import Tracker
from peer.config import ConfigError, DataConfig, ModelConfig, TrainConfig, check_swarm
from peer.model.loading import load_causal_lm, resolve_dims
from peer.model.tokenizer import hf_byte_tokenizer
from peer.runtoml import config_from_dict, load_run_toml, resolve_run
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import build_fields

ROOT = Path(__file__).resolve().parents[1]
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog, said peer {i % 7}.\n" for i in range(600))


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_the_example_configs_are_valid_swarm_runs(path: Path) -> None:
    cfg = load_run_toml(str(path))
    check_swarm(cfg)
    assert (
        not cfg.model.name.startswith("tiny-")
        and cfg.data.tokenizer == "model"
        and cfg.token_budget > 0
        and cfg.checkpoint.every > 0
    )


def test_there_are_examples_for_both_uses() -> None:
    names = {p.name for p in (ROOT / "examples").glob("*.toml")}
    assert {"qwen2.5-0.5b-domain.toml", "llama-3.2-1b-cpt.toml"} <= names


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"optim": {"lr": "3e-4"}}, "optim.lr"),
        ({"codec": {"scheme": "lowrank", "lowrank": {"rank": 2.5}}}, "codec.lowrank.rank"),
        ({"anchor": {"with_masked": 1}}, "anchor.with_masked"),
        (
            {"codec": {"scheme": "transform"}, "anchor": {"every": 5}, "spectral": {"mode": "ef"}},
            "spectral.mode",
        ),  # no masked twin pass for it
        ({"codec": {"transform": {"grad_rounding": "round"}}}, "codec.transform.grad_rounding"),
        (
            {"codec": {"scheme": "mask", "transform": {"bits": 3}}},
            "codec.transform.bits",
        ),  # a setting of a codec the run does not use
        ({"codec": {"bits": 3}}, "codec.bits"),  # a codec's own setting outside its table
        ({"mask": {"bits": 3}}, "mask.bits"),  # the former [mask] table, refused with the key's new home
        ({"data": {"path": "a", "dataset": "b"}}, "data.dataset"),
        ({"data": {"tokenizer": "bpe"}}, "data.tokenizer"),
        ({"data": {"heldout": 0.0}}, "data.heldout"),
        ({"data": {"max_bytes": 10}}, "data.max_bytes"),
        ({"data": {"split": ""}}, "data.split"),
        ({"data": {"colour": "red"}}, "data.colour"),
        ({"checkpoint": {"every": -1}}, "checkpoint.every"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
        ({"token_budget": -5}, "token_budget"),
        ({"token_budget": "1e9"}, "token_budget"),
        ({"steps": True}, "steps"),
    ],
)
def test_a_bad_setting_names_its_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_run(data)
    assert str(info.value).startswith(f"{field}=")


@pytest.mark.processes
def test_the_bootstrap_refuses_a_bad_data_section_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('[data]\npath = "x"\ndataset = "y"\n')
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "bootstrap",
            "--config",
            str(tmp_path / "run.toml"),
            "--state-dir",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "data.dataset='y'" in out.stderr and not (tmp_path / "b").exists()


def test_the_new_sections_round_trip_through_the_trackers_json() -> None:
    cfg = config_from_dict(
        {
            "data": {"path": "/d", "tokenizer": "model", "heldout": 0.05},
            "checkpoint": {"every": 7, "keep": 3},
            "token_budget": 12345,
        }
    )
    assert config_from_dict(json.loads(json.dumps(__import__("dataclasses").asdict(cfg)))) == cfg


# -- the run's data, prepared by the bootstrap ------------------------------------------------------
SMALL = TrainConfig(model=ModelConfig(name="tiny-llama", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=128))
DOCS = "\n\n".join(f"document {i}: " + TEXT[(i * 97) % 4000 :][:600] for i in range(1500))  # paragraphs are documents


def with_data(**kw) -> TrainConfig:
    return TrainConfig(model=SMALL.model, data=DataConfig(**kw))


def test_the_bootstrap_prepares_a_local_file_once_into_its_state_dir(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(DOCS)
    data = open_run_data(with_data(path=str(tmp_path / "a.txt")), tmp_path / "boot")
    assert (
        data.folder == tmp_path / "boot" / "data"
        and data.manifest.tokenizer == "bytes"
        and data.manifest.source == str(tmp_path / "a.txt")
    )
    assert 0.99 * len(DOCS) < data.manifest.tokens <= len(DOCS)  # every byte but the blank lines between documents
    (tmp_path / "a.txt").unlink()
    assert (
        open_run_data(with_data(path=str(tmp_path / "a.txt")), tmp_path / "boot").manifest == data.manifest
    )  # a restart takes it again


def test_a_missing_or_too_small_source_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data=.*nope.*no such file"):
        open_run_data(with_data(path=str(tmp_path / "nope")), tmp_path / "boot")
    (tmp_path / "small.txt").write_text(TEXT[:3000])
    with pytest.raises(ConfigError, match=r"^data=.*small\.txt.*cannot prepare"):
        open_run_data(with_data(path=str(tmp_path / "small.txt")), tmp_path / "boot")


def test_a_dataset_is_prepared_through_the_datasets_library(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    rows = [{"text": f"record {i}: " + TEXT[:300], "id": i} for i in range(1500)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = open_run_data(with_data(dataset=str(folder), max_bytes=200_000), tmp_path / "boot")
    assert data.manifest.source == f"hf:{folder}::train" and 200_000 <= data.manifest.tokens < 200_000 + 400
    with pytest.raises(ConfigError, match=r"text.field='body'.*columns: id, text"):
        open_run_data(with_data(dataset=str(folder), text_field="body"), tmp_path / "boot2")


def test_a_prepared_folder_is_taken_as_it_is_and_must_match_the_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(DOCS)
    made = open_run_data(with_data(path=str(tmp_path / "a.txt")), tmp_path / "boot")
    data = open_run_data(with_data(prepared=str(made.folder)), tmp_path / "other")
    assert data.folder == made.folder and not (tmp_path / "other" / "data").exists()
    with pytest.raises(ConfigError, match=r"^data\.prepared=.*leave data\.path"):
        with_data(prepared=str(made.folder), path=str(tmp_path))
    other = TrainConfig(model=ModelConfig(name="smollm2-135m"), data=DataConfig(prepared=str(made.folder)))
    with pytest.raises(ConfigError, match=r"tokenizer 'bytes'.*--tokenizer smollm2-135m"):
        open_run_data(other, tmp_path / "x")


def tiny_model_folder(tmp_path: Path, layers: int = 3) -> Path:
    """A local pretrained-model folder (weights, config, the byte tokenizer), like an export."""
    folder = tmp_path / "model"
    model = load_causal_lm(
        ModelConfig(name="tiny-llama", hidden_size=32, num_layers=layers, num_heads=2, max_seq_len=128)
    )
    model.save_pretrained(folder)
    hf_byte_tokenizer(64).save_pretrained(folder)
    return folder


def test_the_models_own_tokenizer_and_real_dimensions(tmp_path: Path) -> None:
    folder = tiny_model_folder(tmp_path)
    (tmp_path / "t.txt").write_text(DOCS)
    cfg = TrainConfig(
        model=ModelConfig(name=str(folder), max_seq_len=128),
        data=DataConfig(path=str(tmp_path / "t.txt"), tokenizer="model"),
    )
    data = open_run_data(cfg, tmp_path / "boot")
    assert data.manifest.tokenizer == str(folder)
    first = data.manifest.splits["train"].shards[0]
    assert bytes(np.asarray(data.tokens(first)[:11]).astype(np.uint8)) == b"document 0:"  # this tokenizer is bytes
    dims = resolve_dims(cfg.model)
    assert (dims.num_layers, dims.hidden_size, dims.num_heads) == (3, 32, 2)


# -- the token budget ---------------------------------------------------------------------------------
def test_the_tracker_ends_the_run_at_its_token_budget() -> None:
    t = Tracker("run-x", TrainConfig(model=ModelConfig(num_stages=2, num_layers=4), token_budget=1000))
    for pid in ("a", "b"):
        t.join(pb.JoinRequest(peer_id=pid, grpc_address=f"h:{len(t.peers)}", **build_fields()))

    def beat(pid: str, tokens: int) -> pb.Directive:
        p = t.peers[pid]
        return t.report(
            pb.PeerReport(
                run_id="run-x",
                tokens=tokens,
                peer=pb.PeerInfo(peer_id=pid, stage=p.stage, address=p.address, state="active"),
            )
        )

    assert beat("a", 900).kind == pb.Directive.CONTINUE and t.status().state == "running"
    assert beat("b", 5000).kind == pb.Directive.CONTINUE  # stage 1 counts no tokens of its own
    stop = beat("a", 1000)
    assert stop.kind == pb.Directive.STOP and "token budget of 1000" in stop.reason
    assert beat("b", 5000).kind == pb.Directive.STOP
    s = t.status()
    assert s.state == "done" and "1000" in s.reason and s.tokens == 1000


def test_export_writes_the_tokenizer_the_run_trained_with(tmp_path: Path) -> None:
    """`data.tokenizer = "model"`: the export carries the model's own tokenizer, not the byte one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from peer.client.export import write_model
    from peer.model.stages import split_model
    from peer.store.shard import Shard, snapshot

    folder = tiny_model_folder(tmp_path)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"pad_token": "<pad>"})  # so "its own" differs from a fresh byte tokenizer
    tok.save_pretrained(folder)
    cfg = TrainConfig(
        model=ModelConfig(name=str(folder), num_stages=2, max_seq_len=128), data=DataConfig(tokenizer="model")
    )
    stages = split_model(load_causal_lm(cfg.model), 2)
    shards = [Shard("run-x", f"p{i}", i, 2, 3, snapshot(s)) for i, s in enumerate(stages)]
    write_model(cfg, shards, tmp_path / "out")
    out = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert isinstance(out, PreTrainedTokenizerFast) and out.pad_token == "<pad>"
    assert (
        json.loads((tmp_path / "out" / "anchormesh_export.json").read_text())["tokenizer"]
        == f"the model's own: {folder}"
    )
