"""The quality benchmark's two corpora, cut by document into training, eval and confirmation
text (peer/bench/corpus_split.py), as token streams.

Corpus A (general English prose): `--corpus-a`, else the prose corpus made from Python's
documentation (`python -m peer.bench.prose --out PROSE_DIR`, ~6.8 MB), else the licence texts
the system ships (too small and too repetitive for continual pretraining, which refuses them).
Corpus B (the domain, Python source): `--corpus-b`, else modules of the running interpreter's
standard library. Adaptation trains on B; continual pretraining on A.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from peer.bench.corpus_split import MIN_TRAIN_TOKENS, CorpusSplit, Document, read_documents, split_corpus
from peer.bench.prose import MIN_BYTES as PROSE_MIN_BYTES
from peer.data import TokenStream, generated
from peer.errors import ConfigError

PROSE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "anchormesh" / "prose"
LICENCES = Path("/usr/share/common-licenses")
STDLIB = ("json", "email", "http", "asyncio", "logging", "unittest", "xml", "importlib", "concurrent", "urllib")
MAX_BYTES = {"a": 8_000_000, "b": 3_000_000}  # text read per corpus: the tokenizer takes ~10 s for all of it


def _stdlib_documents(max_bytes: int) -> list[Document]:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    docs: list[Document] = []
    for name in STDLIB:
        if (lib / name).is_dir():
            docs += [
                Document(f"{name}/{d.name}", d.text)
                for d in read_documents(lib / name, max_bytes)
                if "test" not in d.name
            ]
    return docs


def _generated_documents(kind: str) -> list[Document]:
    """A stand-in where the machine has no text: templated prose or code cut into 4 KB documents."""
    text = generated(kind, 1_000_000, seed=1 if kind == "a" else 2).decode()
    return [Document(f"generated-{kind}/{i:04d}", text[i : i + 4096]) for i in range(0, len(text), 4096)]


def documents(kind: str, path: str | None) -> tuple[list[Document], str]:
    """(documents, where they came from) of corpus `kind` ("a" or "b")."""
    flag = f"--corpus-{kind}"
    if path:
        return read_documents(Path(path), MAX_BYTES[kind], flag), path
    if kind == "a":
        for root in (PROSE_DIR, LICENCES):
            if root.is_dir():
                docs = read_documents(root, MAX_BYTES["a"], flag)
                unique = {d.text: d for d in docs}  # the licences' symlinks name one text twice
                if unique:
                    return list(unique.values()), str(root)
    else:
        docs = _stdlib_documents(MAX_BYTES["b"])
        if docs:
            return docs, f"python stdlib: {', '.join(STDLIB)}"
    return _generated_documents(kind), f"generated:{kind}"


def check_continual(docs: list[Document], source: str) -> None:
    """Continual pretraining needs several megabytes of ordinary prose (before any model loads)."""
    size = sum(len(d.text.encode()) for d in docs)
    if size < PROSE_MIN_BYTES:
        raise ConfigError(
            "--corpus-a",
            source,
            f"holds {size:,} bytes; continual pretraining needs {PROSE_MIN_BYTES:,} bytes of general prose: "
            f"make it with `python -m peer.bench.prose --out {PROSE_DIR}` (Python's docs from Debian's "
            "python3.11-doc) or name a folder of prose",
        )


def corpora(
    tokenize: Callable[[str], list[int]],
    corpus_a: str | None,
    corpus_b: str | None,
    seed: int,
    continual: bool,
    pretrains_on_a: bool,
) -> tuple[TokenStream, TokenStream, dict]:
    """Corpus A and corpus B (what the rows train on: the domain, or for continual pretraining the
    general text) as split token streams, and what the output says of them. A corpus is cut the
    same way whichever role it plays; A needs training text only where it pretrains the toy."""
    general, domain = documents("a", corpus_a), documents("b", corpus_b)
    if continual:
        check_continual(*general)
    (docs_a, src_a), (docs_b, src_b) = (domain, general) if continual else (general, domain)
    flag_a, flag_b = ("--corpus-b", "--corpus-a") if continual else ("--corpus-a", "--corpus-b")
    try:
        split_a = split_corpus(
            docs_a,
            tokenize,
            seed,
            min_train_tokens=MIN_TRAIN_TOKENS if pretrains_on_a else 0,
            name=flag_a,
            avoid_repeats=not src_a.startswith("generated:"),
        )
    except ConfigError as e:
        if src_a != str(LICENCES):
            raise
        raise ConfigError(
            flag_a, src_a, f"{e}; make a prose corpus with `python -m peer.bench.prose --out {PROSE_DIR}`"
        ) from e
    split_b = split_corpus(docs_b, tokenize, seed, name=flag_b, avoid_repeats=not src_b.startswith("generated:"))
    info = {"corpus_a": src_a, "corpus_b": src_b, "split_a": split_a.info, "split_b": split_b.info}
    return _stream(split_a), _stream(split_b), info


def _stream(split: CorpusSplit) -> TokenStream:
    return TokenStream.from_splits(split.train, split.eval, split.confirm)
