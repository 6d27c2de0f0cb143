"""The audit of a stage-group averaging round, at coordinates nobody knew in advance.

Before a round a member commits to every value it is about to send: the Merkle root of them
(peer/dp/commitment.py) goes into its signed claim (`commit_claim`). After the round, each member
draws a few leaves with private randomness (`pick_leaves`) and asks every other member to reveal
its committed values there, with their Merkle paths (`run_audit`; served by `answer`). The host
then checks the round's result at those coordinates against the trimmed mean of the revealed
values, and each revealed update for NaN, size and direction (peer/dp/claims.py).

Why: coordinates seeded from the public group key let a member send honest values there and
poison everywhere else. Here a member learns which leaves an auditor checks only after its parts
are sent, and a proof binds it to what it committed to before the round: sending other values
than those shows at every audited leaf they touch. Everything here runs in hivemind's averaging
process (peer/dp/hivemind_averager.py), off the training thread.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from peer.dp.commitment import LEAF, Commitment, commit, leaf_count, verify
from peer.wire import audit_pb2 as pb

AUDIT_LEAVES = 4  # leaves one auditor draws per round: 4,096 coordinates (16 KiB per member to the host)
MAX_REVEAL_LEAVES = 16  # the most a member reveals per request
REVEAL_TIMEOUT_S = 10.0  # a member that has not answered by then is named as not proving what it sent


@dataclass(frozen=True)
class Audit:
    """What the audit of one round found, handed from the averaging process to the host: the flat
    coordinates audited (int64 bytes), every member's committed values there (fp32 bytes, keyed
    by hivemind id, this peer's own included) and why a member's values are missing."""

    index: bytes
    values: dict[str, bytes]
    failed: dict[str, str] = field(default_factory=dict)

    def coordinates(self) -> torch.Tensor:
        return (
            torch.frombuffer(bytearray(self.index), dtype=torch.int64)
            if self.index
            else torch.zeros(0, dtype=torch.int64)
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: torch.frombuffer(bytearray(v), dtype=torch.float32) for k, v in self.values.items()}


def commit_claim(
    tensors: list[torch.Tensor], claim: dict, sign: Callable[[dict], dict] | None
) -> tuple[Commitment, dict]:
    """Commit to `tensors` (what this member is about to send) and put the root and the number
    of values into its `claim`, signed by `sign` when given."""
    c = commit(tensors)
    out = {**claim, "root": c.root, "n": int(c.values.numel())}
    return c, (sign(out) if sign is not None else out)


def pick_leaves(n: int, k: int = AUDIT_LEAVES) -> list[int]:
    """`k` distinct leaves of a vector of `n` values, drawn from the OS's randomness (sorted)."""
    count = leaf_count(n)
    return sorted(secrets.SystemRandom().sample(range(count), min(k, count)))


def coordinates(n: int, leaves: list[int]) -> torch.Tensor:
    """The flat coordinates the `leaves` hold, in order."""
    return (
        torch.cat([torch.arange(leaf * LEAF, min((leaf + 1) * LEAF, n)) for leaf in leaves])
        if leaves
        else torch.zeros(0, dtype=torch.int64)
    )


def answer(commitments: dict[bytes, Commitment], request: pb.RevealRequest) -> pb.RevealReply:
    """Reveal the leaves a member asks for, of the commitment with the root it names."""
    c = commitments.get(bytes(request.root))
    if c is None:
        return pb.RevealReply(error="no commitment with this root here (not this round's, or an old one)")
    leaves, count = list(request.leaves), leaf_count(c.values.numel())
    if not leaves or len(leaves) > MAX_REVEAL_LEAVES:
        return pb.RevealReply(error=f"ask for 1 to {MAX_REVEAL_LEAVES} leaves, not {len(leaves)}")
    if any(leaf >= count for leaf in leaves):
        return pb.RevealReply(error=f"a leaf index is outside the {count} leaves")
    values, proof = c.reveal(leaves)
    return pb.RevealReply(values=values, proof=proof)


async def run_audit(
    me: str,
    own: Commitment | None,
    gathered: dict,
    ask: Callable[[object, pb.RevealRequest], Awaitable[pb.RevealReply]],
) -> Audit:
    """Ask every other member of the round (`gathered`: hivemind peer id -> claim) to reveal the
    same privately drawn leaves of what it committed to, and check each answer against the root
    in its claim. `own`: this member's commitment for the round; `ask(peer id, request)` sends
    one reveal request (with a timeout)."""
    if own is None:
        return Audit(b"", {}, {me: "this member made no commitment for the round"})
    n = int(own.values.numel())
    leaves = pick_leaves(n)
    index = coordinates(n, leaves)
    values = {me: own.values[index].numpy().tobytes()}
    failed: dict[str, str] = {}

    async def reveal(pid: object, claim: object) -> None:
        name = str(pid)
        root, cn = (claim.get("root"), claim.get("n")) if isinstance(claim, dict) else (None, None)
        if not isinstance(root, bytes) or not isinstance(cn, int):
            failed[name] = "its claim holds no commitment"
            return
        if cn != n:
            failed[name] = f"it committed to {cn} values, this stage has {n}"
            return
        try:
            reply = await ask(pid, pb.RevealRequest(root=root, leaves=leaves))
        except Exception as exc:  # a timeout, a closed stream, a member gone
            failed[name] = f"it did not reveal its committed values ({type(exc).__name__}: {exc})"[:300]
            return
        why = reply.error and f"it refused to reveal its committed values: {reply.error[:200]}"
        bad = "" if why else verify(root, n, leaves, reply.values, reply.proof)
        why = why or (bad and f"what it revealed is not what it committed to: {bad}")
        if why:
            failed[name] = why
        else:
            values[name] = bytes(reply.values)

    await asyncio.gather(*(reveal(pid, claim) for pid, claim in gathered.items() if str(pid) != me))
    return Audit(index.numpy().tobytes(), values, failed)
