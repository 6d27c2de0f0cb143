"""Signed averaging claims: who sent a claim, and that nobody changed it on the way.

A round's claims (peer/dp/claims.py) travel in hivemind's all-gather, which the round's leader
relays to everyone: a leader could change another member's claim, to frame it or to make its own
lie fit. So each member signs its claim with its identity key (peer/security/identity.py) and
adds the tracker's certificate of that key: a receiver checks the certificate against the run's
tracker key, the signature over (group key, hivemind id, run peer id, time, the Merkle root of
every value it sends and their number: peer/dp/commitment.py),
and that the claim was made near its own offer (an old claim replayed in a later round is
refused). A round with a claim that fails is refused whole, and nobody is named: the signer and
the relay cannot be told apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer.security.identity import Identity, certificate_bytes, verify

FIELDS = ("peer", "root", "n", "time", "key", "cert", "sig")


def claim_bytes(prefix: str, hivemind_id: str, claim: dict) -> bytes:
    """What a member signs: its claim bound to the group key and to its hivemind id."""
    fields = [prefix, hivemind_id, str(claim["peer"]), repr(float(claim["time"])), str(int(claim["n"]))]
    return b"\0".join([b"anchormesh-claim-v2", *(f.encode() for f in fields), bytes(claim["root"])])


@dataclass
class ClaimSigner:
    """This member's identity and certificate, and the run's tracker key to check the others'."""

    identity: Identity
    run_id: str
    certificate: bytes
    tracker_key: bytes

    def sign(self, claim: dict, prefix: str, hivemind_id: str, now: float) -> dict:
        """`claim` ({"peer", "root", "n"}) with its time, key, certificate and signature."""
        out = {**claim, "time": float(now), "key": self.identity.public, "cert": self.certificate}
        out["sig"] = self.identity.sign(claim_bytes(prefix, hivemind_id, out))
        return out

    def check(self, claim: object, prefix: str, hivemind_id: str, now: float, skew_s: float) -> str:
        """Why `claim`, gathered under `hivemind_id`, is not a member's untouched claim made within
        `skew_s` of `now`; "" when it is."""
        if not isinstance(claim, dict) or any(f not in claim for f in FIELDS):
            return "it is unsigned"
        peer, stamp, key, cert, sig, root, n = (claim[f] for f in ("peer", "time", "key", "cert", "sig", "root", "n"))
        if (
            not isinstance(peer, str)
            or not isinstance(stamp, (int, float))
            or not isinstance(n, int)
            or not all(isinstance(b, bytes) for b in (key, cert, sig, root))
        ):
            return "its fields have the wrong types"
        if not verify(self.tracker_key, cert, certificate_bytes(self.run_id, peer, key)):
            return f"its certificate for {peer!r} was not issued by this run's tracker"
        if not verify(key, sig, claim_bytes(prefix, hivemind_id, claim)):
            return "its signature does not match (altered on the way, or made for another round or member)"
        if not math.isfinite(float(stamp)) or abs(float(stamp) - now) > skew_s:
            return f"it was made {float(stamp) - now:+.0f} s from this round (at most {skew_s:.0f} s): an old claim replayed"
        return ""

    def check_group(self, group: dict, prefix: str, now: float, skew_s: float) -> str:
        """Why the round's claims are not all signed members' claims; "" when they are."""
        for hid, claim in group.items():
            why = self.check(claim, prefix, str(hid), now, skew_s)
            if why:
                who = claim.get("peer") if isinstance(claim, dict) else None
                return f"the claim of {who or 'a member'} ({str(hid)[:16]}) is refused: {why}"
        return ""
