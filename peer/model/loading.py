"""Load a Hugging Face decoder-only causal LM (hub id, local path) or build a tiny one from a config."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from peer.config import TINY_MODEL_PREFIX, ModelConfig
from peer.errors import ConfigError
from peer.model.source import from_pretrained, pretrained_config, resolve
from peer.model.stages import SUPPORTED_FAMILIES, StageModule, layer_ranges, split_model
from peer.model.tokenizer import VOCAB_SIZE

TINY_PREFIX = TINY_MODEL_PREFIX
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
    raise ConfigError(
        "model.name", f"{TINY_PREFIX}{family}", f"unknown family; supported: {', '.join(SUPPORTED_FAMILIES)}"
    )


def load_causal_lm(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Build `tiny-<family>` from a config (seeded init) or load a hub id / local directory.

    Attention is forced to SDPA: stages call decoder layers without a mask tensor and rely on
    SDPA's causal path, which the split-equals-unsplit test checks.
    """
    if cfg.name.startswith(TINY_PREFIX):
        family = cfg.name[len(TINY_PREFIX) :]
        config = tiny_config(family, cfg)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return model.eval()
    _pretrained_config(cfg.name)
    log.info("loading %s (a hub id is downloaded on first use, with a progress bar per file)", cfg.name)
    t0 = time.monotonic()
    model = from_pretrained(cfg.name, dtype)
    n = sum(p.numel() for p in model.parameters())
    log.info("loaded %s: %.1fM parameters in %.1fs", cfg.name, n / 1e6, time.monotonic() - t0)
    return model.eval()


def _pretrained_config(name: str):
    config = pretrained_config(name)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(
            "model.name",
            name,
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}",
        )
    return config


def resolve_dims(cfg: ModelConfig) -> ModelConfig:
    """The config with a hub or local model's real layer count, hidden size and heads (only its
    config.json is read). Why: the tracker plans stages from `num_layers` and reports compression
    from `hidden_size`; for a pretrained model those come from the model, not from the run.toml."""
    if cfg.name.startswith(TINY_PREFIX):
        return cfg
    config = _pretrained_config(cfg.name)
    return dataclasses.replace(
        cfg, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=config.num_attention_heads
    )


def model_config(cfg: ModelConfig):
    """The model's HF config without its weights: what a meta build or a memory plan needs."""
    if cfg.name.startswith(TINY_PREFIX):
        config = tiny_config(cfg.name[len(TINY_PREFIX) :], cfg)
    else:
        config = _pretrained_config(cfg.name)
    config._attn_implementation = "sdpa"
    return config


def meta_stage(cfg: ModelConfig, index: int, *, dtype: torch.dtype = torch.float32) -> StageModule:
    """Stage `index` built on the meta device: every shape, no memory. Why: the memory plan and
    the per-stage loader need the stage's modules before any weight exists."""
    return meta_stages(cfg, [index], dtype=dtype)[0]


def meta_stages(
    cfg: ModelConfig, indices: list[int], *, dtype: torch.dtype = torch.float32, config=None
) -> list[StageModule]:
    """Several meta stages from one meta build of the model (a plan of every stage needs them)."""
    config = config if config is not None else model_config(cfg)
    ranges = layer_ranges(config.num_hidden_layers, cfg.num_stages)
    for index in indices:
        _check_index(cfg, index)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return [StageModule(model, i, *ranges[i], cfg.num_stages) for i in indices]


def _check_index(cfg: ModelConfig, index: int) -> None:
    if not 0 <= index < cfg.num_stages:
        raise ConfigError("stage", index, f"must be in [0, model.num_stages={cfg.num_stages})")


