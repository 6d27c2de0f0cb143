"""The `[data]` section: what the run trains on (read by the bootstrap only)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice
from peer.dataset.manifest import DEFAULT_SHARD_TOKENS
from peer.errors import ConfigError

MIN_SHARD_TOKENS = 4096  # below this a run's shards are mostly fetch and hash overhead

DATA_TOKENIZERS = ("auto", "bytes", "model")


@dataclass
class DataConfig:
    """What the run trains on. The bootstrap alone reads it: it serves the run's prepared data
    (token shards, bootstrap/run_data.py) and stage-0 peers fetch the shards they are given from
    it, so no peer ever reads a path named here.

    Args:
        prepared: a folder written by `anchormesh data prepare` (on the bootstrap's machine), or
            `hf://OWNER/NAME[@REVISION]`: a Hugging Face dataset repo holding such a folder's files
            (the bootstrap pins the revision's commit; stage-0 peers download their shards from
            the hub, not from the bootstrap); the run trains on it. "" = the bootstrap prepares
            `path`, `dataset` or the built-in corpus itself into its state dir at start (at most
            `max_bytes` of text).
        path: a text file or a folder of text files on the bootstrap's machine; "" (with no
            `dataset`) = the built-in corpus (Python's standard library sources, or a generated
            stand-in).
        dataset: a Hugging Face dataset id, streamed with the `datasets` library on the bootstrap;
            exclusive with `path`.
        dataset_config: the dataset's config name, if it has several.
        split: the dataset split to stream.
        text_field: the column holding the text.
        tokenizer: "bytes" (token id = byte value, no download; what the tiny models use),
            "model" (the model's own tokenizer: `AutoTokenizer.from_pretrained(model.name)`, or
            the vocabulary stored in a GGUF file) or "auto" (bytes for the tiny models, the
            model's own for a pretrained one: a pretrained model fed byte ids learns nothing it knew).
        heldout: the fraction of documents the bootstrap keeps out of training when it prepares
            the data: half for the evaluation passes, half as a confirmation set never evaluated
            during the run (the local runner: the fraction at the end of its text).
        max_bytes: bytes of text the bootstrap prepares from `path`, `dataset` or the built-in corpus.
        shard_tokens: token ids per shard when the bootstrap prepares the data: a stage-0 peer
            trains once its first shard is in, so a run whose volunteers sit on slow links
            starts sooner with smaller shards (the default, 32 MiB of ids, takes 1.3 s at
            200 Mbit/s and 11 s at 25); every shard costs one more fetch and hash check.
    """

    prepared: str = ""
    path: str = ""
    dataset: str = ""
    dataset_config: str = ""
    split: str = "train"
    text_field: str = "text"
    tokenizer: str = "auto"
    heldout: float = 0.1
    max_bytes: int = 2_000_000
    shard_tokens: int = DEFAULT_SHARD_TOKENS

    def __post_init__(self) -> None:
        if self.path and self.dataset:
            raise ConfigError(
                "data.dataset", self.dataset, f"give data.path or data.dataset, not both (data.path={self.path!r})"
            )
        if self.prepared.startswith("hf://"):
            from peer.dataset.hub import parse_hub

            parse_hub(self.prepared)
        if self.prepared and (self.path or self.dataset):
            raise ConfigError(
                "data.prepared",
                self.prepared,
                "the run trains on the prepared folder: leave data.path and data.dataset out (they are what `data prepare` reads)",
            )
        choice("data.tokenizer", self.tokenizer, DATA_TOKENIZERS)
        if not (0.0 < self.heldout < 0.5):
            raise ConfigError("data.heldout", self.heldout, "must be in (0, 0.5)")
        if self.max_bytes < 10_000:
            raise ConfigError("data.max_bytes", self.max_bytes, "must be >= 10000")
        if self.shard_tokens < MIN_SHARD_TOKENS:
            raise ConfigError("data.shard_tokens", self.shard_tokens, f"must be >= {MIN_SHARD_TOKENS}")
        if not self.split:
            raise ConfigError("data.split", self.split, "must not be empty")
        if not self.text_field:
            raise ConfigError("data.text_field", self.text_field, "must not be empty")
