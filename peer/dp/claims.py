"""The checks of a finished stage-group averaging round against what the members committed to.

Each round carries every member's *claim*: its id and the Merkle root of every value it sends
(peer/dp/commitment.py), signed. After the round each member draws coordinates privately and has
the others reveal their committed values there (peer/dp/audit.py); nobody knew them in advance.
The reduction itself is a coordinate-wise trimmed mean in which every member weighs 1
(peer/dp/robust.py): in a group of three or more one member cannot scale or flip the result.
The revealed values let a peer check the result it gets back (it must equal the same trimmed
mean of them at those coordinates) and name a member whose update is NaN, far larger than the
group's, or points against the rest of the group (a sign flip); see `attribute`. `implausible`
checks the whole mean against this peer's own drift. Plain functions of tensors: the
`GroupAverager` (peer/dp/group.py) hands them its state.
"""

from __future__ import annotations

import torch

from peer.dp.robust import trimmed_mean
from peer.dp.steering import BIAS_MEMBERS, GROUP_COSINE, BiasTracker, away_from_own

MAX_CORRECTION = 4.0  # see implausible
DRIFT_FLOOR = (
    1e-5  # of the weights' norm: what a round may move them beyond the drift bound (rounding; see implausible)
)
FLIP_COSINE = -0.5  # an update whose cosine with the rest of the group's mean update is below this points against it
CLAIM_TOLERANCE = (
    0.1  # |mean - mean of claims| may be this fraction of the largest claimed update (8-bit quantization: ~2%)
)


def split_index(sizes: list[int], flat: torch.Tensor) -> list[torch.Tensor]:
    """Per tensor, the flat indices inside it of the coordinates `flat` (indices into all the
    tensors concatenated, in order)."""
    out, start = [], 0
    for size in sizes:
        out.append(flat[(flat >= start) & (flat < start + size)] - start)
        start += size
    return out


def take(tensors: list[torch.Tensor], index: list[torch.Tensor]) -> torch.Tensor:
    """The values at the audited coordinates, on the host (revealed values compare there)."""
    return torch.cat([t.detach().reshape(-1)[i.to(t.device)].float().cpu() for t, i in zip(tensors, index)])


def member_updates(
    revealed: dict[str, torch.Tensor], base: list[torch.Tensor], index: list[torch.Tensor], compression: str
) -> dict[str, torch.Tensor]:
    """Each member's update at the audited coordinates: its revealed values, less the last group
    mean where the members send parameters rather than deltas."""
    at_base = take(base, index)
    return {k: (v if compression == "int8" else v - at_base) for k, v in revealed.items()}


def lean_of_round(
    bias: BiasTracker, audit, base: list[torch.Tensor], index: list[torch.Tensor], compression: str, me: str
) -> list[str]:
    """Feed a round's revealed updates (`audit`: peer/dp/audit.py) to `bias`, the tracker of each
    member's lean over rounds (peer/dp/steering.py); the members it names ("peer: why"), whose
    rounds are logged and listed, not refused. Nothing when the reveal failed or is too small."""
    revealed = audit.tensors()
    if audit.failed or len(revealed) < BIAS_MEMBERS or len({v.numel() for v in revealed.values()}) != 1:
        return []
    bias.start()
    updates = member_updates(revealed, base, index, compression)
    return bias.observe(updates, bias.reference(lambda ts: take(ts, index)), me)


