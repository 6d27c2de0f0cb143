"""What a node announces (peer/address.py) and the peer flags around it: `--announce-host auto`,
`--dht-port`, and the ANCHORMESH_* environment defaults the peer image relies on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from peer.address import host_of, outward_address
from peer.cli import _parser


def test_host_of_a_tracker_address_or_a_multiaddr() -> None:
    assert host_of("10.0.0.5:7000") == "10.0.0.5"
    assert host_of("[::1]:7000") == "::1"
    assert host_of("/ip4/198.18.0.2/tcp/7001/p2p/QmX") == "198.18.0.2"
    assert host_of("/dns4/bootstrap/tcp/7001") == "bootstrap"
    for bad in ("nohost", ":7000", "/p2p/QmX"):
        with pytest.raises(ValueError):
            host_of(bad)


def test_auto_is_the_address_that_routes_to_the_target() -> None:
    assert outward_address("127.0.0.1:7000") == "127.0.0.1"
    assert outward_address("/ip4/127.0.0.1/tcp/7001/p2p/QmX") == "127.0.0.1"
    with pytest.raises(ValueError, match="cannot resolve"):
        outward_address("no-such-host.invalid:7000")


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


@pytest.mark.processes
@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["peer", "--host", "0.0.0.0", "--announce-host", "auto"], "--announce-host='auto'"),
        (
            ["peer", "--tracker", "no-such-host.invalid:7000", "--host", "0.0.0.0", "--announce-host", "auto"],
            "--announce-host='auto'",
        ),
        (["peer", "--tracker", "127.0.0.1:7000", "--dht-port", "70000"], "--dht-port=70000"),
    ],
)
def test_bad_address_flags_exit_2_naming_the_flag(args: list[str], field: str) -> None:
    out = cli(*args)
    assert out.returncode == 2 and f"anchormesh: error: {field}" in out.stderr, out.stderr


def test_the_environment_gives_the_peer_flags_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANCHORMESH_TRACKER", "boot:7000")
    monkeypatch.setenv("ANCHORMESH_INITIAL_PEERS", "/ip4/1.2.3.4/tcp/1/p2p/A /ip4/1.2.3.4/tcp/2/p2p/B")
    monkeypatch.setenv("ANCHORMESH_ANNOUNCE_HOST", "5.6.7.8")
    args = _parser().parse_args(["peer"])
    assert (args.tracker, args.initial_peers, args.announce_host) == (
        "boot:7000",
        ["/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/1.2.3.4/tcp/2/p2p/B"],
        "5.6.7.8",
    )
    args = _parser().parse_args(["peer", "--tracker", "other:1"])  # a flag wins over the environment
    assert args.tracker == "other:1"


@pytest.mark.processes
def test_json_logs_are_one_object_per_line_and_a_bad_format_exits_2(tmp_path) -> None:
    import json

    out = cli("bootstrap", "--config", str(tmp_path / "missing.toml"), ANCHORMESH_LOG_FORMAT="yaml")
    assert out.returncode == 2  # the config is read first: it names --config
    (tmp_path / "run.toml").write_text("seed = 5\n")
    out = cli(
        "bootstrap",
        "--config",
        str(tmp_path / "run.toml"),
        "--state-dir",
        str(tmp_path / "b"),
        ANCHORMESH_LOG_FORMAT="yaml",
    )
    assert out.returncode == 2 and "anchormesh: error: ANCHORMESH_LOG_FORMAT='yaml': must be text or json" in out.stderr
    import logging

    from peer.logs import JsonFormatter

    rec = logging.LogRecord("anchormesh.peer", logging.WARNING, __file__, 1, "no gradient for %s", ("mb 3",), None)
    line = json.loads(JsonFormatter().format(rec))
    assert (
        line["level"] == "WARNING"
        and line["logger"] == "anchormesh.peer"
        and line["message"] == "no gradient for mb 3"
        and line["time"].endswith("Z")
    )


def test_a_taken_port_is_refused_not_shared() -> None:
    """gRPC binds with SO_REUSEPORT by default on Linux: a second tracker or peer on a taken port
    would start and split the connections with the first. Both refuse instead, naming the flag."""
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker
    from peer.config import ConfigError, TrainConfig
    from peer.daemon.main import PeerDaemon

    first, address = serve_tracker(Tracker("run-x", TrainConfig()), "127.0.0.1", 0)
    port = int(address.rsplit(":", 1)[1])
    try:
        with pytest.raises(ConfigError, match=r"^--port=\d+: cannot bind the tracker .* taken"):
            serve_tracker(Tracker("run-y", TrainConfig()), "127.0.0.1", port)
        with pytest.raises(ConfigError, match=r"^--grpc-port=\d+: cannot bind a Stage server .* taken"):
            PeerDaemon("127.0.0.1:9", grpc_port=port)
    finally:
        first.stop(0)
