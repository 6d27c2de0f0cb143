"""Reading a prepared folder: checked shards, training windows by id, the fixed eval windows.

Why windows by id: the tracker will hand stage-0 peers window ids, not text; an id must mean the
same tokens on every machine, so the mapping depends only on the manifest and `seq_len`. Shards
are numpy memmaps: a peer reads the pages of the windows it trains on, never a whole shard.
"""

from __future__ import annotations

import bisect
import hashlib
from pathlib import Path

import numpy as np

from peer.dataset.manifest import INDEX_DTYPE, SPLITS, Manifest, ShardError, ShardInfo, read_manifest
from peer.errors import ConfigError

HASH_BLOCK = 1 << 20


def check_tokenizer(manifest: Manifest, tokenizer: str | None, where: str) -> None:
    """ConfigError unless the data at `where` was prepared with `tokenizer` (None: any)."""
    if tokenizer is not None and tokenizer != manifest.tokenizer:
        raise ConfigError(
            "tokenizer",
            tokenizer,
            f"the data in {where} was prepared with tokenizer {manifest.tokenizer!r} (vocabulary {manifest.vocab_size}); "
            f"prepare it again with --tokenizer {tokenizer}",
        )


class PreparedData:
    """A folder written by `anchormesh data prepare`, checked when opened.

    Args:
        folder: the prepared folder.
        tokenizer: the tokenizer the caller's model uses (`bytes`, `smollm2-135m`, ...); a manifest
            from another one is refused (ConfigError). None: any.
        verify: hash every shard and index against the manifest (sizes are always checked). A
            mismatch raises ShardError naming the file.
    """

    def __init__(self, folder: str | Path, tokenizer: str | None = None, verify: bool = True) -> None:
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder)
        m = self.manifest
        check_tokenizer(m, tokenizer, str(self.folder))
        self.dtype = np.dtype("<u2" if m.dtype == "uint16" else "<u4")
        self._maps: dict[str, np.memmap] = {}
        for split in SPLITS:
            for shard in m.splits[split].shards:
                self.check_shard(shard, full=verify)

    def check_shard(self, shard: ShardInfo, full: bool = True) -> None:
        """Raise ShardError unless the shard and its index have the manifest's sizes and (with
        `full`) hashes, and the index is a valid list of document starts."""
        for name, size, digest in (
            (shard.name, shard.tokens * self.dtype.itemsize, shard.sha256),
            (shard.index, shard.documents * 8, shard.index_sha256),
        ):
            path = self.folder / name
            try:
                got = path.stat().st_size
            except FileNotFoundError:
                raise ShardError(name, f"missing from {self.folder}") from None
            if got != size:
                raise ShardError(
                    name, f"{'truncated' if got < size else 'oversized'}: {got} bytes, the manifest says {size}"
                )
            if full:
                h = hashlib.sha256()
                with path.open("rb") as f:
                    while block := f.read(HASH_BLOCK):
                        h.update(block)
                if h.hexdigest() != digest:
                    raise ShardError(
                        name,
                        f"content differs from the manifest: sha256 {h.hexdigest()[:16]}..., expected {digest[:16]}...",
                    )
        if full and shard.documents:
            starts = self.doc_starts(shard)
            if (
                starts[0] < 0
                or (len(starts) > 1 and bool(np.any(np.diff(starts.astype(np.int64)) <= 0)))
                or int(starts[-1]) >= shard.tokens
            ):
                raise ShardError(shard.index, f"is not an increasing list of offsets below {shard.tokens}")

    def tokens(self, shard: ShardInfo) -> np.ndarray:
        """The shard's token ids, memory-mapped read-only (opened once)."""
        if shard.name not in self._maps:
            self._maps[shard.name] = (
                np.memmap(self.folder / shard.name, dtype=self.dtype, mode="r", shape=(shard.tokens,))
                if shard.tokens
                else np.zeros(0, self.dtype)
            )
        return self._maps[shard.name]

    def doc_starts(self, shard: ShardInfo) -> np.ndarray:
        """Offsets (in the shard) of the documents that start in it."""
        return np.fromfile(self.folder / shard.index, dtype=INDEX_DTYPE)

    def windows(self, seq_len: int, split: str = "train") -> Windows:
        """The split's non-overlapping windows of `seq_len + 1` tokens, numbered by id."""
        return Windows(self, split, seq_len)

    def eval_windows(self, seq_len: int, count: int | None = None, split: str = "eval") -> np.ndarray:
        """The fixed eval windows [count, seq_len + 1] (int64): the same ids for every caller,
        spread evenly over the split (all of them when `count` is None or larger)."""
        if count is not None and count < 1:
            raise ConfigError("count", count, "must be >= 1")
        w = self.windows(seq_len, split)
        n = w.count if count is None else min(count, w.count)
        return w.batch([i * w.count // n for i in range(n)])


class Windows:
    """Non-overlapping `seq_len + 1`-token windows of one split, numbered 0..count-1 shard by shard
    (shard k's windows follow shard k-1's). A window never crosses a shard: the last
    `tokens % (seq_len + 1)` tokens of each shard are not in any window. Inputs are [:-1],
    targets [1:], as in `peer.data.TokenStream`."""

    def __init__(self, data: PreparedData, split: str, seq_len: int) -> None:
        if split not in SPLITS:
            raise ConfigError("split", split, f"must be one of {', '.join(SPLITS)}")
        if seq_len < 1:
            raise ConfigError("seq_len", seq_len, "must be >= 1")
        self.data, self.split, self.length = data, split, seq_len + 1
        self.shards = data.manifest.splits[split].shards
        self._ends: list[int] = []
        total = 0
        for s in self.shards:
            total += s.tokens // self.length
            self._ends.append(total)
        self.count = total
        if not self.count:
            raise ConfigError(
                "seq_len",
                seq_len,
                f"the {split} split ({data.manifest.splits[split].tokens} tokens, shards of at most {data.manifest.shard_tokens}) "
                f"holds no window of {self.length} tokens",
            )

    def __len__(self) -> int:
        return self.count

    @property
    def shard_ends(self) -> list[int]:
        """The window count at the end of each shard: shard k holds windows [ends[k-1], ends[k])."""
        return list(self._ends)

    def locate(self, window: int) -> tuple[ShardInfo, int]:
        """(shard, token offset in it) of window id `window`."""
        if not 0 <= window < self.count:
            raise IndexError(
                f"window id {window} is outside [0, {self.count}) of the {self.split} split at seq_len {self.length - 1}"
            )
        k = bisect.bisect_right(self._ends, window)
        first = self._ends[k - 1] if k else 0
        return self.shards[k], (window - first) * self.length

    def __getitem__(self, window: int) -> np.ndarray:
        """Window `window`'s seq_len + 1 token ids (int64, a copy)."""
        shard, offset = self.locate(window)
        return self.data.tokens(shard)[offset : offset + self.length].astype(np.int64)

    def batch(self, ids: list[int]) -> np.ndarray:
        """Windows `ids` stacked: [len(ids), seq_len + 1] int64."""
        out = np.empty((len(ids), self.length), dtype=np.int64)
        for row, window in enumerate(ids):
            out[row] = self[window]
        return out
