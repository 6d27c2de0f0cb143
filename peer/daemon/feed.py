"""Stage 0's training windows, as the tracker hands them out (bootstrap/data_order.py).

The heartbeat thread adds the work ids of each reply (`add`) and lists in each report what this
peer still holds (`for_report`); ids left out of a report are *released*, and become usable only
when that report's reply is in (`acked`), so the tracker has counted them before they train. A
broken heartbeat stream puts them back (`unacked`). A prefetch thread fetches the shards of held
work ahead (peer/dataset/fetch.py), from the tracker or the run's dataset repo on the hub; work
whose shard cannot be had goes back to the tracker.
With a state dir, the ids of every window trained are appended to `windows.log` (one micro-batch
a line): what this peer trained, for the operator's audit.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import threading
from collections import deque
from pathlib import Path

import grpc
import numpy as np
import torch

from peer.config import TrainConfig
from peer.dataset.fetch import ShardSource, ShardStore, TrackerSource
from peer.dataset.hub import HubSource, parse_pinned
from peer.dataset.manifest import ShardError, parse_manifest
from peer.dataset.shards import Windows
from peer.errors import ConfigError
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.peer")
RECENT = 8  # trained micro-batches kept for anchor passes
READY_STEPS = 4  # steps' worth of windows released ahead of training
KEEP_SHARDS = 3  # downloaded shards kept on disk at most (each up to the manifest's shard_tokens)
FETCH_TIMEOUT_S = 600.0  # one shard's download (32 MiB at the default shard size)
MIN_REPORT_GAP_S = 0.1  # a hungry feed asks for a report early, but not more often than this


def open_feed(
    a: pb.Assignment,
    cfg: TrainConfig,
    channel: grpc.Channel,
    state_dir: Path | None,
    data_dir: Path | None,
    vocab_size: int,
) -> WorkFeed:
    """Stage 0's feed for the run the assignment `a` describes; shards come from the tracker over
    `channel`, or from the hub when the assignment names a dataset repo at a commit.
    ConfigError when this peer's model cannot read the run's data."""
    if not a.data_manifest:
        raise ConfigError(
            "data", "none", "the tracker serves no prepared data: its bootstrap must be as new as this peer"
        )
    manifest = parse_manifest(a.data_manifest, "the tracker's manifest")
    want = "bytes" if cfg.data.tokenizer == "bytes" else cfg.model.name
    if manifest.tokenizer != want:
        raise ConfigError("data.tokenizer", want, f"the run's data was prepared with tokenizer {manifest.tokenizer!r}")
    if manifest.vocab_size > vocab_size:
        raise ConfigError(
            "data", manifest.source, f"its vocabulary of {manifest.vocab_size} exceeds the model's {vocab_size}"
        )
    temporary = state_dir is None  # no state dir: a temporary folder, removed when the peer stops
    cache = state_dir / "data" if state_dir is not None else Path(tempfile.mkdtemp(prefix="anchormesh-shards-"))
    source: ShardSource
    if a.data_hub:
        source = HubSource(parse_pinned(a.data_hub), cache)
    else:
        stub = pbg.TrackerStub(channel)
        source = TrackerSource(
            lambda name, offset: stub.GetData(pb.DataRequest(name=name, offset=offset), timeout=FETCH_TIMEOUT_S)
        )
    p = cfg.pipeline
    store = ShardStore(manifest, cache, source, keep=KEEP_SHARDS, data_dir=data_dir)
    log_path = state_dir / "windows.log" if state_dir is not None else None
    feed = WorkFeed(store, a.data_windows, p.seq_len, READY_STEPS * p.micro_batches * p.micro_batch_size, log_path)
    feed.temporary = temporary
    return feed


class WorkFeed:
    """Args:
    store: the run's shards on this peer.
    windows: training windows per epoch (work id = epoch * windows + window).
    seq_len: the run's sequence length.
    ready_target: released windows this peer keeps ready (a couple of steps' worth).
    log_path: where the ids of trained windows are appended, or None.
    """

    def __init__(
        self, store: ShardStore, windows: int, seq_len: int, ready_target: int, log_path: Path | None = None
    ) -> None:
        self.store, self.windows, self.seq_len, self.ready_target = store, windows, seq_len, ready_target
        self.train = Windows(store, "train", seq_len)
        if self.train.count != windows:
            raise ShardError(
                "manifest.json",
                f"gives {self.train.count} training windows at seq_len {seq_len}; the tracker counts {windows}",
            )
        self.held: deque[int] = deque()
        self.ready: deque[int] = deque()
        self.returned: list[int] = []
        self.pending: deque[tuple[list[int], list[int]]] = (
            deque()
        )  # (released, returned) of reports whose reply is not in
        self.recent: deque[torch.Tensor] = deque(maxlen=RECENT)
        self.evals: list[torch.Tensor] | None = None
        self.trained = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.hungry = threading.Event()  # few windows ready or on their way: the heartbeat reports early
        self._log = log_path.open("a") if log_path is not None else None
        self.temporary = False  # its shard cache is a temporary folder (removed by `close`)
        self.waiting = ""  # why no window is ready (for the peer's status): never a local path

    def _shard(self, work_id: int) -> str:
        return self.train.locate(work_id % self.windows)[0].name

    # -- the heartbeat's side ---------------------------------------------------------------
    def add(self, ids) -> None:
        if ids:
            with self._lock:
                self.held.extend(int(i) for i in ids)
                self._check_hunger()
            self._wake.set()

    def for_report(self) -> tuple[list[int], list[int]]:
        """(held, returned) for the next report; releases what should be ready soon."""
        with self._lock:
            want = self.ready_target - len(self.ready) - sum(len(r) for r, _ in self.pending)
            released, kept = [], deque()
            for wid in self.held:
                if want > 0 and self.store.has(self.train.locate(wid % self.windows)[0]):
                    released.append(wid)
                    want -= 1
                else:
                    kept.append(wid)
            self.held = kept
            returned, self.returned = self.returned, []
            self.pending.append((released, returned))
            return list(self.held), returned

    def acked(self) -> None:
        """A reply came: the oldest report's released ids are usable now."""
        with self._lock:
            if self.pending:
                released, _ = self.pending.popleft()
                self.ready.extend(released)
            self._check_hunger()

    def _check_hunger(self) -> None:
        if len(self.ready) + sum(len(r) for r, _ in self.pending) < self.ready_target // 2 and any(
            True for _ in self.held
        ):
            self.hungry.set()

    def unacked(self) -> None:
        """The stream broke: reports without a reply may not have reached the tracker."""
        with self._lock:
            while self.pending:
                released, returned = self.pending.pop()
                self.held.extendleft(reversed(released))
                self.returned += returned

    # -- the main loop's side ---------------------------------------------------------------
    def take(self, n: int) -> torch.Tensor | None:
        """`n` ready windows as a [n, seq_len + 1] batch, or None while fewer are ready."""
        with self._lock:
            if len(self.ready) < n:
                self.waiting = f"waiting for data ({len(self.ready)} of {n} windows ready, {len(self.held)} held)"
                return None
            ids = [self.ready.popleft() for _ in range(n)]
            self._check_hunger()
        try:
            batch = torch.from_numpy(self.train.batch([i % self.windows for i in ids]))
        except (ShardError, grpc.RpcError, OSError) as exc:  # its shard went and cannot be had again now: keep the work
            log.warning("cannot read windows %s..: %s", ids[0], exc)
            with self._lock:
                self.ready.extendleft(reversed(ids))
            self.waiting = "waiting for data (a shard is being fetched again)"
            return None
        self.recent.append(batch)
        self.trained += n
        if self._log is not None:
            self._log.write(" ".join(map(str, ids)) + "\n")
            self._log.flush()
        return batch

    def anchor_batches(self, anchor_id: int, n: int) -> list[torch.Tensor] | None:
        """An anchor pass's batches: recently trained ones, picked by the job id (no window is spent on it)."""
        if not self.recent:
            return None
        rng = random.Random(anchor_id)
        return [rng.choice(list(self.recent)) for _ in range(n)]

    def eval_batches(self, batch: int, count: int) -> list[torch.Tensor] | None:
        """The run's fixed eval windows (the same ids on every peer), in batches; None until fetched."""
        if self.evals is None:
            try:
                w = Windows(self.store, "eval", self.seq_len)
                n = min(count, w.count)
                rows = w.batch([i * w.count // n for i in range(n)])
            except (ShardError, grpc.RpcError, OSError) as exc:
                log.warning("cannot fetch the run's eval windows: %s", exc)
                return None
            self.evals = [torch.from_numpy(np.ascontiguousarray(rows[i : i + batch])) for i in range(0, n, batch)]
        return self.evals

    # -- the prefetch thread ----------------------------------------------------------------
    def prefetch(self, stop: threading.Event) -> None:
        """Fetch the shards of held work in order, a bounded number ahead; give back the work of a
        shard that fails its checks."""
        while not stop.is_set():
            with self._lock:
                order = list(dict.fromkeys(self._shard(w) for w in [*self.ready, *self.held]))[: self.store.keep]
            self.store.pinned = set(order)
            for name in order:
                shard = next(s for s in self.train.shards if s.name == name)
                if self.store.has(shard):
                    continue
                try:
                    self.store.ensure(shard)
                    with self._lock:
                        self._check_hunger()
                except ShardError as exc:
                    log.warning("%s: its work goes back to the tracker", exc)
                    with self._lock:
                        bad = [w for w in self.held if self._shard(w) == name]
                        self.held = deque(w for w in self.held if self._shard(w) != name)
                        self.returned += bad
                except (grpc.RpcError, OSError) as exc:
                    log.warning("cannot fetch shard %s now (%s); trying again", name, exc)
                    stop.wait(2.0)
                break  # re-read the order: work may have come or gone meanwhile
            else:
                self._wake.wait(0.5)
                self._wake.clear()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        if self.temporary:
            shutil.rmtree(self.store.cache, ignore_errors=True)
