"""The run's hivemind DHT belongs to the run: only run-token holders take part, and only the
bootstrap can publish where the tracker is.

Two mechanisms, each for its own threat:

- **`RunAuthorizer`** (our implementation of hivemind's `AuthorizerBase`): every DHT request and
  response carries an access token `(username, the node's Ed25519 public key, expiry)` with an
  HMAC-SHA256 under `dht_key(token)`, a key derived from the run token, and is signed with the
  Ed25519 key that the access token names. A request also carries its time and a nonce: the
  receiver refuses times more than `REQUEST_WINDOW_S` off its clock and nonces it has already
  taken (a bounded memory); a response carries its request's nonce. An outsider without the run
  token cannot produce the HMAC, so every honest node refuses its pings, stores and finds, and
  ignores its responses. The run token itself never crosses the wire; a copied access token is
  useless without the private key it names. Why not hivemind's `TokenAuthorizerBase`: it signs
  every request and response with RSA-2048, one of the main CPU costs of the DHT process (issue
  17); with Ed25519 an RPC's two signatures and two checks take about half the CPU
  (`python -m peer.bench.dht_auth_cost`). All nodes of a run must run this version: an older
  node's RSA-keyed access token is refused.
- **Signed tracker records** (peer/security/tracker_record.py): only the bootstrap can publish
  where the tracker is; every node checks the records it stores or receives.

`dht_kwargs` gives every `hivemind.DHT` of the run both.

Not covered: hivemind's averager RPCs (matchmaking, all-reduce, state download) have no
authorizer hook in hivemind 1.1; they are reached by libp2p peer id (see docs/operator.md).
"""

from __future__ import annotations

import datetime
import hashlib
import heapq
import hmac
import logging
import secrets
import time
from collections.abc import Callable

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase

from peer.security.identity import KEY_BYTES, Identity, verify
from peer.security.tracker_record import TrackerRecordValidator

log = logging.getLogger("anchormesh.dht")

USERNAME = "anchormesh-dht"
ACCESS_TTL_S = 3600.0  # an access token lives an hour, renewed when a quarter is left
MAX_SKEW_S = 300.0  # as peer/security/auth.py: volunteers' clocks may differ this much
REQUEST_WINDOW_S = 60.0  # a request's time may be this far off the receiver's clock (as hivemind's)
NONCE_BYTES = 16
MAX_NONCES = 100_000  # about 28 MB at most; a busy DHT node takes a few thousand requests a minute
_REQUEST_DOMAIN = b"anchormesh-dht-request-v2\0"
_RESPONSE_DOMAIN = b"anchormesh-dht-response-v2\0"


def dht_key(token: str) -> bytes:
    """The DHT's HMAC key: derived from the run token, so the token never goes on the wire."""
    return hmac.new(token.encode(), b"anchormesh-dht-access-v1", hashlib.sha256).digest()


def _token_bytes(t: AccessToken) -> bytes:
    return b"\0".join((b"anchormesh-dht-token", t.username.encode(), t.public_key, t.expiration_time.encode()))


def _expiry(t: AccessToken) -> float | None:
    try:
        return datetime.datetime.fromisoformat(t.expiration_time).timestamp()
    except ValueError:
        return None


class _RecentNonces:
    """The (signer, nonce) pairs of the requests taken whose time is still within the window, so a
    replay is refused. Bounded: past `limit` the oldest is forgotten and, so that it cannot be
    replayed, no request sent at or before its time is taken any more (only under a flood)."""

    def __init__(self, limit: int) -> None:
        self._limit, self._seen, self._heap = (
            limit,
            set[tuple[bytes, bytes]](),
            list[tuple[float, tuple[bytes, bytes]]](),
        )
        self.floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, key: tuple[bytes, bytes], sent: float, now: float) -> str | None:
        """Remember `key` (None), or why the request is refused."""
        while self._heap and self._heap[0][0] + REQUEST_WINDOW_S < now:  # its replays fail the time check now
            self._seen.discard(heapq.heappop(self._heap)[1])
        if key in self._seen:
            return "replayed (its nonce was already taken)"
        heapq.heappush(self._heap, (sent, key))
        self._seen.add(key)
        if len(self._seen) > self._limit:
            oldest, forgotten = heapq.heappop(self._heap)
            self._seen.discard(forgotten)
            self.floor = max(self.floor, oldest)
        if sent <= self.floor:
            return "sent before the oldest nonce this node still remembers (too many requests in the window)"
        return None


