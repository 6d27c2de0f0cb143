"""Text corpora as token streams. The built-in ones are found on the machine or generated, never
downloaded; a run's `[data]` may instead name a local path or a streamed Hugging Face dataset
(`load_training_data`).

Corpus A ("general"): English prose — the license texts every Debian-like system ships.
Corpus B ("domain"): Python source — the standard library of the running interpreter.
A PATH may be a file or a folder of text files. When nothing is found, a generated corpus of
the same kind stands in, so the benchmark runs anywhere.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from peer.errors import ConfigError
from peer.progress import byte_bar

if TYPE_CHECKING:
    from peer.config import DataConfig, TrainConfig

TEXT_SUFFIXES = {"", ".txt", ".md", ".rst", ".py"}
DEFAULT_MAX_BYTES = 2_000_000


def _read_files(files: list[Path], max_bytes: int) -> bytes:
    out, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if b"\x00" in data[:1024]:  # binary file
            continue
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(out)[:max_bytes]


def read_path(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, name: str = "corpus") -> bytes:
    """Bytes of a text file, or of the text files below a folder (sorted, up to max_bytes)."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    else:
        raise ConfigError(name, str(path), "no such file or folder")
    data = _read_files(files, max_bytes)
    if len(data) < 10_000:
        raise ConfigError(name, str(path), f"holds only {len(data)} bytes of text; need at least 10000")
    return data


def _generated(kind: str, n_bytes: int, seed: int) -> bytes:
    """A stand-in corpus: templated prose (A) or templated Python (B)."""
    rng = random.Random(seed)
    nouns = "license work software copy program source holder party notice term right code".split()
    verbs = "grants permits requires distributes modifies includes provides covers states".split()
    names = "value count item node total index result buffer key data".split()
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        if kind == "a":
            s = f"The {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)} of the {rng.choice(nouns)}. "
        else:
            a, b = rng.sample(names, 2)
            s = f"def {a}_{rng.randint(0, 99)}({b}):\n    {a} = {b} + {rng.randint(0, 9)}\n    return {a}\n\n"
        parts.append(s)
        size += len(s)
    return "".join(parts).encode()


def default_corpus(kind: str, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """(bytes, where they came from) for corpus "a" or "b"."""
    if kind == "a":
        roots = [Path("/usr/share/common-licenses")]
    elif kind == "b":
        lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        roots = [lib / name for name in ("json", "email", "http", "asyncio", "logging", "unittest", "xml")]
    else:
        raise ConfigError("corpus", kind, "must be 'a' or 'b'")
    files = []
    for root in roots:
        if root.is_dir():
            files += sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES and "test" not in f.name)
    data = _read_files(files, max_bytes)
    if len(data) >= 100_000:
        return data, ",".join(str(r) for r in roots if r.is_dir())
    return _generated(kind, min(max_bytes, 400_000), seed=1 if kind == "a" else 2), f"generated:{kind}"


class TokenStream:
    """A byte-token corpus split into train and held-out parts (the last `heldout` fraction).

    Batches are [B, T+1] windows at random offsets: inputs are [:, :-1], targets [:, 1:].
    """

    def __init__(self, data: bytes | torch.Tensor, heldout: float = 0.1) -> None:
        """`data`: raw bytes (token id = byte value) or a 1-D tensor of token ids."""
        tokens = data.to(torch.long) if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
        cut = int(len(tokens) * (1 - heldout))
        self.train, self.heldout = tokens[:cut], tokens[cut:]

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> torch.Tensor:
        src = self.train if split == "train" else self.heldout
        if len(src) <= seq_len + 1:
            raise ConfigError("pipeline.seq_len", seq_len, f"longer than the {split} split ({len(src)} tokens)")
        starts = torch.randint(0, len(src) - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([src[s : s + seq_len + 1] for s in starts.tolist()])

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[torch.Tensor]:
        """Fixed, non-overlapping held-out windows, the same on every call (for comparable eval loss)."""
        n = min(max_batches * batch_size, (len(self.heldout) - 1) // (seq_len + 1))
        windows = [self.heldout[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(n)]
        return [torch.stack(windows[i : i + batch_size]) for i in range(0, n, batch_size)]


TOKENIZE_CHUNK = 1 << 20  # bytes per tokenizer call: bounded memory and a moving progress bar


def _dataset_text(cfg: DataConfig) -> bytes:
    """Stream `cfg.dataset` with the `datasets` library up to `max_bytes` of text (UTF-8)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.dataset", cfg.dataset, "needs the `datasets` package on stage-0 peers: pip install 'anchormesh[data]'") from None
    try:
        rows = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None, split=cfg.split, streaming=True)
    except Exception as exc:  # the library raises many kinds (not found, no network, bad config)
        raise ConfigError("data.dataset", cfg.dataset, f"cannot load it: {type(exc).__name__}: {exc}") from None
    out, total = [], 0
    with byte_bar(f"streaming {cfg.dataset}", cfg.max_bytes) as bar:
        for row in rows:
            if cfg.text_field not in row:
                raise ConfigError("data.text_field", cfg.text_field, f"not a column of {cfg.dataset}; columns: {', '.join(sorted(row))}")
            text = str(row[cfg.text_field]).encode("utf-8")
            out.append(text)
            total += len(text) + 1
            bar.update(len(text) + 1)
            if total >= cfg.max_bytes:
                break
    data = b"\n".join(out)[: cfg.max_bytes]
    if len(data) < 10_000:
        raise ConfigError("data.dataset", cfg.dataset, f"gave only {len(data)} bytes of text; need at least 10000")
    return data


def _tokenize(data: bytes, cfg: TrainConfig, vocab_size: int) -> bytes | torch.Tensor:
    """Byte ids as they are, or ids from the model's own tokenizer (checked against the model's vocabulary)."""
    if cfg.data.tokenizer == "bytes":
        if vocab_size < 256:
            raise ConfigError("data.tokenizer", "bytes", f"byte ids need a vocabulary of 256; {cfg.model.name} has {vocab_size}")
        return data
    from peer.model.source import load_tokenizer

    tok = load_tokenizer(cfg.model.name)
    parts = []
    with byte_bar(f"tokenizing with the tokenizer of {cfg.model.name}", len(data)) as bar:
        start = 0
        while start < len(data):  # chunks end at a newline, so no character or word is cut in two
            cut = data.find(b"\n", start + TOKENIZE_CHUNK)
            end = len(data) if cut < 0 else cut + 1
            chunk, start = data[start:end], end
            parts.append(torch.tensor(tok(chunk.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"], dtype=torch.long))
            bar.update(len(chunk))
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if len(ids) and int(ids.max()) >= vocab_size:
        raise ConfigError("data.tokenizer", "model", f"the tokenizer of {cfg.model.name} gives id {int(ids.max())}, outside the model's vocabulary of {vocab_size}")
    return ids


def load_training_data(cfg: TrainConfig, vocab_size: int) -> tuple[TokenStream, str]:
    """A stage-0 peer's data as `cfg.data` says: a local path, a streamed dataset, or the built-in
    corpus; tokenized by bytes or by the model's tokenizer. Returns (stream, where it came from)."""
    d = cfg.data
    if d.path:
        data, source = read_path(d.path, d.max_bytes, name="data.path"), d.path
    elif d.dataset:
        data, source = _dataset_text(d), f"dataset:{d.dataset}"
    else:
        data, source = default_corpus("b", d.max_bytes)
    return TokenStream(_tokenize(data, cfg, vocab_size), heldout=d.heldout), source
