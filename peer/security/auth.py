"""Who may call what: every gRPC call of a swarm carries credentials, every server checks them.

Three kinds of credential, each for a reason (DESIGN §6):
- **run token** (`token`): the secret the operator hands to volunteers. It admits a peer (Join)
  and lets an observer read the run (export). It never crosses the wire: calls carry an HMAC of
  the call's method, time and nonce under it.
- **operator key** (`operator`): only in the bootstrap's `bootstrap.json` (mode 0600); the only
  credential that may ban a peer.
- **member certificate** (`member`): a peer's identity key signed by the tracker at Join
  (peer/security/identity.py). Member calls carry the certificate, the public key and the caller's
  signature over the call; any peer checks them with the tracker's public key alone.

A server's `Gate` (a gRPC server interceptor) checks them before any handler runs. Calls without
credentials, with a wrong token, a forged certificate, a bad signature, a stale time or a
replayed nonce get UNAUTHENTICATED; a banned key, or a credential the method does not take,
gets PERMISSION_DENIED; a caller over its call rate or its concurrent calls
(peer/security/admission.py), or a request over its method's size (peer/security/limits.py),
gets RESOURCE_EXHAUSTED; a request that has not arrived within the receive deadline is
cancelled. Every refusal is counted and logged (at most one line per caller and reason every
10 s; oversized requests: one per method every 10 s).

The credentials cover the call, not each message's bytes: with plain TCP an on-path attacker
could splice a member's open stream. `[security] tls` closes that.

This module holds both ends: what a client presents (`Credentials`, `open_channel`) and the
server's `Gate`; the rules that verify one call's headers are peer/security/call_check.py.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from peer.security.admission import Admission, RateLimit, host_of, refusal  # noqa: F401  (RateLimit: auth.RateLimit for callers)
from peer.security.call_check import (
    H_CERT,
    H_KEY,
    H_MAC,
    H_NONCE,
    H_OP,
    H_PEER,
    H_SIG,
    H_TS,
    H_WIRE,
    MAX_SKEW_S,
    MEMBER,
    OPEN,
    OPERATOR,
    TOKEN,
    Caller,
    Refused,
    call_bytes,
    check_call,
    mac,
)
from peer.security.identity import Identity
from peer.security.limits import METHOD_LIMITS, bound
from peer.wire.version import wire_version

log = logging.getLogger("anchormesh.auth")


def tls_hint(details: str | None, tls: bool) -> str:
    """What to try when a connection fails the way a TLS mismatch does (gRPC says only
    "Socket closed" to a plain client of a TLS server, "handshake failed" the other way)."""
    d = (details or "").lower()
    if not tls and "socket closed" in d:
        return " (if the run uses TLS, as every run off loopback does, pass --tls-ca with the bootstrap.json or its CA, or --tracker HOST:PORT#KEY, the address line)"
    if tls and "handshake" in d:
        return " (a TLS handshake failed: the server may not use TLS, drop --tls-ca, or uses another run's CA)"
    return ""


def new_secret() -> str:
    """256 random bits as hex: no leading "-" (token_urlsafe may start with one, and then
    `--token VALUE` reads it as a flag: found by a test), nothing to quote in a shell."""
    return secrets.token_hex(32)


@dataclass
class Credentials:
    """What a client presents; mutable, so a peer's channels pick up its certificate after Join."""

    token: str | None = None
    identity: Identity | None = None
    certificate: bytes = b""
    operator: str | None = None

    def metadata(self, method: str) -> list[tuple[str, str | bytes]]:
        ts, nonce = f"{time.time():.3f}", secrets.token_hex(12)
        ident = self.identity
        peer, key = (ident.peer_id, ident.public) if ident else ("", b"")
        data = call_bytes(method, peer, ts, nonce, key)
        md: list[tuple[str, str | bytes]] = [(H_TS, ts), (H_NONCE, nonce), (H_WIRE, wire_version())]
        if ident is not None:
            md += [(H_PEER, peer), (H_KEY, key)]
            if self.certificate:
                md += [(H_CERT, self.certificate), (H_SIG, ident.sign(data))]
        if self.token:
            md.append((H_MAC, mac(self.token, data)))
        if self.operator:
            md.append((H_OP, mac(self.operator, data)))
        return md


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _AddCredentials(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, creds: Credentials) -> None:
        self.creds = creds

    def _with(self, d: grpc.ClientCallDetails) -> _Details:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        md = [*(d.metadata or ()), *self.creds.metadata(method)]
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._with(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._with(d), request)

    def intercept_stream_unary(self, continuation, d, requests):
        return continuation(self._with(d), requests)

    def intercept_stream_stream(self, continuation, d, requests):
        return continuation(self._with(d), requests)


