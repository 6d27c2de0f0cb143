"""The quality benchmark's corpora cut by document: training text, an eval set that chooses
settings, and a confirmation set that never does.

Why by document and not the tail: the tail of one file is one author's one topic, and a corpus
that repeats itself (boilerplate, quoted passages) leaks its tail into its head. Documents are
ordered by a seeded hash of their name (so the held-out ones are drawn across the corpus, and
the same seed always holds out the same ones) and taken whole: the first ones until the eval set
has `eval_tokens`, the next until the confirmation set has as many, the rest is training text.
Each held-out set's 50-character shingles found in the training text are reported
(peer/bench/overlap.py): leakage is measured, not assumed away.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from peer.bench.overlap import LIMIT, overlap, overlap_each
from peer.errors import ConfigError

EVAL_TOKENS = 16_384  # per held-out set: 32 windows of 512 tokens
MIN_TRAIN_TOKENS = 32_768  # 64 windows of 512 tokens: less and a row memorises its training text
SUFFIXES = {"", ".txt", ".md", ".rst", ".py"}  # "" : the licence texts have no suffix


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass
class CorpusSplit:
    """Token ids of each part, and what a reader of the benchmark needs to trust them."""

    train: torch.Tensor
    eval: torch.Tensor
    confirm: torch.Tensor
    info: dict


def read_documents(path: Path, max_bytes: int, name: str = "corpus") -> list[Document]:
    """The text files under `path` (a folder; sorted), whole, until `max_bytes` of text."""
    if not path.is_dir():
        raise ConfigError(name, str(path), "must be a folder of text files: documents are held out whole")
    docs, total = [], 0
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES):
        raw = f.read_bytes()
        if b"\x00" in raw[:1024]:
            continue
        docs.append(Document(str(f.relative_to(path)), raw.decode("utf-8", errors="replace")))
        total += len(raw)
        if total >= max_bytes:
            break
    return docs


def _order(docs: Sequence[Document], seed: int) -> list[Document]:
    key = lambda d: hashlib.blake2b(f"{seed}|{d.name}".encode(), digest_size=8).digest()  # noqa: E731
    return sorted(docs, key=key)


def split_corpus(
    docs: Sequence[Document],
    tokenize: Callable[[str], list[int]],
    seed: int,
    eval_tokens: int = EVAL_TOKENS,
    min_train_tokens: int = MIN_TRAIN_TOKENS,
    name: str = "corpus",
    avoid_repeats: bool = True,
) -> CorpusSplit:
    """Eval, confirmation and training token ids (documents joined by their own ids), with each
    held-out set's overlap with the training text.

    The held-out documents are drawn in hash order from a pool of about four sets' worth; one
    that repeats the rest of the corpus (its shingles found there at `LIMIT` or more: a page
    copied with small edits) is not held out but trained on, so a held-out set measures
    generalisation, not recall (`avoid_repeats` False: a generated stand-in, repetitive by
    construction). A corpus too small for both held-out sets and
    `min_train_tokens` of training text is refused with the minimum."""
    ordered = _order(docs, seed)
    pool, pool_bytes = [], 0
    while len(pool) < len(ordered) and pool_bytes < 16 * eval_tokens:  # ~4 bytes a token: four sets' worth
        pool.append(ordered[len(pool)])
        pool_bytes += len(pool[-1].text)
    rest = ordered[len(pool) :]
    leaks = overlap_each([d.text for d in pool], [d.text for d in rest])
    parts: dict[str, list[Document]] = {"eval": [], "confirm": [], "train": []}
    ids: dict[str, list[int]] = {"eval": [], "confirm": [], "train": []}
    repeats = []
    for doc, leak in zip(pool, leaks):
        part = next((p for p in ("eval", "confirm") if len(ids[p]) < eval_tokens), "train")
        if part != "train" and avoid_repeats and leak >= LIMIT:
            repeats.append(doc.name)
            part = "train"
        parts[part].append(doc)
        ids[part] += tokenize(doc.text)
    for doc in rest:
        parts["train"].append(doc)
        ids["train"] += tokenize(doc.text)
    counts = {p: len(v) for p, v in ids.items()}
    if counts["confirm"] < eval_tokens or counts["train"] < min_train_tokens:
        raise ConfigError(
            name,
            f"{len(docs)} documents, {sum(counts.values()):,} tokens",
            f"too small: it needs {eval_tokens:,} tokens for each of eval and confirmation (whole documents that do "
            f"not repeat the rest) and {min_train_tokens:,} to train on; got eval {counts['eval']:,}, confirmation "
            f"{counts['confirm']:,}, training {counts['train']:,}",
        )
    train_texts = [d.text for d in parts["train"]]
    final = {p: overlap([d.text for d in parts[p]], train_texts) for p in ("eval", "confirm")}
    info = {
        "documents": {p: len(v) for p, v in parts.items()},
        "tokens": counts,
        "heldout_documents": {p: [d.name for d in parts[p]] for p in ("eval", "confirm")},
        "not_held_out_repeats": repeats,
        "overlap": final,  # share of each held-out set's 50-character shingles found in the training text
        "overlap_ok": all(v < LIMIT for v in final.values()),
        "split": "whole documents by blake2b(seed|name): eval first, confirmation next, the rest trains; "
        f"a document whose shingles the rest of the corpus holds at >= {LIMIT:.0%} trains instead",
    }
    as_tensor = lambda p: torch.tensor(ids[p], dtype=torch.long)  # noqa: E731
    return CorpusSplit(as_tensor("train"), as_tensor("eval"), as_tensor("confirm"), info)
