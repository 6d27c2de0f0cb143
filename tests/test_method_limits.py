"""Per-method request size limits (peer/security/limits.py, enforced by the Gate): every method of the
proto has one, the realistic largest request of each fits 4 times over, and on real tracker and
Stage servers an oversized Ping, GetShard, Join, GetStatus or heartbeat report is refused with
RESOURCE_EXHAUSTED naming both sizes, before it is parsed, while the server keeps serving."""

from __future__ import annotations

import logging
import math

import grpc
import pytest
from swarmkit import listening_address

from peer.security import auth, limits
from peer.security.identity import Identity
from peer.security.limits import KIB, METHOD_LIMITS
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.version import build_fields

RUN = "run-0123abcd"
TOKEN = "limits-test-token-0123456789"
TENSOR_STREAMS = {"ActivationChunk", "GradientChunk", "AnchorPrior"}
BIG = 2**63 - 1
U32 = 2**32 - 1


def padded(message, size: int) -> bytes:
    """`message`'s bytes plus an unknown length-delimited field (number 1000): `size` bytes in all,
    which today's parsers accept (proto3 keeps unknown fields)."""
    body = message.SerializeToString()
    tag = bytes([(1000 << 3 | 2) & 0x7F | 0x80, (1000 << 3 | 2) >> 7])

    def varint(n: int) -> bytes:
        out = b""
        while n >= 0x80:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    n = size - len(body) - len(tag)
    n -= len(varint(n - len(varint(n))))
    raw = body + tag + varint(n) + b"x" * n
    assert len(raw) == size
    type(message).FromString(raw)  # still a valid message
    return raw


# -- the table ------------------------------------------------------------------------------


