"""`manifest.json` of a prepared data folder: what `data prepare` wrote and what a reader checks.

Why a manifest: the tracker will hand out training windows by id and peers will fetch shards
from elsewhere, so every shard must be checkable on its own (name, size, sha256) and the whole
set must say which tokenizer made it. JSON, not pickles: a manifest is read from untrusted places.

Layout of a prepared folder (SPLIT is `train`, `eval` or `confirm`):
    manifest.json
    SPLIT-00000.bin   token ids, little-endian `dtype`, `shard_tokens` of them (the last shard fewer)
    SPLIT-00000.idx   uint64 offsets (within the shard) of the documents that start in that shard
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peer.errors import AnchormeshError, ConfigError

FORMAT = "anchormesh-tokens"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval", "confirm")
DTYPES = ("uint16", "uint32")
INDEX_DTYPE = "<u8"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 ids: a few seconds to fetch, hash and map
DEFAULT_HELDOUT_FRACTION = 0.01
DEFAULT_MIN_HELDOUT_TOKENS = 4096  # one evaluation pass of the tiny run: 4 x 8 windows of 128 + 1


class ShardError(AnchormeshError, ValueError):
    """A shard (or its index) does not match the manifest: missing, truncated, oversized or
    different content. `shard` names the file, so a caller can fetch it again or take other work."""

    def __init__(self, shard: str, why: str) -> None:
        self.shard = shard
        super().__init__(f"shard {shard}: {why}")


@dataclass(frozen=True)
class ShardInfo:
    """One shard file and its document index, as the manifest lists them."""

    name: str  # SPLIT-NNNNN.bin
    tokens: int
    documents: int  # documents that start in this shard (one may continue from the previous)
    sha256: str
    index: str  # SPLIT-NNNNN.idx
    index_sha256: str


@dataclass(frozen=True)
class SplitInfo:
    """The shards of one split, in order: their concatenation is the split's token stream."""

    tokens: int = 0
    documents: int = 0
    shards: tuple[ShardInfo, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to check and address a prepared folder."""

    tokenizer: str  # `bytes`, or the model name the tokenizer came from (e.g. smollm2-135m)
    vocab_size: int
    dtype: str  # uint16 when the vocabulary fits, else uint32
    shard_tokens: int
    seed: int  # of the document hash that chose the eval and confirmation documents
    eval_fraction: float
    confirm_fraction: float
    source: str
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    def to_json(self) -> bytes:
        body = {"format": self.format, "version": self.version, **asdict(self)}  # what it is, first
        body["total"] = {"tokens": self.tokens, "documents": self.documents}
        body["split_method"] = (
            "sha256(seed as 8 bytes little-endian + document bytes): "
            "eval below eval_fraction, confirm below eval_fraction + confirm_fraction"
        )
        return (json.dumps(body, indent=1) + "\n").encode()


def read_manifest(folder: Path) -> Manifest:
    """The manifest of `folder`, checked for shape and consistency (not the shards themselves)."""
    path = Path(folder) / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            "data folder", str(folder), f"holds no {MANIFEST}: not a folder written by `anchormesh data prepare`"
        ) from None
    except OSError as exc:
        raise ConfigError(MANIFEST, str(path), f"cannot be read: {exc}") from None
    return parse_manifest(text, str(path))


def parse_manifest(text: bytes | str, path: str = MANIFEST) -> Manifest:
    """A manifest from its JSON (a file's, or the one a tracker sends), checked as `read_manifest` does."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ConfigError(MANIFEST, path, f"cannot be read as JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ConfigError(
            f"{MANIFEST}: format", body.get("format") if isinstance(body, dict) else None, f"must be {FORMAT!r}"
        )
    if body.get("version") != VERSION:
        raise ConfigError(f"{MANIFEST}: version", body.get("version"), f"this anchormesh reads version {VERSION}")
    try:
        splits = {name: _split(name, body["splits"][name]) for name in SPLITS}
        m = Manifest(
            tokenizer=str(body["tokenizer"]),
            vocab_size=int(body["vocab_size"]),
            dtype=str(body["dtype"]),
            shard_tokens=int(body["shard_tokens"]),
            seed=int(body["seed"]),
            eval_fraction=float(body["eval_fraction"]),
            confirm_fraction=float(body["confirm_fraction"]),
            source=str(body["source"]),
            splits=splits,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(MANIFEST, str(path), f"missing or malformed field: {type(exc).__name__}: {exc}") from None
    if m.dtype not in DTYPES:
        raise ConfigError(f"{MANIFEST}: dtype", m.dtype, f"must be one of {', '.join(DTYPES)}")
    if m.vocab_size > (1 << 16 if m.dtype == "uint16" else 1 << 32) or m.vocab_size < 1:
        raise ConfigError(f"{MANIFEST}: vocab_size", m.vocab_size, f"does not fit dtype {m.dtype}")
    if m.shard_tokens < 1:
        raise ConfigError(f"{MANIFEST}: shard_tokens", m.shard_tokens, "must be >= 1")
    return m


def _split(name: str, body: dict) -> SplitInfo:
    shards = tuple(
        ShardInfo(
            name=str(s["name"]),
            tokens=int(s["tokens"]),
            documents=int(s["documents"]),
            sha256=str(s["sha256"]),
            index=str(s["index"]),
            index_sha256=str(s["index_sha256"]),
        )
        for s in body["shards"]
    )
    for s in shards:
        if not (
            s.name == Path(s.name).name
            and s.name.startswith(f"{name}-")
            and s.name.endswith(".bin")
            and s.index == s.name[:-4] + ".idx"
        ):
            raise ConfigError(
                f"{MANIFEST}: splits.{name}.shards.name",
                s.name,
                f"must be a plain file name {name}-NNNNN.bin with its index {name}-NNNNN.idx",
            )
        if s.tokens < 0 or s.documents < 0:
            raise ConfigError(f"{MANIFEST}: splits.{name}.shards", s.name, "tokens and documents must be >= 0")
    split = SplitInfo(tokens=int(body["tokens"]), documents=int(body["documents"]), shards=shards)
    if split.tokens != sum(s.tokens for s in shards) or split.documents != sum(s.documents for s in shards):
        raise ConfigError(
            f"{MANIFEST}: splits.{name}",
            f"{split.tokens} tokens, {split.documents} documents",
            "differ from the sums over its shards",
        )
    return split