def attribute(
    group: dict,
    revealed: dict[str, torch.Tensor],
    failed: dict[str, str],
    result: torch.Tensor,
    kept: torch.Tensor | None,
    *,
    me: str,
    members: set[str] | None,
    excluded: dict[str, str],
    base: list[torch.Tensor],
    index: list[torch.Tensor],
    compression: str,
) -> tuple[str, list[str], str | None]:
    """Check the round against what the members committed to; (why it is refused or "", the
    members named as "peer: why", the member hivemind left out of the round or None). `group`:
    hivemind peer id -> claim; `revealed`: hivemind id -> the values it committed to at the
    audited coordinates (`index`), `failed`: hivemind id -> why its values are missing (the
    audit, peer/dp/audit.py); `result`: the mean at those coordinates; `kept`: the audited
    coordinates whose results arrived (all when None); rule (1) is checked on those only.
    `me`: this peer's hivemind id; `members`: the stage group's, from the tracker (None: not
    known yet); `base`: the last group mean; `compression` says whether claims are deltas from it.

    Rules, at the audited coordinates: (1) the mean must equal the mean of the claims, within
    `CLAIM_TOLERANCE` of the largest claimed update: otherwise some member sent other values
    than it declared, and nobody can be named. (2) a claimed update holding NaN/Inf, (3) one
    larger than `MAX_CORRECTION` times the median update of the others, or (4) one whose
    cosine with the others' mean update is below `FLIP_COSINE`, or (5) one whose cosine with
    this peer's own update is below `steering.MEMBER_COSINE`, names that member. Why these:
    honest replicas start from the same mean and train on the same distribution for the same
    number of steps, so their updates have similar sizes and point the same way; scaled,
    NaN and sign-flipped updates do not, nor does an update aimed elsewhere. Rules (3) and (4)
    need at least three members (two others to compare with): in a pair, an honest member whose
    base is older looks just as outsized. Rule (5) holds in any group: two colluders of three
    agree with each other, not with the honest member, and are the trimmed mean's majority at
    every coordinate. A member never names itself.
    A member banned by the operator (`excluded`, from the heartbeat's `banned_dht`) makes
    every round that includes it refused: hivemind's matchmaking cannot leave it out, so the
    honest members train on without averaging with it. Nobody is excluded on a peer's own
    say-so: a false alarm would stop a group's averaging for good."""
    out = [str(h) for h in group if str(h) in excluded]
    if out:  # hivemind cannot keep a member out of matchmaking; its rounds are refused instead
        return "the group includes excluded member(s) " + ", ".join(f"{h} ({excluded[h]})" for h in out), [], None
    strangers = [str(h) for h in group if members is not None and str(h) not in members and str(h) != me]
    if strangers:  # a member that joined since the last heartbeat is refused once, then known
        return (
            "the group includes peer(s) that are not members of this stage group: " + ", ".join(strangers),
            [f"{h}: not a member of the run" for h in strangers],
            None,
        )
    claims: dict[str, torch.Tensor] = {}
    for hid in group:
        # members are named by their hivemind peer id (libp2p authenticates it), not by the id
        # they claim: the tracker maps it to the run's peer id (bootstrap/tracker.py)
        name = str(hid)
        why = failed.get(name) or (
            ""
            if name in revealed and revealed[name].numel() == result.numel()
            else "its committed values were not revealed"
        )
        if why:
            return f"member {name} did not prove what it sent: {why}", ([] if name == me else [f"{name}: {why}"]), None
        claims[name] = revealed[name]
    at_base = take(base, index)
    updates = member_updates(claims, base, index, compression)
    floor = 1e-5 * float(at_base.norm()) + 1e-12
    for name, u in updates.items():
        if not torch.isfinite(u).all() and name != me:
            return f"member {name} sent NaN or Inf", [f"{name}: sent NaN or Inf"], None
    if not all(torch.isfinite(u).all() for u in updates.values()):
        return "a member sent NaN or Inf", [], None
    biggest = max(float(u.norm()) for u in updates.values())
    if kept is not None:  # results lost on the way back: compare where they arrived
        result, claims = result[kept], {k: v[kept] for k, v in claims.items()}
    dropped = None
    off = float(
        (result - trimmed_mean(torch.stack(list(claims.values())))).norm()
    )  # what the robust reducers compute from the claims
    if off > CLAIM_TOLERANCE * biggest + floor:
        dropped = left_out(claims, result, CLAIM_TOLERANCE * biggest + floor, me)
        if dropped is None:
            return (
                f"the mean is {off:.3g} away from the mean of what the members declared (largest update {biggest:.3g}): a member sent other values than it committed to",
                [],
                None,
            )
        # hivemind dropped this sender (its stream failed): the result is the others' mean; every
        # claim still counts below (a dropped member that flipped its update is still named)
    named = []
    for name, u in updates.items():
        if name == me:
            continue
        # size and the group's direction need at least two others to compare with: in a pair, an
        # honest member whose base is older (it missed a round, or just joined) looks "outsized" too
        if len(updates) >= 3:
            others = [v for k, v in updates.items() if k != name]
            ref = float(torch.stack([v.norm() for v in others]).median())
            if float(u.norm()) > MAX_CORRECTION * ref + floor:
                named.append(
                    f"{name}: its update is {float(u.norm()) / max(ref, 1e-30):.1f}x the others' (limit {MAX_CORRECTION:g}x)"
                )
                continue
            rest = torch.stack(others).mean(0)
            cos = float(u @ rest / (u.norm() * rest.norm() + 1e-30))
            if cos < FLIP_COSINE:
                named.append(f"{name}: its update points against the rest of the group (cosine {cos:.2f})")
                continue
        # against this peer's own, in any group: two colluders of three are every coordinate's majority
        why = away_from_own(u, updates[me], floor) if me in updates else ""
        if why:
            named.append(f"{name}: {why}")
    if named:
        return "; ".join(named), named, dropped
    return "", [], dropped


