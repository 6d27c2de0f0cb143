"""Headers-only floods (peer/security/admission.py): another process opens hundreds of calls that
send their headers and never a request, against a real tracker and a real Stage server; a valid
Join and a stage mate's Ping are still answered within a second, and a call whose request never
comes is cancelled at the receive deadline."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from swarmkit import listening_address

from peer.security import auth
from peer.security.identity import Identity, certificate_bytes
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

pytestmark = pytest.mark.processes

ROOT = Path(__file__).parent.parent
RUN = "run-floods"
TOKEN = "floods-test-token-0123456789"
TRACKER, STATUS, STAGE = "/anchormesh.v1.Tracker/", "/anchormesh.v1.Status/", "/anchormesh.v1.Stage/"


def flood(target: str, calls: int, *methods: str) -> subprocess.Popen:
    """Start tests/headers_only.py against `target`; returns once its calls are open."""
    cmd = [sys.executable, str(ROOT / "tests" / "headers_only.py"), target, str(calls), *methods]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def tracker(tmp_path):
    from bootstrap import keys
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker

    cfg = default_run()
    cfg.security = replace(cfg.security, receive_deadline_s=1.0)
    secrets = keys.load_or_create(tmp_path, TOKEN)
    server, address = serve_tracker(Tracker(RUN, cfg), "127.0.0.1", 0, secrets)
    yield address
    server.stop(0)


def test_a_headers_only_flood_leaves_a_valid_join_answered_within_a_second(tracker: str) -> None:
    """600 headers-only calls (more than the tracker's 240 concurrent calls) to Join without
    credentials, the open status methods and Heartbeat: a token holder's Join is answered in < 1 s."""
    from peer.wire.version import build_fields

    attacker = flood(
        tracker,
        600,
        TRACKER + "Join",
        STATUS + "GetStatus",
        STATUS + "WatchStatus",
        TRACKER + "Heartbeat",
        TRACKER + "GetConfig",
    )
    try:
        me = Identity.generate()
        with auth.open_channel(tracker, auth.Credentials(token=TOKEN, identity=me)) as ch:
            t0 = time.monotonic()
            a = pbg.TrackerStub(ch).Join(
                pb.JoinRequest(peer_id=me.peer_id, grpc_address=listening_address(), **build_fields()), timeout=1.0
            )
            took = time.monotonic() - t0
        assert a.run_id == RUN and a.certificate and took < 1.0
    finally:
        stop(attacker)


def test_a_call_whose_request_never_comes_is_cancelled_at_the_receive_deadline(tracker: str) -> None:
    with grpc.insecure_channel(tracker) as ch:
        call = ch.stream_unary(STATUS + "GetStatus", request_serializer=None, response_deserializer=None)

        def never():  # headers, then no request for 5 s
            time.sleep(5)
            yield from ()

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            call(never(), timeout=10)
        took = time.monotonic() - t0
    assert exc.value.code() == grpc.StatusCode.CANCELLED and 0.9 < took < 3.0


def test_a_headers_only_flood_leaves_a_stage_mate_s_ping_answered_within_a_second() -> None:
    """300 headers-only Pings and pipeline streams at a Stage server (its pool once had 32 threads,
    all taken): a stage mate's Ping, which carries its certificate, is answered in < 1 s."""
    from peer.pipeline.grpc_transport import STAGE_POLICY, GrpcTransport

    tracker_key = Identity.generate()
    gate = auth.Gate(STAGE_POLICY)
    gate.configure(RUN, tracker_key.public, TOKEN)
    t = GrpcTransport(run_id=RUN, gate=gate)
    addr = t.attach((0, 0))
    attacker = flood(addr, 300, STAGE + "Ping", STAGE + "Forward", STAGE + "GetShard")
    try:
        mate = Identity.generate()
        creds = auth.Credentials(
            identity=mate, certificate=tracker_key.sign(certificate_bytes(RUN, mate.peer_id, mate.public))
        )
        with auth.open_channel(addr, creds) as ch:
            t0 = time.monotonic()
            reply = pbg.StageStub(ch).Ping(pb.PingRequest(run_id=RUN, sender=mate.peer_id), timeout=1.0)
            took = time.monotonic() - t0
        assert reply.run_id == RUN and took < 1.0
    finally:
        stop(attacker)
        t.close()
