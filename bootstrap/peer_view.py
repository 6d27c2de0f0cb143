"""How the tracker shows one peer of its roster: its `PeerInfo` (in the run's status and in the
neighbour lists of heartbeat replies), with the averaging suspects its reports named."""

from __future__ import annotations

from collections.abc import Collection

from bootstrap.roster import LIVE, PeerRecord
from peer.security.identity import fingerprint
from peer.wire import anchormesh_pb2 as pb

Suspects = tuple[
    dict[str, list[str]], dict[str, int], dict[str, int]
]  # (peer id -> whom it named, -> how many name it, -> how many joiners refused its state)


def suspects(peers: Collection[PeerRecord]) -> Suspects:
    """Per peer: the members its refused averaging rounds named, as run peer ids (the reports
    name hivemind peer ids, which the tracker knows from each peer's DHT multiaddrs); and
    per peer: how many live peers name it, and how many live joiners refused its state (the peer
    id a `refused_donors` entry starts with)."""
    by_dht = {m.rsplit("/p2p/", 1)[1]: p.peer_id for p in peers for m in p.dht_maddrs if "/p2p/" in m}
    named: dict[str, list[str]] = {}
    flagged: dict[str, int] = {}
    for p in peers:
        out, seen = [], set()
        for s in p.dp_suspects:
            hid, _, why = s.partition(": ")
            who = by_dht.get(hid, f"unknown DHT peer {hid[:16]}")
            out.append(f"{who}: {why}")
            if p.state in LIVE and who not in seen:
                seen.add(who)
                flagged[who] = flagged.get(who, 0) + 1
        named[p.peer_id] = out
    donors: dict[str, int] = {}
    for p in peers:
        for who in {s.partition(": ")[0] for s in p.refused_donors} if p.state in LIVE else ():
            donors[who] = donors.get(who, 0) + 1
    return named, flagged, donors


def peer_info(p: PeerRecord, now: float, suspects: Suspects = ({}, {}, {})) -> pb.PeerInfo:
    """`p` as the wire shows it, at tracker clock `now`."""
    named, flagged, donors = suspects
    return pb.PeerInfo(
        peer_id=p.peer_id,
        stage=p.stage,
        address=p.address,
        state=p.state,
        last_seen_s=now - p.last_seen,
        tokens_per_s=p.tokens_per_s,
        bytes_in=p.bytes_in,
        bytes_out=p.bytes_out,
        step=p.step,
        loss=p.loss,
        queue_depth=p.queue_depth,
        reason=p.reason
        if p.reported or p.state not in LIVE
        else f"loading its stage ({now - p.joined_at:.0f}s since it joined)",
        dp_rounds=p.dp_rounds,
        anchor_id=p.anchor_id,
        anchor_bytes_out=p.anchor_bytes_out,
        pp_state_bytes_out=p.pp_state_bytes_out,
        capacity_tokens_per_s=p.capacity,
        dp_bytes_out=p.dp_bytes_out,
        dp_dense_bytes=p.dp_dense_bytes,
        eval_id=p.eval_id,
        eval_loss=p.eval_loss,
        dp_rejected=p.dp_rejected,
        refused_calls=p.refused_calls,
        key_fingerprint=fingerprint(bytes.fromhex(p.key)) if p.key else "",
        dp_suspects=named.get(p.peer_id, []),
        dp_flagged=flagged.get(p.peer_id, 0),
        link_mbit=p.link_mbit,
        pp_keep=p.pp_keep,
        dp_period_s=p.dp_period_s,
        device=p.device,
        build=p.build,
        memory_bytes=p.memory,
        memory_plan_bytes=p.memory_plan,
        refused_reports=p.refused_reports,
        excluding=list(p.excluding),
        startup_s=p.startup_s,
        startup_phases=[pb.StartupPhase(name=n, seconds=x) for n, x in p.startup_phases],
        replica_stage=p.replica_stage,
        replica_step=p.replica_step,
        resumed_from=p.resumed_from,
        refused_donors=list(p.refused_donors),
        donor_flagged=donors.get(p.peer_id, 0),
        refused_senders=list(p.refused_senders),
        dropped_steps=p.dropped_steps,
        links_held=list(p.links_held),
    )