def left_out(claims: dict[str, torch.Tensor], result: torch.Tensor, tolerance: float, me: str) -> str | None:
    """The one member (not this peer, `me`) whose part hivemind left out of the round, if the result
    is the trimmed mean of everyone else's claims; else None. Why: hivemind's all-reduce drops
    a sender whose stream fails (a busy or leaving peer) and reduces the others' parts, so an
    honest round can miss a member; refusing it as a lie would name a fault nobody made."""
    if len(claims) < 3:  # in a pair, "the other's values alone" would pass any one-sided result
        return None
    for name in claims:
        rest = [v for k, v in claims.items() if k != name]
        if name != me and float((result - trimmed_mean(torch.stack(rest))).norm()) <= tolerance:
            return name
    return None


def implausible(means: list[torch.Tensor], offered: list[torch.Tensor], base: list[torch.Tensor]) -> str:
    """Why the group's mean cannot be right, or "". The rules: every value finite; the correction
    it asks for (mean - what this peer `offered`) at most `MAX_CORRECTION` times this peer's own
    drift since the last mean (`base`), plus `DRIFT_FLOOR` of the weights' norm for rounding; and
    the group's update (mean - base) not pointing away from this peer's own (cosine below
    `GROUP_COSINE`, peer/dp/steering.py). Why: honest replicas start a round from the same mean
    and drift by similar amounts, in similar directions, in `every` local steps, so the mean of n
    of them lies within about that drift and on the same side; a NaN or scaled contribution lands
    far outside it, and a group whose majority flipped or turned its updates (which the trimmed
    mean cannot outvote) lands on the other side or far off to one. The whole round is dropped
    because hivemind's all-reduce hands back only the mean: who is to blame cannot be told here
    (a steering majority would name this peer).
    The floor was once 0.1 % of the weights' norm: a pair member whose honest drift was far
    smaller rode it, moving the weights 4.5 % in 50 rounds."""
    if not all(torch.isfinite(m).all() for m in means):
        return "the group mean holds NaN or Inf"
    correction = torch.sqrt(sum(((m - o) ** 2).sum() for m, o in zip(means, offered)))
    drift = torch.sqrt(sum(((o - b) ** 2).sum() for o, b in zip(offered, base)))
    scale = torch.sqrt(sum((b**2).sum() for b in base))
    limit = MAX_CORRECTION * drift + DRIFT_FLOOR * scale
    if correction > limit:
        return f"it would move the weights by {float(correction):.3g}, more than {MAX_CORRECTION}x this peer's own drift since the last mean ({float(drift):.3g}, plus {DRIFT_FLOOR:g} of their norm)"
    moved = torch.sqrt(sum(((m - b) ** 2).sum() for m, b in zip(means, base)))
    if float(drift) > DRIFT_FLOOR * float(scale) and float(moved) > DRIFT_FLOOR * float(scale):
        dot = sum(((m - b) * (o - b)).sum() for m, b, o in zip(means, base, offered))
        cos = float(dot / (moved * drift))
        if cos < GROUP_COSINE:
            return f"the group's update points away from this peer's own (cosine {cos:.2f}, limit {GROUP_COSINE:g}): a majority of the group sent updates far from it"
    return ""
