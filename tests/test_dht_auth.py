"""The run's hivemind DHT is the run's (peer/security/dht_auth.py), on real DHT nodes over loopback.

An outsider without the run token is refused by every node (its store does not land, its finds
get nothing); a token holder that is not the bootstrap cannot plant a tracker record that a
peer holding the tracker key takes (the bootstrap's node refuses it, `find_tracker` skips it);
a plain or far-expiring value never lands; a peer with the token joins and finds the tracker.
Unit tests check the access tokens (expired, another run's, forged) and the TLS names that
tell the tracker from members.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from peer.daemon.discovery import find_tracker
from peer.errors import ConfigError
from peer.security import auth, dht_auth, flagfile, tracker_record
from peer.security.identity import Identity
from peer.security.tls import PEER_NAME, TRACKER_NAME, RunCA, key_pem, member_names, new_key, public_der

TOKEN = "run-token-0123456789abcdef"
RUN, ADDRESS = "run-1a2b3c4d", "127.0.0.1:7000"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def dht(token: str | None, initial: list[str] | None = None, tracker_key: bytes | None = None, **kw) -> hivemind.DHT:
    extra = dht_auth.dht_kwargs(token, tracker_key) if token else {}
    return hivemind.DHT(initial_peers=initial, host_maddrs=LOOPBACK, start=True, **extra, **kw)


def maddrs(node: hivemind.DHT) -> list[str]:
    return [str(m) for m in node.get_visible_maddrs()]


async def _local_subkeys(_dht, node) -> list[str]:
    """The tracker-key subkeys this node holds in its own storage (not what it can find)."""
    found = node.protocol.storage.get(DHTID.from_bytes(tracker_record.TRACKER_KEY_ID))
    return sorted(str(k) for k, _ in found.value.items()) if found is not None and hasattr(found.value, "items") else []


def local_subkeys(node: hivemind.DHT) -> list[str]:
    return node.run_coroutine(_local_subkeys)


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[hivemind.DHT, Identity]]:
    """The bootstrap's DHT node (pinned to its own key) and the record it publishes."""
    tracker = Identity.generate()
    boot = dht(TOKEN, tracker_key=tracker.public)
    try:
        assert tracker_record.publish_tracker(boot, tracker, RUN, ADDRESS, 60.0)
        assert boot.store("run/secret", "stage weights live here", get_dht_time() + 60)
        yield boot, tracker
    finally:
        boot.shutdown()


def within(seconds: float) -> threading.Event:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return stop


# -- (a) outsiders are refused ---------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize(
    "outsider_token", ["another-runs-token-0123456789", None], ids=["wrong-token", "no-authorizer"]
)
def test_an_outsider_cannot_join_store_or_read(run, outsider_token) -> None:
    boot, _ = run
    with pytest.raises(RuntimeError, match="bootstrap failed"):  # every run node refuses its pings
        dht(outsider_token, maddrs(boot))
    out = dht(outsider_token, maddrs(boot), ensure_bootstrap_success=False)
    try:
        out.store("run/planted", "junk", get_dht_time() + 60)  # lands on its own node only
        forged = Identity.generate()
        tracker_record.publish_tracker(out, forged, RUN, "10.6.6.6:7000", 60.0)
        assert out.get("run/secret", latest=True) is None  # finds get nothing
        assert boot.get("run/planted", latest=True) is None  # its store never reached the run
        assert local_subkeys(boot) == [run[1].public.hex()]
    finally:
        out.shutdown()


# -- (b) a token holder that is not the bootstrap cannot pose as the tracker -----------------------------
@pytest.mark.processes
def test_a_forged_tracker_record_is_refused_and_find_tracker_takes_the_bootstraps(run) -> None:
    boot, tracker = run
    pinned = dht(TOKEN, maddrs(boot), tracker_key=tracker.public)  # a peer given bootstrap.json
    forger = dht(TOKEN, maddrs(boot))  # a member with the token, posing as the tracker
    try:
        mallory = Identity.generate()
        far = get_dht_time() + 10 * 24 * 3600
        _, record = tracker_record.sign_record(mallory, RUN, "10.6.6.6:7000", far)
        assert not forger.store(
            tracker_record.TRACKER_RECORD_KEY, record, far, subkey=mallory.public.hex()
        )  # far expiry: no node takes it
        assert not forger.store(
            tracker_record.TRACKER_RECORD_KEY, {"run_id": RUN, "tracker": "10.6.6.6:7000"}, get_dht_time() + 60
        )  # unsigned: none
        _, stolen = tracker_record.sign_record(
            tracker, RUN, ADDRESS, get_dht_time() + 60
        )  # the tracker's key, another record
        stolen["tracker"] = "10.6.6.6:7000"
        assert not forger.store(
            tracker_record.TRACKER_RECORD_KEY, stolen, get_dht_time() + 60, subkey=tracker.public.hex()
        )
        # well-formed but signed by the member's own key: nodes that know the tracker key refuse it
        tracker_record.publish_tracker(forger, mallory, RUN, "10.6.6.6:7000", 120.0)
        assert local_subkeys(boot) == [tracker.public.hex()] and mallory.public.hex() not in local_subkeys(pinned)
        assert find_tracker(pinned, within(20), tracker.public, RUN) == ADDRESS
        # a node that does not know the key sees two signers and takes neither
        with pytest.raises(SystemExit):
            find_tracker(forger, within(2.0))
    finally:
        forger.shutdown()
        pinned.shutdown()


