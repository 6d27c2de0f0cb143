"""A run off loopback is protected by default (peer/security/exposure.py): TLS with the tracker's
CA fetched and checked with the tracker's key, a status that needs the run token, and a peer
that refuses to start without the tracker's key. Loopback runs stay plain and open."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bootstrap import keys
from bootstrap.node import default_run, run_protection
from bootstrap.server import serve_tracker
from bootstrap.tracker import Tracker
from peer.errors import ConfigError
from peer.runtoml import resolve_run
from peer.security import auth, exposure
from peer.security.exposure import address_line, exposed, is_loopback, resolve_access, run_ca, split_address
from peer.security.identity import Identity
from peer.security.tls import PLAIN_HINT, RunCA, fetch_ca
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

TOKEN = "exposure-test-token-0123456789"
RUN = "run-exposure"
OUTSIDE = "198.18.7.1"  # a benchmark-net address: not loopback, never routed anywhere


def test_loopback_is_127_8_and_1_and_localhost_only() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", OUTSIDE, "10.0.0.2", "bootstrap", "example.org"))
    assert not exposed(["127.0.0.1", None]) and exposed(["127.0.0.1", OUTSIDE])


def test_tls_and_a_private_status_by_default_off_loopback_each_opted_out_by_name() -> None:
    cfg = default_run()
    assert run_protection(cfg, "127.0.0.1", None, False, False) == (False, False)  # tests, make demo: as before
    assert run_protection(cfg, OUTSIDE, None, False, False) == (True, True)
    assert run_protection(cfg, "0.0.0.0", "bootstrap", False, False) == (True, True)  # compose: a name
    assert run_protection(cfg, "127.0.0.1", OUTSIDE, False, False) == (
        True,
        True,
    )  # announced elsewhere (a port forward)
    assert run_protection(cfg, OUTSIDE, None, True, False) == (False, True)
    assert run_protection(cfg, OUTSIDE, None, False, True) == (True, False)
    both = resolve_run(sets=["security.tls=true", "security.private_status=true"]).config
    assert run_protection(both, "127.0.0.1", None, False, False) == (True, True)  # asked for on loopback too
    with pytest.raises(ConfigError, match="--insecure-plaintext"):
        run_protection(both, OUTSIDE, None, True, False)
    with pytest.raises(ConfigError, match="--public-status"):
        run_protection(both, OUTSIDE, None, False, True)


def test_the_address_line_carries_the_tracker_key() -> None:
    key = Identity.generate().public
    line = address_line(f"{OUTSIDE}:7000", key)
    assert split_address(line) == (f"{OUTSIDE}:7000", key)
    assert split_address(f"{OUTSIDE}:7000") == (f"{OUTSIDE}:7000", None)
    with pytest.raises(ConfigError, match="64 hex digits"):
        split_address(f"{OUTSIDE}:7000#abcd")


def test_a_peer_without_the_tracker_key_is_refused_off_loopback_only(tmp_path: Path) -> None:
    key = Identity.generate().public
    with pytest.raises(ConfigError, match="does not know the tracker's key"):
        resolve_access(f"{OUTSIDE}:7000", [], None, TOKEN, None, False, require=True)
    with pytest.raises(ConfigError, match="--initial-peers"):
        resolve_access(None, [f"/ip4/{OUTSIDE}/tcp/7001/p2p/12D3KooWabc"], None, TOKEN, None, False, require=True)
    plain = resolve_access("127.0.0.1:7000", [], None, TOKEN, None, False, require=True)  # loopback: as before
    assert (plain.key, plain.ca, plain.fetch) == (None, None, False)
    access = resolve_access(address_line(f"{OUTSIDE}:7000", key), [], None, TOKEN, None, False, require=True)
    assert (access.tracker, access.key, access.ca, access.fetch) == (
        f"{OUTSIDE}:7000",
        key,
        None,
        True,
    )  # TLS, CA from the tracker
    assert not resolve_access(
        address_line(f"{OUTSIDE}:7000", key), [], None, TOKEN, None, True, require=True
    ).fetch  # --insecure-plaintext
    with pytest.raises(ConfigError, match="two runs"):
        resolve_access(address_line(f"{OUTSIDE}:7000", key), [], Identity.generate().public.hex(), TOKEN, None, False)
    info = tmp_path / "bootstrap.json"  # --token @bootstrap.json gives the key and the CA
    info.write_text(
        '{"token": "%s", "tracker_key": "%s", "tls_ca": "-----BEGIN CERTIFICATE-----x"}' % (TOKEN, key.hex())
    )
    via_file = resolve_access(f"{OUTSIDE}:7000", [], None, f"@{info}", None, False, require=True)
    assert via_file.key == key and via_file.ca and not via_file.fetch


@pytest.mark.processes
def test_the_peer_command_exits_2_naming_where_the_key_is() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "peer.cli", "peer", "--tracker", f"{OUTSIDE}:7000", "--token", TOKEN, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("anchormesh: error: --tracker=") and "HOST:PORT#KEY" in last and "bootstrap.json" in last, (
        res.stderr
    )


@pytest.fixture
def secrets(tmp_path: Path) -> keys.RunSecrets:
    return keys.load_or_create(tmp_path, TOKEN)


def _status(address: str, token: str | None, tls_ca: bytes | None = None) -> pb.RunStatus:
    with auth.tracker_channel(address, auth.Credentials(token=token) if token else None, tls_ca=tls_ca) as ch:
        return pbg.StatusStub(ch).GetStatus(pb.StatusRequest(), timeout=5)


def test_a_private_status_needs_the_token_and_public_status_opens_it(secrets: keys.RunSecrets) -> None:
    cfg = default_run()
    _, private = run_protection(cfg, OUTSIDE, None, False, False)
    server, address = serve_tracker(Tracker(RUN, cfg), "127.0.0.1", 0, secrets, private_status=private)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            _status(address, None)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _status(address, TOKEN).run_id == RUN
    finally:
        server.stop(0)
    _, private = run_protection(cfg, OUTSIDE, None, False, True)  # --public-status
    server, address = serve_tracker(Tracker(RUN, cfg), "127.0.0.1", 0, secrets, private_status=private)
    try:
        assert _status(address, None).run_id == RUN
    finally:
        server.stop(0)


def test_the_tracker_serves_its_ca_vouched_by_its_key(
    tmp_path: Path, secrets: keys.RunSecrets, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = RunCA.load_or_create(tmp_path)
    server, address = serve_tracker(Tracker(RUN, default_run()), "127.0.0.1", 0, secrets, ca, private_status=True)
    plain, plain_address = serve_tracker(Tracker(RUN, default_run()), "127.0.0.1", 0, secrets)
    try:
        fetched = fetch_ca(address, secrets.tracker.public)
        assert fetched == ca.pem
        assert _status(address, TOKEN, fetched).run_id == RUN  # verified TLS with the fetched CA
        with pytest.raises(
            ConfigError, match="not signed by the tracker key"
        ):  # another run's key, or a tracker posing as this one
            fetch_ca(address, Identity.generate().public)
        with pytest.raises(ConfigError, match="does not speak TLS"):
            fetch_ca(plain_address, secrets.tracker.public)
        assert "--insecure-plaintext" in PLAIN_HINT
        # the address line of a loopback tracker: TLS when it speaks it, plain when not (only this machine is on the path)
        assert resolve_access(
            address_line(address, secrets.tracker.public), [], None, TOKEN, None, False, require=True
        ).fetch
        assert run_ca(address, secrets.tracker.public) == ca.pem
        assert run_ca(plain_address, secrets.tracker.public) is None
        monkeypatch.setattr(exposure, "is_loopback", lambda host: False)  # as if the tracker were elsewhere
        with pytest.raises(ConfigError, match="does not speak TLS"):  # off loopback a plain answer is refused
            run_ca(plain_address, secrets.tracker.public)
    finally:
        server.stop(0)
        plain.stop(0)


def test_a_members_certificate_carries_no_ca_to_fetch(tmp_path: Path) -> None:
    """A member serving TLS (its CA-issued certificate) cannot hand out a CA: only the tracker's
    certificate carries one, signed with the tracker key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from peer.security.tls import new_key, public_der, vouched_ca

    ca = RunCA.load_or_create(tmp_path)
    member = x509.load_pem_x509_certificate(ca.issue("peer-abc", public_der(new_key()))).public_bytes(
        serialization.Encoding.DER
    )
    with pytest.raises(ConfigError, match="carries no run CA"):
        vouched_ca(member, Identity.generate().public)


