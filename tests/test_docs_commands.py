"""The commands and run.toml snippets the docs quote go through the real parser and config loader.

A renamed flag, subcommand or run.toml key breaks a test here, not a user who copied it.

What is checked, in README.md and docs/*.md:

- Every command line in a fenced code block that runs `anchormesh` (also `.venv/bin/anchormesh`,
  `sudo anchormesh`, `docker exec NAME anchormesh ...`, `docker compose ... exec SERVICE
  anchormesh ...`), and every `docker run` line whose image is `anchormesh-peer` or
  `anchormesh-bootstrap` followed by arguments (the images' entry point is `anchormesh`):
  lines ending in `\\` are joined, `# comments` dropped, and the words after `anchormesh` (up to
  `|`, `&&`, `;` or a redirection) are parsed by the parser `peer/cli.py` builds, with
  `parse_args`: nothing runs. `--help` and `--version` count as parsed when they exit 0.
- Every `anchormesh ...` in inline code in the prose: such fragments often name a command
  rather than give all of it (`anchormesh bench quality`), so only the names are checked: each
  subcommand must exist, and each `--flag` must be one of that subcommand's.
- Every ```toml block: read with tomllib and resolved by `peer.runtoml.resolve_run`, as the
  bootstrap and `anchormesh config check` resolve a run.toml (no model is read).

Placeholders are substituted before parsing: `<anything>` becomes `1` after a flag that takes a
number and `SAMPLE` elsewhere; a word ending in `...` (`DIR...`) loses the dots and a lone
`...` is dropped; `[--json]` loses its brackets (an optional part is checked as if given);
`a|b` becomes `a`. Capitalised placeholders (`BOOT_IP:7000#KEY`, `RUN_TOKEN`, `OUT`) are plain
strings to the parser and stay. The environment the docs tell users to export
(`ANCHORMESH_TRACKER`, `ANCHORMESH_TOKEN`) is set to sample values while the parser is built.
"""

from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from peer import cli
from peer.runtoml import resolve_run

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IMAGES = re.compile(r"^anchormesh-(peer|bootstrap)(:[\w.-]+)?$")
STOP = {"|", "||", "&&", ";", ">", ">>", "2>&1", "<"}
SAMPLE_ENV = {"ANCHORMESH_TRACKER": "127.0.0.1:7000", "ANCHORMESH_TOKEN": "sample-run-token-0123456789"}


def _blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced code block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and lang is None:
            lang, start, body = fence.group(1), n + 1, []
        elif fence:
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def _numeric_flags() -> set[str]:
    numeric, todo = set(), [_build()]
    while todo:
        p = todo.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
            elif action.type in (int, float):
                numeric.update(action.option_strings)
    return numeric


def _build() -> argparse.ArgumentParser:
    build = getattr(cli, "build_parser", None) or cli._parser
    return build()


def _substitute(words: list[str], numeric: set[str]) -> list[str]:
    out: list[str] = []
    for word in words:
        if word == "...":
            continue
        if re.fullmatch(r"<[^>]*>", word):
            word = "1" if out and out[-1] in numeric else "SAMPLE"
        word = re.sub(r"<[^>]*>", "SAMPLE", word).strip("[]")
        if word.endswith("...") and len(word) > 3:
            word = word[:-3]
        if "|" in word and not word.startswith("-"):
            word = word.split("|")[0]
        elif word.startswith("--") and "|" in word:
            word = word.split("|")[0]
        if word:
            out.append(word)
    return out


def _argv(words: list[str]) -> list[str] | None:
    """The anchormesh arguments of one shell command, or None if it runs no anchormesh."""
    for i, word in enumerate(words):
        at_command = i == 0 or words[i - 1] in ("sudo", "env") or (words[0] == "docker" and "exec" in words[:i])
        if Path(word).name == "anchormesh" and at_command:
            rest = words[i + 1 :]
            break
        if IMAGES.match(word) and words[0] == "docker" and "run" in words[:3] and "--entrypoint" not in words:
            rest = words[i + 1 :]
            if not rest:
                return None  # the image's default command: tests/test_docker.py checks it
            break
    else:
        return None
    for j, word in enumerate(rest):
        if word in STOP:
            return rest[:j]
    return rest