# -- (c) a peer with the token joins and finds the tracker ----------------------------------------------
@pytest.mark.processes
def test_a_peer_with_the_token_joins_and_finds_the_tracker(run) -> None:
    boot, tracker = run
    peer = dht(TOKEN, maddrs(boot), tracker_key=tracker.public)
    bare = dht(TOKEN, maddrs(boot))  # --token only (no key): one signer, taken with a warning
    try:
        assert find_tracker(peer, within(20), tracker.public) == ADDRESS
        assert find_tracker(bare, within(20)) == ADDRESS
        assert peer.get("run/secret", latest=True).value == "stage weights live here"
        assert bare.store("run/from-peer", 1, get_dht_time() + 60) and boot.get("run/from-peer", latest=True).value == 1
    finally:
        bare.shutdown()
        peer.shutdown()


# -- (d) the access tokens ---------------------------------------------------------------------------------
KEY = Identity.generate()


def test_access_tokens_admit_only_this_runs_live_tokens() -> None:
    now = [1_000_000.0]
    ours = dht_auth.RunAuthorizer(TOKEN, KEY, clock=lambda: now[0])
    token = asyncio.run(ours.get_token())
    assert ours.is_token_valid(token) and not ours.does_token_need_refreshing(token)
    assert (
        dht_auth.USERNAME == token.username and TOKEN.encode() not in token.SerializeToString()
    )  # the token never goes out

    other = dht_auth.RunAuthorizer("another-runs-token-0123456789", KEY, clock=lambda: now[0])
    assert "another run" in ours.token_problem(asyncio.run(other.get_token()))  # wrong run
    forged = type(token)()
    forged.CopyFrom(token)
    forged.public_key = RSAPrivateKey().get_public_key().to_bytes()  # someone else's key under our HMAC
    assert "forged" in ours.token_problem(forged)
    forged.CopyFrom(token)
    forged.signature = bytes(32)
    assert "forged" in ours.token_problem(forged)
    forged.CopyFrom(token)
    forged.username = "mallory"
    assert "username" in ours.token_problem(forged)
    assert "too far" in ours.token_problem(ours.mint(now[0] + 30 * 24 * 3600))  # minted far ahead
    assert "ISO" in ours.token_problem(type(token)(username=dht_auth.USERNAME, expiration_time="soon"))

    now[0] += dht_auth.ACCESS_TTL_S * 0.8
    assert ours.is_token_valid(token) and ours.does_token_need_refreshing(token)
    now[0] += dht_auth.ACCESS_TTL_S
    assert ours.token_problem(token) == "expired"


def test_requests_signed_by_another_key_than_the_tokens_are_refused() -> None:
    """The request check: the access token names the Ed25519 key that must sign the request."""
    from hivemind.proto import dht_pb2

    alice, bob = dht_auth.RunAuthorizer(TOKEN, KEY), dht_auth.RunAuthorizer(TOKEN, Identity.generate())

    async def go() -> tuple[bool, bool, bool]:
        req = dht_pb2.PingRequest()
        await alice.sign_request(req, None)
        ok = await bob.validate_request(req)
        replay = await bob.validate_request(req)  # the same nonce again
        stolen = dht_pb2.PingRequest()
        await bob.sign_request(stolen, None)
        stolen.auth.client_access_token.CopyFrom(req.auth.client_access_token)  # alice's token, bob's signature
        return ok, replay, await bob.validate_request(stolen)

    assert asyncio.run(go()) == (True, False, False)


# -- the tracker record ------------------------------------------------------------------------------------
def _record(subkey: object, value: object, expiration: float) -> DHTRecord:
    return DHTRecord(
        tracker_record.TRACKER_KEY_ID, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration
    )


def test_the_validator_takes_only_signed_tracker_records() -> None:
    tracker, mallory = Identity.generate(), Identity.generate()
    pinned, bare = tracker_record.TrackerRecordValidator(tracker.public), tracker_record.TrackerRecordValidator()
    exp = time.time() + 60
    good = _record(*tracker_record.sign_record(tracker, RUN, ADDRESS, exp), exp)
    assert pinned.validate(good) and bare.validate(good)
    other = _record(*tracker_record.sign_record(mallory, RUN, ADDRESS, exp), exp)
    assert not pinned.validate(other) and bare.validate(other)  # a member's own key: only a node with the key can tell
    sub, value = tracker_record.sign_record(tracker, RUN, ADDRESS, exp)
    assert not bare.validate(_record(sub, value, exp + 1))  # the expiry is signed
    assert not bare.validate(_record(None, value, exp))  # a plain value
    assert not bare.validate(_record(mallory.public.hex(), value, exp))  # subkey is not the signer
    assert not bare.validate(_record(sub, {**value, "tracker": "10.6.6.6:7000"}, exp))
    assert not bare.validate(_record(sub, {"run_id": RUN, "tracker": ADDRESS}, exp))
    far = time.time() + 3600
    assert not bare.validate(_record(*tracker_record.sign_record(tracker, RUN, ADDRESS, far), far))
    assert not bare.validate(DHTRecord(tracker_record.TRACKER_KEY_ID, b"\xc1", b"\xc1", exp))  # not msgpack
    assert bare.validate(
        DHTRecord(DHTID.generate(source="other/key").to_bytes(), b"", b"x", exp)
    )  # other keys: untouched
    assert tracker_record.check_record(sub, value, exp, tracker.public, "run-other") is not None  # another run


