"""What `data prepare` reads: a text file, a folder of text files, or a streamed Hugging Face
dataset, as one stream of documents (bytes).

Why documents: the eval and confirmation sets are cut by document, so a held-out text never
shares a paragraph with training text. A file in a folder or a dataset record is a document; a
single-file source, or a file or record over `SPLIT_DOC_BYTES`, is cut into paragraph-level
documents so that it can be split at all and so that no document is held in memory whole.
The documents of a source concatenate to its text exactly (no byte is added or lost).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from peer.errors import ConfigError

HF_PREFIX = "hf:"
SPLIT_DOC_BYTES = 1 << 20  # a file or record larger than this is cut into paragraph-level documents
PARAGRAPH_DOC_BYTES = 4096  # such a document ends at the first blank line past this many bytes...
MAX_DOC_BYTES = 1 << 16  # ...or, with no blank line by then, at a line end (else a character boundary)
READ_BLOCK = 1 << 20  # bytes read from a large file at a time


@dataclass(frozen=True)
class Source:
    """A parsed SOURCE: `documents()` streams it (call it once per pass); `total_bytes` feeds the
    progress bar's ETA (None for a streamed dataset, whose size is not known up front)."""

    spec: str
    total_bytes: int | None
    documents: Callable[[], Iterator[bytes]]


def open_source(spec: str, text_field: str = "text") -> Source:
    """SOURCE as the command line gives it: a file, a folder, or hf:DATASET[:CONFIG[:SPLIT]]."""
    if spec.startswith(HF_PREFIX):
        return _hf_source(spec, text_field)
    from peer.data import TEXT_SUFFIXES  # the suffixes the benchmarks read too; imported here: peer.data brings torch

    path = Path(spec)
    if path.is_file():
        return Source(spec, path.stat().st_size, lambda: _file_documents(path, always_split=True))
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise ConfigError(
                "SOURCE",
                spec,
                f"holds no text files (suffixes read: {', '.join(repr(s) for s in sorted(TEXT_SUFFIXES))})",
            )
        return Source(spec, sum(f.stat().st_size for f in files), lambda: _folder_documents(files))
    raise ConfigError(
        "SOURCE",
        spec,
        f"no such file or folder; give a text file, a folder of text files, or {HF_PREFIX}DATASET[:CONFIG[:SPLIT]]",
    )


def _folder_documents(files: list[Path]) -> Iterator[bytes]:
    for f in files:
        yield from _file_documents(f, always_split=False)


def _file_documents(path: Path, always_split: bool) -> Iterator[bytes]:
    """One document per file, or paragraph-level ones for a large (or the only) file. Unreadable
    and binary files (a NUL byte in the first KiB) are skipped, as `peer/data.py` does."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            first = f.read(READ_BLOCK if (always_split or size > SPLIT_DOC_BYTES) else size + 1)
            if b"\x00" in first[:1024]:
                return
            if not (always_split or len(first) > SPLIT_DOC_BYTES):
                if first:
                    yield first
                return
            yield from paragraphs(_blocks(f, first))
    except OSError:
        return


def _blocks(f, first: bytes) -> Iterator[bytes]:
    yield first
    while block := f.read(READ_BLOCK):
        yield block


def paragraphs(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """Cut a byte stream into documents of paragraphs: each ends at the first blank line past
    PARAGRAPH_DOC_BYTES, or at MAX_DOC_BYTES (a line end, else not inside a UTF-8 character).
    Holds at most one block plus MAX_DOC_BYTES; the pieces concatenate to the input exactly."""
    buf = b""
    for block in blocks:
        buf += block
        pos = 0
        while (cut := _cut(buf, pos)) is not None:
            yield buf[pos:cut]
            pos = cut
        buf = buf[pos:]
    if buf:
        yield buf


def _cut(buf: bytes, pos: int) -> int | None:
    """Where the document starting at `pos` ends, or None when `buf` must grow first."""
    if len(buf) - pos < PARAGRAPH_DOC_BYTES:
        return None
    blank = buf.find(b"\n\n", pos + PARAGRAPH_DOC_BYTES - 2, pos + MAX_DOC_BYTES)
    if blank >= 0:
        return blank + 2
    if len(buf) - pos < MAX_DOC_BYTES:
        return None  # a blank line may still come
    limit = pos + MAX_DOC_BYTES
    line = buf.rfind(b"\n", pos + PARAGRAPH_DOC_BYTES, limit)
    if line >= 0:
        return line + 1
    while limit > pos + 1 and (buf[limit] & 0xC0) == 0x80:  # a UTF-8 continuation byte: step back
        limit -= 1
    return limit


def _hf_source(spec: str, text_field: str) -> Source:
    """A Hugging Face dataset, streamed record by record (never downloaded whole)."""
    name, config, split = (spec[len(HF_PREFIX) :].split(":", 2) + ["", ""])[:3]
    if not name:
        raise ConfigError("SOURCE", spec, f"names no dataset; give {HF_PREFIX}DATASET[:CONFIG[:SPLIT]]")
    try:
        import datasets
    except ImportError:
        raise ConfigError("SOURCE", spec, "needs the `datasets` package: pip install 'anchormesh[data]'") from None

    def documents() -> Iterator[bytes]:
        try:
            rows = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        except Exception as exc:  # the library raises many kinds (not found, no network, bad config)
            raise ConfigError("SOURCE", spec, f"cannot load it: {type(exc).__name__}: {exc}") from None
        for row in rows:
            if text_field not in row:
                raise ConfigError(
                    "--text-field", text_field, f"not a column of {name}; columns: {', '.join(sorted(row))}"
                )
            text = str(row[text_field]).encode("utf-8")
            if len(text) > SPLIT_DOC_BYTES:
                yield from paragraphs(text[i : i + READ_BLOCK] for i in range(0, len(text), READ_BLOCK))
            elif text:
                yield text

    return Source(spec, None, documents)
