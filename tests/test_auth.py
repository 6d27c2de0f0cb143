"""Who may call what (peer/security/auth.py): the gate on a real gRPC server, every way a call can be
refused, a hypothesis fuzz of the credential metadata, and the tracker's Join/Ban path."""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarmkit import listening_address

from peer.security import auth, call_check
from peer.security.identity import Identity, certificate_bytes

RUN = "run-auth"
TOKEN = "auth-test-token-0123456789"
POLICY = {
    "/t.T/Open": frozenset({auth.OPEN}),
    "/t.T/Observe": frozenset({auth.TOKEN, auth.MEMBER}),
    "/t.T/Ban": frozenset({auth.OPERATOR}),
    # unlisted (/t.T/Member, /t.T/Stream): members only
}


class Server:
    """A gated server whose handlers answer with the caller's peer id."""

    def __init__(self, **gate) -> None:
        self.tracker = Identity.generate()
        self.gate = auth.Gate(
            POLICY,
            token=TOKEN,
            operator="operator-secret-0123456789",
            tracker_key=self.tracker.public,
            run_id=RUN,
            **gate,
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[self.gate])

        def who(_req, ctx) -> bytes:
            return auth.caller(ctx)[0].encode() or b"-"

        def who_stream(reqs, ctx):
            for _ in reqs:
                yield who(None, ctx)

        unary = {m: grpc.unary_unary_rpc_method_handler(who) for m in ("Open", "Observe", "Ban", "Member")}
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.T", {**unary, "Stream": grpc.stream_stream_rpc_method_handler(who_stream)}
                ),
            )
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def member(self, peer_id: str = "peer-a", run_id: str = RUN, signer: Identity | None = None) -> auth.Credentials:
        ident = Identity.generate()
        ident.peer_id = peer_id
        cert = (signer or self.tracker).sign(certificate_bytes(run_id, peer_id, ident.public))
        return auth.Credentials(identity=ident, certificate=cert)

    def call(self, method: str, creds: auth.Credentials | None, metadata=None) -> str:
        with auth.open_channel(self.address, creds) as ch:
            return ch.unary_unary(f"/t.T/{method}")(b"x", timeout=5, metadata=metadata).decode()

    def refused(self, method: str, creds: auth.Credentials | None, metadata=None) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as exc:
            self.call(method, creds, metadata)
        return exc.value


@pytest.fixture
def server():
    s = Server(open_calls_per_s=1e6)  # these tests call the open method hundreds of times; its limit has its own test
    yield s
    s.server.stop(0)


def test_members_tokens_and_the_operator_each_reach_what_their_role_allows(server: Server) -> None:
    member = server.member("peer-a")
    assert server.call("Member", member) == "peer-a"  # the handler knows who calls
    assert server.call("Observe", member) == "peer-a"
    assert server.call("Observe", auth.Credentials(token=TOKEN)) == "-"
    assert server.call("Ban", auth.Credentials(operator="operator-secret-0123456789")) == "-"
    assert server.call("Open", None) == "-"  # open methods take anyone
    with auth.open_channel(server.address, member) as ch:  # streams are checked once, when they open
        assert list(ch.stream_stream("/t.T/Stream")(iter([b"1", b"2"]), timeout=5)) == [b"peer-a", b"peer-a"]
    assert sum(server.gate.refused.values()) == 0