def test_a_health_check_without_the_ca_sees_a_tls_tracker_up(tmp_path: Path, secrets: keys.RunSecrets) -> None:
    """The containers' health checks carry no CA: a server that completes a TLS handshake is up."""
    from peer.client.health import check

    server, address = serve_tracker(
        Tracker(RUN, default_run()), "127.0.0.1", 0, secrets, RunCA.load_or_create(tmp_path), private_status=True
    )
    try:
        ok, line = check(address, tracker=True, timeout_s=5)
        assert ok and "serving TLS" in line, line
    finally:
        server.stop(0)
    ok, line = check(address, tracker=True, timeout_s=2)  # closed now
    assert not ok and "UNAVAILABLE" in line, line


@pytest.mark.parametrize("env_on", [False, True])
def test_status_and_export_take_insecure_plaintext_from_the_flag_or_the_environment(monkeypatch, env_on: bool) -> None:
    """A run whose bootstrap runs with --insecure-plaintext is watched and exported with the same
    flag (or $ANCHORMESH_INSECURE_PLAINTEXT): the TLS hint names it, so these commands take it."""
    from peer.cli import client_commands
    from peer.cli.parser import build_parser
    from peer.security import exposure

    if env_on:
        monkeypatch.setenv("ANCHORMESH_INSECURE_PLAINTEXT", "1")
    seen = []

    class Stop(Exception):
        pass

    def fake(tracker, peers, key, token, ca, plaintext, require=False):
        seen.append(plaintext)
        raise Stop

    monkeypatch.setattr(exposure, "resolve_access", fake)
    flag = [] if env_on else ["--insecure-plaintext"]
    for argv, run in (
        (["status", "--tracker", f"{OUTSIDE}:7000", *flag], client_commands.run_status),
        (["export", "--tracker", f"{OUTSIDE}:7000", "--token", TOKEN, "--out", "x", *flag], client_commands.run_export),
        (["status", "--tracker", f"{OUTSIDE}:7000"], client_commands.run_status),
    ):
        with pytest.raises(Stop):
            run(build_parser().parse_args(argv))
    assert seen == [True, True, env_on]
