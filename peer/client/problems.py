"""Plain-language problems found in a run's status dict (`problems()`), shown by the dashboard's
problems panel and usable by anything that reads `anchormesh status --json`. Each rule is one
small function whose docstring says why its threshold; docs/status.md lists them for people."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from peer.client.view import duration as _duration

LIVE_STATES = ("joining", "active", "idle")  # as bootstrap/tracker.py: the tracker routes to these

# thresholds of the rules in `problems()`; each rule's docstring says why
BOTTLENECK_RATIO = 0.5
ANCHOR_CADENCES_LATE = 3
ANCHOR_FALLBACK_STEPS = 200
DEAD_PEER_SHOWN_S = 600.0  # a dead peer is a problem for 10 minutes after its last heartbeat
SILENT_PEER_S = 5.0
NO_LOSS_AFTER_STEPS = 20
STALL_AFTER_UPTIME_S = 60.0


def _stages_without_peer(s: dict) -> list[str]:
    """A stage with no live peer stops the whole pipeline: no threshold, always a problem."""
    if s.get("state") == "done":  # peers leave when the budget is spent; nothing is wrong
        return []
    return [
        f"stage {st['index']} has no peer: the run is paused until one joins"
        for st in s.get("stages", [])
        if not st.get("peers")
    ]


def _bottlenecks(s: dict) -> list[tuple[dict, float]]:
    """(stage, median capacity of the others) for each stage whose capacity is < 0.5x that median.

    The run goes at its slowest stage's pace, so at that ratio the other stages idle at least
    half the time, and adding a peer to that stage is the fix (the tracker moves one itself
    only when a move raises the bottleneck by more than half, so it may not). Stages with
    no peer (reported apart) or not yet measured (capacity 0) are left out."""
    measured = [st for st in s.get("stages", []) if st.get("peers") and st.get("capacity_tokens_per_s", 0) > 0]
    out = []
    for st in measured:
        others = [o["capacity_tokens_per_s"] for o in measured if o is not st]
        if others and st["capacity_tokens_per_s"] < BOTTLENECK_RATIO * statistics.median(others):
            out.append((st, statistics.median(others)))
    return out


def _bottleneck_stages(s: dict) -> list[str]:
    """A stage far slower than the others (rule and threshold: `_bottlenecks`)."""
    return [
        f"stage {st['index']} is the bottleneck: it could do {st['capacity_tokens_per_s']:,.0f} tok/s, "
        f"under half the other stages' {median:,.0f}; add a peer to it"
        for st, median in _bottlenecks(s)
    ]


def _stale_anchor(s: dict) -> list[str]:
    """The newest anchor any optimizer took is older than 3 anchor cadences (200 steps if the
    cadence is unknown), or none was taken that long into a run that launches them.

    Normally the age stays between 1 and 2 cadences (a pass takes a while to cross the
    pipeline); one late or dropped pass (120 s without progress) can push it past 2; past 3
    passes keep failing and the spectral correction works from an old gradient. The status
    JSON does not carry `anchor.every`; an optional `anchor_every` key is used when present,
    else 200 steps = 10 cadences of the recommended `anchor.every = 20`."""
    launched = s.get("anchors_launched") or 0
    if not launched:
        return []  # anchors off, or the first not due yet
    every = s.get("anchor_every")
    limit = ANCHOR_CADENCES_LATE * every if every else ANCHOR_FALLBACK_STEPS
    age = s.get("anchor_age_steps")
    if age is None:
        if (s.get("step") or 0) > limit:
            return [f"no anchor taken yet at step {s['step']} ({launched} launched): anchor passes are not completing"]
        return []
    if age > limit:
        return [f"anchor is stale: {age} steps old (limit {limit}); anchor passes are not completing"]
    return []


def _dead_peers(s: dict) -> list[str]:
    """Peers the tracker declared dead (no heartbeat within its timeout), with its reason.

    `left` (SIGTERM, done, moved to another stage) and `joining` are a peer's normal life and are
    only shown in the peer table; `dead` means a peer vanished and its micro-batches were lost.
    After `DEAD_PEER_SHOWN_S` it stays in the table only: the tracker keeps every record, and a
    death an hour ago is history, not a problem to act on."""
    return [
        f"{p['id']} (stage {p['stage']}) is dead: {p.get('reason') or 'no reason given'}"
        for p in s.get("peers", [])
        if p.get("state") == "dead" and (p.get("last_seen_s") or 0) <= DEAD_PEER_SHOWN_S
    ]


def _silent_peers(s: dict) -> list[str]:
    """A live peer not heard from for > 5 s: peers heartbeat every 1 s and the tracker declares
    them dead after 10 s, so 5 missed heartbeats means it is hung or its link is failing."""
    return [
        f"{p['id']} (stage {p['stage']}) not seen for {p['last_seen_s']:.0f}s: hung or unreachable?"
        for p in s.get("peers", [])
        if p.get("state") in LIVE_STATES and (p.get("last_seen_s") or 0) > SILENT_PEER_S
    ]


def _rejected_rounds(s: dict) -> list[str]:
    """A peer refused stage-group averaging results (NaN, or a correction far outside its own
    drift: peer/dp/claims.py). Any refusal is shown: honest groups do not produce one, so it
    means a broken or hostile member in that stage group."""
    return [
        f"{p['id']} (stage {p['stage']}) refused {p['dp_rejected']} averaging result(s) of its stage group: a member sends NaN or outsized updates"
        for p in s.get("peers", [])
        if (p.get("dp_rejected") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _named_by_group(s: dict) -> list[str]:
    """A peer its stage mates name as the sender of a NaN, outsized or sign-flipped averaging
    contribution (peer/dp/group.py's claims). Shown with what they say, so the operator can
    judge and ban it (`anchormesh ban`); nothing bans automatically, since a hostile member
    could name an honest one."""
    out = []
    for p in s.get("peers", []):
        if (p.get("dp_flagged") or 0) > 0 and p.get("state") in LIVE_STATES:
            said = next(
                (
                    x.split(": ", 1)[1]
                    for q in s.get("peers", [])
                    for x in q.get("dp_suspects") or []
                    if x.startswith(p["id"] + ": ")
                ),
                "",
            )
            out.append(
                f"{p['id']} (stage {p['stage']}) is named by {p['dp_flagged']} stage mate(s) as the sender of a bad averaging update: {said}"
            )
    return out


def _refused_senders(s: dict) -> list[str]:
    """A peer whose link bounds refused a sender's activations or gradients (peer/pipeline/bounds.py),
    and a peer that dropped steps for a non-finite gradient. A sender refused again and again
    stalls its micro-batches: either it is broken or hostile, or an honest run outgrew a bound
    (the reason names the setting)."""
    out = []
    for p in s.get("peers", []):
        if p.get("state") not in LIVE_STATES:
            continue
        for x in p.get("refused_senders") or []:
            out.append(f"{p['id']} (stage {p['stage']}) refuses messages from {x}")
        if (p.get("dropped_steps") or 0) > 0:
            out.append(
                f"{p['id']} (stage {p['stage']}) dropped {p['dropped_steps']} step(s) for a non-finite gradient (its log names the senders)"
            )
    return out


def _links_held(s: dict) -> list[str]:
    """A peer whose link meter holds its last estimate (peer/pipeline/linkmeter.py): a link with no
    ack for a while is stalled, and its self-tuning works from old figures until acks come back."""
    return [
        f"{p['id']} (stage {p['stage']}) holds its link estimate of {x}"
        for p in s.get("peers", [])
        if p.get("state") in LIVE_STATES
        for x in p.get("links_held") or []
    ]


def _refused_donors(s: dict) -> list[str]:
    """A peer whose stage state a joiner refused (far from what its other stage mates hold, or
    out of bounds: peer/daemon/state_witness.py), with the joiner's reason; the operator judges
    and bans (a hostile joiner could name an honest donor, so nothing bans automatically)."""
    out = []
    for p in s.get("peers", []):
        if (p.get("donor_flagged") or 0) > 0 and p.get("state") in LIVE_STATES:
            said = next(
                (
                    x.split(": ", 1)[1]
                    for q in s.get("peers", [])
                    for x in q.get("refused_donors") or []
                    if x.startswith(p["id"] + ": ")
                ),
                "",
            )
            out.append(
                f"{p['id']} (stage {p['stage']}) served a stage state {p['donor_flagged']} joiner(s) refused: {said}"
            )
    return out


def _excluding(s: dict) -> list[str]:
    """A live peer routes around a next-stage peer whose stream stopped taking messages (it is
    excluded for a while, then tried again): hung, overloaded, or a member that accepts streams
    and never reads them. Shown with the sender's reason so the operator sees who and why."""
    return [
        f"{p['id']} (stage {p['stage']}) routes around {x}"
        for p in s.get("peers", [])
        if p.get("state") in LIVE_STATES
        for x in p.get("excluding") or []
    ]


def _refused_calls(s: dict) -> list[str]:
    """Calls refused for bad credentials, bans or rate (peer/security/auth.py), at the tracker and each
    live peer: honest members never trip the gate, so any refusal means a misconfigured
    volunteer (wrong token, clock far off) or someone probing the run; their logs say which."""
    out = (
        [f"the tracker refused {s['refused_calls']} call(s): wrong tokens, banned keys or too many calls (see its log)"]
        if s.get("refused_calls")
        else []
    )
    return out + [
        f"{p['id']} (stage {p['stage']}) refused {p['refused_calls']} call(s) to its Stage service (see its log)"
        for p in s.get("peers", [])
        if (p.get("refused_calls") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _implausible_reports(s: dict) -> list[str]:
    """Peers whose reports the tracker refused (a step, token count or capacity no honest peer
    reaches): a broken peer or someone trying to end or steer the run."""
    return [
        f"{p['id']} (stage {p['stage']}) sent {p['refused_reports']} implausible report(s) (step or tokens): the tracker kept its old figures; judge it and ban it if needed"
        for p in s.get("peers", [])
        if (p.get("refused_reports") or 0) > 0 and p.get("state") in LIVE_STATES
    ]


def _unfit(s: dict) -> list[str]:
    """Volunteers the tracker turned away because no stage of the run fits their memory: the
    operator may want more stages or activation checkpointing to use them."""
    return [
        f"no stage fits {u}: refused (more stages or compute.activation_checkpointing would let it in)"
        for u in s.get("unfit") or []
    ]


def _bad_loss(s: dict) -> list[str]:
    """The training loss is NaN/inf, or none was reported after 20 run steps.

    `status_dict` turns NaN into null and the tracker averages only finite losses, so a
    diverged run shows as a missing loss; 20 steps leaves time for the first steps to reach the
    last stage and be reported, since no loss at all is normal at the start."""
    loss = s.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return [f"training loss is {loss}: the run has diverged"]
    out = [
        f"{p['id']} (stage {p['stage']}) reports a {p['loss']} loss: it has diverged"
        for p in s.get("peers", [])
        if isinstance(p.get("loss"), float) and not math.isfinite(p["loss"])
    ]
    stages = s.get("stages", [])
    last_has_peer = bool(stages) and bool(stages[-1].get("peers"))
    if loss is None and last_has_peer and (s.get("step") or 0) >= NO_LOSS_AFTER_STEPS:
        out.append(f"no training loss at step {s['step']}: the last stage reports NaN (diverged) or nothing")
    return out


def _stalled(s: dict) -> list[str]:
    """0 tokens/s while the run is `running`, > 60 s after the tracker started, and no peer
    is still joining. Peers load the model and download state in the first minute, and a
    joining peer explains a pause; past that, nothing moving means the pipeline is stuck."""
    peers = s.get("peers", [])
    if (
        s.get("state") != "running"
        or (s.get("tokens_per_s") or 0) > 0
        or (s.get("uptime_s") or 0) <= STALL_AFTER_UPTIME_S
    ):
        return []
    if any(p.get("state") == "joining" for p in peers):
        return []
    return [f"no throughput: 0 tok/s while running (up {_duration(s.get('uptime_s') or 0)}); the pipeline is stuck"]


RULES: tuple[Callable[[dict], list[str]], ...] = (
    _stages_without_peer,
    _bottleneck_stages,
    _stale_anchor,
    _dead_peers,
    _silent_peers,
    _rejected_rounds,
    _named_by_group,
    _refused_donors,
    _refused_senders,
    _links_held,
    _excluding,
    _refused_calls,
    _implausible_reports,
    _unfit,
    _bad_loss,
    _stalled,
)


def problems(status: dict) -> list[str]:
    """Every rule's findings, in a stable order (most blocking first)."""
    return [msg for rule in RULES for msg in rule(status)]
