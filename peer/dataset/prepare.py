"""`anchormesh data prepare`: tokenize a source once into token shards and a manifest.

Why once, by the operator: stage-0 peers should train on distinct, recorded data instead of each
tokenizing its own prefix of the source. The writer streams: documents are read, tokenized in
batches of about `BATCH_BYTES` and copied into one shard buffer per split, written (atomically,
with its sha256) as soon as it is full, so memory stays near three shards whatever the source
size. Each document goes whole to train, eval or confirmation by a seeded hash of its bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from peer.atomic import fsync_dir, write_atomic
from peer.dataset.manifest import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_MIN_HELDOUT_TOKENS,
    DEFAULT_SHARD_TOKENS,
    INDEX_DTYPE,
    MANIFEST,
    SPLITS,
    Manifest,
    ShardInfo,
    SplitInfo,
)
from peer.dataset.sources import open_source
from peer.errors import ConfigError
from peer.progress import byte_bar

BATCH_BYTES = 1 << 20  # text per tokenizer call: bounded memory, a moving progress bar
BYTES = "bytes"


class TokenIds:
    """The tokenizer as the writer needs it: a name for the manifest, a vocabulary size, and a
    batch of documents (bytes) to arrays of ids in the shards' dtype."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tok = None
        if name == BYTES:
            self.vocab_size = 256
        else:
            from peer.model.source import load_tokenizer

            try:
                self._tok = load_tokenizer(name)
            except ConfigError as exc:
                why = " ".join(
                    str(exc)[len(f"{exc.field}={exc.value!r}: ") :].split()
                )  # one line: the library's messages span several
                raise ConfigError(
                    "--tokenizer",
                    name,
                    f"{why} (allowed: bytes, smollm2-135m, a Hugging Face model id or folder, a .gguf file)",
                ) from None
            self._tok.model_max_length = 1 << 62  # documents are longer than the model's context: no warning
            self.vocab_size = len(self._tok)
        self.dtype = np.dtype("<u2" if self.vocab_size <= 1 << 16 else "<u4")

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(d, dtype=np.uint8).astype(self.dtype) for d in docs]
        ids = self._tok([d.decode("utf-8", errors="replace") for d in docs], add_special_tokens=False)["input_ids"]
        out = [np.asarray(x, dtype=np.int64) for x in ids]
        for a in out:
            if len(a) and int(a.max()) >= self.vocab_size:
                raise ConfigError(
                    "--tokenizer", self.name, f"gave id {int(a.max())}, outside its vocabulary of {self.vocab_size}"
                )
        return [a.astype(self.dtype) for a in out]

    def decode(self, ids: np.ndarray) -> bytes:
        """The text of `ids` (UTF-8), for checks and debugging."""
        if self._tok is None:
            return np.asarray(ids).astype(np.uint8).tobytes()
        return self._tok.decode(np.asarray(ids).tolist()).encode("utf-8")


def split_of(doc: bytes, seed: int, eval_fraction: float, confirm_fraction: float) -> str:
    """`train`, `eval` or `confirm` for one document: the same bytes and seed always give the same
    answer (so two runs, or two copies of a document, agree), and the shares are the fractions."""
    h = hashlib.sha256(seed.to_bytes(8, "little", signed=True))
    h.update(doc)
    u = int.from_bytes(h.digest()[:8], "little") / 2.0**64
    return "eval" if u < eval_fraction else "confirm" if u < eval_fraction + confirm_fraction else "train"


class ShardWriter:
    """Token shards of one split: one buffer of `shard_tokens` ids, written when full. A document
    may continue into the next shard; each shard's index lists the documents that start in it."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.buf = np.empty(shard_tokens, dtype=dtype)  # pages are touched only as they fill
        self.fill = 0
        self.starts: list[int] = []
        self.shards: list[ShardInfo] = []

    def add(self, ids: np.ndarray) -> None:
        """Append one document (an empty one is not a document)."""
        if not len(ids):
            return
        self.starts.append(self.fill)
        done = 0
        while done < len(ids):
            n = min(len(ids) - done, self.shard_tokens - self.fill)
            self.buf[self.fill : self.fill + n] = ids[done : done + n]
            self.fill += n
            done += n
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        """Write the buffer (if it holds anything) as the next shard and its index."""
        if not self.fill:
            return
        stem = f"{self.split}-{len(self.shards):05d}"
        tokens = memoryview(self.buf[: self.fill]).cast("B")
        index = np.asarray(self.starts, dtype=INDEX_DTYPE).tobytes()
        write_atomic(self.folder / f"{stem}.bin", lambda f: f.write(tokens))
        write_atomic(self.folder / f"{stem}.idx", index)
        self.shards.append(
            ShardInfo(
                name=f"{stem}.bin",
                tokens=self.fill,
                documents=len(self.starts),
                sha256=hashlib.sha256(tokens).hexdigest(),
                index=f"{stem}.idx",
                index_sha256=hashlib.sha256(index).hexdigest(),
            )
        )
        self.fill = 0
        self.starts = []

    def info(self) -> SplitInfo:
        return SplitInfo(
            tokens=sum(s.tokens for s in self.shards),
            documents=sum(s.documents for s in self.shards),
            shards=tuple(self.shards),
        )


def check_out(out: Path, force: bool) -> None:
    """Refuse an output folder that holds anything, unless --force and it is a prepared folder
    (never delete a folder `data prepare` did not write, whatever the flags)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(
                "--out",
                str(out),
                "exists and is not empty; name a new folder, or pass --force to replace a prepared one",
            )
        if not (out / MANIFEST).is_file():
            raise ConfigError(
                "--out",
                str(out),
                f"exists, is not empty and holds no {MANIFEST}; --force replaces only a folder written by `data prepare`",
            )