@pytest.mark.parametrize(
    "case, code, text",
    [
        ("no credentials", "UNAUTHENTICATED", "needs credentials and the call has none: pass --token"),
        ("wrong token", "UNAUTHENTICATED", "wrong run token"),
        ("token on a member method", "PERMISSION_DENIED", "takes member credentials; the caller has token ones"),
        ("member on an operator method", "PERMISSION_DENIED", "takes operator credentials; the caller has member ones"),
        ("token as the operator key", "UNAUTHENTICATED", "wrong operator key"),
        ("certificate from another tracker", "UNAUTHENTICATED", "not issued by this run's tracker"),
        ("certificate of another run", "UNAUTHENTICATED", "not issued by this run's tracker"),
        ("someone else's certificate", "UNAUTHENTICATED", "not issued by this run's tracker"),
        ("banned key", "PERMISSION_DENIED", "is banned from this run: sent NaN gradients"),
    ],
)
def test_each_bad_call_gets_its_code_and_a_message_that_says_why(
    server: Server, case: str, code: str, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    method, creds = "Member", None
    if case == "wrong token":
        method, creds = "Observe", auth.Credentials(token="guessed-token-0123456789")
    elif case == "token on a member method":
        creds = auth.Credentials(token=TOKEN)
    elif case == "member on an operator method":
        method, creds = "Ban", server.member()
    elif case == "token as the operator key":
        method, creds = "Ban", auth.Credentials(operator=TOKEN)
    elif case == "certificate from another tracker":
        creds = server.member(signer=Identity.generate())
    elif case == "certificate of another run":
        creds = server.member(run_id="run-other")
    elif case == "someone else's certificate":  # a stolen certificate without its key
        creds, victim = server.member("peer-x"), server.member("peer-victim")
        creds.identity.peer_id, creds.certificate = "peer-victim", victim.certificate
    elif case == "banned key":
        creds = server.member("peer-bad")
        server.gate.banned[creds.identity.fingerprint] = "sent NaN gradients"
    with caplog.at_level(logging.WARNING, logger="anchormesh.auth"):
        err = server.refused(method, creds)
    assert err.code().name == code and text in err.details(), err.details()
    assert server.gate.refused[code] == 1
    assert any(text in r.getMessage() for r in caplog.records)  # the refusal is logged


def test_a_forged_signature_a_stale_time_and_a_replayed_call_are_refused(server: Server) -> None:
    member = server.member("peer-a")
    md = dict(member.metadata("/t.T/Member"))
    forged = {**md, auth.H_SIG: bytes(64)}
    assert "signature does not match its key" in server.refused("Member", None, list(forged.items())).details()
    member_stale = dict(member.metadata("/t.T/Member"))
    old = time.time() - 2 * call_check.MAX_SKEW_S
    member_stale[auth.H_TS] = f"{old:.3f}"  # re-signed with the old time: only the clock check can catch it
    member_stale[auth.H_SIG] = member.identity.sign(
        call_check.call_bytes(
            "/t.T/Member", "peer-a", member_stale[auth.H_TS], member_stale[auth.H_NONCE], member.identity.public
        )
    )
    assert "off this server's clock" in server.refused("Member", None, list(member_stale.items())).details()
    assert server.call("Member", None, list(md.items())) == "peer-a"  # the original, once
    err = server.refused("Member", None, list(md.items()))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed call" in err.details()


def test_a_caller_over_its_call_rate_is_told_to_slow_down() -> None:
    s = Server(calls_per_s=1.0)  # bursts of 10 calls
    try:
        member = s.member("peer-fast")
        codes = []
        for _ in range(14):
            try:
                s.call("Member", member)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
                assert "opens calls faster than 1/s" in exc.details()
        assert codes[:10] == ["OK"] * 10 and codes[10:].count("RESOURCE_EXHAUSTED") >= 3
        assert s.call("Member", s.member("peer-slow")) == "peer-slow"  # per caller: others are not throttled
    finally:
        s.server.stop(0)


HEADERS = st.sampled_from(
    [auth.H_PEER, auth.H_KEY, auth.H_CERT, auth.H_SIG, auth.H_TS, auth.H_NONCE, auth.H_MAC, auth.H_OP]
)
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None, max_examples=300)
@given(st.data())
def test_fuzzed_credentials_are_refused_never_crash_the_server(server: Server, data) -> None:
    """Start from a valid member's metadata, then replace, drop or add credential headers."""
    md = dict(server.member("peer-a").metadata("/t.T/Member"))
    for _ in range(data.draw(st.integers(1, 4))):
        h = data.draw(HEADERS)
        if data.draw(st.booleans()):
            md.pop(h, None)
        else:
            md[h] = data.draw(st.binary(max_size=96)) if h.endswith("-bin") else data.draw(PRINTABLE)
    try:
        answer = server.call("Member", None, list(md.items()))
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (
            f"{exc.code().name}: {exc.details()}"
        )
    else:  # only an unchanged credential may pass (e.g. a header replaced by an equal value)
        assert answer == "peer-a"
    assert server.call("Open", None) == "-"  # still serving


