"""A peer loads only its stage: same weights and outputs as cutting the full model, and it reads
no other stage's layer tensors from the checkpoint."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import peer.model.loading as loading
from peer.config import ModelConfig
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm, load_stage, meta_stage, model_config
from peer.model.stages import layer_ranges, split_model

STAGES = 3
LAYERS = 5


def _saved(
    tmp_path: Path, family: str, *, tied: bool = False, shard: str = "60KB"
) -> tuple[ModelConfig, torch.nn.Module]:
    """A tiny model saved as several safetensors shards; the ModelConfig points at the folder."""
    tiny = ModelConfig(name=f"tiny-{family}", hidden_size=32, num_layers=LAYERS, num_heads=4, max_seq_len=64)
    model = load_causal_lm(tiny, seed=3)
    if tied:
        config = model_config(tiny)
        config.tie_word_embeddings = True
        from transformers import AutoModelForCausalLM

        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.save_pretrained(tmp_path, max_shard_size=shard)
    return ModelConfig(name=str(tmp_path), num_stages=STAGES, max_seq_len=64), model


def _inputs(stage, batch: int = 2, seq: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(stage.index)
    if stage.is_first:
        return torch.randint(0, stage.vocab_size, (batch, seq), generator=g)
    return torch.randn(batch, seq, stage.hidden_size, generator=g)


def _assert_same_stage(got, ref) -> None:
    got_params, ref_params = dict(got.named_parameters()), dict(ref.named_parameters())
    assert got_params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        assert torch.equal(got_params[name], p), name
    x = _inputs(ref)
    with torch.no_grad():
        assert torch.equal(got(x), ref(x))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_stage_equals_split_of_full_model(tmp_path: Path, family: str) -> None:
    cfg, model = _saved(tmp_path, family)
    assert len(list(tmp_path.glob("*.safetensors"))) >= 3, "the test needs several shards"
    ref = split_model(model, STAGES)
    for index in range(STAGES):
        _assert_same_stage(load_stage(cfg, index), ref[index])


def _layers_of(key: str) -> int | None:
    m = re.search(r"\.(?:layers|h)\.(\d+)\.", key)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stage_reads_only_its_own_tensors(tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _ = _saved(tmp_path, family)
    real_open = loading.safe_open
    read: list[str] = []
    opened: list[str] = []

    class Recording:
        def __init__(self, path, **kw) -> None:
            opened.append(os.path.basename(path))
            self.inner = real_open(path, **kw)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(loading, "safe_open", Recording)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for index, (start, end) in enumerate(layer_ranges(LAYERS, STAGES)):
        read.clear()
        opened.clear()
        stage = load_stage(cfg, index)
        layers = {_layers_of(k) for k in read} - {None}
        assert layers == set(range(start, end)), f"stage {index} read layers {sorted(layers)}"
        assert len(read) == len(list(stage.parameters()))
        assert set(opened) == {weight_map[k] for k in read}, "opened a shard it needed nothing from"
        assert len(opened) == len(set(opened)), "opened a shard twice"
        assert len(opened) < len(set(weight_map.values())), "a stage of three should not need every shard"


def test_tied_embeddings_fill_the_head(tmp_path: Path) -> None:
    cfg, model = _saved(tmp_path, "llama", tied=True)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map
    ref = split_model(model, STAGES)
    last = load_stage(cfg, STAGES - 1)
    assert torch.equal(last.head.weight, model.model.embed_tokens.weight)
    _assert_same_stage(last, ref[-1])


def test_single_file_checkpoint(tmp_path: Path) -> None:
    cfg, model = _saved(tmp_path, "llama", shard="50GB")
    assert (tmp_path / "model.safetensors").exists()
    _assert_same_stage(load_stage(cfg, 1), split_model(model, STAGES)[1])


def test_logs_what_it_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, _ = _saved(tmp_path, "llama")
    with caplog.at_level("INFO", logger="peer.model.loading"):
        load_stage(cfg, 1)
    assert re.search(r"stage 1 of .*: read [\d.]+ MiB from \d+ of \d+ weight file\(s\) in [\d.]+s", caplog.text)


def test_bf16_request(tmp_path: Path) -> None:
    cfg, model = _saved(tmp_path, "llama")
    stage = load_stage(cfg, 1, dtype=torch.bfloat16)
    ref = split_model(model, STAGES)[1]
    for name, p in ref.named_parameters():
        got = dict(stage.named_parameters())[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, p.to(torch.bfloat16)), name
    assert stage.rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(stage.rotary.inv_freq, ref.rotary.inv_freq, rtol=0, atol=0)
    out = stage(_inputs(ref).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_tiny_models_equal_split_model() -> None:
    cfg = ModelConfig(name="tiny-qwen2", num_stages=2, hidden_size=32, num_layers=3, num_heads=4)
    ref = split_model(load_causal_lm(cfg, seed=5), 2)
    for index in range(2):
        _assert_same_stage(load_stage(cfg, index, seed=5), ref[index])


def test_meta_stage_holds_no_memory() -> None:
    stage = meta_stage(ModelConfig(name="tiny-llama", num_stages=2), 1)
    assert all(p.device.type == "meta" for p in stage.parameters())
    assert stage.is_last and stage.head is not None
    with pytest.raises(ConfigError, match="num_stages"):
        meta_stage(ModelConfig(name="tiny-llama", num_stages=2), 2)


def test_missing_shard_file(tmp_path: Path) -> None:
    cfg, _ = _saved(tmp_path, "llama")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    gone = weight_map["lm_head.weight"]
    (tmp_path / gone).unlink()
    with pytest.raises(ConfigError, match=re.escape(gone)) as err:
        load_stage(cfg, STAGES - 1)
    assert "does not exist" in str(err.value)


def test_damaged_shard(tmp_path: Path) -> None:
    cfg, _ = _saved(tmp_path, "llama")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / weight_map["model.layers.0.self_attn.q_proj.weight"]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"cannot read .*{re.escape(shard.name)}"):
        load_stage(cfg, 0)


def test_missing_key(tmp_path: Path) -> None:
    cfg, _ = _saved(tmp_path, "llama")
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="'model.norm.weight' is in no shard"):
        load_stage(cfg, STAGES - 1)


def test_key_missing_from_its_shard(tmp_path: Path) -> None:
    """The index names a shard that does not hold the key (an index from another save)."""
    cfg, _ = _saved(tmp_path, "llama")
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    wrong = doc["weight_map"]["model.embed_tokens.weight"]
    doc["weight_map"]["model.norm.weight"] = wrong
    index.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"'model.norm.weight' is missing from .*{re.escape(wrong)}"):
        load_stage(cfg, STAGES - 1)


def test_shape_mismatch(tmp_path: Path) -> None:
    cfg, _ = _saved(tmp_path, "llama")
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.gate_proj.weight' in .*safetensors has shape"):
        load_stage(cfg, 0)


def test_bin_only_folder_falls_back_to_a_full_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, model = _saved(tmp_path, "llama", shard="50GB")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    with caplog.at_level("WARNING", logger="peer.model.loading"):
        stage = load_stage(cfg, 1)
    assert "no safetensors weights" in caplog.text
    _assert_same_stage(stage, split_model(model, STAGES)[1])