def test_every_method_of_the_proto_has_a_limit_and_only_the_tensor_streams_keep_the_servers() -> None:
    methods = {f"/{s.full_name}/{m.name}": m for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert set(METHOD_LIMITS) == set(methods)
    for name, m in methods.items():
        assert (METHOD_LIMITS[name] is None) == (m.input_type.name in TENSOR_STREAMS), name
        assert METHOD_LIMITS[name] is None or 4 * KIB <= METHOD_LIMITS[name] < (1 << 20), (
            name
        )  # under the tracker's server-wide MiB


def _largest_report() -> pb.PeerReport:
    """A heartbeat report with every string at the length the tracker keeps (300; the peer sends at
    most 4 excluded hops and 4 suspects) or longer, and every counter at its largest varint."""
    ident, s300 = Identity.generate(), "y" * 300
    return pb.PeerReport(
        run_id=RUN,
        tokens=BIG,
        peer=pb.PeerInfo(
            peer_id=ident.peer_id,
            stage=U32,
            address="a-long-dns-name-of-a-volunteer-machine.some-university.example.org:31337",
            state="joining",
            last_seen_s=1e9,
            tokens_per_s=1e9,
            bytes_in=BIG,
            bytes_out=BIG,
            step=BIG,
            loss=math.nan,
            queue_depth=U32,
            reason=f"downloading its stage's state from {ident.peer_id} (step 123456789) " + "z" * 300,
            dp_rounds=BIG,
            anchor_id=BIG,
            anchor_bytes_out=BIG,
            capacity_tokens_per_s=1e9,
            dp_bytes_out=BIG,
            dp_dense_bytes=BIG,
            eval_id=BIG,
            eval_loss=1.5,
            dp_rejected=U32,
            refused_calls=BIG,
            key_fingerprint=ident.fingerprint,
            dp_suspects=[s300] * 4,
            link_mbit=1e4,
            pp_keep=0.5,
            dp_period_s=30.0,
            excluding=[s300] * 4,
            startup_s=1e6,
            replica_stage=U32,
            replica_step=BIG,
            resumed_from=f"replica step 123456789 from {ident.peer_id}",
            device="cuda:0 " + "d" * 120,
            memory_bytes=BIG,
            memory_plan_bytes=BIG,
            refused_reports=U32,
            dp_flagged=U32,  # status-only fields too
        ),
        windows_held=[BIG] * 256,
        windows_returned=[BIG] * 256,
    )


def _largest_join() -> pb.JoinRequest:
    """A Join from a host with 32 DHT addresses (IPv6, each interface) of a 256-stage run, with TLS."""
    from peer.security.tls import new_key, public_der

    maddr = (
        "/ip6/2001:db8:85a3:1234:5678:8a2e:370:7334/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    )
    return pb.JoinRequest(
        run_id=RUN,
        peer_id=Identity.generate().peer_id,
        grpc_address="a-long-dns-name-of-a-volunteer-machine.some-university.example.org:31337",
        code_version="0.99.123.dev45+g0123abcd",
        wire_version="w999-0123456789",
        codecs=["mask", "lowrank", "transform", "a-future-codec-name"],
        dht_maddrs=[maddr] * 32,
        tls_public_key=public_der(new_key()),
        device="cuda:0 NVIDIA GeForce RTX 4090 Laptop GPU with a long marketing name bf16",
        memory_bytes=BIG,
        stage_memory_bytes=[BIG] * 256,
    )


LARGEST = {
    "/anchormesh.v1.Stage/Ping": lambda: pb.PingRequest(run_id="r" * 64, sender="s" * 64),
    "/anchormesh.v1.Stage/GetShard": lambda: pb.ShardRequest(
        run_id="r" * 64, sender="anchormesh-export", what=pb.ShardRequest.STATE, stage=U32
    ),
    "/anchormesh.v1.Tracker/Join": _largest_join,
    "/anchormesh.v1.Tracker/GetConfig": pb.ConfigRequest,
    "/anchormesh.v1.Tracker/GetData": lambda: pb.DataRequest(name="confirm-99999.idx", offset=BIG),
    "/anchormesh.v1.Tracker/Heartbeat": _largest_report,
    "/anchormesh.v1.Tracker/Leave": lambda: pb.LeaveRequest(
        run_id=RUN, peer_id="peer-01234567", reason="moving: " + "m" * 300
    ),
    "/anchormesh.v1.Tracker/Ban": lambda: pb.BanRequest(
        peer_id="0123456789abcdef",
        reason="sign-flipped updates on stage 3 since step 1200, named by three stage mates " * 3,
        unban=True,
    ),
    "/anchormesh.v1.Status/GetStatus": lambda: pb.StatusRequest(interval_s=math.pi),
    "/anchormesh.v1.Status/WatchStatus": lambda: pb.StatusRequest(interval_s=math.pi),
}


def test_the_realistic_largest_request_of_each_bounded_method_fits_four_times() -> None:
    assert set(LARGEST) == {m for m, limit in METHOD_LIMITS.items() if limit is not None}
    sizes = {m: build().ByteSize() for m, build in LARGEST.items()}
    for m, size in sizes.items():
        assert 4 * size <= METHOD_LIMITS[m], f"{m}: {size} bytes, limit {METHOD_LIMITS[m]}"
    assert (
        sizes["/anchormesh.v1.Tracker/Heartbeat"] > 3000 and sizes["/anchormesh.v1.Tracker/Join"] > 6000
    )  # the builders are the large ones they claim


# -- the wrapper, all four handler kinds ------------------------------------------------------


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code: grpc.StatusCode, text: str) -> None:
        self.aborted = (code, text)
        raise Aborted(text)


KINDS = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler, False),
    "unary_stream": (grpc.unary_stream_rpc_method_handler, False),
    "stream_unary": (grpc.stream_unary_rpc_method_handler, True),
    "stream_stream": (grpc.stream_stream_rpc_method_handler, True),
}