# -- the tracker: Join needs the token and a key; the certificate it issues opens every peer --------
def test_join_issues_a_certificate_that_other_peers_accept_and_a_ban_revokes(tmp_path) -> None:
    from bootstrap import keys
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker
    from peer.pipeline.grpc_transport import STAGE_POLICY
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg
    from peer.wire.version import build_fields

    secrets = keys.load_or_create(tmp_path, TOKEN)
    assert (tmp_path / keys.FILE).stat().st_mode & 0o777 == 0o600
    t = Tracker(RUN, default_run())
    server, address = serve_tracker(t, "127.0.0.1", 0, secrets)
    try:
        me = Identity.generate()
        creds = auth.Credentials(token=TOKEN, identity=me)
        with auth.open_channel(address, creds) as ch:
            stub = pbg.TrackerStub(ch)
            with pytest.raises(grpc.RpcError) as exc:  # speaking for another peer
                stub.Join(
                    pb.JoinRequest(peer_id="peer-other", grpc_address=listening_address(), **build_fields()), timeout=5
                )
            assert (
                exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
                and "speaks only for itself" in exc.value.details()
            )
            a = stub.Join(
                pb.JoinRequest(peer_id=me.peer_id, grpc_address=listening_address(), **build_fields()), timeout=5
            )
        assert a.tracker_key == secrets.tracker.public and a.certificate
        with auth.open_channel(address, None) as ch:  # no token: refused
            with pytest.raises(grpc.RpcError) as exc:
                pbg.TrackerStub(ch).Join(
                    pb.JoinRequest(peer_id="x", grpc_address=listening_address(), **build_fields()), timeout=5
                )
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert pbg.StatusStub(ch).GetStatus(pb.StatusRequest(), timeout=5).run_id == RUN  # status stays open
        # another peer's gate, configured from its own Assignment, accepts the certificate
        gate = auth.Gate(STAGE_POLICY)
        gate.configure(a.run_id, a.tracker_key, TOKEN)
        creds.certificate = a.certificate
        md = dict(creds.metadata("/anchormesh.v1.Stage/Forward"))
        assert gate.check("/anchormesh.v1.Stage/Forward", md, frozenset({auth.MEMBER})).peer_id == me.peer_id
        # the operator bans it: the tracker refuses it, and its next heartbeat reply names the key to every peer
        with auth.open_channel(address, auth.Credentials(operator=secrets.operator)) as ch:
            banned = (
                pbg.TrackerStub(ch)
                .Ban(pb.BanRequest(peer_id=me.peer_id, reason="sign-flipped updates"), timeout=5)
                .banned
            )
        assert banned == [f"{me.fingerprint} ({me.peer_id}): sign-flipped updates"]
        assert t.status().banned == 1 and t.peers[me.peer_id].state == "banned"
        with auth.open_channel(address, creds) as ch:
            with pytest.raises(grpc.RpcError) as exc:
                next(
                    iter(
                        pbg.TrackerStub(ch).Heartbeat(
                            iter([pb.PeerReport(run_id=RUN, peer=pb.PeerInfo(peer_id=me.peer_id))]), timeout=5
                        )
                    )
                )
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "banned" in exc.value.details()
        with auth.open_channel(address, creds) as ch:  # a member may not ban
            with pytest.raises(grpc.RpcError) as exc:
                pbg.TrackerStub(ch).Ban(pb.BanRequest(peer_id="x"), timeout=5)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        gate.banned.update({fp: "" for fp in t.banned})  # what the daemon does with Directive.banned
        with pytest.raises(auth.Refused, match="is banned"):
            gate.check(
                "/anchormesh.v1.Stage/Forward",
                dict(creds.metadata("/anchormesh.v1.Stage/Forward")),
                frozenset({auth.MEMBER}),
            )
        # the secrets survive a restart of the bootstrap: the same certificates stay valid
        again = keys.load_or_create(tmp_path)
        assert (again.token, again.operator, again.tracker.public) == (
            secrets.token,
            secrets.operator,
            secrets.tracker.public,
        )
    finally:
        server.stop(0)


