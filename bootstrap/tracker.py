"""The tracker's state: run config, roster with heartbeats, stage assignment, global progress.

Pure Python and thread-safe (the gRPC services call it from their worker threads); no I/O, so
tests drive it directly with a fake clock.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from peer import __version__
from peer.config import TrainConfig
from peer.errors import AnchormeshError
from peer.model.stages import layer_ranges
from peer.wire import anchormesh_pb2 as pb

LIVE = ("joining", "active", "idle")


class JoinRefused(AnchormeshError):
    """A peer may not join (wrong run, wrong code version, duplicate id); the message says why."""


@dataclass
class PeerRecord:
    peer_id: str
    stage: int
    address: str
    state: str = "joining"
    last_seen: float = 0.0
    tokens_per_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    step: int = 0
    loss: float = math.nan
    queue_depth: int = 0
    tokens: int = 0
    reason: str = ""
    dp_rounds: int = 0


@dataclass
class Tracker:
    """Roster and assignment for one run.

    Args:
        run_id: the run this tracker serves.
        config: the run's TrainConfig (sent to every joining peer as JSON).
        peer_timeout_s: a peer silent for this long is marked dead and leaves the roster's routing.
        heartbeat_interval_s: how often peers report.
        clock: time source (tests pass a fake).
    """

    run_id: str
    config: TrainConfig
    peer_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    dht_maddrs: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    started: float = field(default=0.0)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.ranges = layer_ranges(self.config.model.num_layers, self.config.model.num_stages)

    # -- membership -------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        for p in self.peers.values():
            if p.state in LIVE and now - p.last_seen > self.peer_timeout_s:
                p.state, p.reason = "dead", f"no heartbeat for {now - p.last_seen:.1f}s (timeout {self.peer_timeout_s:.0f}s)"

    def live(self, stage: int | None = None) -> list[PeerRecord]:
        return [p for p in self.peers.values() if p.state in LIVE and (stage is None or p.stage == stage)]

    def join(self, req: pb.JoinRequest) -> pb.Assignment:
        """Admit a peer and give it the stage with the fewest live peers (lowest index on ties)."""
        if req.run_id and req.run_id != self.run_id:
            raise JoinRefused(f"run_id={req.run_id!r}: this tracker serves run {self.run_id!r}")
        if req.code_version != __version__:
            raise JoinRefused(f"code_version={req.code_version!r}: the run needs anchormesh {__version__}")
        if not req.peer_id or not req.grpc_address:
            raise JoinRefused("peer_id and grpc_address are required")
        with self._lock:
            self._expire()
            old = self.peers.get(req.peer_id)
            if old is not None and old.state in LIVE:
                raise JoinRefused(f"peer_id={req.peer_id!r} is already in the run (state {old.state})")
            counts = [len(self.live(s)) for s in range(self.config.model.num_stages)]
            stage = counts.index(min(counts))
            start_step = max((p.step for p in self.peers.values() if p.stage == stage), default=0)
            self.peers[req.peer_id] = PeerRecord(req.peer_id, stage, req.grpc_address, last_seen=self.clock())
        start, end = self.ranges[stage]
        return pb.Assignment(
            run_id=self.run_id,
            stage=stage,
            num_stages=self.config.model.num_stages,
            layer_start=start,
            layer_end=end,
            run_config_json=json.dumps(asdict(self.config)),
            heartbeat_interval_s=self.heartbeat_interval_s,
            start_step=start_step,
            dht_maddrs=self.dht_maddrs,
        )

    def report(self, rep: pb.PeerReport) -> pb.Directive:
        """Record a heartbeat; answer with the live neighbours of the peer's stage."""
        if rep.run_id != self.run_id:
            raise JoinRefused(f"run_id={rep.run_id!r}: this tracker serves run {self.run_id!r}")
        with self._lock:
            p = self.peers.get(rep.peer.peer_id)
            if p is None or p.state in ("dead", "left"):
                raise JoinRefused(f"peer_id={rep.peer.peer_id!r} is not in the roster: join first")
            info = rep.peer
            p.state = info.state if info.state in LIVE else p.state
            p.last_seen, p.tokens_per_s, p.step, p.loss = self.clock(), info.tokens_per_s, info.step, info.loss
            p.bytes_in, p.bytes_out, p.queue_depth, p.tokens, p.reason = info.bytes_in, info.bytes_out, info.queue_depth, rep.tokens, info.reason
            p.dp_rounds = info.dp_rounds
            self._expire()
            neighbours = [self._info(q) for q in self.live() if abs(q.stage - p.stage) == 1]
        return pb.Directive(kind=pb.Directive.CONTINUE, neighbours=neighbours)

    def leave(self, req: pb.LeaveRequest) -> None:
        with self._lock:
            p = self.peers.get(req.peer_id)
            if p is not None:
                p.state, p.reason = "left", req.reason or "left"

    # -- status -----------------------------------------------------------------------------
    def _info(self, p: PeerRecord) -> pb.PeerInfo:
        return pb.PeerInfo(
            peer_id=p.peer_id, stage=p.stage, address=p.address, state=p.state, last_seen_s=self.clock() - p.last_seen,
            tokens_per_s=p.tokens_per_s, bytes_in=p.bytes_in, bytes_out=p.bytes_out, step=p.step, loss=p.loss,
            queue_depth=p.queue_depth, reason=p.reason, dp_rounds=p.dp_rounds,
        )

    def status(self) -> pb.RunStatus:
        with self._lock:
            self._expire()
            K = self.config.model.num_stages
            stages = []
            for s in range(K):
                live = self.live(s)
                stages.append(pb.StageStatus(index=s, peers=len(live), tokens_per_s=sum(p.tokens_per_s for p in live), queue_depth=sum(p.queue_depth for p in live)))
            first, last = self.live(0), self.live(K - 1)
            tokens = sum(p.tokens for p in self.peers.values() if p.stage == 0)
            losses = [p.loss for p in last if not math.isnan(p.loss)]
            step = max((p.step for p in self.peers.values() if p.stage == 0), default=0)  # stage 0 counts the run's steps
            pp_bytes = sum(p.bytes_out for p in self.peers.values())
            missing = [s for s in range(K) if not self.live(s)]
            state, reason = "running", ""
            if missing:
                state, reason = "paused", "no live peer for stage " + ", ".join(map(str, missing))
            pp_bpt = pp_bytes / tokens if tokens else 0.0
            dense = 2 * 2 * self.config.model.hidden_size * (K - 1)
            return pb.RunStatus(
                run_id=self.run_id,
                step=step,
                tokens=tokens,
                loss=sum(losses) / len(losses) if losses else math.nan,
                tokens_per_s=sum(p.tokens_per_s for p in first),
                pp_bytes_per_token=pp_bpt,
                pp_compression=dense / pp_bpt if pp_bpt else 0.0,
                uptime_s=self.clock() - self.started,
                state=state,
                reason=reason,
                stages=stages,
                peers=[self._info(p) for p in sorted(self.peers.values(), key=lambda p: (p.stage, p.peer_id))],
                dht_maddrs=self.dht_maddrs,
            )
