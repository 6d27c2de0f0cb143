"""Where this peer's messages go: the neighbours the tracker names, the next-stage peer for each
message (by capacity, what each already holds and how fast its gradients come back), its stage
mates, stage 0's resends of micro-batches whose gradient never came, and what its links measure.

A part of `PeerDaemon` (peer/daemon/main.py) on its own so that routing can be tested without a
swarm: it needs the transport (endpoints, meters, exclusions), this peer's id and its worker
(read when asked: the daemon has no worker until it joins).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from peer.capacity import fill_unmeasured
from peer.errors import AnchormeshError
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")

# round trips (output sent to its gradient back) kept per next hop, and for how long: the median of
# the recent ones, so one slow start (a coder shipped, a warm-up message) is outvoted, and a peer
# left unmeasured for a while counts as the median of the others again (it is tried again)
TRIPS_KEPT = 8
TRIPS_WINDOW_S = 30.0


class Links(Protocol):
    """What routing needs of the transport."""

    endpoints: dict[str, str]
    meters: dict

    def usable(self, dst: str) -> bool: ...


class Router:
    """The neighbours by stage, the capacity-weighted choice of a next hop, and stage 0's
    round trips and resends."""

    def __init__(self, transport: Links, peer_id: str, worker: Callable[[], StageWorker | None]) -> None:
        self.transport, self.peer_id, self._worker = transport, peer_id, worker
        self.neighbours: dict[int, list[pb.PeerInfo]] = {}
        self.route_gen = torch.Generator().manual_seed(uuid.uuid4().int & 0xFFFF)
        self.sent_at: dict[tuple[int, int], float] = {}
        self.round_trips: deque[float] = deque(maxlen=64)  # stage 0: seconds from sending a micro-batch to its gradient
        self.trips: dict[str, deque[tuple[float, float]]] = {}  # per next hop: (when, seconds to the gradient)
        self._watched: dict[tuple[int, int], tuple[object, float]] = {}  # in flight at the last look: (dst, sent at)
        self.held: set[str] = set()  # "DST CHANNEL: kind of why" of the links whose meter holds its estimate, logged
        self.held_why: list[str] = []  # "DST CHANNEL: why" of those links, for the status

    def next_hop(self) -> str:
        """A live next-stage peer, chosen with probability

            capacity_p / ((1 + held_p) * trip_p)

        capacity_p: tokens/s it could do if never waiting (not its throughput: a peer that gets
        little work shows little throughput, and routing by it would starve that peer further);
        held_p: this peer's micro-batches it holds (sent, no gradient back yet); trip_p: the
        median of its recent round trips from here. A peer behind a slow link, its own or its
        answers', returns gradients late and holds more: it gets less, and stage 0's in-flight
        slots (max_staleness) are not hoarded behind it. Unmeasured figures count as the median
        of the others. A peer whose stream stopped taking messages is left out while the
        transport excludes it, unless it is the only one."""
        w = self._worker()
        peers = self.neighbours.get(w.stage.index + 1, [])
        if not peers:
            raise AnchormeshError(f"no live peer of stage {w.stage.index + 1} to send to")
        peers = [p for p in peers if self.transport.usable(p.peer_id)] or peers
        held: dict[object, int] = {}
        for job in w.inflight.values():
            held[job.dst] = held.get(job.dst, 0) + 1
        now = time.monotonic()
        trips = fill_unmeasured([self._trip(p.peer_id, now) for p in peers])
        capacity = fill_unmeasured([p.capacity_tokens_per_s for p in peers])
        weights = torch.tensor(
            [c / ((1 + held.get(p.peer_id, 0)) * t) for p, c, t in zip(peers, capacity, trips, strict=True)]
        )
        return peers[int(torch.multinomial(weights, 1, generator=self.route_gen))].peer_id

    def _trip(self, peer_id: str, now: float) -> float:
        """The median of `peer_id`'s round trips of the last TRIPS_WINDOW_S (0: none)."""
        kept = self.trips.get(peer_id)
        while kept and now - kept[0][0] > TRIPS_WINDOW_S:
            kept.popleft()
        return sorted(x for _, x in kept)[len(kept) // 2] if kept else 0.0

    def watch(self, w: StageWorker) -> None:
        """Time each next hop's round trips: a micro-batch seen in flight before and gone now got
        its gradient (or was dropped: a resend starts a new one). Call once per loop."""
        now = time.monotonic()
        for key, (dst, sent) in self._watched.items():
            job = w.inflight.get(key)
            # gone, or sent again (its first next hop held it past the resend limit: at least that long)
            if (job is None or job.sent_s != sent) and isinstance(dst, str) and sent > 0:
                self.trips.setdefault(dst, deque(maxlen=TRIPS_KEPT)).append((now, now - sent))
        self._watched = {key: (job.dst, job.sent_s) for key, job in w.inflight.items()}

    @staticmethod
    def resolve(sender: str) -> str:
        return sender

    def apply_neighbours(self, directive: pb.Directive) -> None:
        by_stage: dict[int, list[pb.PeerInfo]] = {}
        for n in directive.neighbours:
            by_stage.setdefault(n.stage, []).append(n)
            self.transport.endpoints[n.peer_id] = n.address
        self.neighbours = by_stage

    def siblings(self) -> list[str]:
        """The other live peers of this peer's stage group."""
        return [n.peer_id for n in self.neighbours.get(self._worker().stage.index, []) if n.peer_id != self.peer_id]

    def retry_after_s(self) -> float:
        """How long stage 0 waits for a micro-batch's gradient before sending it again: three
        times the slowest recent round trip, within [5 s, 60 s] (20 s before any is measured)."""
        if len(self.round_trips) < 4:
            return 20.0
        return min(max(3.0 * max(self.round_trips), 5.0), 60.0)

    def retry_stale(self, w: StageWorker) -> None:
        """Stage 0: a micro-batch without its gradient for `retry_after_s()` is sent again (same window,
        same id) to a live next-stage peer; its old forward is dropped. Covers a neighbour that died."""
        now = time.monotonic()
        limit = self.retry_after_s()
        for key, job in list(w.inflight.items()):
            sent = self.sent_at.setdefault(key, now)
            if now - sent > limit and self.neighbours.get(1):
                step, mb = key
                w.inflight.pop(key)
                w.forget_sent()  # the lost message may have carried the receiver's basis or coder
                log.warning(
                    "no gradient for micro-batch %s of step %d after %.0fs; sending it again", mb, step, now - sent
                )
                w.inject(job.window, step, mb - w.replica * w.cfg.pipeline.micro_batches)
                self.sent_at[key] = now
        for key in list(self.sent_at):
            if key not in w.inflight:
                self.round_trips.append(now - self.sent_at.pop(key))

    def uplink_bps(self) -> float | None:
        """Bytes/s of its slowest measured outbound pipeline stream (None: not measured yet): what
        its uplink carries, as far as this peer can tell."""
        rates = [
            bps
            for (_, ch), m in list(self.transport.meters.items())
            if ch in ("forward", "backward") and (bps := m.bps()) is not None
        ]
        return min(rates) if rates else None

    def links(self) -> tuple[float, float]:
        """(its slowest measured outbound pipeline link in Mbit/s or 0, the fraction of the codec's
        configured payload (mask.rank, or mask.drop's keep) it sends on its most constrained link,
        or 0 when it sends no activations). A link whose meter holds its last estimate rather than
        measuring (no ack, acks twice or out of order, a clock step) is logged once per reason and
        listed in `held_why` (the status's `links_held`): the figures are then that link's last good ones."""
        held = {
            f"{dst} {ch}: {why.split(':')[0]}": why
            for (dst, ch), m in list(self.transport.meters.items())
            if ch in ("forward", "backward") and (why := m.held())
        }
        for key in held.keys() - self.held:
            log.warning("link meter of %s holds its last estimate: %s", key.split(":")[0], held[key])
        self.held = set(held)
        self.held_why = [f"{key.split(':')[0]}: {why}" for key, why in sorted(held.items())]
        w, bps = self._worker(), self.uplink_bps()
        keep = min(w.keep_sent.values()) if w is not None and w.keep_sent else 0.0
        return (bps * 8 / 1e6 if bps else 0.0), keep