def test_run_secrets_never_start_with_a_dash_and_bad_tokens_are_refused(tmp_path) -> None:
    """`--token -abc...` would be read as a flag: a generated token starting with "-" made a
    peer exit 2 with "argument --token: expected one argument" (seen in CI)."""
    from bootstrap import keys
    from peer.errors import ConfigError

    assert all(not auth.new_secret().startswith("-") for _ in range(2000))
    for bad in ("short", "-starts-with-a-dash-0123456789", " padded-token-0123456789 "):
        with pytest.raises(ConfigError, match="--token"):
            keys.load_or_create(tmp_path, bad)


def test_status_streams_have_their_own_budget_and_compressed_calls_are_refused() -> None:
    """240 anonymous WatchStatus streams once made a valid Join fail: now at most MAX_WATCHERS
    stream at once, the next one is told so, and the tracker still answers everything else; a
    gzip-compressed call is refused before it is inflated."""
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.services import MAX_WATCHERS
    from bootstrap.tracker import Tracker
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg

    t = Tracker(RUN, default_run())
    server, address = serve_tracker(t, "127.0.0.1", 0)
    streams = []
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pbg.StatusStub(ch)
            for _ in range(MAX_WATCHERS):
                s = stub.WatchStatus(pb.StatusRequest(interval_s=5.0))
                assert next(s).run_id == RUN
                streams.append(s)
            extra = stub.WatchStatus(pb.StatusRequest(interval_s=5.0))
            with pytest.raises(grpc.RpcError) as exc:
                next(extra)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "GetStatus" in exc.value.details()
            assert stub.GetStatus(pb.StatusRequest(), timeout=5).run_id == RUN  # everything else still answers
            streams.pop().cancel()
            time.sleep(0.5)
            again = stub.WatchStatus(pb.StatusRequest(interval_s=5.0))
            assert next(again).run_id == RUN
            streams.append(again)
            with pytest.raises(grpc.RpcError) as exc:
                stub.GetStatus(pb.StatusRequest(), timeout=5, compression=grpc.Compression.Gzip)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        for s in streams:
            s.cancel()
        server.stop(0)


def test_open_methods_are_rate_limited_per_host_and_the_server_keeps_serving() -> None:
    """Ping needs no credentials, so a flood of them has no caller to limit: the gate limits open
    methods per network host (here 1 call/s, bursts of 10): the rest get RESOURCE_EXHAUSTED with
    the reason, are counted, and the host is served again once its bucket refills."""
    from peer.pipeline.grpc_transport import STAGE_POLICY, GrpcTransport
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg

    gate = auth.Gate(STAGE_POLICY, open_calls_per_s=1.0)
    t = GrpcTransport(run_id=RUN, gate=gate)
    addr = t.attach((0, 0))
    try:
        with grpc.insecure_channel(addr) as channel:
            stub = pbg.StageStub(channel)
            codes = []
            for _ in range(40):
                try:
                    stub.Ping(pb.PingRequest(), timeout=5)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
                    assert (
                        exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        and "faster than 1/s" in exc.details()
                        and "127.0.0.1" in exc.details()
                    )
            assert (
                10 <= codes.count("OK") <= 13 and codes[:10] == ["OK"] * 10
            )  # the burst, plus what refilled meanwhile
            assert gate.refused["RESOURCE_EXHAUSTED"] == codes.count("RESOURCE_EXHAUSTED")
            time.sleep(1.2)
            assert stub.Ping(pb.PingRequest(), timeout=5).run_id == RUN
    finally:
        t.close()


def test_the_host_of_a_grpc_peer_string() -> None:
    assert auth._host("ipv4:198.18.0.7:51234") == "198.18.0.7"
    assert auth._host("ipv6:[::1]:51234") == "[::1]"
    assert auth._host("unix:/tmp/x.sock") == "unix:/tmp/x.sock"
