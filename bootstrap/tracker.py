"""The tracker's state: run config, roster with heartbeats, stage assignment, global progress.

Pure Python and thread-safe (the gRPC services call it from their worker threads); no I/O, so
tests drive it directly with a fake clock.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from peer import __version__
from peer.capacity import MAX_CAPACITY_FACTOR, MAX_STEPS_PER_S, STEP_SLACK, fill_unmeasured, step_ceiling
from peer.config import TrainConfig
from peer.errors import AnchormeshError
from peer.model.stages import layer_ranges
from peer.security.identity import fingerprint
from peer.wire import anchormesh_pb2 as pb

LIVE = ("joining", "active", "idle")


class JoinRefused(AnchormeshError):
    """A peer may not join (wrong run, wrong code version, duplicate id); the message says why."""


class Banned(AnchormeshError):
    """The peer's key is banned from the run (the operator's `anchormesh ban`)."""


MAX_MADDRS_PER_PEER = 4  # a peer's DHT addresses kept for its stage mates (bounded: the peer declares them)
MAX_SUSPECTS = 4  # averaging suspects (and excluded next hops) kept per peer report
log = logging.getLogger("anchormesh.tracker")


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
    dp_rejected: int = 0
    anchor_id: int = 0
    anchor_bytes_out: int = 0
    dht_maddrs: tuple[str, ...] = ()
    capacity: float = 0.0  # tokens/s at its stage if it never waited; 0 = not measured yet
    dp_bytes_out: int = 0
    dp_dense_bytes: int = 0
    eval_id: int = 0
    eval_loss: float = math.nan
    joined_at: float = 0.0
    accepted_at: float = 0.0  # tracker clock of its last report taken as true (0: none yet): bounds the next one's step
    reported: bool = False  # has it sent a heartbeat since it joined (before: it loads its stage)
    key: str = ""  # its identity key (hex); bans name the key's fingerprint
    refused_calls: int = 0
    dp_suspects: tuple[str, ...] = ()  # "HIVEMIND_PEER_ID: why" of members its refused averaging rounds named
    link_mbit: float = 0.0  # its slowest measured outbound pipeline link
    pp_keep: float = 0.0  # fraction of mask.rank it sends there
    dp_period_s: float = 0.0  # its averaging slot period
    device: str = ""  # where it computes (from its Join)
    memory: int = 0  # bytes it may plan a stage for; 0 = unknown
    memory_plan: int = 0  # its plan for the stage it serves; 0 = unknown
    start_step: int = 0  # the run step it was given at Join (its reports start from there)
    refused_reports: int = 0  # reports whose figures were implausible (kept the old ones)
    last_refusal: str = ""  # why the newest one was
    excluding: tuple[str, ...] = ()  # "PEER: why (N s left)" of next-stage peers its sends route around
    startup_s: float = 0.0  # its process start to its first step (0: not yet)


@dataclass
class Cadence:
    """Jobs the tracker hands to stage 0 every `every` run steps (anchor or evaluation passes).

    Ids count from 1 in launch order; `launched_at` maps an id to the run step it was launched at."""

    every: int
    next_at: int = 0
    launched: int = 0
    launched_at: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.next_at = self.every  # the first at step `every`, as in the local runner

    def due(self, run_step: int) -> int:
        """A new job id when one is due at `run_step` (and record it), else 0."""
        if not self.every or run_step < self.next_at:
            return 0
        self.launched += 1
        self.launched_at[self.launched] = run_step
        self.next_at = run_step + self.every
        return self.launched


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

    Stage balance (SWARM/Petals-style): each peer reports its capacity, the tokens/s it could do
    at its stage if it never waited. A peer's *speed* is that times its stage's layer count
    (layer-tokens/s, comparable across stages); a stage's *score* is the sum of its live peers'
    speeds over its layer count — the tokens/s the stage could sustain. Peers not measured yet
    count as the median measured speed (1.0 when none is). A joiner takes the stage with the
    lowest score. A stage with no live peer pulls one peer from the highest-scoring stage that
    has at least two; so does a stage whose score a move would raise the run's bottleneck (the
    lowest score) by more than half, when every peer involved is measured and that has held for
    `move_cooldown_s` (capacity readings on shared machines are noisy, and a move costs the peer
    a restart). A peer is moved only after `move_cooldown_s` in its stage, at most one move per
    `move_cooldown_s`; the moved peer is given the stage it was moved for when it joins again,
    and until then it counts for that stage.
    """

    run_id: str
    config: TrainConfig
    peer_timeout_s: float = 10.0
    load_grace_s: float = 600.0
    heartbeat_interval_s: float = 1.0
    move_cooldown_s: float = 20.0
    dht_maddrs: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    started: float = field(default=0.0)
    expire_after: float = 0.0  # clock time before which no peer is declared dead (set after a restart)
    banned: dict[str, str] = field(default_factory=dict)  # key fingerprint -> why (the gate refuses their calls too)
    unfit: deque = field(default_factory=lambda: deque(maxlen=8))  # the newest joins no stage fitted (status shows them)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.ranges = layer_ranges(self.config.model.num_layers, self.config.model.num_stages)
        self.layers = [max(end - start, 1) for start, end in self.ranges]
        self.anchors = Cadence(self.config.anchor.every)
        self.evals = Cadence(self.config.pipeline.eval_every)
        self._next_move_at = self.started
        self.moves = 0
        self._reserved: dict[str, tuple[int, float, float]] = {}  # peer id -> (stage it was moved to, its speed, when)
        self._imbalanced_since: float | None = None  # when the capacity rule first asked for a move (reset when it stops)

    # -- stage balance ----------------------------------------------------------------------
    def _speeds(self) -> dict[str, float]:
        """Layer-tokens/s of every live peer (unmeasured ones: the median measured speed)."""
        live = self.live()
        return dict(zip((p.peer_id for p in live), fill_unmeasured([p.capacity * self.layers[p.stage] for p in live])))

    def scores(self, speeds: dict[str, float] | None = None) -> list[float]:
        """Per stage: the tokens/s its live peers could sustain (see the class docstring)."""
        speeds = self._speeds() if speeds is None else speeds
        pending = [0.0] * self.config.model.num_stages  # moved peers on their way to their new stage
        for stage, speed, _ in self._reserved.values():
            pending[stage] += speed
        return [(sum(speeds[p.peer_id] for p in self.live(s)) + pending[s]) / self.layers[s] for s in range(self.config.model.num_stages)]

    def _pick_stage(self, allowed: list[int] | None = None) -> int:
        scores = self.scores()
        return min(allowed if allowed is not None else range(len(scores)), key=lambda s: (scores[s], len(self.live(s)), s))

    def _fitting(self, req: pb.JoinRequest) -> list[int] | None:
        """The stages whose memory plan fits the joining peer (None: it sent no plan, any stage
        will do). Raises JoinRefused, and notes it for the status, when none fits."""
        K = self.config.model.num_stages
        if not req.memory_bytes or not req.stage_memory_bytes:
            return None
        if len(req.stage_memory_bytes) != K:
            raise JoinRefused(f"stage_memory_bytes has {len(req.stage_memory_bytes)} entries; this run has {K} stages")
        fits = [s for s, need in enumerate(req.stage_memory_bytes) if need <= req.memory_bytes]
        if not fits:
            gib = 2**30
            smallest = min(range(K), key=lambda s: req.stage_memory_bytes[s])
            why = (f"{req.peer_id} on {req.device or 'an unnamed device'}: {req.memory_bytes / gib:.1f} GiB, "
                   f"the smallest stage (stage {smallest}) needs {req.stage_memory_bytes[smallest] / gib:.1f} GiB")
            self.unfit.append(why)
            raise JoinRefused(f"no stage of this run fits this peer's memory ({why}); turn on compute.activation_checkpointing, lower pipeline.micro_batch_size, or run more stages (model.num_stages)")
        return fits

    def _move_target(self, p: PeerRecord) -> tuple[int, float] | None:
        """The stage `p` should move to now and p's speed, if any (call with the lock held).

        One decision for the whole run, not one per reporting peer: the donor stage is the
        highest-scoring stage with at least two live peers, the peer to move is the one of it
        whose move raises the bottleneck most, and only that peer is told when it reports."""
        now = self.clock()
        if now < self._next_move_at:
            return None
        speeds = self._speeds()
        scores = self.scores(speeds)
        donors = [s for s in range(len(scores)) if len(self.live(s)) >= 2]
        if not donors:
            self._imbalanced_since = None
            return None
        rich = max(donors, key=lambda s: scores[s])
        poor = min(range(len(scores)), key=lambda s: scores[s])
        movable = [q for q in self.live(rich) if q.state in ("active", "idle") and now - q.joined_at >= self.move_cooldown_s]
        if poor == rich or not movable:
            return None

        def after(q: PeerRecord) -> float:
            a = list(scores)
            a[rich] -= speeds[q.peer_id] / self.layers[rich]
            a[poor] += speeds[q.peer_id] / self.layers[poor]
            return min(a)

        best = max(movable, key=lambda q: (after(q), q.peer_id))
        if self.live(poor):
            if any(q.capacity <= 0 for q in self.live(poor) + self.live(rich)) or after(best) <= 1.5 * min(scores):
                self._imbalanced_since = None
                return None
            if self._imbalanced_since is None:
                self._imbalanced_since = now
            if now - self._imbalanced_since < self.move_cooldown_s:
                return None  # not yet sustained
        if p.peer_id != best.peer_id:
            return None  # the decision stands; `best` is told when it reports
        self._imbalanced_since = None
        return poor, speeds[p.peer_id]

    # -- membership -------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        for pid, (_, _, at) in list(self._reserved.items()):
            if now - at > 3 * self.peer_timeout_s:  # the moved peer never came back
                del self._reserved[pid]
        if now < self.expire_after:  # just restored: peers are still reconnecting
            return
        for p in self.peers.values():
            timeout = self.peer_timeout_s if p.reported else max(self.peer_timeout_s, self.load_grace_s)
            if p.state in LIVE and now - p.last_seen > timeout:
                what = "heartbeat" if p.reported else "first heartbeat after joining (still loading its stage?)"
                p.state, p.reason = "dead", f"no {what} for {now - p.last_seen:.1f}s (timeout {timeout:.0f}s)"

    def live(self, stage: int | None = None) -> list[PeerRecord]:
        return [p for p in self.peers.values() if p.state in LIVE and (stage is None or p.stage == stage)]

    def join(self, req: pb.JoinRequest, key: bytes = b"") -> pb.Assignment:
        """Admit a peer (identity key `key`) and give it the stage it was reserved (a move) or
        the lowest-scoring one (`_pick_stage`)."""
        if req.run_id and req.run_id != self.run_id:
            raise JoinRefused(f"run_id={req.run_id!r}: this tracker serves run {self.run_id!r}")
        if req.code_version != __version__:
            raise JoinRefused(f"code_version={req.code_version!r}: the run needs anchormesh {__version__}")
        if not req.peer_id or not req.grpc_address:
            raise JoinRefused("peer_id and grpc_address are required")
        if key and fingerprint(key) in self.banned:
            raise Banned(f"peer {req.peer_id} is banned from this run: {self.banned[fingerprint(key)]}")
        with self._lock:
            self._expire()
            old = self.peers.get(req.peer_id)
            restarted = old is not None and old.state in LIVE and bool(key) and old.key == key.hex()
            if old is not None and old.state in LIVE and not restarted:
                raise JoinRefused(f"peer_id={req.peer_id!r} is already in the run (state {old.state})")
            if restarted:  # the same key joins again before its old record expired: it was restarted
                old.state, old.reason = "left", "restarted (joined again with the same key)"
            if old is not None:  # a peer joining again (after a move or a restart): keep its past in the roster
                n = sum(1 for k in self.peers if k.startswith(req.peer_id + "~"))
                old.peer_id = f"{req.peer_id}~{n + 1}"
                self.peers[old.peer_id] = old
            fits = self._fitting(req)
            stage, _, _ = self._reserved.pop(req.peer_id, (None, 0.0, 0.0))
            if stage is None or (fits is not None and stage not in fits):
                stage = self._pick_stage(fits)
            start_step = max((p.step for p in self.peers.values() if p.stage == stage), default=0)
            mates = [m for q in self.live(stage) for m in q.dht_maddrs[:MAX_MADDRS_PER_PEER]]
            self.peers[req.peer_id] = PeerRecord(
                req.peer_id, stage, req.grpc_address, last_seen=self.clock(), joined_at=self.clock(), dht_maddrs=tuple(req.dht_maddrs[:MAX_MADDRS_PER_PEER]), key=key.hex(),
                device=req.device[:120], memory=req.memory_bytes, memory_plan=req.stage_memory_bytes[stage] if req.stage_memory_bytes else 0,
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
        )

    def run_config(self) -> pb.RunConfig:
        """The run's config for an observer that does not join (anchormesh export)."""
        return pb.RunConfig(run_id=self.run_id, run_config_json=json.dumps(asdict(self.config)), code_version=__version__)

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
            why = self._implausible(p, info, rep.tokens, now)
            if why:  # a broken or lying member: its figures would stop the run or steer the routing; keep the old ones
                p.refused_reports += 1
                p.last_refusal = why
                if p.refused_reports in (1, 10, 100) or p.refused_reports % 1000 == 0:
                    log.warning("implausible report from %s (%d so far): %s", p.peer_id, p.refused_reports, why)
            else:
                p.step, p.tokens, p.capacity, p.tokens_per_s = info.step, rep.tokens, info.capacity_tokens_per_s, info.tokens_per_s
                p.accepted_at = now
            p.state = info.state if info.state in LIVE else p.state
            p.last_seen, p.loss, p.reported = now, info.loss, True
            p.bytes_in, p.bytes_out, p.queue_depth, p.reason = info.bytes_in, info.bytes_out, info.queue_depth, info.reason
            p.dp_rounds, p.anchor_id, p.anchor_bytes_out = info.dp_rounds, min(info.anchor_id, self.anchors.launched), info.anchor_bytes_out
            p.dp_bytes_out, p.dp_dense_bytes, p.dp_rejected = info.dp_bytes_out, info.dp_dense_bytes, info.dp_rejected
            p.eval_id, p.eval_loss, p.refused_calls = info.eval_id, info.eval_loss, info.refused_calls
            p.link_mbit, p.pp_keep, p.dp_period_s = info.link_mbit, info.pp_keep, info.dp_period_s
            p.dp_suspects = tuple(x[:300] for x in info.dp_suspects[:MAX_SUSPECTS])
            p.excluding = tuple(x[:300] for x in info.excluding[:MAX_SUSPECTS])
            p.startup_s = info.startup_s if math.isfinite(info.startup_s) and 0 <= info.startup_s < 1e7 else 0.0
            self._expire()
            if self._budget_spent():
                return pb.Directive(kind=pb.Directive.STOP, reason=f"the run's token budget of {self.config.token_budget} tokens is spent")
            move = self._move_target(p)
            if move is not None:
                target, speed = move
                self.moves += 1
                self._next_move_at = self.clock() + self.move_cooldown_s
                p.state, p.reason = "left", f"moved to stage {target}, which was starving"
                self._reserved[p.peer_id] = (target, speed, self.clock())
                return pb.Directive(kind=pb.Directive.MOVE, reason=f"stage {target} needs a peer more than stage {p.stage}")
            # a joining peer may not serve yet (it may still be downloading its stage's state)
            neighbours = [self._info(q) for q in self.live() if abs(q.stage - p.stage) <= 1 and q.peer_id != p.peer_id and q.state != "joining"]
            banned_dht = sorted({m.rsplit("/p2p/", 1)[1] for q in self.peers.values() if q.state == "banned" for m in q.dht_maddrs if "/p2p/" in m})
            # libp2p authenticates hivemind peer ids, and each member declared its own at Join:
            # an averaging round with any other id has an outsider in it
            members = sorted({m.rsplit("/p2p/", 1)[1] for q in self.live(p.stage) for m in q.dht_maddrs if "/p2p/" in m})
            directive = pb.Directive(kind=pb.Directive.CONTINUE, neighbours=neighbours, banned=sorted(self.banned), banned_dht=banned_dht, member_dht=members)
            # anchor and evaluation passes: to the next stage-0 peer to report once due, while every stage is served
            if p.stage == 0 and p.state in ("active", "idle") and all(self.live(s) for s in range(self.config.model.num_stages)):
                step = self._run_step()
                directive.anchor_id, directive.eval_id = self.anchors.due(step), self.evals.due(step)
                if directive.anchor_id:
                    directive.anchor_micro_batches = self.config.anchor.micro_batches
            directive.anchors_issued = self.anchors.launched
        return directive

    def _implausible(self, p: PeerRecord, info: pb.PeerInfo, tokens: int, now: float) -> str:
        """Why a report's step, tokens or capacity cannot be true, or "". Why: the run's step is
        the highest stage-0 step and its token budget sums stage-0 tokens, so one member reporting
        step 2^40 or 10^12 tokens would end the run, and a huge capacity draws all the routing.
        Bounds: a step never goes back and grows at most MAX_STEPS_PER_S x the seconds since its
        last report taken as true (plus a slack; counted from that report, not the last one seen,
        so a peer that trained on while the tracker was down or refused it catches up instead of
        being refused for ever); tokens grow at most one step's tokens per step; tokens/s stays
        under MAX_STEPS_PER_S steps' tokens per second and capacity under MAX_CAPACITY_FACTOR
        times that (a tiny model's stage alone can compute faster than the pipeline steps)."""
        per_step = self.config.pipeline.micro_batches * self.config.pipeline.micro_batch_size * self.config.pipeline.seq_len
        ceiling = step_ceiling(max(p.step, p.start_step, self._run_step()), now - (p.accepted_at or p.joined_at))
        if info.step < p.step:
            return f"step {info.step} is below its last reported step {p.step}"
        if info.step > ceiling:
            return f"step {info.step} is over {ceiling:.0f} ({MAX_STEPS_PER_S:g} steps/s since its last report)"
        if tokens < p.tokens:
            return f"tokens {tokens} below its last report's {p.tokens}"
        if tokens - p.tokens > (info.step - p.step + STEP_SLACK) * per_step:
            return f"tokens grew by {tokens - p.tokens} over {info.step - p.step} steps of {per_step} tokens"
        rate_limit = MAX_STEPS_PER_S * per_step
        if not 0 <= info.tokens_per_s <= rate_limit:
            return f"rate {info.tokens_per_s:.3g} tokens/s outside [0, {rate_limit:.3g}]"
        if not 0 <= info.capacity_tokens_per_s <= MAX_CAPACITY_FACTOR * rate_limit:
            return f"capacity {info.capacity_tokens_per_s:.3g} tokens/s outside [0, {MAX_CAPACITY_FACTOR * rate_limit:.3g}]"
        return ""

    def _tokens(self) -> int:
        return sum(p.tokens for p in self.peers.values() if p.stage == 0)  # stage 0 feeds every token once

    def _budget_spent(self) -> bool:
        return 0 < self.config.token_budget <= self._tokens()

    def _run_step(self) -> int:
        return max((q.step for q in self.peers.values() if q.stage == 0), default=0)  # stage 0 counts the run's steps

    def leave(self, req: pb.LeaveRequest) -> None:
        with self._lock:
            p = self.peers.get(req.peer_id)
            if p is not None:
                p.state, p.reason = "left", req.reason or "left"

    def ban(self, who: str, reason: str, unban: bool = False) -> list[str]:
        """Ban (or readmit) the key of peer `who` (a peer id, or a key fingerprint): its calls are
        refused from now on, it leaves the roster's routing, and every peer hears of it in its
        next heartbeat reply. Returns "fingerprint (peer id): reason" for every banned key."""
        with self._lock:
            records = [p for p in self.peers.values() if p.peer_id == who or (p.key and fingerprint(bytes.fromhex(p.key)) == who)]
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
            return self._ban_list()

    def _ban_list(self) -> list[str]:
        names = {fingerprint(bytes.fromhex(p.key)): p.peer_id for p in self.peers.values() if p.key}
        return [f"{fp} ({names.get(fp, 'unknown peer')}): {why}" for fp, why in sorted(self.banned.items())]

    def _suspects(self) -> tuple[dict[str, list[str]], dict[str, int]]:
        """Per peer: the members its refused averaging rounds named, as run peer ids (the reports
        name hivemind peer ids, which the tracker knows from each peer's DHT multiaddrs); and
        per peer: how many live peers name it."""
        by_dht = {m.rsplit("/p2p/", 1)[1]: p.peer_id for p in self.peers.values() for m in p.dht_maddrs if "/p2p/" in m}
        named: dict[str, list[str]] = {}
        flagged: dict[str, int] = {}
        for p in self.peers.values():
            out, seen = [], set()
            for s in p.dp_suspects:
                hid, _, why = s.partition(": ")
                who = by_dht.get(hid, f"unknown DHT peer {hid[:16]}")
                out.append(f"{who}: {why}")
                if p.state in LIVE and who not in seen:
                    seen.add(who)
                    flagged[who] = flagged.get(who, 0) + 1
            named[p.peer_id] = out
        return named, flagged

    # -- status -----------------------------------------------------------------------------
    def _info(self, p: PeerRecord, suspects: tuple[dict[str, list[str]], dict[str, int]] = ({}, {})) -> pb.PeerInfo:
        named, flagged = suspects
        return pb.PeerInfo(
            peer_id=p.peer_id, stage=p.stage, address=p.address, state=p.state, last_seen_s=self.clock() - p.last_seen,
            tokens_per_s=p.tokens_per_s, bytes_in=p.bytes_in, bytes_out=p.bytes_out, step=p.step, loss=p.loss,
            queue_depth=p.queue_depth, reason=p.reason if p.reported or p.state not in LIVE else f"loading its stage ({self.clock() - p.joined_at:.0f}s since it joined)",
            dp_rounds=p.dp_rounds, anchor_id=p.anchor_id,
            anchor_bytes_out=p.anchor_bytes_out, capacity_tokens_per_s=p.capacity, dp_bytes_out=p.dp_bytes_out,
            dp_dense_bytes=p.dp_dense_bytes, eval_id=p.eval_id, eval_loss=p.eval_loss, dp_rejected=p.dp_rejected,
            refused_calls=p.refused_calls, key_fingerprint=fingerprint(bytes.fromhex(p.key)) if p.key else "",
            dp_suspects=named.get(p.peer_id, []), dp_flagged=flagged.get(p.peer_id, 0),
            link_mbit=p.link_mbit, pp_keep=p.pp_keep, dp_period_s=p.dp_period_s,
            device=p.device, memory_bytes=p.memory, memory_plan_bytes=p.memory_plan, refused_reports=p.refused_reports,
            excluding=list(p.excluding), startup_s=p.startup_s,
        )

    def status(self) -> pb.RunStatus:
        with self._lock:
            self._expire()
            K = self.config.model.num_stages
            stages = []
            scores = self.scores()
            for s in range(K):
                live = self.live(s)
                stages.append(pb.StageStatus(index=s, peers=len(live), tokens_per_s=sum(p.tokens_per_s for p in live), queue_depth=sum(p.queue_depth for p in live), capacity_tokens_per_s=scores[s]))
            first, last = self.live(0), self.live(K - 1)
            tokens = self._tokens()
            losses = [p.loss for p in last if not math.isnan(p.loss)]
            step = self._run_step()
            anchor_bytes = sum(p.anchor_bytes_out for p in self.peers.values())
            dp_bytes = sum(p.dp_bytes_out for p in self.peers.values())
            newest_eval = max((p for p in self.peers.values() if p.eval_id), key=lambda p: p.eval_id, default=None)
            pp_bytes = sum(p.bytes_out for p in self.peers.values()) - anchor_bytes
            newest = max((p.anchor_id for p in self.peers.values()), default=0)
            anchor_step = self.anchors.launched_at.get(newest, -1)
            missing = [s for s in range(K) if not self.live(s)]
            suspects = self._suspects()
            state, reason = "running", ""
            if self._budget_spent():
                state, reason = "done", f"token budget of {self.config.token_budget} tokens spent"
            elif missing:
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
                peers=[self._info(p, suspects) for p in sorted(self.peers.values(), key=lambda p: (p.stage, p.peer_id))],
                dht_maddrs=self.dht_maddrs,
                anchor_step=anchor_step,
                anchor_age_steps=max(step - anchor_step, 0) if anchor_step >= 0 else -1,
                anchors_launched=self.anchors.launched,
                anchor_bytes_per_token=anchor_bytes / tokens if tokens else 0.0,
                stage_moves=self.moves,
                dp_bytes_per_token=dp_bytes / tokens if tokens else 0.0,
                dp_compression=sum(p.dp_dense_bytes for p in self.peers.values()) / dp_bytes if dp_bytes else 0.0,
                eval_loss=newest_eval.eval_loss if newest_eval else math.nan,
                eval_step=self.evals.launched_at.get(newest_eval.eval_id, -1) if newest_eval else -1,
                banned=len(self.banned),
                unfit=list(self.unfit),
                model=pb.ModelInfo(name=self.config.model.name, num_layers=self.config.model.num_layers, hidden_size=self.config.model.hidden_size,
                                   num_stages=K, tokenizer=self.config.data.tokenizer),
            )
