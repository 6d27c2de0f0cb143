"""The K-stage chain computes exactly what the unsplit model computes: loss and every gradient."""

from __future__ import annotations

import pytest
import torch

from peer.config import ModelConfig
from peer.errors import ConfigError, TensorError
from peer.model.loading import load_causal_lm
from peer.model.stages import layer_ranges, lm_loss, merged_state_dict, split_model

FAMILIES = ["llama", "gpt2", "qwen2", "mistral"]


def _model(family: str, layers: int = 4):
    return load_causal_lm(ModelConfig(name=f"tiny-{family}", hidden_size=64, num_layers=layers, num_heads=4), seed=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_stages", [2, 3])
def test_chain_equals_unsplit_loss_and_grads(family: str, num_stages: int) -> None:
    model = _model(family)
    model.train()
    window = torch.randint(0, 256, (3, 25), generator=torch.Generator().manual_seed(0))
    ids, tgt = window[:, :-1], window[:, 1:]

    ref_loss = lm_loss(model(input_ids=ids).logits, tgt)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}

    stages = split_model(model, num_stages)
    h = ids
    for stage in stages:
        h = stage(h)
    loss = lm_loss(h, tgt)
    loss.backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            hf = stage.hf_names[name]
            seen.add(hf)
            torch.testing.assert_close(p.grad, ref_grads[hf], rtol=1e-5, atol=1e-6, msg=f"{family}: grad of {hf}")
    assert seen == set(ref_grads), f"parameters not covered: {set(ref_grads) ^ seen}"


def test_tied_gpt2_head_grads_sum_to_the_shared_matrix() -> None:
    """A tied embedding/head becomes two copies; their gradients add up to the tied one."""
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    window = torch.randint(0, 256, (2, 17))
    lm_loss(model(input_ids=window[:, :-1]).logits, window[:, 1:]).backward()
    stages = split_model(model, 2)
    h = window[:, :-1]
    for s in stages:
        h = s(h)
    lm_loss(h, window[:, 1:]).backward()
    total = stages[0].embed.wte.weight.grad + stages[1].head.weight.grad
    torch.testing.assert_close(total, model.transformer.wte.weight.grad, rtol=1e-5, atol=1e-6)


def test_merged_state_dict_matches_model() -> None:
    model = _model("llama")
    merged = merged_state_dict(split_model(model, 2))
    ref = dict(model.named_parameters())
    assert merged.keys() == ref.keys()
    for k, v in merged.items():
        assert torch.equal(v, ref[k])


def test_decoder_matrices_are_2d_layer_weights_only() -> None:
    stages = split_model(_model("llama"), 2)
    names = stages[0].decoder_matrices()
    assert names and all(n.startswith("layers.") for n in names)
    assert not any("norm" in n or "embed" in n for n in names)
    assert "head.weight" not in stages[1].decoder_matrices()


def test_layer_ranges_cover_all_layers_contiguously() -> None:
    assert layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("stages", [0, 5])
def test_more_stages_than_layers_is_a_clear_error(stages: int) -> None:
    with pytest.raises(ConfigError, match=r"model.num_stages"):
        split_model(_model("llama"), stages)


def test_unknown_family_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"model.name='tiny-bert'.*unknown family"):
        load_causal_lm(ModelConfig(name="tiny-bert"))


def test_unsupported_local_model_type_is_refused(tmp_path) -> None:
    from transformers import BertConfig

    BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model_type 'bert' is not supported"):
        load_causal_lm(ModelConfig(name=str(tmp_path)))


def test_loads_a_local_model_directory(tmp_path) -> None:
    """The real loading path (from_pretrained on a saved directory), on a tiny model."""
    model = _model("qwen2", layers=2)
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(ModelConfig(name=str(tmp_path)))
    ids = torch.randint(0, 256, (1, 9))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_stage_rejects_wrong_input() -> None:
    stages = split_model(_model("llama"), 2)
    with pytest.raises(TensorError, match="token ids"):
        stages[0](torch.zeros(2, 3))
    with pytest.raises(TensorError, match=r"\[0, 256\)"):
        stages[0](torch.full((1, 4), 300))
    with pytest.raises(TensorError, match="hidden states"):
        stages[1](torch.zeros(1, 4, 7))
