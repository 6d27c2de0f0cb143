"""A stage-0 peer's shards of the run's prepared data: found in its `--data-dir` or fetched from a
`ShardSource` (the bootstrap over gRPC, or a Hugging Face dataset: peer/dataset/hub.py), each
checked against the run's manifest before a token of it is used, a bounded number kept on disk.

Why a source is one small class: where the bytes come from is the only thing that differs; the
size and hash checks, the cache, its bound and the prefetch are the same for every source.

Why a volunteer's own folder is searched only by manifest name and hash: the run config must
never make a peer read a path of its choosing. `--data-dir DIR` is the volunteer's word; only
`DIR/NAME` for a NAME the manifest lists is looked at, a file whose real path leaves DIR
(a symlink out, included) is refused, and what goes wrong with a local file is logged on this
machine only, never reported to the tracker.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from peer.dataset.manifest import Manifest, ShardError, ShardInfo
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")
HASH_BLOCK = 1 << 20

# (file name, offset) -> the DataChunk stream of Tracker.GetData
Fetch = Callable[[str, int], Iterator[pb.DataChunk]]


class ShardSource(Protocol):
    """Where a peer downloads the files its manifest names."""

    where: str  # for logs and errors, e.g. "the bootstrap"

    def download(self, name: str, size: int, part: Path) -> None:
        """Write file `name` (the manifest says `size` bytes) into `part`, never more than `size`
        bytes. ShardError: the source cannot give this file (refused; its work goes back);
        OSError or grpc.RpcError: the source cannot be reached now (try again later)."""
        ...


class TrackerSource:
    """Files from the bootstrap (Tracker.GetData), checked chunk by chunk as they come."""

    where = "the bootstrap"

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch

    def download(self, name: str, size: int, part: Path) -> None:
        got = 0
        with part.open("wb") as f:
            for chunk in self.fetch(name, 0):
                if chunk.name != name or chunk.offset != got:
                    raise ShardError(
                        name, f"the server sent {chunk.name!r} at offset {chunk.offset}, expected offset {got}"
                    )
                if chunk.total_bytes != size:
                    raise ShardError(name, f"the server says {chunk.total_bytes} bytes, the manifest says {size}")
                if got + len(chunk.data) > size:
                    raise ShardError(name, f"oversized: more than the manifest's {size} bytes")
                f.write(chunk.data)
                got += len(chunk.data)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def inside(folder: Path, name: str) -> Path | None:
    """`folder/name` when its real path (symlinks followed) is a file inside `folder`, else None."""
    root = folder.resolve()
    try:
        real = (folder / name).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if real.parent != root and root not in real.parents:
        log.warning("--data-dir: %s leads outside %s (to %s): refused", name, folder, real)
        return None
    return real if real.is_file() else None


class ShardStore:
    """Training shards as `Windows` (peer/dataset/shards.py) reads them: `tokens(shard)`.

    Args:
        manifest: the run's manifest (from the Join's assignment).
        cache: where downloaded shards go (created; this peer's own folder).
        source: where missing shards are downloaded from (`TrackerSource`, `HubSource`).
        keep: downloaded shards kept on disk at most; the least recently used one not in
            `pinned` goes first.
        data_dir: the volunteer's own folder of prepared shards (`--data-dir`), or None.
    """

    def __init__(
        self, manifest: Manifest, cache: Path, source: ShardSource, keep: int = 3, data_dir: Path | None = None
    ) -> None:
        self.manifest, self.cache, self.source, self.keep, self.data_dir = (
            manifest,
            Path(cache),
            source,
            max(keep, 1),
            data_dir,
        )
        self.cache.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype("<u2" if manifest.dtype == "uint16" else "<u4")
        self.pinned: set[str] = set()  # shards held work needs: not evicted
        self._paths: OrderedDict[str, Path] = OrderedDict()  # shard name -> checked file, least recently used first
        self._maps: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()
        self._fetching = threading.Lock()
        self._local_checked: set[str] = set()
        self.downloaded = 0  # bytes fetched from the source

    def has(self, shard: ShardInfo) -> bool:
        return shard.name in self._paths

    def ensure(self, shard: ShardInfo) -> Path:
        """The checked file of `shard`: found, else fetched. Raises ShardError naming the shard."""
        with self._lock:
            if shard.name in self._paths:
                self._paths.move_to_end(shard.name)
                return self._paths[shard.name]
        with self._fetching:  # one download at a time: the prefetch thread and the main loop may ask for the same shard
            with self._lock:
                if shard.name in self._paths:
                    return self._paths[shard.name]
            path = self._local(shard) or self._download(shard)
            with self._lock:
                self._paths[shard.name] = path
                self._evict()
        return path

    def tokens(self, shard: ShardInfo) -> np.ndarray:
        """The shard's token ids, memory-mapped read-only."""
        path = self.ensure(shard)
        with self._lock:
            if shard.name not in self._maps:
                self._maps[shard.name] = (
                    np.memmap(path, dtype=self.dtype, mode="r", shape=(shard.tokens,))
                    if shard.tokens
                    else np.zeros(0, self.dtype)
                )
            return self._maps[shard.name]

    def _size(self, shard: ShardInfo) -> int:
        return shard.tokens * self.dtype.itemsize

    def _local(self, shard: ShardInfo) -> Path | None:
        """`--data-dir`'s copy when its size and hash match the manifest (checked once)."""
        if self.data_dir is None or shard.name in self._local_checked:
            return None
        self._local_checked.add(shard.name)
        path = inside(self.data_dir, shard.name)
        if path is None:
            return None
        if path.stat().st_size != self._size(shard) or sha256_file(path) != shard.sha256:
            log.warning("--data-dir: %s differs from the run's manifest: downloading it instead", shard.name)
            return None
        log.info("--data-dir: using %s", shard.name)
        return path

    def _download(self, shard: ShardInfo) -> Path:
        size, part = self._size(shard), self.cache / f".{shard.name}.part"
        try:
            self._receive(shard, size, part)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        path = self.cache / shard.name
        os.replace(part, path)
        self.downloaded += size
        return path

    def _receive(self, shard: ShardInfo, size: int, part: Path) -> None:
        """The source's download into `part`, then its size and hash checked against the manifest."""
        self.source.download(shard.name, size, part)
        got = part.stat().st_size
        if got != size:
            raise ShardError(
                shard.name, f"{'truncated' if got < size else 'oversized'}: {got} bytes, the manifest says {size}"
            )
        digest = sha256_file(part)
        if digest != shard.sha256:
            raise ShardError(
                shard.name,
                f"content differs from the manifest: sha256 {digest[:16]}..., expected {shard.sha256[:16]}...",
            )

    def _evict(self) -> None:
        """At most `keep` downloaded shards on disk (--data-dir's are the volunteer's: never deleted)."""
        ours = [n for n, p in self._paths.items() if p.parent == self.cache.resolve() or p.parent == self.cache]
        for name in ours[: max(len(ours) - self.keep, 0)]:
            if name in self.pinned:
                continue
            path = self._paths.pop(name)
            self._maps.pop(name, None)  # a map in use stays valid: the pages live until it is dropped
            path.unlink(missing_ok=True)