class RunAuthorizer(AuthorizerBase):
    """Admits to the DHT the nodes whose access token carries a valid HMAC under `dht_key(token)`
    and who sign their requests and responses with the Ed25519 key their token names.

    `identity`: the key this node signs with (None: a fresh one; the DHT needs no stable key).
    `clock` is for tests; it is the time of tokens, requests and the nonce memory."""

    def __init__(
        self,
        token: str,
        identity: Identity | None = None,
        clock: Callable[[], float] = time.time,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self._key, self._clock = dht_key(token), clock
        self._identity = identity if identity is not None else Identity.generate()
        self._access: AccessToken | None = None
        self._nonces = _RecentNonces(max_nonces)

    @property
    def public_key(self) -> bytes:
        """The Ed25519 key this node signs with (the one its access tokens name)."""
        return self._identity.public

    def mint(self, expires: float) -> AccessToken:
        """An access token for this node's key, valid until `expires` (epoch seconds)."""
        t = AccessToken(
            username=USERNAME,
            public_key=self.public_key,
            expiration_time=datetime.datetime.fromtimestamp(expires, datetime.timezone.utc).isoformat(),
        )
        t.signature = hmac.new(self._key, _token_bytes(t), hashlib.sha256).digest()
        return t

    async def get_token(self) -> AccessToken:
        return self.mint(self._clock() + ACCESS_TTL_S)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.token_problem(access_token) is None

    def token_problem(self, t: AccessToken) -> str | None:
        """Why `t` does not admit its holder (None: it does)."""
        if t.username != USERNAME:
            return f"username {t.username[:40]!r} is not {USERNAME!r}"
        expires, now = _expiry(t), self._clock()
        if expires is None:
            return f"expiration_time {t.expiration_time[:40]!r} is not an ISO time"
        if expires < now:
            return "expired"
        if expires > now + ACCESS_TTL_S + MAX_SKEW_S:
            return "expires too far ahead"
        if not hmac.compare_digest(t.signature, hmac.new(self._key, _token_bytes(t), hashlib.sha256).digest()):
            return "not signed with this run's token (another run, or forged)"
        if len(t.public_key) != KEY_BYTES:
            return "names no Ed25519 key (a node of an older version, which signed with RSA?)"
        return None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        return expires is None or expires - self._clock() < ACCESS_TTL_S / 4

    def _access_token(self) -> AccessToken:
        """This node's access token, minted anew when a quarter of its life is left."""
        if self._access is None or self.does_token_need_refreshing(self._access):
            self._access = self.mint(self._clock() + ACCESS_TTL_S)
        return self._access

    # -- hivemind's AuthorizerBase: called by AuthRPCWrapper around every DHT RPC ------------------
    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: bytes | None) -> None:
        """Fill `request.auth` and sign the request; `service_public_key` (hivemind's DHT passes
        None) pins the servicer the request is meant for."""
        auth = request.auth
        auth.client_access_token.CopyFrom(self._access_token())
        if service_public_key is not None:
            auth.service_public_key = service_public_key
        auth.time, auth.nonce = self._clock(), secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._identity.sign(_signed_bytes(_REQUEST_DOMAIN, request))

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        problem = self.request_problem(request)
        if problem is not None:
            log.debug("refused a DHT request: %s", problem)
        return problem is None

    def _signer_problem(
        self, token: AccessToken, domain: bytes, message: AuthorizedRequestBase | AuthorizedResponseBase
    ) -> str | None:
        """Why `message` is not signed by a run member: its access token, then its signature by
        the key that token names."""
        problem = self.token_problem(token)
        if problem is not None:
            return f"access token: {problem}"
        if not verify(token.public_key, message.auth.signature, _signed_bytes(domain, message)):
            return "bad signature (not by the key its access token names, or altered)"
        return None

    def request_problem(self, request: AuthorizedRequestBase) -> str | None:
        """Why `request` is refused (None: taken, and its nonce remembered)."""
        auth = request.auth
        problem = self._signer_problem(auth.client_access_token, _REQUEST_DOMAIN, request)
        if problem is not None:
            return problem
        if auth.service_public_key and auth.service_public_key != self.public_key:
            return "meant for another node"
        now = self._clock()
        if not abs(auth.time - now) <= REQUEST_WINDOW_S:  # (so that a NaN time fails too)
            return f"sent {now - auth.time:.0f}s ago by this node's clock (at most {REQUEST_WINDOW_S:.0f}s either way)"
        if not NONCE_BYTES // 2 <= len(auth.nonce) <= 64:
            return f"a nonce of {len(auth.nonce)} bytes"
        return self._nonces.admit((auth.client_access_token.public_key, auth.nonce), auth.time, now)

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        """Sign `response` for `request`: its nonce ties the response to the request."""
        auth = response.auth
        auth.service_access_token.CopyFrom(self._access_token())
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._identity.sign(_signed_bytes(_RESPONSE_DOMAIN, response))

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        problem = self.response_problem(response, request)
        if problem is not None:
            log.debug("ignored a DHT response: %s", problem)
        return problem is None

    def response_problem(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> str | None:
        """Why `response` to `request` is ignored (None: taken)."""
        auth = response.auth
        problem = self._signer_problem(auth.service_access_token, _RESPONSE_DOMAIN, response)
        if problem is not None:
            return problem
        if not request.auth.nonce or not hmac.compare_digest(auth.nonce, request.auth.nonce):
            return "answers another request (nonce)"
        return None


def _signed_bytes(domain: bytes, message: AuthorizedRequestBase | AuthorizedResponseBase) -> bytes:
    """What a request or response is signed over: the message with `auth.signature` empty, after a
    domain tag, so a signed request can never pass for a response or another protocol's message."""
    auth = message.auth
    signature, auth.signature = auth.signature, b""
    try:
        return domain + message.SerializeToString(deterministic=True)
    finally:
        auth.signature = signature


def dht_kwargs(token: str, tracker_key: bytes | None = None, identity: Identity | None = None) -> dict:
    """What every `hivemind.DHT(...)` of the run takes: the authorizer (signing with `identity`,
    else a fresh key) and the record validator."""
    return {"authorizer": RunAuthorizer(token, identity), "record_validators": [TrackerRecordValidator(tracker_key)]}
