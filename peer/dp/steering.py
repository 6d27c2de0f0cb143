"""Who steers a stage group's average: each member's update judged against this peer's own, and
each member's lean over many rounds.

Why: the trimmed mean (peer/dp/robust.py) outvotes one hostile member, but two colluders of three
are the majority of every coordinate: whatever they both send is the result. A flip of the honest
direction was refused (the group's update pointed against this peer's own), but an update at
cosine 0 or -0.45 to it was taken at full size. An honest member's own outer delta is its best
local evidence of where the group should go. Measured on the tiny model (three members from the
same weights, each on its own data, 10 to 50 local steps a round: drifts 1x, 3x and 5x each
other; 30 rounds): two members' updates agree less as training goes on (cosine 0.37 to 0.68 in
the first rounds, 0.04 to 0.19 after 20), too little to tell a colluder at cosine 0 from an
honest stage mate, but each member's update against the group's trimmed mean stays at 0.37 to
0.88, because the trimmed mean of honest members holds this peer's own share. So the group's
update below `GROUP_COSINE` to this peer's own is refused (claims.implausible), and a member's
update below `MEMBER_COSINE` to it, at the audited coordinates, names that member and refuses
the round (claims.attribute).

A member that adds a small bias every round, under the honest spread, passes any one round.
Over rounds it does not: `BiasTracker` keeps decayed sums of the group's applied updates and of
this peer's own, and takes as its reference direction the first less the common direction it
shares with the second: what the group carried that this peer's training did not. Each round it
projects every member's deviation from the robust mean, at freshly audited coordinates, on that
direction. A bias is the same every round, so it builds up in the reference and shows in the
biased member's deviations alike, while honest noise does not repeat; the z-score of the
projection (over the member's own spread along it), summed with decay over rounds, names a
member whose lean exceeds the median lean of the others (this peer's own included: the honest
spread) by `BIAS_Z`. The common direction is taken out because an honest member that takes more
steps than this peer leans along it every round too; on the tiny model that was not enough (a
member at 5x the steps of the slowest reached z 20 in 10 rounds), so only members, and rounds
of this peer, whose update is within `BIAS_PACE` of the robust mean's size are scored. With
equal paces the tiny model's honest members stayed 4 to 7 below the limit over 14 rounds, but
not over 40: trained for real (three members on their own data, 10 local steps a round, each
member observing), two of three observers named an honest member, at rounds 11 and 19. An
honest member's deviation carries into the next round through AdamW's momentum (cosine 0.12 to
0.35 with the previous round's), and the tracker reads that as a lean. A name is a lead for the
operator, not evidence; it excludes no one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from peer.dp.robust import trimmed_mean

log = logging.getLogger(__name__)

MEMBER_COSINE = -0.3  # a member's update below this cosine to this peer's own is named (honest: >= 0.04 measured)
GROUP_COSINE = 0.2  # the group's update below this cosine to this peer's own is refused (honest: >= 0.37 measured)
BIAS_DECAY = 0.97  # per round, of the running sums below (about 30 rounds remembered)
BIAS_Z = 6.0  # a member whose decayed z-sum of its lean exceeds this is named
BIAS_MIN_ROUNDS = 4  # rounds a member must have been seen in before it can be named
BIAS_WARMUP = 6  # rounds this peer has applied before it scores anyone (its reference needs them)
SUM_DTYPE = torch.float32  # of the decayed sums (see BiasTracker; bf16 lost the real-round test's bias signal)
BIAS_PACE = 1.5  # only members (and rounds of this peer) whose update's size is within this factor of the robust mean's are scored
BIAS_MEMBERS = 3  # rounds with fewer members are not tracked: of two, each one's lean mirrors the other's, so neither can exceed it


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm() + 1e-30))


def away_from_own(update: torch.Tensor, own: torch.Tensor, floor: float) -> str:
    """Why a member's `update` is too far from this peer's `own` (both at the audited
    coordinates) to be averaged with, or "". Below `floor` either has no direction to judge."""
    if float(own.norm()) <= floor or float(update.norm()) <= floor:
        return ""
    cos = cosine(update, own)
    if cos < MEMBER_COSINE:
        return f"its update is far from this peer's own (cosine {cos:.2f}, limit {MEMBER_COSINE:g})"
    return ""


class BiasTracker:
    """The lean of each member's contributions over rounds (see the module's docstring).

    Holds decayed sums of the group's applied updates (mean - base) and of this peer's own
    (offer - base), over even and odd rounds apart: four fp32 copies of the stage in host memory
    (16 bytes a parameter, as much as the weights and AdamW's state together; bf16 sums lost a
    real-round bias below the naming limit), and a few passes over them per round. They are
    made at the first round of BIAS_MEMBERS members or more (`start`): a group of two never
    needs them, and on SmolLM2 they were 1.3 GB of each peer's memory. The reference direction is the group's sum less the common
    direction it shares with this peer's own (`reference`): what the group carried this peer
    towards that its own training did not. `scores`: hivemind id -> (decayed sum of z, decayed
    sum of squared weights, rounds seen). `named`: hivemind id -> why, each member named once."""

    def __init__(self, like: list[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in like]
        # decayed sums of the group's updates and of this peer's own, over even and odd rounds apart (`start`)
        self.group_even: list[torch.Tensor] = []
        self.group_odd: list[torch.Tensor] = []
        self.own_even: list[torch.Tensor] = []
        self.own_odd: list[torch.Tensor] = []
        self.started = False
        self.rounds = 0
        self.scores: dict[str, tuple[float, float, int]] = {}
        self.named: dict[str, str] = {}

    def start(self) -> None:
        """Make the sums (once): called at a round of BIAS_MEMBERS members or more."""
        if not self.started:
            self.group_even, self.group_odd, self.own_even, self.own_odd = (
                [torch.zeros(s, dtype=SUM_DTYPE, device="cpu") for s in self.shapes] for _ in range(4)
            )
            self.started = True

    def z(self, name: str) -> float:
        s, v, _ = self.scores.get(name, (0.0, 0.0, 0))
        return s / math.sqrt(v) if v > 0 else 0.0

    def reference(self, take: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """The reference at the audited coordinates (`take(list of tensors)` picks them): the
        group's summed updates less `alpha` times this peer's own, where `alpha` is how much of
        the common direction the group's sum holds per unit of this peer's. Why even against odd
        rounds: the common direction persists from one round to the next, the noise of a round
        does not, so sums over different rounds meet only in the common part (a least-squares
        fit on the same rounds would be diluted by this peer's own noise and leave part of the
        common direction in, which a faster honest member then leans along)."""

        if not self.started:
            return torch.zeros(0)

        def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
            return sum(float(torch.dot(x.flatten().float(), y.flatten().float())) for x, y in zip(a, b))

        common = dot(self.own_even, self.own_odd)
        alpha = (
            (dot(self.group_even, self.own_odd) + dot(self.group_odd, self.own_even)) / (2 * common)
            if common > 0
            else 0.0
        )
        return (take(self.group_even) + take(self.group_odd)).float() - alpha * (
            take(self.own_even) + take(self.own_odd)
        ).float()

    def observe(self, updates: dict[str, torch.Tensor], reference: torch.Tensor, me: str) -> list[str]:
        """One round: `updates` (hivemind id -> update at the audited coordinates, this peer's
        own included), `reference` (`reference()` before this round is added). Returns the
        members newly named, as "id: why"."""
        if (
            not self.started
            or self.rounds < BIAS_WARMUP
            or len(updates) < BIAS_MEMBERS
            or me not in updates
            or not all(torch.isfinite(u).all() for u in updates.values())
        ):
            return []
        robust = trimmed_mean(torch.stack(list(updates.values())))
        r = reference.float()
        if float(r.norm()) == 0.0:
            return []
        r = r / r.norm()
        size = float(robust.norm())

        def paced(u: torch.Tensor) -> bool:  # a member at another pace leans along the common direction, honestly
            return size / BIAS_PACE <= float(u.norm()) <= size * BIAS_PACE

        if not paced(updates[me]):
            return []
        leans = {}
        for name, u in updates.items():  # this peer's own too: the spread an honest member shows
            if not paced(u):
                continue
            d = u.float() - robust
            spread = float(((d * r) ** 2).sum())
            z = float(d @ r) / math.sqrt(spread) if spread > 0 else 0.0
            s, v, n = self.scores.get(name, (0.0, 0.0, 0))
            s, v, n = BIAS_DECAY * s + z, BIAS_DECAY**2 * v + 1.0, n + 1
            self.scores[name] = (s, v, n)
            leans[name] = s / math.sqrt(v)
        out = []
        for name, lean in leans.items():
            honest = float(torch.tensor([abs(x) for k, x in leans.items() if k != name] or [0.0]).median())
            if (
                name != me
                and self.scores[name][2] >= BIAS_MIN_ROUNDS
                and lean - honest > BIAS_Z
                and name not in self.named
            ):
                self.named[name] = (
                    f"its updates lean one way over rounds (z {lean:.1f} over {self.scores[name][2]} rounds, the others' {honest:.1f}, limit {BIAS_Z:g} beyond)"
                )
                log.warning("stage-group averaging: member %s %s", name, self.named[name])
                out.append(f"{name}: {self.named[name]}")
        return out

    def add(self, group: list[torch.Tensor], own: list[torch.Tensor]) -> None:
        """After an applied round: decay the sums and add the group's update and this peer's own
        to this round's (even or odd) pair. Nothing before `start`."""
        if not self.started:
            return
        sums = (self.group_even, self.own_even) if self.rounds % 2 == 0 else (self.group_odd, self.own_odd)
        self.rounds += 1
        for acc in self.group_even + self.group_odd + self.own_even + self.own_odd:
            acc.mul_(BIAS_DECAY)
        for acc, x in zip(sums[0] + sums[1], group + own):
            acc.add_(x.detach().to("cpu", torch.float32))  # added in fp32, rounded once into the bf16 sum
