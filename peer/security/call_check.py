"""Checking one call's credentials (auth.py's `Gate` runs it on every call's headers).

What a call carries (DESIGN §6): the caller's time and nonce, its wire version, and one of a run
token's HMAC, an operator key's HMAC, or a member certificate with the caller's signature, each
over the call's method, peer id, time, nonce and public key (`call_bytes`). `check_call` says who
the verified caller is (`Caller`) or why not (`Refused`, with the gRPC code a caller can act on).

Apart from the Gate (interception, rates, refusal counting and logging) because these are the
rules themselves: plain functions of the headers and the keys, readable and testable alone.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import grpc

from peer.security.identity import certificate_bytes, fingerprint, verify
from peer.wire.version import wire_version

OPEN, TOKEN, MEMBER, OPERATOR = "open", "token", "member", "operator"
H_PEER, H_KEY, H_CERT, H_SIG = "am-peer", "am-key-bin", "am-cert-bin", "am-sig-bin"
H_TS, H_NONCE, H_MAC, H_OP = "am-ts", "am-nonce", "am-mac", "am-op"
H_WIRE = "am-wire"  # the caller's wire version (peer/wire/version.py): a member of another one is refused
MAX_SKEW_S = 300.0  # clocks of volunteers' machines may differ this much (NTP keeps them far closer)
NO_TOKEN_HINT = 'pass --token or set ANCHORMESH_TOKEN (the "token" in the bootstrap\'s bootstrap.json)'


def call_bytes(method: str, peer: str, ts: str, nonce: str, key: bytes) -> bytes:
    """What a call's HMAC or signature covers."""
    return f"anchormesh-call\n{method}\n{peer}\n{ts}\n{nonce}\n".encode() + key


def mac(secret: str, data: bytes) -> str:
    return hmac.new(secret.encode(), data, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    role: str
    peer_id: str = ""
    key: bytes = b""

    @property
    def name(self) -> str:
        return self.peer_id or self.role


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text


def check_call(
    method: str,
    md: dict,
    roles: frozenset[str],
    *,
    token: str | None,
    operator: str | None,
    tracker_key: bytes,
    run_id: str,
    banned: dict[str, str],
    now: float,
) -> Caller:
    """The verified caller of `method` from its headers `md`, or Refused (code + text): a credential
    of one of `roles`, valid under this server's `token`, `operator` key or `tracker_key` (member
    certificates of `run_id`), of a key not `banned`, made at most `MAX_SKEW_S` from `now`, and
    for a member, of this build's wire version. The nonce's freshness is the caller's to check."""
    unauth, denied = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    ts, nonce = str(md.get(H_TS, "")), str(md.get(H_NONCE, ""))
    peer, key = str(md.get(H_PEER, "")), md.get(H_KEY, b"")
    if not isinstance(key, bytes):
        raise Refused(unauth, f"{H_KEY} must be binary metadata")
    presented = [h for h in (H_CERT, H_MAC, H_OP) if h in md]
    if not presented:
        raise Refused(unauth, f"{method} needs credentials and the call has none: {NO_TOKEN_HINT}")
    try:
        age = abs(now - float(ts))
    except ValueError:
        raise Refused(unauth, f"{H_TS}={ts[:40]!r} is not a time") from None
    if age > MAX_SKEW_S:
        raise Refused(
            unauth,
            f"the call's time is {age:.0f}s off this server's clock (at most {MAX_SKEW_S:.0f}s): fix the caller's clock",
        )
    if not 8 <= len(nonce) <= 64:
        raise Refused(unauth, f"{H_NONCE} must be 8-64 characters")
    data = call_bytes(method, peer, ts, nonce, key)
    caller = None
    if H_OP in md and operator and hmac.compare_digest(str(md[H_OP]), mac(operator, data)):
        caller = Caller(OPERATOR, peer, key)
    elif H_CERT in md:
        caller = _member(md, peer, key, data, tracker_key, run_id)
    elif H_MAC in md:
        if not token:
            raise Refused(unauth, "this server does not know the run token yet")
        if not hmac.compare_digest(str(md[H_MAC]), mac(token, data)):
            raise Refused(
                unauth, "wrong run token: check --token / ANCHORMESH_TOKEN against the bootstrap's bootstrap.json"
            )
        caller = Caller(TOKEN, peer, key)
    else:
        raise Refused(unauth, "wrong operator key")
    if key and fingerprint(key) in banned:
        raise Refused(denied, f"peer {peer or fingerprint(key)} is banned from this run: {banned[fingerprint(key)]}")
    if caller.role not in roles:
        raise Refused(
            denied, f"{method} takes {' or '.join(sorted(roles))} credentials; the caller has {caller.role} ones"
        )
    if (
        caller.role == MEMBER and md.get(H_WIRE) != wire_version()
    ):  # every stream's first headers: never a silent mis-decode
        theirs = md.get(H_WIRE) or "none (a build older than wire versions)"
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"peer {peer!r} speaks wire version {str(theirs)[:40]}, this peer {wire_version()}: both must run a build of the same wire version",
        )
    return caller


def _member(md: dict, peer: str, key: bytes, data: bytes, tracker_key: bytes, run_id: str) -> Caller:
    unauth = grpc.StatusCode.UNAUTHENTICATED
    cert, sig = md.get(H_CERT, b""), md.get(H_SIG, b"")
    if not tracker_key:
        raise Refused(unauth, "this server has not joined a run yet")
    if (
        not isinstance(cert, bytes)
        or not isinstance(sig, bytes)
        or not verify(tracker_key, cert, certificate_bytes(run_id, peer, key))
    ):
        raise Refused(
            unauth, f"peer {peer!r}: its certificate was not issued by this run's tracker (another run, or forged)"
        )
    if not verify(key, sig, data):
        raise Refused(unauth, f"peer {peer!r}: the call's signature does not match its key")
    return Caller(MEMBER, peer, key)
