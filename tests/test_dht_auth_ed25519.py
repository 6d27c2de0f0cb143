"""The run's DHT authorizer signs with Ed25519 (peer/security/dht_auth.py `RunAuthorizer`).

Why these tests: the scheme replaced hivemind's RSA one (its CPU cost), so every
protection that one gave is checked here on its own: a member's request is taken by another
member; a tampered request, a replayed nonce, another run's token, a token naming another key
than the signer's and an old or future time are refused; a response is tied to its request's
nonce and to its body. Last, two real hivemind DHT nodes of the run store and find a value that
an outsider with another run's token cannot get.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac

import hivemind
import pytest
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peer.security import dht_auth
from peer.security.identity import KEY_BYTES, SIG_BYTES, Identity

TOKEN = "run-token-0123456789abcdef"
OTHER = "another-runs-token-0123456789"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
T0 = 1_700_000_000.0


class Clock:
    """A settable clock shared by the authorizers of one test."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def node(
    token: str = TOKEN, clock: Clock | None = None, identity: Identity | None = None, **kw
) -> dht_auth.RunAuthorizer:
    return dht_auth.RunAuthorizer(token, identity, clock=clock or Clock(), **kw)


def store_request() -> dht_pb2.StoreRequest:
    """A typical store: two keys with their values and expiries, and the sender's node id."""
    return dht_pb2.StoreRequest(
        keys=[bytes(range(20)), bytes(20)],
        subkeys=[b"\xc0", b"\xc0"],
        values=[b"stage weights live here", b"\x01"],
        expiration_time=[T0 + 60, T0 + 60],
        in_cache=[False, False],
        peer=dht_pb2.NodeInfo(node_id=b"\x07" * 20),
    )


def signed(sender: dht_auth.RunAuthorizer, request=None, service: bytes | None = None):
    request = request if request is not None else store_request()
    asyncio.run(sender.sign_request(request, service))
    return request


def copy(message):
    twin = type(message)()
    twin.ParseFromString(message.SerializeToString())  # as the receiver gets it off the wire
    return twin


def answered(servicer: dht_auth.RunAuthorizer, request) -> dht_pb2.StoreResponse:
    response = dht_pb2.StoreResponse(store_ok=[True, False], peer=dht_pb2.NodeInfo(node_id=b"\x09" * 20))
    asyncio.run(servicer.sign_response(response, request))
    return copy(response)


# -- requests ---------------------------------------------------------------------------------------
def test_a_members_request_is_taken_by_another_member_and_is_ed25519_signed() -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock)
    req = signed(alice)
    auth = req.auth
    assert auth.client_access_token.public_key == alice.public_key and len(alice.public_key) == KEY_BYTES
    assert len(auth.signature) == SIG_BYTES and TOKEN.encode() not in req.SerializeToString()
    assert bob.request_problem(copy(req)) is None
    assert asyncio.run(bob.validate_request(copy(signed(alice))))  # hivemind's entry point
    assert asyncio.run(alice.validate_request(copy(signed(bob))))  # and the other way round


@pytest.mark.parametrize(
    "tamper",
    [
        lambda r: r.values.__setitem__(0, b"attacker's weights"),
        lambda r: r.keys.append(bytes(20)),
        lambda r: setattr(r.peer, "node_id", b"\x06" * 20),
        lambda r: setattr(r.auth, "time", r.auth.time + 1),
        lambda r: setattr(r.auth, "nonce", bytes(16)),
        lambda r: setattr(r.auth, "service_public_key", b"\x01" * KEY_BYTES),
        lambda r: setattr(r.auth, "signature", bytes(SIG_BYTES)),
        lambda r: setattr(r.auth, "signature", b""),
    ],
    ids=["value", "added-key", "node-id", "time", "nonce", "service-key", "zero-signature", "no-signature"],
)
def test_a_tampered_request_is_refused(tamper) -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock)
    req = copy(signed(alice))
    tamper(req)
    problem = bob.request_problem(req)
    assert problem is not None and "signature" in problem