def prepare(
    source: str,
    tokenizer: str | TokenIds,
    out: Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eval_fraction: float = DEFAULT_HELDOUT_FRACTION,
    confirm_fraction: float = DEFAULT_HELDOUT_FRACTION,
    min_heldout_tokens: int = DEFAULT_MIN_HELDOUT_TOKENS,
    seed: int = 0,
    text_field: str = "text",
    force: bool = False,
    show_progress: bool | None = None,
    max_bytes: int | None = None,
) -> Manifest:
    """Tokenize `source` into `out` (see the module docstring) with `tokenizer` (a name, or a
    `TokenIds` already loaded); returns the manifest written.

    The folder appears whole or not at all: shards go to a hidden `.NAME.partial` folder beside
    `out`, renamed into place after the manifest. A source too small for its held-out sets is
    refused (ConfigError naming SOURCE and the minimum) and leaves nothing behind. `max_bytes`:
    stop after the document that reaches this much text (a bootstrap preparing a run's data)."""
    out = Path(os.path.abspath(out))  # `.` or `dir/` still name a folder beside which `.partial` goes
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens", shard_tokens, "must be >= 1")
    for flag, value in (("--eval-fraction", eval_fraction), ("--confirm-fraction", confirm_fraction)):
        if not 0 < value < 0.5:
            raise ConfigError(flag, value, "must be in (0, 0.5)")
    if eval_fraction + confirm_fraction >= 0.5:
        raise ConfigError(
            "--confirm-fraction",
            confirm_fraction,
            f"with --eval-fraction {eval_fraction} holds out half the documents or more; together they must stay below 0.5",
        )
    if min_heldout_tokens < 1:
        raise ConfigError("--min-heldout-tokens", min_heldout_tokens, "must be >= 1")
    check_out(out, force)
    src = open_source(source, text_field)
    tok = tokenizer if isinstance(tokenizer, TokenIds) else TokenIds(tokenizer)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # a leftover of a killed run
    partial.mkdir(parents=True)
    try:
        writers = {s: ShardWriter(partial, s, tok.dtype, shard_tokens) for s in SPLITS}
        started = time.monotonic()
        docs = src.documents() if max_bytes is None else _at_most(src.documents(), max_bytes)
        total = src.total_bytes if max_bytes is None or src.total_bytes is None else min(src.total_bytes, max_bytes)
        _tokenize_into(docs, tok, writers, seed, eval_fraction, confirm_fraction, total, show_progress)
        for w in writers.values():
            w.flush()
        manifest = Manifest(
            tokenizer=tok.name,
            vocab_size=tok.vocab_size,
            dtype=tok.dtype.name,
            shard_tokens=shard_tokens,
            seed=seed,
            eval_fraction=eval_fraction,
            confirm_fraction=confirm_fraction,
            source=source,
            splits={s: w.info() for s, w in writers.items()},
        )
        _check_enough(manifest, min_heldout_tokens)
        write_atomic(partial / MANIFEST, manifest.to_json())
        fsync_dir(partial)
        check_out(out, force)  # again: someone may have written there meanwhile
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(partial, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    elapsed = max(time.monotonic() - started, 1e-9)
    counts = ", ".join(
        f"{s} {manifest.splits[s].tokens:,} tokens / {manifest.splits[s].documents:,} documents" for s in SPLITS
    )
    shards = sum(len(v.shards) for v in manifest.splits.values())
    print(
        f"prepared {out}: {counts}; {shards} shards; {elapsed:.1f} s ({manifest.tokens / elapsed:,.0f} tokens/s)",
        file=sys.stderr,
    )
    return manifest


def _at_most(docs, max_bytes: int):
    seen = 0
    for doc in docs:
        yield doc
        seen += len(doc)
        if seen >= max_bytes:
            return


def _tokenize_into(
    docs,
    tok: TokenIds,
    writers: dict[str, ShardWriter],
    seed: int,
    eval_fraction: float,
    confirm_fraction: float,
    total: int | None,
    show: bool | None,
) -> None:
    """Batch documents, tokenize each batch in one call, hand each document to its split's writer."""
    batch: list[bytes] = []
    size = tokens = 0
    with byte_bar(f"tokenizing with {tok.name}", total, show=show) as bar:

        def drain() -> None:
            nonlocal batch, size, tokens
            for doc, ids in zip(batch, tok.encode(batch)):
                writers[split_of(doc, seed, eval_fraction, confirm_fraction)].add(ids)
                tokens += len(ids)
            bar.update(size)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
            batch, size = [], 0

        for doc in docs:
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES:
                drain()
        if batch:
            drain()


def _check_enough(m: Manifest, min_tokens: int) -> None:
    """Each split needs `min_tokens`; else say what came out and what would be enough."""
    short = [s for s in SPLITS if m.splits[s].tokens < min_tokens]
    if not short:
        return
    got = "; ".join(f"{s}: {m.splits[s].documents} documents, {m.splits[s].tokens} tokens" for s in SPLITS)
    share = min(m.eval_fraction, m.confirm_fraction)
    raise ConfigError(
        "SOURCE",
        m.source,
        f"too little text for its eval and confirmation splits ({got}); each split needs at least {min_tokens} tokens "
        f"(--min-heldout-tokens), so about {int(min_tokens / share):,} tokens in at least {int(2 / share)} documents "
        f"at --eval-fraction {m.eval_fraction} --confirm-fraction {m.confirm_fraction}",
    )
