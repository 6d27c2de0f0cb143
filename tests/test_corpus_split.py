"""The quality benchmark's corpora cut by document (peer/bench/corpus_split.py)."""

from __future__ import annotations

import random

import pytest

from peer.bench.corpus_split import Document, split_corpus
from peer.errors import ConfigError


def _doc(i: int, n: int = 3000) -> Document:
    rng = random.Random(i)
    words = [rng.choice("alpha beta gamma delta epsilon zeta eta theta iota kappa".split()) for _ in range(n // 6)]
    return Document(f"doc{i:03d}.txt", f"document {i} " + " ".join(words))


def _bytes(text: str) -> list[int]:
    return list(text.encode())


DOCS = [_doc(i) for i in range(60)]


def test_documents_are_held_out_whole_and_the_same_seed_holds_out_the_same_ones() -> None:
    a = split_corpus(DOCS, _bytes, seed=3, eval_tokens=4000, min_train_tokens=1000)
    b = split_corpus(list(reversed(DOCS)), _bytes, seed=3, eval_tokens=4000, min_train_tokens=1000)
    assert a.info["heldout_documents"] == b.info["heldout_documents"]
    held = a.info["heldout_documents"]["eval"] + a.info["heldout_documents"]["confirm"]
    assert len(set(held)) == len(held) and a.info["documents"]["train"] == 60 - len(held)
    assert (
        len(a.eval) >= 4000
        and len(a.confirm) >= 4000
        and len(a.eval) + len(a.confirm) + len(a.train) == sum(len(_bytes(d.text)) for d in DOCS)
    )
    other = split_corpus(DOCS, _bytes, seed=4, eval_tokens=4000, min_train_tokens=1000)
    assert other.info["heldout_documents"] != a.info["heldout_documents"]


def test_a_document_that_repeats_the_rest_is_trained_on_not_held_out() -> None:
    first = split_corpus(DOCS, _bytes, seed=0, eval_tokens=4000, min_train_tokens=1000)
    victim = first.info["heldout_documents"]["eval"][0]
    copy = next(d for d in DOCS if d.name == victim)
    docs = DOCS + [Document("zz-copy.txt", copy.text)]  # the same text under another name, trained on
    got = split_corpus(docs, _bytes, seed=0, eval_tokens=4000, min_train_tokens=1000)
    assert victim in got.info["not_held_out_repeats"]
    assert victim not in got.info["heldout_documents"]["eval"] + got.info["heldout_documents"]["confirm"]
    assert got.info["overlap_ok"] and max(got.info["overlap"].values()) < 0.02


def test_a_corpus_too_small_for_its_held_out_sets_is_refused_with_the_minimum() -> None:
    with pytest.raises(ConfigError, match="needs 40,000 tokens for each of eval and confirmation"):
        split_corpus(DOCS[:20], _bytes, seed=0, eval_tokens=40_000, min_train_tokens=1000, name="--corpus-b")
