"""The tracker's roster: one `PeerRecord` per peer that joined (kept after it leaves, for the
status), the states that count as live, and the refusals a join or a report can get."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from peer.errors import AnchormeshError

LIVE = ("joining", "active", "idle")


class JoinRefused(AnchormeshError):
    """A peer may not join (wrong run, wrong code version, duplicate id); the message says why."""


class Banned(AnchormeshError):
    """The peer's key is banned from the run (the operator's `anchormesh ban`)."""


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
    pp_state_bytes_out: int = 0  # of bytes_out: codec state its links shipped
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
    build: str = ""  # its anchormesh VERSION+COMMIT (from its Join; peer/build.py)
    memory: int = 0  # bytes it may plan a stage for; 0 = unknown
    memory_plan: int = 0  # its plan for the stage it serves; 0 = unknown
    start_step: int = 0  # the run step it was given at Join (its reports start from there)
    refused_reports: int = 0  # reports whose figures were implausible (kept the old ones)
    last_refusal: str = ""  # why the newest one was
    excluding: tuple[str, ...] = ()  # "PEER: why (N s left)" of next-stage peers its sends route around
    startup_s: float = 0.0  # its process start to its first step (0: not yet)
    startup_phases: tuple[tuple[str, float], ...] = ()  # where that time went (peer/daemon/startup.py)
    replica_stage: int = 0  # the replica of another stage's state it keeps (peer/daemon/replicas.py)
    replica_step: int = 0  # its step; 0 = none
    resumed_from: str = ""  # where its stage state came from (initial weights, checkpoint, group, replica)
    rate: float = (
        -1.0
    )  # steps/s the tracker saw it make over its last window of reports (bootstrap/support.py); -1 = not yet
    mark_step: int = 0  # the step and tracker clock its current rate window started at
    mark_at: float = 0.0
    supported_step: int = (
        0  # the highest of its step the others' reports supported (kept: the run's step never goes back)
    )
    supported_tokens: int = 0  # the same for its tokens (the budget)
    copy_stage: int = -1  # the stage the tracker last told it to copy (a replica), and that source's step then
    copy_step: int = 0
    refused_donors: tuple[str, ...] = ()  # "PEER: why" of the stage mates whose state it refused as a joiner
    refused_senders: tuple[str, ...] = ()  # "PEER: N refused, newest: why" of senders its link bounds refused
    dropped_steps: int = 0  # steps it dropped for a non-finite gradient
    links_held: tuple[str, ...] = ()  # "PEER CHANNEL: why" of its links whose meter holds its estimate


def live(peers: Iterable[PeerRecord], stage: int | None = None) -> list[PeerRecord]:
    """The live ones of `peers` (of `stage` when given)."""
    return [p for p in peers if p.state in LIVE and (stage is None or p.stage == stage)]
