"""The tracker dials a joiner back (bootstrap/dial_back.py): a peer whose announced addresses
answer is admitted; one whose addresses do not is refused with the address, the error and what
to forward, and a peer process refused so exits 1 with that message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from swarmkit import listening_address

from bootstrap.dial_back import Busy, DialBack, Unreachable, dial, refusal, targets
from bootstrap.node import default_run
from bootstrap.server import serve_tracker
from bootstrap.tracker import Tracker
from peer.address import REFUSAL_KEY, UNREACHABLE, free_port
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.version import build_fields

ROOT = Path(__file__).resolve().parents[1]


def _closed_address() -> str:
    return f"127.0.0.1:{free_port('127.0.0.1')}"  # bound then closed: nothing listens there


def test_targets_take_the_grpc_address_first_then_tcp_multiaddrs_and_skip_what_cannot_be_dialed() -> None:
    req = pb.JoinRequest(
        grpc_address="203.0.113.5:31337",
        dht_maddrs=[
            "/ip4/203.0.113.5/tcp/31338/p2p/QmX",
            "/ip4/127.0.0.1/tcp/31338/p2p/QmX",  # the tracker's own loopback from elsewhere: skipped
            "/ip4/203.0.113.5/udp/31338/quic",
            "/ip4/203.0.113.5/tcp/31338/p2p/QmX",  # the same host:port once
            "/dns4/volunteer.example.org/tcp/4001",
        ],
    )
    assert targets(req) == [
        ("gRPC", "203.0.113.5", 31337),
        ("DHT", "203.0.113.5", 31338),
        ("DHT", "volunteer.example.org", 4001),
    ]
    loop = pb.JoinRequest(grpc_address="127.0.0.1:5", dht_maddrs=["/ip4/127.0.0.1/tcp/6"])
    assert targets(loop) == [("gRPC", "127.0.0.1", 5), ("DHT", "127.0.0.1", 6)]  # a loopback run dials loopback
    assert targets(pb.JoinRequest(grpc_address="[::1]:7")) == [("gRPC", "::1", 7)]


def test_the_refusal_names_each_address_its_error_and_the_ports_to_forward() -> None:
    msg = refusal([("gRPC", "203.0.113.5", 31337, "connection refused"), ("DHT", "203.0.113.5", 31338, "no answer")])
    assert msg.startswith("tracker could not reach 203.0.113.5:31337 (connection refused); nor DHT 203.0.113.5:31338")
    assert "forward TCP 31337, 31338 to this machine" in msg and "--announce-host" in msg
    assert "0.0.0.0 is no address" in dial("0.0.0.0", 5, 1.0)
    assert dial(*_closed_address().split(":")[0:1], int(_closed_address().split(":")[1]), 1.0) == "connection refused"
    host, port = listening_address().split(":")
    assert dial(host, int(port), 1.0) == ""


def test_one_answering_address_admits_and_none_refuses_within_the_timeout() -> None:
    answers = {("h", 1): "connection refused", ("h", 2): ""}
    check = DialBack(timeout_s=0.5, dial=lambda h, p, t: answers[(h, p)])
    check.check(pb.JoinRequest(grpc_address="h:1", dht_maddrs=["/dns4/h/tcp/2"]))  # the DHT answers: admitted
    with pytest.raises(Unreachable, match=r"^tracker could not reach h:1 \(connection refused\)"):
        check.check(pb.JoinRequest(grpc_address="h:1"))
    slow = DialBack(timeout_s=0.2, dial=lambda h, p, t: time.sleep(5) or "")
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match=r"no answer in 0.2 s"):
        slow.check(pb.JoinRequest(grpc_address="h:1"))
    assert time.monotonic() - t0 < 2


def test_dialing_is_bounded_and_the_one_over_the_bound_is_told_to_retry() -> None:
    release = threading.Event()
    check = DialBack(timeout_s=5, max_dialing=1, dial=lambda h, p, t: release.wait(5) and "")
    first = threading.Thread(target=check.check, args=(pb.JoinRequest(grpc_address="h:1"),))
    first.start()
    time.sleep(0.2)
    with pytest.raises(Busy):
        check.check(pb.JoinRequest(grpc_address="h:2"))
    release.set()
    first.join()


@pytest.fixture
def tracker():
    t = Tracker("run-dial", default_run())
    server, address = serve_tracker(t, "127.0.0.1", 0)
    yield t, address
    server.stop(grace=0).wait()


def test_through_grpc_a_reachable_peer_is_admitted_and_an_unreachable_one_refused(tracker) -> None:
    t, address = tracker
    with grpc.insecure_channel(address) as ch:
        stub = pbg.TrackerStub(ch)
        a = stub.Join(pb.JoinRequest(peer_id="up", grpc_address=listening_address(), **build_fields()), timeout=10)
        assert a.run_id == "run-dial" and "up" in t.peers
        closed = _closed_address()
        with pytest.raises(grpc.RpcError) as exc:
            stub.Join(pb.JoinRequest(peer_id="down", grpc_address=closed, **build_fields()), timeout=10)
        e = exc.value
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details().startswith(f"tracker could not reach {closed} (connection refused): forward TCP ")
        assert (REFUSAL_KEY, UNREACHABLE) in e.trailing_metadata() and "down" not in t.peers
        with pytest.raises(grpc.RpcError) as exc:  # a wrong build hears that, not that it is unreachable
            stub.Join(pb.JoinRequest(peer_id="old", grpc_address=closed, code_version="0.0.0"), timeout=10)
        assert "wire_version" in exc.value.details()


def test_without_dial_back_a_fake_address_joins() -> None:
    t = Tracker("run-nodial", default_run())
    server, address = serve_tracker(t, "127.0.0.1", 0, dial_back=False)
    try:
        with grpc.insecure_channel(address) as ch:
            pbg.TrackerStub(ch).Join(
                pb.JoinRequest(peer_id="p", grpc_address=_closed_address(), **build_fields()), timeout=10
            )
        assert "p" in t.peers
    finally:
        server.stop(grace=0).wait()


@pytest.mark.processes
def test_a_peer_announcing_an_unreachable_host_exits_1_with_the_address_in_its_message(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ANCHORMESH_TOKEN": "", "ANCHORMESH_TRACKER": ""}
    boot = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "bootstrap", "--state-dir", str(tmp_path / "boot")],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "boot.log", "w"),
        text=True,
        env=env,
    )
    try:
        info = json.loads(boot.stdout.readline())
        token = json.loads((tmp_path / "boot" / "bootstrap.json").read_text())["token"]
        grpc_port = free_port("127.0.0.1")
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "peer",
                "--tracker",
                info["address"],
                "--token",
                token,
                "--initial-peers",
                *info["dht_maddrs"],
                "--grpc-port",
                str(grpc_port),
                "--announce-host",
                "127.0.0.2",  # loopback, but nothing of the peer's listens there
            ],  # fmt: skip
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )
        assert res.returncode == 1, res.stderr[-3000:]
        assert f"tracker could not reach 127.0.0.2:{grpc_port} (connection refused)" in res.stderr, res.stderr[-3000:]
        assert f"forward TCP {grpc_port}" in res.stderr
    finally:
        boot.terminate()
        boot.wait(30)