def _block_commands() -> list[tuple[str, list[str]]]:
    cases = []
    for doc in DOCS:
        for lang, start, body in _blocks(doc.read_text()):
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            joined, first = "", None
            for n, line in enumerate(body, start):
                first = n if first is None else first
                if line.rstrip().endswith("\\"):
                    joined += line.rstrip()[:-1] + " "
                    continue
                joined += line
                try:
                    words = shlex.split(
                        re.sub(r"<[^>]*>", lambda m: m.group(0).replace(" ", "_"), joined), comments=True
                    )
                except ValueError:
                    words = []
                argv = _argv(words) if words else None
                if argv is not None:
                    cases.append((f"{doc.relative_to(ROOT)}:{first}", argv))
                joined, first = "", None
    return cases


def _inline_commands() -> list[tuple[str, list[str]]]:
    cases = []
    for doc in DOCS:
        text = doc.read_text()
        fenced = {n for _, start, body in _blocks(text) for n in range(start - 1, start + len(body) + 1)}
        for n, line in enumerate(text.splitlines(), 1):
            if n in fenced:
                continue
            for code in re.findall(r"`([^`]+)`", line):
                if code.startswith("anchormesh ") or code.startswith(".venv/bin/anchormesh "):
                    words = re.sub(r"<[^>]*>", lambda m: m.group(0).replace(" ", "_"), code).split()
                    if words[1].endswith(":") or words[1][0].isupper():
                        continue  # a quoted log or output line (`anchormesh peer: starting ...`), not a command
                    cases.append((f"{doc.relative_to(ROOT)}:{n}", words[1:]))
    return cases


def _toml_snippets() -> list[tuple[str, str]]:
    return [
        (f"{doc.relative_to(ROOT)}:{start}", "\n".join(body))
        for doc in DOCS
        for lang, start, body in _blocks(doc.read_text())
        if lang == "toml"
    ]


BLOCKS = _block_commands()
INLINE = _inline_commands()
TOMLS = _toml_snippets()


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    for name, value in SAMPLE_ENV.items():
        monkeypatch.setenv(name, value)
    return _build()


def test_the_docs_quote_commands() -> None:
    assert len(BLOCKS) >= 20, BLOCKS
    assert len(INLINE) >= 20, INLINE
    assert TOMLS


@pytest.mark.parametrize("where,argv", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_command_parses(parser: argparse.ArgumentParser, where: str, argv: list[str], capsys) -> None:
    words = _substitute(argv, _numeric_flags())
    try:
        parser.parse_args(words)
    except SystemExit as exc:
        if exc.code != 0:
            pytest.fail(f"{where}: anchormesh {' '.join(words)}\n{capsys.readouterr().err.strip()}")


def _options(p: argparse.ArgumentParser) -> tuple[set[str], dict[str, argparse.ArgumentParser]]:
    flags, subs = set(), {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
        flags.update(action.option_strings)
    return flags, subs


@pytest.mark.parametrize("where,words", INLINE, ids=[w for w, _ in INLINE])
def test_inline_command_names_exist(parser: argparse.ArgumentParser, where: str, words: list[str]) -> None:
    current, path = parser, ["anchormesh"]
    flags, subs = _options(current)
    for word in _substitute(words, set()):
        if word.startswith("--"):
            flag = word.split("=")[0]
            assert flag in flags, f"{where}: `{' '.join(path)}` has no {flag}"
        elif subs and not word.startswith("-"):
            if word not in subs:
                pytest.fail(f"{where}: `{' '.join(path)}` has no subcommand {word!r}")
            current = subs[word]
            path.append(word)
            flags, subs = _options(current)


@pytest.mark.parametrize("where,text", TOMLS, ids=[w for w, _ in TOMLS])
def test_toml_snippet_resolves(where: str, text: str) -> None:
    resolve_run(tomllib.loads(text))
