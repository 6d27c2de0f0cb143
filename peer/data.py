"""Text corpora as token streams, for the local runner and the benchmarks, and the built-in corpus
a bootstrap prepares when its run names no data (bootstrap/run_data.py). The built-in ones are
found on the machine or generated, never downloaded. A swarm's stage-0 peers read none of this:
they train on the windows the tracker hands them (peer/daemon/feed.py).

Corpus A ("general"): English prose — the license texts every Debian-like system ships.
Corpus B ("domain"): Python source — the standard library of the running interpreter.
A PATH may be a file or a folder of text files. When nothing is found, a generated corpus of
the same kind stands in, so the benchmark runs anywhere.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from peer.errors import ConfigError

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


def generated(kind: str, n_bytes: int, seed: int) -> bytes:
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
            files += sorted(
                f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES and "test" not in f.name
            )
    data = _read_files(files, max_bytes)
    if len(data) >= 100_000:
        return data, ",".join(str(r) for r in roots if r.is_dir())
    return generated(kind, min(max_bytes, 400_000), seed=1 if kind == "a" else 2), f"generated:{kind}"


class TokenStream:
    """A byte-token corpus split into train and held-out parts (the last `heldout` fraction).

    Batches are [B, T+1] windows at random offsets: inputs are [:, :-1], targets [:, 1:].
    """

    def __init__(self, data: bytes | torch.Tensor, heldout: float = 0.1) -> None:
        """`data`: raw bytes (token id = byte value) or a 1-D tensor of token ids."""
        tokens = (
            data.to(torch.long)
            if isinstance(data, torch.Tensor)
            else torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
        )
        cut = int(len(tokens) * (1 - heldout))
        self.train, self.heldout = tokens[:cut], tokens[cut:]
        self.confirm: torch.Tensor | None = None  # a second held-out split, never used to choose settings

    @classmethod
    def from_splits(cls, train: torch.Tensor, heldout: torch.Tensor, confirm: torch.Tensor) -> TokenStream:
        """A stream whose splits were cut elsewhere (by document: peer/bench/corpus_split.py)."""
        stream = cls(torch.zeros(0, dtype=torch.long), heldout=0.0)
        stream.train, stream.heldout, stream.confirm = train, heldout, confirm
        return stream

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> torch.Tensor:
        src = self.train if split == "train" else self.heldout
        if len(src) <= seq_len + 1:
            raise ConfigError("pipeline.seq_len", seq_len, f"longer than the {split} split ({len(src)} tokens)")
        starts = torch.randint(0, len(src) - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([src[s : s + seq_len + 1] for s in starts.tolist()])

    def eval_batches(
        self, batch_size: int, seq_len: int, max_batches: int, split: str = "heldout"
    ) -> list[torch.Tensor]:
        """Fixed, non-overlapping held-out windows, the same on every call (for comparable eval
        loss); `split` "confirm": the confirmation split's."""
        src = self.confirm if split == "confirm" else self.heldout
        if src is None:
            raise ConfigError("split", split, "this stream has no confirmation split (it was cut by position)")
        n = min(max_batches * batch_size, (len(src) - 1) // (seq_len + 1))
        windows = [src[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(n)]
        return [torch.stack(windows[i : i + batch_size]) for i in range(0, n, batch_size)]