@pytest.mark.parametrize("parser", ["raw", "parsed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_wrapper_checks_the_length_before_parsing_for_every_handler_kind(kind: str, parser: str) -> None:
    make, streaming = KINDS[kind]
    parsed: list[bytes] = []
    seen: list = []

    def parse(raw: bytes) -> tuple[str, bytes]:
        parsed.append(raw)
        return ("parsed", raw)

    def behaviour(request, context):
        for r in request if streaming else [request]:
            seen.append(r)
        return "done"

    refusals: list[str] = []
    handler = limits.bound(
        make(behaviour, request_deserializer=parse if parser == "parsed" else None),
        "/x.Y/Small",
        8,
        lambda ctx, text: refusals.append(text),
    )
    assert getattr(handler, kind) is not None and sum(getattr(handler, k) is not None for k in KINDS) == 1
    deserialize = handler.request_deserializer
    ok, big = deserialize(b"12345678"), deserialize(b"123456789")
    assert ok == (("parsed", b"12345678") if parser == "parsed" else b"12345678")
    assert big == limits.TooBig(9) and parsed == ([b"12345678"] if parser == "parsed" else [])  # never parsed
    ctx = Context()
    assert (
        getattr(handler, kind)(iter([ok]) if streaming else ok, ctx) == "done" and seen == [ok] and ctx.aborted is None
    )
    seen.clear()
    with pytest.raises(Aborted):
        getattr(handler, kind)(iter([ok, big, ok]) if streaming else big, ctx)
    text = "Small request is 9 bytes; this method takes at most 8"
    assert ctx.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, text) and refusals == [text]
    assert seen == (
        [ok] if streaming else []
    )  # a stream's messages before the oversized one were served, none after it


def test_methods_without_a_limit_keep_their_handler() -> None:
    gate = auth.Gate({})
    h = grpc.stream_stream_rpc_method_handler(lambda reqs, ctx: iter(()), request_deserializer=None)
    assert gate._bounded(h, "/anchormesh.v1.Stage/Forward", "peer-a") is h
    assert gate._bounded(h, "/t.T/Unlisted", "peer-a") is h
    assert gate._bounded(h, "/anchormesh.v1.Stage/Ping", None) is not h


# -- real servers ---------------------------------------------------------------------------


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.value.code(), exc.value.details())
    return exc.value


