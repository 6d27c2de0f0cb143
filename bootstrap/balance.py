"""Stage assignment and balance: which stage a joining peer takes, and when one peer should move
to a starving stage.

SWARM/Petals-style: each peer reports its capacity, the tokens/s it could do at its stage if it
never waited. A peer's *speed* is that times its stage's layer count (layer-tokens/s, comparable
across stages); a stage's *score* is the sum of its live peers' speeds over its layer count — the
tokens/s the stage could sustain. Peers not measured yet count as the median measured speed (1.0
when none is). A joiner takes the stage with the lowest score. A stage with no live peer pulls
one peer from the highest-scoring stage that has at least two; so does a stage whose score a move
would raise the run's bottleneck (the lowest score) by more than half, when every peer involved
is measured and that has held for `move_cooldown_s` (capacity readings on shared machines are
noisy, and a move costs the peer a restart). A peer is moved only after `move_cooldown_s` in its
stage, at most one move per `move_cooldown_s`; the moved peer is given the stage it was moved for
when it joins again, and until then it counts for that stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from bootstrap.roster import JoinRefused, PeerRecord, live
from peer.capacity import fill_unmeasured
from peer.wire import anchormesh_pb2 as pb


@dataclass
class StageBalance:
    """The scores of one run's stages and its moves. Every call takes the roster's records
    (`peers`) and is made with the tracker's lock held."""

    layers: list[int]  # per stage
    move_cooldown_s: float
    clock: Callable[[], float]
    next_move_at: float  # no move before this clock time
    reserved: dict[str, tuple[int, float, float]] = field(
        default_factory=dict
    )  # peer id -> (stage it was moved to, its speed, when)
    imbalanced_since: float | None = None  # when the capacity rule first asked for a move (reset when it stops)

    def speeds(self, peers: Collection[PeerRecord]) -> dict[str, float]:
        """Layer-tokens/s of every live peer (unmeasured ones: the median measured speed)."""
        up = live(peers)
        return dict(zip((p.peer_id for p in up), fill_unmeasured([p.capacity * self.layers[p.stage] for p in up])))

    def scores(self, peers: Collection[PeerRecord], speeds: dict[str, float] | None = None) -> list[float]:
        """Per stage: the tokens/s its live peers could sustain (see the module docstring)."""
        speeds = self.speeds(peers) if speeds is None else speeds
        pending = [0.0] * len(self.layers)  # moved peers on their way to their new stage
        for stage, speed, _ in self.reserved.values():
            pending[stage] += speed
        return [
            (sum(speeds[p.peer_id] for p in live(peers, s)) + pending[s]) / self.layers[s]
            for s in range(len(self.layers))
        ]

    def pick_stage(self, peers: Collection[PeerRecord], allowed: list[int] | None = None) -> int:
        """The lowest-scoring stage (of `allowed`), fewer live peers first on a tie."""
        scores = self.scores(peers)
        return min(
            allowed if allowed is not None else range(len(scores)), key=lambda s: (scores[s], len(live(peers, s)), s)
        )

    def take_reservation(self, peer_id: str) -> int | None:
        """The stage `peer_id` was moved to, if it was (the reservation ends: it joins there)."""
        stage, _, _ = self.reserved.pop(peer_id, (None, 0.0, 0.0))
        return stage

    def forget_reservations(self, now: float, after_s: float) -> None:
        """Drop the reservations older than `after_s`: the moved peer never came back."""
        for pid, (_, _, at) in list(self.reserved.items()):
            if now - at > after_s:
                del self.reserved[pid]

    def moved(self, peer_id: str, stage: int, speed: float) -> None:
        """`peer_id` was told to move to `stage`: no other move for `move_cooldown_s`, and its
        speed counts for `stage` until it joins there."""
        self.next_move_at = self.clock() + self.move_cooldown_s
        self.reserved[peer_id] = (stage, speed, self.clock())

    def move_target(self, peers: Collection[PeerRecord], p: PeerRecord) -> tuple[int, float] | None:
        """The stage `p` should move to now and p's speed, if any.

        One decision for the whole run, not one per reporting peer: the donor stage is the
        highest-scoring stage with at least two live peers, the peer to move is the one of it
        whose move raises the bottleneck most, and only that peer is told when it reports."""
        now = self.clock()
        if now < self.next_move_at:
            return None
        speeds = self.speeds(peers)
        scores = self.scores(peers, speeds)
        donors = [s for s in range(len(scores)) if len(live(peers, s)) >= 2]
        if not donors:
            self.imbalanced_since = None
            return None
        rich = max(donors, key=lambda s: scores[s])
        poor = min(range(len(scores)), key=lambda s: scores[s])
        movable = [
            q for q in live(peers, rich) if q.state in ("active", "idle") and now - q.joined_at >= self.move_cooldown_s
        ]
        if poor == rich or not movable:
            return None

        def after(q: PeerRecord) -> float:
            a = list(scores)
            a[rich] -= speeds[q.peer_id] / self.layers[rich]
            a[poor] += speeds[q.peer_id] / self.layers[poor]
            return min(a)

        best = max(movable, key=lambda q: (after(q), q.peer_id))
        if live(peers, poor):
            if any(q.capacity <= 0 for q in live(peers, poor) + live(peers, rich)) or after(best) <= 1.5 * min(scores):
                self.imbalanced_since = None
                return None
            if self.imbalanced_since is None:
                self.imbalanced_since = now
            if now - self.imbalanced_since < self.move_cooldown_s:
                return None  # not yet sustained
        if p.peer_id != best.peer_id:
            return None  # the decision stands; `best` is told when it reports
        self.imbalanced_since = None
        return poor, speeds[p.peer_id]


def fitting_stages(req: pb.JoinRequest, num_stages: int, unfit: deque) -> list[int] | None:
    """The stages whose memory plan fits the joining peer (None: it sent no plan, any stage
    will do). Raises JoinRefused, and notes it in `unfit` for the status, when none fits."""
    K = num_stages
    if not req.memory_bytes or not req.stage_memory_bytes:
        return None
    if len(req.stage_memory_bytes) != K:
        raise JoinRefused(f"stage_memory_bytes has {len(req.stage_memory_bytes)} entries; this run has {K} stages")
    fits = [s for s, need in enumerate(req.stage_memory_bytes) if need <= req.memory_bytes]
    if not fits:
        gib = 2**30
        smallest = min(range(K), key=lambda s: req.stage_memory_bytes[s])
        why = (
            f"{req.peer_id} on {req.device or 'an unnamed device'}: {req.memory_bytes / gib:.1f} GiB, "
            f"the smallest stage (stage {smallest}) needs {req.stage_memory_bytes[smallest] / gib:.1f} GiB"
        )
        unfit.append(why)
        raise JoinRefused(
            f"no stage of this run fits this peer's memory ({why}); turn on compute.activation_checkpointing, lower pipeline.micro_batch_size, or run more stages (model.num_stages)"
        )
    return fits
