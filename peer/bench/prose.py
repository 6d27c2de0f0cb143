"""General English prose for the continual-pretraining benchmark: Python's documentation (its
reStructuredText sources, as Debian's `python3.11-doc` ships them) with the code taken out.

Why this text: continual pretraining needs several megabytes of ordinary prose that no hub
download is needed for; the documentation is ~11 MB of sources, licensed for redistribution (PSF),
and a `.deb` fetched from Debian's mirror in seconds (`apt-get download python3.11-doc`). Code
blocks, doctests, directives' arguments, tables and section rules are dropped, markup roles keep
their text, and a sentence seen before anywhere in the corpus is written once: the benchmark's
eval/train overlap check (peer/bench/overlap.py) then measures real leakage, not boilerplate.
One output file per source page, so `anchormesh data prepare` cuts its held-out sets by page.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from peer.errors import ConfigError

DEB = "python3.11-doc"
SOURCES = Path("usr/share/doc/python3.11/html/_sources")  # inside the package
MIN_BYTES = 5_000_000  # the continual task's floor: less is too little text to hold out pages from
CODE_DIRECTIVES = {
    "code-block",
    "sourcecode",
    "literalinclude",
    "doctest",
    "testcode",
    "testoutput",
    "testsetup",
    "productionlist",
    "highlight",
    "index",
    "toctree",
    "csv-table",
    "table",
    "list-table",
    "raw",
    "include",
    "image",
    "figure",
    "only",
    "ifconfig",
    "c:macro",
    "opcode",
}
_ROLE = re.compile(r":[\w:.+-]+:`([^`]*)`")
_LITERAL = re.compile(r"``([^`]*)``")
_LINK = re.compile(r"`([^`<]*?)\s*(<[^>]*>)?`_{1,2}")
_RULE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{3,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\.\s+([\w:-]+)::(.*)$")
_FIELD = re.compile(r"^:[^:`\s][^:`]*:(\s|$)")  # a field list's line (`:param x: ...`), not a role


def _role_text(m: re.Match[str]) -> str:
    """`:ref:`the text <target>`` -> "the text"; `:func:`~os.path.join`` -> "join"."""
    text = re.sub(r"\s*<[^>]*>$", "", m.group(1)).lstrip("!")
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def _inline(line: str) -> str:
    line = _ROLE.sub(_role_text, line)
    line = _LITERAL.sub(r"\1", line)
    return _LINK.sub(r"\1", line)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def prose_of(rst: str) -> list[str]:
    """The prose paragraphs of one reST page, markup reduced to its text, whitespace normalised."""
    paragraphs: list[str] = []
    current: list[str] = []
    skip_below: int | None = None  # drop lines indented deeper than this (a code block or a directive's body)
    literal_next = False  # the last paragraph ended in "::": the next indented block is code
    doctest = False  # inside a paragraph that opened with ">>>": code and its output, to the blank line

    def flush() -> None:
        nonlocal literal_next
        if current:
            text = " ".join(" ".join(current).split())
            if text.endswith("::"):
                literal_next = True
                text = text[:-1]
            if len(text) > 1 and any(c.isalpha() for c in text):
                paragraphs.append(text)
            current.clear()

    for raw in rst.splitlines():
        line = raw.rstrip()
        if not line.strip():
            flush()
            doctest = False
            continue
        if doctest:
            continue
        ind = _indent(line)
        if skip_below is not None:
            if ind > skip_below:
                continue
            skip_below = None
        if literal_next:
            literal_next = False
            if ind > 0 and not current:
                skip_below = ind - 1
                continue
        stripped = line.strip()
        directive = _DIRECTIVE.match(line)
        if directive:
            flush()
            if directive.group(1) in CODE_DIRECTIVES:
                skip_below = ind
            continue
        if stripped.startswith(".. ") or stripped == "..":  # comments and link targets
            flush()
            skip_below = ind
            continue
        if stripped.startswith(">>>") and not current:
            doctest = True
            continue
        if _RULE.match(line) or _FIELD.match(stripped) or stripped.startswith(("+-", "+=", "|")):
            flush()
            continue
        current.append(_inline(stripped))
    flush()
    return paragraphs


_SENTENCE = re.compile(r"(?<=[.!?:;])\s+")
SHORT = 40  # a sentence shorter than this ("For example:") may repeat: no 50-character shingle in it


def _first_time(sentence: str, seen: set[bytes]) -> bool:
    """Whether a sentence is new to the corpus (short ones always are); remembers it.

    Sentences, not paragraphs: the documentation repeats itself with small edits (a class
    described again in its legacy API's page), and a repeated sentence in a held-out page is a
    leak the eval/train overlap check would count."""
    if len(sentence) < SHORT:
        return True
    digest = hashlib.blake2b(sentence.encode(), digest_size=16).digest()
    if digest in seen:
        return False
    seen.add(digest)
    return True


def pages(sources: Path) -> Iterator[tuple[Path, str]]:
    """(relative path, text) of every page under a `_sources` folder, in a fixed order."""
    for path in sorted(sources.rglob("*.rst.txt")):
        yield path.relative_to(sources), path.read_text(encoding="utf-8", errors="replace")


def write_corpus(sources: Path, out: Path) -> dict[str, int]:
    """One `.txt` per page under `out`, each paragraph once across the corpus; returns counts."""
    if not sources.is_dir():
        raise ConfigError("--sources", str(sources), "is not a folder of reST sources (`.rst.txt` files)")
    seen: set[bytes] = set()
    counts = {"pages": 0, "paragraphs": 0, "duplicates": 0, "bytes": 0}
    for rel, text in pages(sources):
        kept = []
        for para in prose_of(text):
            fresh = [s for s in _SENTENCE.split(para) if _first_time(s, seen)]
            if not fresh:
                counts["duplicates"] += 1
                continue
            kept.append(" ".join(fresh))
        if not kept:
            continue
        body = "\n\n".join(kept) + "\n"
        dest = out / rel.with_suffix("").with_suffix(".txt")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(body, encoding="utf-8")
        counts["pages"] += 1
        counts["paragraphs"] += len(kept)
        counts["bytes"] += len(body.encode())
    if counts["bytes"] < MIN_BYTES:
        raise ConfigError(
            "--sources", str(sources), f"gives {counts['bytes']:,} bytes of prose; the benchmark needs {MIN_BYTES:,}"
        )
    return counts


def fetch_sources(into: Path) -> Path:
    """Download and unpack Debian's python3.11-doc into `into` (apt-get and dpkg, no root needed);
    returns its `_sources` folder."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", DEB], cwd=tmp, check=True, capture_output=True, timeout=300)
            (deb,) = Path(tmp).glob(f"{DEB}_*.deb")
            subprocess.run(["dpkg", "-x", str(deb), str(into)], check=True, capture_output=True, timeout=300)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            raise ConfigError(
                "--sources", DEB, f"could not be fetched with apt-get ({e}); unpack its .deb and pass --sources"
            ) from e
    return into / SOURCES


def main(argv: list[str] | None = None) -> None:
    """`python -m peer.bench.prose --out DIR [--sources DIR]`: write the prose corpus."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m peer.bench.prose", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the corpus (one .txt per page)")
    p.add_argument("--sources", type=Path, default=None, help="a `_sources` folder; default: fetch python3.11-doc")
    args = p.parse_args(argv)
    try:
        sources = args.sources or fetch_sources(args.out.with_name(args.out.name + ".deb"))
        print(json.dumps({"sources": str(sources), "out": str(args.out), **write_corpus(sources, args.out)}))
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