def open_channel(
    target: str,
    creds: Credentials | None,
    options: list | None = None,
    tls_ca: bytes | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """A channel whose every call carries `creds` (TLS-verified against the run's CA when given,
    and the server's certificate must carry `server_name`: default, a member's name)."""
    options = list(options or [])
    if tls_ca:
        from peer.security.tls import PEER_NAME

        channel = grpc.secure_channel(
            target,
            grpc.ssl_channel_credentials(root_certificates=tls_ca),
            options=[*options, ("grpc.ssl_target_name_override", server_name or PEER_NAME)],
        )
    else:
        channel = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(channel, _AddCredentials(creds)) if creds is not None else channel


def tracker_channel(
    target: str, creds: Credentials | None, options: list | None = None, tls_ca: bytes | None = None
) -> grpc.Channel:
    """`open_channel` to the tracker: with TLS its certificate must carry the tracker's name, which
    no member's certificate does (peer/security/tls.py), so a member cannot pose as the tracker."""
    from peer.security.tls import TRACKER_NAME

    return open_channel(target, creds, options, tls_ca, server_name=TRACKER_NAME)


@dataclass
class Gate(grpc.ServerInterceptor):
    """Checks every call against `policy` (method -> roles it takes; unlisted methods: member).

    `tracker_key` verifies member certificates; `token`/`operator` verify HMACs; `banned` maps key
    fingerprints to the reason. A peer's gate learns these after it joins (`configure`); until
    then it takes open methods only. `calls_per_s` bounds each caller's new calls (a burst of 10 s
    worth is allowed): streams are long-lived, so a normal peer opens few. Open methods (Ping,
    a public status) have no verified caller unless the call carries valid credentials:
    `open_calls_per_s` bounds them per network host (2,000 anonymous Pings once cost 2,000
    handler calls; a dashboard polls every 2 s). `admission` caps concurrent calls and sets the
    receive deadline, before any request is read (peer/security/admission.py). `limits` bounds
    each method's request bytes before it is parsed (None or unlisted: the server's limit)."""

    policy: dict[str, frozenset[str]]
    token: str | None = None
    operator: str | None = None
    tracker_key: bytes = b""
    run_id: str = ""
    calls_per_s: float = 20.0
    open_calls_per_s: float = 20.0
    admission: Admission | None = None
    banned: dict[str, str] = field(default_factory=dict)
    limits: dict[str, int | None] = field(default_factory=lambda: dict(METHOD_LIMITS))
    refused: collections.Counter = field(default_factory=collections.Counter)
    clock: Callable[[], float] = time.time
    _nonces: dict[str, float] = field(default_factory=dict)
    _logged: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._calls = RateLimit(self.calls_per_s)
        if self.admission is None:
            self.admission = Admission(open_calls_per_s=self.open_calls_per_s)

    def configure(self, run_id: str, tracker_key: bytes, token: str | None, calls_per_s: float | None = None) -> None:
        self.run_id, self.tracker_key, self.token = run_id, tracker_key, token
        if calls_per_s:
            self.calls_per_s = calls_per_s
            self._calls = RateLimit(calls_per_s)

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        """Runs when a call's headers arrive, before its request is read (peer/security/admission.py):
        checks the credentials, then hands out a handler that takes its place before it reads."""
        handler = continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        roles = self.policy.get(method, frozenset({MEMBER}))
        md = {k: v for k, v in (details.invocation_metadata or ())}
        caller = None
        try:
            if OPEN not in roles or any(h in md for h in (H_CERT, H_MAC, H_OP)):
                caller = self.check(method, md, roles | {TOKEN, MEMBER, OPERATOR} if OPEN in roles else roles)
                self._rate(caller)
        except Refused as r:
            if OPEN not in roles:
                self._refuse(method, md, r)
                return refusal(handler, r.code, r.text)
            caller = None  # an open method: bad credentials make the call anonymous, not refused
        who = caller.name if caller is not None else None

        def refuse(name: str, code: grpc.StatusCode, text: str) -> None:
            self._refuse(method, {H_PEER: name}, Refused(code, text))

        return self.admission.admit(
            self._bounded(handler, method, who), method, who, caller.role if caller else OPEN, refuse
        )

    def _bounded(self, handler: grpc.RpcMethodHandler, method: str, who: str | None) -> grpc.RpcMethodHandler:
        """`handler` with its requests bounded by `limits[method]`; refusals name `who` (the verified
        caller), else the caller's host (an open method's caller is whoever it claims to be)."""
        limit = self.limits.get(method)
        if limit is None:
            return handler

        def refuse(context: grpc.ServicerContext, text: str) -> None:
            self._refuse(
                method,
                {H_PEER: who or _host(context.peer())},
                Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, text),
                log_as="oversized",
            )

        return bound(handler, method, limit, refuse)

    # -- the checks -------------------------------------------------------------------------
    def check(self, method: str, md: dict, roles: frozenset[str]) -> Caller:
        """The verified caller of `method`, or Refused (code + text): peer/security/call_check.py
        says the rules; a nonce seen before is refused here."""
        caller = check_call(
            method,
            md,
            roles,
            token=self.token,
            operator=self.operator,
            tracker_key=self.tracker_key,
            run_id=self.run_id,
            banned=self.banned,
            now=self.clock(),
        )
        self._fresh(str(md.get(H_NONCE, "")))
        return caller

    def _fresh(self, nonce: str) -> None:
        """Refuse a replayed call (its nonce seen within the time window)."""
        now = self.clock()
        with self._lock:
            if nonce in self._nonces:
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, "replayed call (its nonce was used before)")
            self._nonces[nonce] = now
            if len(self._nonces) > 4096:  # forget nonces older than the window (their times are refused anyway)
                self._nonces = {n: t for n, t in self._nonces.items() if now - t <= 2 * MAX_SKEW_S}

    def _rate(self, caller: Caller) -> None:
        # members by their certified id; token and operator callers name themselves, so they
        # share one bucket per role (a token holder cannot dodge the limit by making up names)
        if not self._calls.take(caller.peer_id if caller.role == MEMBER else caller.role):
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{caller.name} opens calls faster than {self.calls_per_s:g}/s; slow down",
            )

    def _refuse(self, method: str, md: dict, r: Refused, log_as: str | None = None) -> None:
        """Count a refusal and log it at most every 10 s per (caller, text), or per (method,
        `log_as`) for texts that vary call by call (a request's size)."""
        who = str(md.get(H_PEER, "")) or "an anonymous caller"
        key = (who, r.text) if log_as is None else (method, log_as)
        now = time.monotonic()
        with self._lock:
            self.refused[r.code.name] += 1
            last = self._logged.get(key)
            if last is None or now - last > 10.0:
                self._logged[key] = now
                if len(self._logged) > 1024:
                    self._logged.clear()
                log.warning("refused %s from %s: %s %s", method, who, r.code.name, r.text)


_host = host_of  # the name the tests and older callers use


def caller(context: grpc.ServicerContext) -> tuple[str, bytes]:
    """(peer id, public key) of a call the gate let through (empty for open methods)."""
    md = {k: v for k, v in (context.invocation_metadata() or ())}
    key = md.get(H_KEY, b"")
    return str(md.get(H_PEER, "")), key if isinstance(key, bytes) else b""


def read_token(value: str | None) -> str | None:
    """--token's value: the token, or `@FILE` (a bootstrap.json, or a file holding the token)."""
    from peer.errors import ConfigError
    from peer.security.flagfile import json_object, read_text

    if not value or not value.startswith("@"):
        return value or None
    text = read_text(value[1:], "--token", value).strip()
    if text.startswith("{"):
        token = json_object(text, "--token", value).get("token")
        if not token or not isinstance(token, str):
            raise ConfigError("--token", value, 'that JSON has no "token" (is it a bootstrap.json of this version?)')
        return token
    if not text:
        raise ConfigError("--token", value, "the file is empty: it must hold the token or be a bootstrap.json")
    return text
