"""The tracker's state: run config, roster with heartbeats, stage assignment, global progress.

Pure Python and thread-safe (the gRPC services call it from their worker threads); no I/O, so
tests drive it directly with a fake clock. Its parts: the roster's records (roster.py), stage
assignment and balance (balance.py), the bounds on a report (report_bounds.py), the anchor and
evaluation passes (cadence.py), a peer as the status shows it (peer_view.py) and the run's status
(run_status.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from bootstrap.balance import StageBalance, fitting_stages
from bootstrap.cadence import Cadence
from bootstrap.data_order import DataOrder
from bootstrap.peer_view import peer_info
from bootstrap.report_bounds import MAX_TEXT, take_fields, take_report
from bootstrap.roster import LIVE, Banned, JoinRefused, PeerRecord, live
from bootstrap.run_status import run_status
from bootstrap.support import Support, rate_bound, restore_choice
from peer.build import build
from peer.capacity import step_ceiling
from peer.config import TrainConfig
from peer.model.stages import layer_ranges
from peer.runtoml import config_digest
from peer.security.identity import fingerprint
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import wire_version

MAX_MADDRS_PER_PEER = 4  # a peer's DHT addresses kept for its stage mates (bounded: the peer declares them)
REPLICA_HOLDERS = 2  # peers of a stage that keep a copy of the next stage's state
MAX_DONORS = 4  # stage mates a joiner may ask for the stage's state, most-trained first
MAX_HELD = 512  # work ids read from each of a report's lists (a peer holds at most the data order's lease)
log = logging.getLogger("anchormesh.tracker")


@dataclass
class Tracker:
    """Roster and assignment for one run.

    Args:
        run_id: the run this tracker serves.
        config: the run's TrainConfig (sent to every joining peer as JSON).
        peer_timeout_s: a peer silent for this long is marked dead and leaves the roster's routing.
        load_grace_s: how long a joined peer may take to its first heartbeat: it loads its stage's
            weights first (a hub download, a GGUF file to dequantize: a minute or more), and
            declaring it dead then would make it join and load again, for ever.
        heartbeat_interval_s: how often peers report.
        move_cooldown_s: at most one peer is moved between stages per this many seconds.
        clock: time source (tests pass a fake).

    Stage balance (SWARM/Petals-style, bootstrap/balance.py): a joiner takes the stage its live
    peers' measured capacity serves worst, and a starving stage pulls a peer from the richest one.
    """

    run_id: str
    config: TrainConfig
    peer_timeout_s: float = 10.0
    load_grace_s: float = 600.0
    heartbeat_interval_s: float = 1.0
    move_cooldown_s: float = 20.0
    dht_maddrs: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    data: DataOrder | None = None  # the run's data order (None: no prepared data, stage 0 gets no work)
    data_manifest: str = ""  # the prepared data's manifest.json, handed to every joiner
    data_hub: str = ""  # OWNER/NAME@COMMIT when stage 0 downloads the shards from the hub, not from here
    eval_windows: int = 0  # the fixed evaluation windows every peer uses (for the status)
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    started: float = field(default=0.0)
    expire_after: float = 0.0  # clock time before which no peer is declared dead (set after a restart)
    banned: dict[str, str] = field(default_factory=dict)  # key fingerprint -> why (the gate refuses their calls too)
    unfit: deque = field(
        default_factory=lambda: deque(maxlen=8)
    )  # the newest joins no stage fitted (status shows them)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.ranges = layer_ranges(self.config.model.num_layers, self.config.model.num_stages)
        self.digest = config_digest(self.config)
        self.anchors = Cadence(self.config.anchor.every)
        self.evals = Cadence(self.config.pipeline.eval_every)
        self.balance = StageBalance(
            [max(end - start, 1) for start, end in self.ranges],
            self.move_cooldown_s,
            self.clock,
            next_move_at=self.started,
        )
        self.moves = 0

    def scores(self, speeds: dict[str, float] | None = None) -> list[float]:
        """Per stage: the tokens/s its live peers could sustain (bootstrap/balance.py)."""
        return self.balance.scores(self.peers.values(), speeds)

    # -- membership -------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        self.balance.forget_reservations(now, 3 * self.peer_timeout_s)  # the moved peer never came back
        if now < self.expire_after:  # just restored: peers are still reconnecting
            return
        for p in self.peers.values():
            timeout = self.peer_timeout_s if p.reported else max(self.peer_timeout_s, self.load_grace_s)
            if p.state in LIVE and now - p.last_seen > timeout:
                what = "heartbeat" if p.reported else "first heartbeat after joining (still loading its stage?)"
                p.state, p.reason = "dead", f"no {what} for {now - p.last_seen:.1f}s (timeout {timeout:.0f}s)"
            if p.state not in LIVE:
                self._release(p.peer_id)

    def _release(self, peer_id: str) -> None:
        """A peer that is no longer live gives back the work it held (bootstrap/data_order.py)."""
        if self.data is not None and peer_id in self.data.held:
            n = self.data.release(peer_id, self.peers[peer_id].tokens if peer_id in self.peers else None)
            log.info("%s left with %d windows of work not started: they go to the next stage-0 peer", peer_id, n)

    def live(self, stage: int | None = None) -> list[PeerRecord]:
        return live(self.peers.values(), stage)

    def admissible(self, req: pb.JoinRequest, key: bytes = b"") -> None:
        """Raise JoinRefused (Banned) when `req` cannot join whatever the roster holds: another run,
        wire version or codec, no address, a banned key. Join's server thread asks it before dialing
        the peer back (bootstrap/dial_back.py), so a wrong build hears so, not that it is unreachable."""
        if req.run_id and req.run_id != self.run_id:
            raise JoinRefused(f"run_id={req.run_id!r}: this tracker serves run {self.run_id!r}")
        if req.wire_version != wire_version():
            theirs = req.wire_version or f"none (anchormesh {req.code_version or '?'} predates wire versions)"
            raise JoinRefused(
                f"wire_version={theirs}: this run's peers speak wire version {wire_version()} (anchormesh {build()}); run a build with that wire version"
            )
        if self.config.mask.scheme not in req.codecs:
            raise JoinRefused(
                f"codecs={list(req.codecs)}: this run's PP codec is codec.scheme={self.config.mask.scheme!r}, which this peer's build does not have"
            )
        if not req.peer_id or not req.grpc_address:
            raise JoinRefused("peer_id and grpc_address are required")
        if key and fingerprint(key) in self.banned:
            raise Banned(f"peer {req.peer_id} is banned from this run: {self.banned[fingerprint(key)]}")

    def join(self, req: pb.JoinRequest, key: bytes = b"") -> pb.Assignment:
        """Admit a peer (identity key `key`) and give it the stage it was reserved (a move) or
        the lowest-scoring one (bootstrap/balance.py)."""
        self.admissible(req, key)
        with self._lock:
            self._expire()
            old = self.peers.get(req.peer_id)
            restarted = old is not None and old.state in LIVE and bool(key) and old.key == key.hex()
            if old is not None and old.state in LIVE and not restarted:
                raise JoinRefused(f"peer_id={req.peer_id!r} is already in the run (state {old.state})")
            if restarted:  # the same key joins again before its old record expired: it was restarted
                old.state, old.reason = "left", "restarted (joined again with the same key)"
            self._release(req.peer_id)  # its old process's work, not started: another takes it
            if old is not None:  # a peer joining again (after a move or a restart): keep its past in the roster
                n = sum(1 for k in self.peers if k.startswith(req.peer_id + "~"))
                old.peer_id = f"{req.peer_id}~{n + 1}"
                self.peers[old.peer_id] = old
            fits = fitting_stages(req, self.config.model.num_stages, self.unfit)
            stage = self.balance.take_reservation(req.peer_id)
            if stage is None or (fits is not None and stage not in fits):
                stage = self.balance.pick_stage(self.peers.values(), fits)
            support = Support(
                self.peers.values(), self.clock()
            )  # a lone member's claim counts as far as the others' reports reach
            start_step = max((support.step(p) for p in self.peers.values() if p.stage == stage), default=0)
            restore = self._restore_source(stage)
            donors = [peer_info(q, self.clock()) for q in support.donor_order(self._serving(stage))[:MAX_DONORS]]
            mates = [m for q in self.live(stage) for m in q.dht_maddrs[:MAX_MADDRS_PER_PEER]]
            self.peers[req.peer_id] = PeerRecord(
                req.peer_id,
                stage,
                req.grpc_address,
                last_seen=self.clock(),
                joined_at=self.clock(),
                dht_maddrs=tuple(req.dht_maddrs[:MAX_MADDRS_PER_PEER]),
                key=key.hex(),
                device=req.device[:120],
                build=req.code_version[:80],
                memory=req.memory_bytes,
                memory_plan=req.stage_memory_bytes[stage] if req.stage_memory_bytes else 0,
                start_step=start_step,
            )
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
            group_dht_maddrs=mates,
            anchors_issued=self.anchors.launched,
            restore_from=restore,
            donors=donors,
            data_manifest=self.data_manifest if stage == 0 else "",
            data_hub=self.data_hub if stage == 0 else "",
            data_windows=self.data.windows if self.data is not None else 0,
        )

    def run_config(self) -> pb.RunConfig:
        """The run's config for an observer that does not join (anchormesh export)."""
        return pb.RunConfig(
            run_id=self.run_id,
            run_config_json=json.dumps(asdict(self.config)),
            code_version=build(),
            wire_version=wire_version(),
            server_time_unix=time.time(),
        )

    def report(self, rep: pb.PeerReport) -> pb.Directive:
        """Record a heartbeat; answer with the live peers of the adjacent stages and of the peer's
        own stage group, plus an anchor job (stage 0) or a move to a starving stage."""
        if rep.run_id != self.run_id:
            raise JoinRefused(f"run_id={rep.run_id!r}: this tracker serves run {self.run_id!r}")
        with self._lock:
            p = self.peers.get(rep.peer.peer_id)
            if p is not None and p.state == "banned":
                raise Banned(f"peer {p.peer_id} is banned from this run: {p.reason}")
            if p is None or p.state in ("dead", "left"):
                raise JoinRefused(f"peer_id={rep.peer.peer_id!r} is not in the roster: join first")
            info = rep.peer
            now = self.clock()
            take_report(
                p, info, rep.tokens, now, self.config.pipeline, self._run_step(), rate_bound(self.peers.values(), p)
            )
            replica_ceiling = step_ceiling(self._run_step(), 2 * self.heartbeat_interval_s)
            take_fields(p, info, now, self.anchors.launched, self.config.model.num_stages, replica_ceiling)
            self._expire()
            new_work = self._settle_work(p, rep)
            if self._budget_spent():
                return pb.Directive(
                    kind=pb.Directive.STOP,
                    reason=f"the run's token budget of {self.config.token_budget} tokens is spent",
                )
            move = self.balance.move_target(self.peers.values(), p)
            if move is not None:
                target, speed = move
                self.moves += 1
                p.state, p.reason = "left", f"moved to stage {target}, which was starving"
                self._release(p.peer_id)
                self.balance.moved(p.peer_id, target, speed)
                return pb.Directive(
                    kind=pb.Directive.MOVE, reason=f"stage {target} needs a peer more than stage {p.stage}"
                )
            # a joining peer may not serve yet (it may still be downloading its stage's state)
            neighbours = [
                peer_info(q, self.clock())
                for q in self.live()
                if abs(q.stage - p.stage) <= 1 and q.peer_id != p.peer_id and q.state != "joining"
            ]
            banned_dht = sorted(
                {
                    m.rsplit("/p2p/", 1)[1]
                    for q in self.peers.values()
                    if q.state == "banned"
                    for m in q.dht_maddrs
                    if "/p2p/" in m
                }
            )
            # libp2p authenticates hivemind peer ids, and each member declared its own at Join:
            # an averaging round with any other id has an outsider in it
            members = sorted(
                {m.rsplit("/p2p/", 1)[1] for q in self.live(p.stage) for m in q.dht_maddrs if "/p2p/" in m}
            )
            directive = pb.Directive(
                kind=pb.Directive.CONTINUE,
                neighbours=neighbours,
                banned=sorted(self.banned),
                banned_dht=banned_dht,
                member_dht=members,
                windows=new_work,
            )
            # anchor and evaluation passes: to the next stage-0 peer to report once due, while every stage is served
            if (
                p.stage == 0
                and p.state in ("active", "idle")
                and all(self.live(s) for s in range(self.config.model.num_stages))
            ):
                step = self._run_step()
                directive.anchor_id, directive.eval_id = self.anchors.due(step), self.evals.due(step)
                if directive.anchor_id:
                    directive.anchor_micro_batches = self.config.anchor.micro_batches
            directive.anchors_issued = self.anchors.launched
            source = self._replica_source(p)
            if source is not None:  # what it was told to copy, and how far: the evidence a restore is chosen by
                directive.replicate.CopyFrom(peer_info(source, self.clock()))
                p.copy_stage, p.copy_step = source.stage, source.step
        return directive

    def _settle_work(self, p: PeerRecord, rep: pb.PeerReport) -> list[int]:
        """Stage 0: count what the peer released or gave back, and the new work for its reply
        (none once the budget is spent: the reply is STOP)."""
        if self.data is None or p.stage != 0:
            return []
        want = p.state in LIVE and not self._budget_spent() and self.data.keeps_up(p.peer_id, p.tokens)
        return self.data.report(
            p.peer_id, list(rep.windows_held[:MAX_HELD]), list(rep.windows_returned[:MAX_HELD]), want=want
        )

    def _serving(self, stage: int | None = None) -> list[PeerRecord]:
        """Live peers that serve (not joining) of `stage` (all stages: None), most-trained first:
        what a joiner, a replica or a restore may be taken from."""
        return sorted(
            (q for q in self.live(stage) if q.state in ("active", "idle")), key=lambda q: (-q.step, q.peer_id)
        )

    def _replica_source(self, p: PeerRecord) -> PeerRecord | None:
        """Whom `p` copies the next stage's state from (the last stage copies stage 0), so every
        stage's state lives on another stage's peers too. Only the first `REPLICA_HOLDERS` serving
        peers of a stage (by id) keep a copy, each from another of the most-trained peers of the
        next stage: a copy is 12 bytes per parameter, and every peer of a big group pulling from
        one source would take that source's uplink."""
        K = self.config.model.num_stages
        if K < 2 or p.state not in ("active", "idle"):
            return None
        holders = sorted(q.peer_id for q in self._serving(p.stage))[:REPLICA_HOLDERS]
        sources = self._serving((p.stage + 1) % K)
        if p.peer_id not in holders or not sources:
            return None
        return sources[holders.index(p.peer_id) % len(sources)]

    def _restore_source(self, stage: int) -> pb.PeerInfo | None:
        """When `stage` has no live peer (its whole group died): the holder of its newest replica by
        the tracker's own records (bootstrap/support.py `restore_choice`), that step in `step`."""
        best = None if self.live(stage) else restore_choice(self.peers.values(), self._serving(), stage)
        info = peer_info(best[0], self.clock()) if best is not None else None
        if info is not None:
            info.step = best[1]
        return info

    def _tokens(self) -> int:
        return Support(self.peers.values(), self.clock()).stage0_tokens(
            self.config.pipeline
        )  # stage 0 feeds every token once

    def _budget_spent(self) -> bool:  # lost windows count: the budget caps what is handed out, so they never come
        return (
            0
            < self.config.token_budget
            <= self._tokens() + (self.data.lost * self.data.seq_len if self.data is not None else 0)
        )

    def _run_step(self) -> int:
        return Support(
            self.peers.values(), self.clock()
        ).run_step()  # stage 0 counts the run's steps, as far as the others support them

    def leave(self, req: pb.LeaveRequest) -> None:
        with self._lock:
            p = self.peers.get(req.peer_id)
            if p is not None:
                p.state, p.reason = "left", req.reason[:MAX_TEXT] or "left"
                self._release(p.peer_id)

    def ban(self, who: str, reason: str, unban: bool = False) -> list[str]:
        """Ban (or readmit) the key of peer `who` (a peer id, or a key fingerprint): its calls are
        refused from now on, it leaves the roster's routing, and every peer hears of it in its
        next heartbeat reply. Returns "fingerprint (peer id): reason" for every banned key."""
        with self._lock:
            records = [
                p
                for p in self.peers.values()
                if p.peer_id == who or (p.key and fingerprint(bytes.fromhex(p.key)) == who)
            ]
            fps = {fingerprint(bytes.fromhex(p.key)) for p in records if p.key}
            if not fps and len(who) == 16 and all(c in "0123456789abcdef" for c in who):
                fps = {who}  # a key that never joined (or left the roster)
            if not fps:
                raise JoinRefused(f"no peer or key fingerprint {who!r} in this run (see `anchormesh status`)")
            for fp in fps:
                if unban:
                    self.banned.pop(fp, None)
                else:
                    self.banned[fp] = reason or "banned by the operator"
            for p in records:
                if unban and p.state == "banned":
                    p.state, p.reason = "left", "unbanned; may join again"
                elif not unban:
                    p.state, p.reason = "banned", reason or "banned by the operator"
                    self._release(p.peer_id)
            return self._ban_list()

    def _ban_list(self) -> list[str]:
        names = {fingerprint(bytes.fromhex(p.key)): p.peer_id for p in self.peers.values() if p.key}
        return [f"{fp} ({names.get(fp, 'unknown peer')}): {why}" for fp, why in sorted(self.banned.items())]

    # -- status -----------------------------------------------------------------------------
    def status(self) -> pb.RunStatus:
        """The run's status (bootstrap/run_status.py)."""
        with self._lock:
            self._expire()
            return run_status(self)