class _FakeDHT:
    """What an unpinned node's `get` may return: records its validator could not judge."""

    def __init__(self, records: list[tuple[str, dict, float]]) -> None:
        from hivemind.utils.timed_storage import ValueWithExpiration

        self.found = ValueWithExpiration(
            {k: ValueWithExpiration(v, e) for k, v, e in records}, max(e for *_, e in records)
        )

    def get(self, key: str, latest: bool = False):
        assert key == tracker_record.TRACKER_RECORD_KEY and latest
        return self.found


def test_find_tracker_checks_each_record_itself(caplog) -> None:
    tracker, mallory = Identity.generate(), Identity.generate()
    now = time.time()
    old = (
        *tracker_record.sign_record(tracker, RUN, "127.0.0.1:6999", now + 10),
        now + 10,
    )  # (hivemind keeps the newest per signer)
    new = (*tracker_record.sign_record(tracker, RUN, ADDRESS, now + 50), now + 50)
    posing = (*tracker_record.sign_record(mallory, RUN, "10.6.6.6:7000", now + 90), now + 90)  # newer, another key
    sub, value = tracker_record.sign_record(tracker, RUN, ADDRESS, now + 40)
    tampered = (sub + "00", {**value, "tracker": "10.6.6.6:7000"}, now + 99)
    assert find_tracker(_FakeDHT([old, posing, tampered]), within(5), tracker.public) == "127.0.0.1:6999"
    assert "refused a tracker record in the DHT" in caplog.text and "not by this run's tracker key" in caplog.text
    with pytest.raises(SystemExit):  # a record of another run is not taken either
        find_tracker(_FakeDHT([new]), within(1.0), tracker.public, run_id="run-other")
    with pytest.raises(SystemExit):  # no key, two signers: it cannot tell which is the tracker
        find_tracker(_FakeDHT([new, posing]), within(1.0))
    assert "cannot tell the tracker from a member" in caplog.text


def test_read_tracker_key(tmp_path: Path) -> None:
    key = Identity.generate().public
    boot = tmp_path / "bootstrap.json"
    boot.write_text(json.dumps({"token": TOKEN, "tracker_key": key.hex()}))
    assert flagfile.read_tracker_key(None, f"@{boot}") == key  # --token @bootstrap.json carries it
    assert flagfile.read_tracker_key(key.hex(), TOKEN) == key
    assert flagfile.read_tracker_key(f"@{boot}") == key
    assert flagfile.read_tracker_key(None, TOKEN) is None
    (tmp_path / "token.txt").write_text(TOKEN)
    assert flagfile.read_tracker_key(None, f"@{tmp_path / 'token.txt'}") is None
    with pytest.raises(ConfigError, match="tracker key"):
        flagfile.read_tracker_key("abcd")


# -- TLS names ---------------------------------------------------------------------------------------------
def _serve(pair: tuple[bytes, bytes]) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
    server.start()
    return server, f"127.0.0.1:{port}"


def _handshakes(channel: grpc.Channel) -> bool:
    try:
        grpc.channel_ready_future(channel).result(timeout=2)
        return True
    except grpc.FutureTimeoutError:
        return False


def test_a_member_certificate_cannot_serve_as_the_tracker(tmp_path: Path) -> None:
    ca = RunCA.load_or_create(tmp_path)
    member_key = new_key()
    member = (key_pem(member_key), ca.issue("peer-1a2b3c4d", public_der(member_key)))
    assert member_names("peer-1a2b3c4d") == [PEER_NAME, "anchormesh-peer-1a2b3c4d"]
    assert TRACKER_NAME not in member_names("tracker") and member_names("bad name!") == [PEER_NAME]
    servers = []
    try:
        m_server, m_addr = _serve(member)
        t_server, t_addr = _serve(ca.server_pair())
        servers = [m_server, t_server]
        with auth.tracker_channel(m_addr, None, tls_ca=ca.pem) as ch:
            assert not _handshakes(ch)  # a member posing as the tracker
        with auth.tracker_channel(t_addr, None, tls_ca=ca.pem) as ch:
            assert _handshakes(ch)
        with auth.open_channel(m_addr, None, tls_ca=ca.pem) as ch:  # peers still reach members
            assert _handshakes(ch)
    finally:
        for s in servers:
            s.stop(None)