def test_a_replayed_request_is_refused_even_after_a_while() -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock)
    req = signed(alice)
    assert bob.request_problem(copy(req)) is None
    assert "replayed" in bob.request_problem(copy(req))
    clock.now += dht_auth.REQUEST_WINDOW_S  # still in the window: still remembered
    assert "replayed" in bob.request_problem(copy(req))
    clock.now += 1  # out of the window: refused by the time check, and forgotten by the nonce memory
    assert "sent" in bob.request_problem(copy(req))
    assert bob.request_problem(copy(signed(alice))) is None and len(bob._nonces) == 1


def test_a_request_with_another_runs_token_is_refused() -> None:
    clock = Clock()
    outsider, bob = node(OTHER, clock), node(clock=clock)
    assert "another run" in bob.request_problem(copy(signed(outsider)))
    assert not asyncio.run(bob.validate_request(copy(signed(outsider))))


def test_a_token_naming_another_key_than_the_signers_is_refused() -> None:
    clock = Clock()
    alice, mallory, bob = node(clock=clock), node(clock=clock), node(clock=clock)
    stolen = signed(alice).auth.client_access_token  # seen on the wire
    req = store_request()
    asyncio.run(mallory.sign_request(req, None))
    req.auth.client_access_token.CopyFrom(stolen)  # alice's token, mallory's signature
    assert "signature" in bob.request_problem(copy(req))
    req.auth.signature = b""  # re-signed by mallory over alice's token: still not alice's key
    req.auth.signature = mallory._identity.sign(dht_auth._signed_bytes(dht_auth._REQUEST_DOMAIN, req))
    assert "signature" in bob.request_problem(copy(req))
    rekeyed = copy(signed(mallory))
    rekeyed.auth.client_access_token.public_key = alice.public_key  # the HMAC covers the key
    assert "forged" in bob.request_problem(rekeyed)


@pytest.mark.parametrize("offset", [-65.0, 65.0, float("nan")], ids=["old", "future", "nan"])
def test_a_request_whose_time_is_off_is_refused(offset: float) -> None:
    sender_clock, receiver_clock = Clock(), Clock()
    alice, bob = node(clock=sender_clock), node(clock=receiver_clock)
    req = signed(alice)
    req.auth.time = T0 + offset  # as alice's clock would have it (her access token is still valid)
    req.auth.signature = alice._identity.sign(dht_auth._signed_bytes(dht_auth._REQUEST_DOMAIN, req))
    assert "sent" in bob.request_problem(copy(req))
    sender_clock.now = T0 + 30  # within the window (a minute either way): taken
    assert bob.request_problem(copy(signed(alice))) is None


def test_the_service_key_pins_the_servicer() -> None:
    clock = Clock()
    alice, bob, carol = node(clock=clock), node(clock=clock), node(clock=clock)
    for_bob = signed(alice, service=bob.public_key)
    assert "another node" in carol.request_problem(copy(for_bob))
    assert bob.request_problem(copy(for_bob)) is None


def test_an_older_nodes_rsa_keyed_token_is_refused_with_a_reason() -> None:
    bob = node()
    t = AccessToken(
        username=dht_auth.USERNAME,
        public_key=RSAPrivateKey().get_public_key().to_bytes(),
        expiration_time=datetime.datetime.fromtimestamp(T0 + 600, datetime.timezone.utc).isoformat(),
    )
    t.signature = hmac.new(dht_auth.dht_key(TOKEN), dht_auth._token_bytes(t), hashlib.sha256).digest()
    assert "Ed25519" in bob.token_problem(t)


def test_the_nonce_memory_is_bounded_and_a_forgotten_nonce_cannot_be_replayed() -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock, max_nonces=3)
    first = signed(alice)
    clock.now += 1
    later = [signed(alice) for _ in range(3)]
    assert all(bob.request_problem(copy(r)) is None for r in [first, *later])
    assert len(bob._nonces) == 3  # the oldest (first) was forgotten...
    assert bob.request_problem(copy(first)) is not None  # ...and still cannot be replayed
    clock.now += 1
    assert bob.request_problem(copy(signed(alice))) is None  # newer requests are still taken
    assert len(bob._nonces) == 3


def test_alice_renews_her_access_token_before_it_expires() -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock)
    first = signed(alice).auth.client_access_token.expiration_time
    clock.now += dht_auth.ACCESS_TTL_S * 0.9
    req = signed(alice)
    assert req.auth.client_access_token.expiration_time != first and bob.request_problem(copy(req)) is None