def load_stage(
    cfg: ModelConfig,
    index: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Stage `index` with its weights, reading only this stage's tensors from the checkpoint.

    Why: a volunteer holding one stage of an 8B model should neither download nor hold the
    other stages. Tiny models are the exception: their seeded init draws every module's values
    in order from one RNG stream, so a stage's initial weights depend on all modules before it;
    building the whole (small) model is the only way to get the same numbers as `split_model`.
    """
    if cfg.name.startswith(TINY_PREFIX):
        _check_index(cfg, index)
        return split_model(load_causal_lm(cfg, seed=seed, dtype=dtype), cfg.num_stages)[index].to(device)
    config = model_config(cfg)
    src = resolve(cfg.name)
    files = None if src.gguf_file else _safetensors_files(src.path)
    if files is None:
        what = "is one GGUF file" if src.gguf_file else "has no safetensors weights"
        log.warning(
            "%s %s: loading the whole model to keep stage %d (needs the full model's memory once)",
            cfg.name,
            what,
            index,
        )
        stage = _keep_stage(load_causal_lm(cfg, dtype=dtype), cfg, index).to(device)
        trim_host_memory()  # the rest of the model is garbage now: hand its pages back
        return stage
    t0 = time.monotonic()
    stage = meta_stages(cfg, [index], dtype=dtype, config=config)[0]
    stage.to_empty(device=device)
    _rebuild_buffers(stage, config, torch.device(device))
    read, opened = _read_stage_tensors(stage, files, config)
    log.info(
        "stage %d of %s: read %.1f MiB from %d of %d weight file(s) in %.1fs",
        index,
        cfg.name,
        read / 2**20,
        opened,
        len(set(files.values())),
        time.monotonic() - t0,
    )
    return stage.eval()


def _keep_stage(model: PreTrainedModel, cfg: ModelConfig, index: int) -> StageModule:
    """Stage `index` of a whole loaded model, without copying the other stages (split_model would)."""
    start, end = layer_ranges(model.config.num_hidden_layers, cfg.num_stages)[index]
    return StageModule(model, index, start, end, cfg.num_stages)


def trim_host_memory() -> None:
    """Collect cycles, then hand glibc's free heap back to the OS. Why: a peer that loaded a whole
    model to keep one stage held the rest's pages (5.4 GB resident for half of SmolLM2-135M, four
    such peers on a 24 GB machine were killed for memory); freed blocks stay in glibc's arenas
    until trimmed. No-op where libc is not glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _safetensors_files(name: str) -> dict[str, str] | None:
    """Checkpoint key -> where its shard is (a local path, or "hub_id::file" fetched only when a
    stage needs it); {"*": path} for a single-file checkpoint; None without safetensors weights."""
    local = os.path.isdir(name)

    def fetch(filename: str) -> str | None:
        if local:
            path = os.path.join(name, filename)
            return path if os.path.isfile(path) else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(name, filename)
        except EntryNotFoundError:
            return None
        except Exception as exc:  # offline, gated, no such repo: the message says which
            raise ConfigError("model.name", name, f"cannot fetch {filename} ({exc})") from exc

    index = fetch("model.safetensors.index.json")
    if index is not None:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError("model.name", name, f"{index} is not a valid safetensors index ({exc})") from exc
        return {key: os.path.join(name, file) if local else f"{name}::{file}" for key, file in weight_map.items()}
    single = fetch("model.safetensors")
    return None if single is None else {"*": single}


def _shard_path(ref: str) -> str:
    """A local shard path, downloading it first when `ref` is "hub_id::file"."""
    if "::" not in ref:
        return ref
    from huggingface_hub import hf_hub_download

    repo, _, file = ref.partition("::")
    try:
        return hf_hub_download(repo, file)
    except Exception as exc:
        raise ConfigError("model.name", repo, f"cannot fetch shard {file} ({exc})") from exc


def _rebuild_buffers(stage: StageModule, config, device: torch.device) -> None:
    """`to_empty` leaves buffers uninitialised; the only ones a stage holds are the rotary
    embedding's non-persistent `inv_freq`s, recomputed from the config (on the CPU, as a full
    load does, then moved). Any other buffer would stay garbage, so it is refused."""
    if stage.rotary is not None:
        stage.rotary = type(stage.rotary)(config).to(device)
    other = [n for n, _ in stage.named_buffers() if not n.startswith("rotary.")]
    if other:
        raise ConfigError(
            "model.name", config._name_or_path, f"stage buffers {other} are not restored by the per-stage loader"
        )


def _checkpoint_keys(hf_name: str, config) -> list[str]:
    """Where a parameter may sit in a checkpoint: under its own name, as the input embedding when
    the head is tied to it and not stored, or without the base-model prefix (old GPT-2 files)."""
    names = [hf_name]
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        names.append("transformer.wte.weight" if config.model_type == "gpt2" else "model.embed_tokens.weight")
    return names + [n.partition(".")[2] for n in names if n.startswith(("transformer.", "model."))]


def _read_stage_tensors(stage: StageModule, files: dict[str, str], config) -> tuple[int, int]:
    """Copy every stage parameter from its shard, opening each needed shard once and reading only
    the stage's keys. Returns (bytes read, files opened)."""
    name = config._name_or_path
    wanted: dict[str, list[tuple[torch.nn.Parameter, str]]] = {}
    for pname, param in stage.named_parameters():
        hf_name = stage.hf_names[pname]
        ref = files.get("*") or next((files[k] for k in _checkpoint_keys(hf_name, config) if k in files), None)
        if ref is None:
            raise ConfigError(
                "model.name", name, f"checkpoint key {hf_name!r} is in no shard of model.safetensors.index.json"
            )
        wanted.setdefault(ref, []).append((param, hf_name))
    read = 0
    for ref, params in wanted.items():
        path = _shard_path(ref)
        if not os.path.isfile(path):
            raise ConfigError("model.name", name, f"shard {path} (holding {params[0][1]!r}) does not exist")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                keys = set(f.keys())
                for param, hf_name in params:
                    key = next((k for k in _checkpoint_keys(hf_name, config) if k in keys), None)
                    if key is None:
                        raise ConfigError("model.name", name, f"checkpoint key {hf_name!r} is missing from {path}")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(param.shape):
                        raise ConfigError(
                            "model.name",
                            name,
                            f"checkpoint key {key!r} in {path} has shape {shape}, the stage expects {tuple(param.shape)}",
                        )
                    tensor = f.get_tensor(key)
                    with torch.no_grad():
                        param.copy_(tensor)
                    read += tensor.numel() * tensor.element_size()
        except ConfigError:
            raise
        except Exception as exc:  # a truncated or corrupt shard: safetensors raises its own types
            raise ConfigError("model.name", name, f"cannot read {path} ({type(exc).__name__}: {exc})") from exc
    return read, len(wanted)
