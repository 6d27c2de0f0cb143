"""The run's data order: which training windows each stage-0 peer holds, and how far the run is.

Why the tracker owns it: peers come and go, so only the tracker can say which windows the run
has trained; kept here (and persisted with the roster) the position survives restarts of peers
and of the bootstrap, like a checkpointed data loader.

Work is a *work id* = `epoch * windows + window`: the window's id in the prepared data
(peer/dataset/shards.py `Windows`) and the epoch it is trained in, so a window handed out late
in one epoch never collides with the same window in the next. Each epoch walks a permutation
of the windows seeded by (seed, epoch): every window once per epoch, in an order no peer picks.
With several shards the permutation is shard by shard (the shards in a random order, the windows
of each in a random order): a stage-0 peer fetches whole shards and keeps a few, so a lease drawn
across all shards would have it fetch a shard for nearly every window.

The exchange, one heartbeat at a time:
- the tracker hands a stage-0 peer new work ids (`Directive.windows`), up to `lease` held;
- the peer lists in each report the ids it still holds and has not started (`windows_held`),
  and the ids it cannot train (`windows_returned`: a shard it cannot get);
- an id the tracker gave a peer that is in neither list is *released*: the peer trains it, and
  uses it only after the tracker's reply to that report has arrived, so the tracker has counted
  it before any token of it is trained.
A peer that leaves or dies gives back what it still held: those ids go to the next peer asking
for work. Released ids are never handed out again, so no window is trained twice in an epoch;
what a dead peer had released but not finished is lost (its in-flight micro-batches), and counted.

With a token budget the tracker hands out no window past it: the run trains its budget, not the
budget plus what the peers held when the tracker said stop (a few leases: 25 % more on a short run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from peer.wire import anchormesh_pb2 as pb

MAX_REFUSED = 4096  # work ids a peer gave back that it is not handed again (bounded memory)
MAX_AHEAD_LEASES = 4  # windows a peer may have released beyond what its reported tokens trained, in leases


@dataclass
class DataOrder:
    """Args:
    windows: training windows per epoch (`Windows.count` of the prepared data at the run's seq_len).
    seq_len: tokens a window trains (its inputs).
    seed: the run's seed; the permutation of epoch e is seeded by (seed, e).
    lease: work ids a peer holds at most (a few steps' worth).
    source: what the data is (the manifest's source), for the status.
    budget: windows the run trains in all (its token budget; 0: no end). Not persisted: the
        run.toml's budget holds, also after a restart.
    shard_ends: the cumulative window count at the end of each shard (`Windows`' numbering);
        empty: one shard.
    """

    windows: int
    seq_len: int
    seed: int = 0
    lease: int = 64
    source: str = ""
    epoch: int = 0
    cursor: int = 0  # windows of this epoch's permutation handed out
    done: int = 0  # work ids released over the run (trained, or lost in flight)
    held: dict[str, list[int]] = field(default_factory=dict)  # peer id -> work ids it holds, oldest first
    returned: list[int] = field(default_factory=list)  # work ids given back, handed out before new ones
    refused: dict[str, list[int]] = field(default_factory=dict)  # peer id -> ids it could not train
    released: dict[str, int] = field(default_factory=dict)  # peer id -> ids it released since it joined
    lost: int = 0  # windows released by peers that left before training them
    version: int = 0  # changes with every change of the above (the bootstrap saves before it answers)
    budget: int = 0
    shard_ends: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError(f"windows={self.windows}: the prepared data holds no training window")
        if self.shard_ends and (self.shard_ends[-1] != self.windows or sorted(self.shard_ends) != self.shard_ends):
            raise ValueError(f"shard_ends={self.shard_ends[:4]}...: must rise to windows={self.windows}")
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order of the window ids (the same on every restart)."""
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if len(self.shard_ends) <= 1:
                order = rng.permutation(self.windows)
            else:
                starts = [0, *self.shard_ends[:-1]]
                order = np.concatenate(
                    [
                        starts[k] + rng.permutation(self.shard_ends[k] - starts[k])
                        for k in rng.permutation(len(self.shard_ends))
                    ]
                )
            self._perm = (epoch, order)
        return self._perm[1]

    def window(self, work_id: int) -> int:
        return work_id % self.windows

    def _take(self, peer: str, fresh: bool = True) -> int | None:
        """A work id for `peer`: one given back first, else (with `fresh`) the permutation's next."""
        refused = set(self.refused.get(peer, ()))
        for k, wid in enumerate(self.returned):
            if wid not in refused:
                return self.returned.pop(k)
        if not fresh:
            return None
        if self.cursor >= self.windows:
            self.epoch, self.cursor = self.epoch + 1, 0
        wid = self.epoch * self.windows + int(self.permutation(self.epoch)[self.cursor])
        self.cursor += 1
        return wid

    def report(self, peer: str, held: list[int], returned: list[int], want: bool = True) -> list[int]:
        """A stage-0 peer's report: settle what it released or gave back; with `want`, top its
        holding up to `lease` and return the new work ids (to send in the reply)."""
        mine = self.held.get(peer, [])
        keep, back = set(held), set(returned)
        released = [i for i in mine if i not in keep and i not in back]
        given_back = [i for i in mine if i in back]
        still = [i for i in mine if i in keep and i not in back]
        if given_back:
            self.returned.extend(given_back)
            self.refused[peer] = (self.refused.get(peer, []) + given_back)[-MAX_REFUSED:]
        self.done += len(released)
        if released:
            self.released[peer] = self.released.get(peer, 0) + len(released)
        new: list[int] = []
        if want:
            others = sum(len(v) for k, v in self.held.items() if k != peer)
            room = self.budget - (
                self.done + others + len(still) + len(self.returned)
            )  # budget windows not yet handed out
            for _ in range(self.lease - len(still)):
                pool = len(self.returned)
                wid = self._take(peer, fresh=not self.budget or room > 0)
                if wid is None:
                    break
                room -= (
                    len(self.returned) == pool
                )  # a fresh id takes the budget's room; one given back was counted already
                new.append(wid)
        if released or given_back or new or (peer not in self.held and want):
            self.version += 1
        self.held[peer] = still + new
        return new

    def keeps_up(self, peer: str, tokens: int) -> bool:
        """Whether `peer` may take more work: the windows it released are not far ahead of the
        tokens it reports trained (a broken or lying peer would otherwise burn the epoch untrained)."""
        return self.released.get(peer, 0) - tokens // self.seq_len <= MAX_AHEAD_LEASES * self.lease

    def release(self, peer: str, trained_tokens: int | None = None) -> int:
        """The peer left or died: what it held goes back, and with `trained_tokens` (what it
        reported trained) the windows it released but never trained count as lost. Returns how
        many ids went back."""
        ids = self.held.pop(peer, [])
        self.refused.pop(peer, None)
        released = self.released.pop(peer, 0)
        if trained_tokens is not None and released > trained_tokens // self.seq_len:
            self.lost += released - trained_tokens // self.seq_len
            self.version += 1
        if ids:
            self.returned.extend(ids)
            self.version += 1
        return len(ids)

    @property
    def in_flight(self) -> int:
        return sum(len(v) for v in self.held.values())

    @property
    def tokens_seen(self) -> int:
        return self.done * self.seq_len

    def status(self, eval_windows: int = 0) -> pb.DataStatus:
        return pb.DataStatus(
            source=self.source[:300],
            epoch=self.epoch,
            windows=self.windows,
            position=self.cursor,
            done=self.done,
            tokens_seen=self.tokens_seen,
            in_flight=self.in_flight,
            returned=len(self.returned),
            eval_windows=eval_windows,
        )

    def to_dict(self) -> dict:
        keys = (
            "windows",
            "seq_len",
            "seed",
            "lease",
            "source",
            "epoch",
            "cursor",
            "done",
            "held",
            "returned",
            "refused",
            "released",
            "lost",
            "shard_ends",
            "version",
        )
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_dict(cls, d: dict) -> DataOrder:
        order = cls(
            int(d["windows"]),
            int(d["seq_len"]),
            int(d.get("seed", 0)),
            int(d.get("lease", 64)),
            str(d.get("source", "")),
            shard_ends=[int(x) for x in d.get("shard_ends") or []],  # none saved: the one-shard order it had
        )
        order.epoch, order.cursor, order.done = int(d.get("epoch", 0)), int(d.get("cursor", 0)), int(d.get("done", 0))
        order.held = {str(k): [int(x) for x in v] for k, v in (d.get("held") or {}).items()}
        order.returned = [int(x) for x in d.get("returned") or []]
        order.refused = {str(k): [int(x) for x in v] for k, v in (d.get("refused") or {}).items()}
        order.released = {str(k): int(v) for k, v in (d.get("released") or {}).items()}
        order.lost, order.version = int(d.get("lost", 0)), int(d.get("version", 0))
        return order