# -- responses --------------------------------------------------------------------------------------
def test_a_response_is_tied_to_its_requests_nonce_and_body() -> None:
    clock = Clock()
    alice, bob = node(clock=clock), node(clock=clock)
    req = signed(alice)
    assert bob.request_problem(copy(req)) is None
    resp = answered(bob, copy(req))
    assert alice.response_problem(copy(resp), req) is None and asyncio.run(alice.validate_response(copy(resp), req))

    other = signed(alice)  # a response to this request is not one to `req`
    assert "nonce" in alice.response_problem(copy(resp), other)
    wrong = copy(resp)
    wrong.auth.nonce = other.auth.nonce  # re-pointed at another request: the signature breaks
    assert "signature" in alice.response_problem(wrong, other)

    tampered = copy(resp)
    tampered.store_ok[1] = True
    assert "signature" in alice.response_problem(tampered, req)
    assert not asyncio.run(alice.validate_response(tampered, req))
    mallory = node(clock=clock)  # a member's key with bob's token
    forged = answered(mallory, copy(req))
    forged.auth.service_access_token.CopyFrom(resp.auth.service_access_token)
    assert "signature" in alice.response_problem(forged, req)


def test_a_response_from_another_run_or_a_signed_request_posing_as_a_response_is_ignored() -> None:
    clock = Clock()
    alice, outsider = node(clock=clock), node(OTHER, clock)
    req = signed(alice)
    assert "another run" in alice.response_problem(answered(outsider, copy(req)), req)
    # PingRequest{auth{token, service_public_key=N}, peer} has the very bytes of PingResponse{auth{token,
    # nonce=N}, peer}: a signature over the one would pass for the other but for the domain tag
    nonce = bytes(range(16))
    as_request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"\x05" * 20))
    as_request.auth.client_access_token.CopyFrom(req.auth.client_access_token)
    as_request.auth.service_public_key = nonce
    posing = dht_pb2.PingResponse.FromString(as_request.SerializeToString())
    assert posing.auth.nonce == nonce and posing.peer.node_id == b"\x05" * 20
    posing.auth.signature = alice._identity.sign(dht_auth._signed_bytes(dht_auth._REQUEST_DOMAIN, as_request))
    ping = dht_pb2.PingRequest()
    ping.auth.nonce = nonce
    assert "signature" in alice.response_problem(posing, ping)
    posing.auth.signature = alice._identity.sign(dht_auth._signed_bytes(dht_auth._RESPONSE_DOMAIN, posing))
    assert alice.response_problem(posing, ping) is None  # (the same bytes, signed as a response)


# -- two real hivemind DHT nodes ------------------------------------------------------------------------
@pytest.mark.processes
def test_two_dht_nodes_of_the_run_share_a_value_an_outsider_cannot_get() -> None:
    started: list[hivemind.DHT] = []

    def dht(token: str, initial: list[str] | None = None, **kw) -> hivemind.DHT:
        run_kwargs = dht_auth.dht_kwargs(token)
        assert len(run_kwargs["authorizer"].public_key) == KEY_BYTES  # the Ed25519 scheme
        started.append(hivemind.DHT(initial_peers=initial, host_maddrs=LOOPBACK, start=True, **run_kwargs, **kw))
        return started[-1]

    try:
        first = dht(TOKEN)
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        second = dht(TOKEN, maddrs)
        assert second.store("run/secret", "stage weights live here", get_dht_time() + 60)
        assert first.get("run/secret", latest=True).value == "stage weights live here"
        assert first.store("run/from-first", 7, get_dht_time() + 60)
        assert second.get("run/from-first", latest=True).value == 7
        with pytest.raises(RuntimeError, match="bootstrap failed"):  # both nodes refuse its pings
            dht(OTHER, maddrs)
        outsider = dht(OTHER, maddrs, ensure_bootstrap_success=False)
        assert outsider.get("run/secret", latest=True) is None
        outsider.store("run/planted", "junk", get_dht_time() + 60)
        assert first.get("run/planted", latest=True) is None and second.get("run/planted", latest=True) is None
    finally:
        for d in reversed(started):
            if d.is_alive():
                d.shutdown()