def test_the_tracker_refuses_oversized_joins_status_calls_and_heartbeat_reports_and_keeps_serving(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    from bootstrap import keys
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker

    secrets = keys.load_or_create(tmp_path, TOKEN)
    t = Tracker(RUN, default_run())
    server, address = serve_tracker(t, "127.0.0.1", 0, secrets)
    caplog.set_level(logging.WARNING, logger="anchormesh.auth")
    try:
        with grpc.insecure_channel(address) as ch:  # GetStatus is open: the limit applies to anonymous callers
            get_status = ch.unary_unary(
                "/anchormesh.v1.Status/GetStatus",
                request_serializer=None,
                response_deserializer=pb.RunStatus.FromString,
            )
            for size in (70_000, 70_001, 500_000):
                e = _refused(lambda size=size: get_status(padded(pb.StatusRequest(interval_s=1.0), size), timeout=5))
                assert e.details() == f"GetStatus request is {size} bytes; this method takes at most 4096"
            assert get_status(padded(pb.StatusRequest(), 4096), timeout=5).run_id == RUN  # at the limit: served
            assert pbg.StatusStub(ch).GetStatus(pb.StatusRequest(), timeout=5).run_id == RUN
        lines = [r.getMessage() for r in caplog.records if "GetStatus request is" in r.getMessage()]
        assert len(lines) == 1 and "127.0.0.1" in lines[0]  # three refusals, one log line per method and 10 s

        me = Identity.generate()
        creds = auth.Credentials(token=TOKEN, identity=me)
        with auth.open_channel(address, creds) as ch:
            stub = pbg.TrackerStub(ch)
            fat = pb.JoinRequest(
                peer_id=me.peer_id, grpc_address=listening_address(), **build_fields(), device="d" * 100_000
            )
            e = _refused(lambda: stub.Join(fat, timeout=5))
            assert e.details() == f"Join request is {fat.ByteSize()} bytes; this method takes at most 65536"
            a = stub.Join(
                pb.JoinRequest(peer_id=me.peer_id, grpc_address=listening_address(), **build_fields()), timeout=5
            )
        assert a.certificate and me.peer_id in t.peers

        creds.certificate = a.certificate
        report = pb.PeerReport(run_id=RUN, peer=pb.PeerInfo(peer_id=me.peer_id, stage=a.stage, state="idle"))
        huge = pb.PeerReport(
            run_id=RUN,
            peer=pb.PeerInfo(
                peer_id=me.peer_id, stage=a.stage, state="idle", reason="r" * 40_000, excluding=["x" * 10_000] * 4
            ),
            windows_held=[1] * 20_000,
        )
        with auth.open_channel(address, creds) as ch:
            replies = pbg.TrackerStub(ch).Heartbeat(iter([report, huge, report]), timeout=5)
            assert next(replies).kind == pb.Directive.CONTINUE  # the report before the oversized one was served
            e = _refused(lambda: next(replies))
            assert e.details() == f"Heartbeat request is {huge.ByteSize()} bytes; this method takes at most 65536"
            assert "r" * 1000 not in t.peers[me.peer_id].reason  # never reached the tracker
            replies = pbg.TrackerStub(ch).Heartbeat(iter([report]), timeout=5)  # a new stream is served
            assert next(replies).kind == pb.Directive.CONTINUE
        assert (
            sum(1 for r in caplog.records if "Heartbeat request is" in r.getMessage() and me.peer_id in r.getMessage())
            == 1
        )  # names the verified member
    finally:
        server.stop(0)


def test_a_peers_stage_server_refuses_oversized_pings_and_shard_requests_and_keeps_serving() -> None:
    """Ping is open (container health checks) and GetShard takes the run token; both come to the
    Stage server, whose server-wide limit must fit activations (256 MiB)."""
    from peer.pipeline.grpc_transport import STAGE_POLICY, GrpcTransport

    gate = auth.Gate(STAGE_POLICY, token=TOKEN)
    t = GrpcTransport(run_id=RUN, gate=gate)
    addr = t.attach((0, 0))
    try:
        with grpc.insecure_channel(addr) as ch:
            ping = ch.unary_unary(
                "/anchormesh.v1.Stage/Ping", request_serializer=None, response_deserializer=pb.PingReply.FromString
            )
            e = _refused(lambda: ping(padded(pb.PingRequest(run_id=RUN, sender="probe"), 70_000), timeout=5))
            assert e.details() == "Ping request is 70000 bytes; this method takes at most 4096"
            e = _refused(lambda: ping(b"\x00" * 5_000_000, timeout=5))  # not even a message: refused by its size alone
            assert e.details() == "Ping request is 5000000 bytes; this method takes at most 4096"
            assert pbg.StageStub(ch).Ping(pb.PingRequest(run_id=RUN), timeout=5).run_id == RUN
        with auth.open_channel(addr, auth.Credentials(token=TOKEN)) as ch:
            shard = ch.unary_stream(
                "/anchormesh.v1.Stage/GetShard", request_serializer=None, response_deserializer=pb.ShardChunk.FromString
            )
            e = _refused(lambda: next(shard(padded(pb.ShardRequest(run_id=RUN), 10_000), timeout=5)))
            assert e.details() == "GetShard request is 10000 bytes; this method takes at most 4096"
            with pytest.raises(
                grpc.RpcError
            ) as exc:  # a normal request gets past the limit (this transport has no weights to give)
                next(pbg.StageStub(ch).GetShard(pb.ShardRequest(run_id=RUN), timeout=5))
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert gate.refused["RESOURCE_EXHAUSTED"] == 3
        assert t.rejected_count == 0  # refused by the gate, before the handler parsed anything
    finally:
        t.close()
