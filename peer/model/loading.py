"""Load a Hugging Face decoder-only causal LM (hub id, local path) or build a tiny one from a config."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from peer.config import ModelConfig
from peer.errors import ConfigError
from peer.model.tokenizer import VOCAB_SIZE

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
TINY_PREFIX = "tiny-"
log = logging.getLogger(__name__)


def tiny_config(family: str, cfg: ModelConfig):
    """A small config of `family` with a byte vocabulary; dropout off so runs are deterministic."""
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False,
    )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=None)
    raise ConfigError("model.name", f"{TINY_PREFIX}{family}", f"unknown family; supported: {', '.join(SUPPORTED_FAMILIES)}")


def load_causal_lm(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Build `tiny-<family>` from a config (seeded init) or load a hub id / local directory.

    Attention is forced to SDPA: stages call decoder layers without a mask tensor and rely on
    SDPA's causal path, which the split-equals-unsplit test checks.
    """
    if cfg.name.startswith(TINY_PREFIX):
        family = cfg.name[len(TINY_PREFIX):]
        config = tiny_config(family, cfg)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return model.eval()
    _pretrained_config(cfg.name)
    log.info("loading %s (a hub id is downloaded on first use, with a progress bar per file)", cfg.name)
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(cfg.name, dtype=dtype, attn_implementation="sdpa")
    n = sum(p.numel() for p in model.parameters())
    log.info("loaded %s: %.1fM parameters in %.1fs", cfg.name, n / 1e6, time.monotonic() - t0)
    return model.eval()


def _pretrained_config(name: str):
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.name", name, f"cannot load a model config from it ({exc})") from exc
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ConfigError("model.name", name, f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return config


def resolve_dims(cfg: ModelConfig) -> ModelConfig:
    """The config with a hub or local model's real layer count, hidden size and heads (only its
    config.json is read). Why: the tracker plans stages from `num_layers` and reports compression
    from `hidden_size`; for a pretrained model those come from the model, not from the run.toml."""
    if cfg.name.startswith(TINY_PREFIX):
        return cfg
    config = _pretrained_config(cfg.name)
    return dataclasses.replace(cfg, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=config.num_attention_heads)


def family_of(model: PreTrainedModel) -> str:
    family = model.config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError("model.name", getattr(model.config, "_name_or_path", family), f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return family
