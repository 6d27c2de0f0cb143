"""Whether a run is on the public network, and the address line that carries the tracker's key.

Why a rule and not a setting: TLS, a private status and a pinned tracker key were opt-in, so a
run across the internet sent its activations and token ids in the clear unless its operator knew
to ask. A run whose addresses are all loopback (tests, `make demo`) reaches nobody else and stays
plain and open; any other address turns the protections on (the bootstrap's `--insecure-plaintext`
and `--public-status` turn them off again, by name).

The address line is what a volunteer copies to join: `HOST:PORT#KEY`, the tracker's address and
its Ed25519 public key (hex). With the key a peer takes only the tracker's DHT record and checks
the run's TLS CA the tracker serves (peer/security/tls.py: `fetch_ca`), so no certificate has to
be handed out.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from peer.errors import ConfigError
from peer.security.identity import KEY_BYTES

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})
KEY_MARK = "#"
log = logging.getLogger("anchormesh.peer")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a loopback name; 0.0.0.0, other addresses and other names are not
    (a bound 0.0.0.0 answers on every interface; a name may point anywhere)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed(hosts: Iterable[str | None]) -> bool:
    """Whether any of `hosts` (None: not given) is off loopback: then the run is on a network."""
    return any(h is not None and not is_loopback(h) for h in hosts)


def split_address(value: str) -> tuple[str, bytes | None]:
    """`HOST:PORT#KEY` -> (`HOST:PORT`, key); a plain `HOST:PORT` -> (it, None)."""
    address, mark, key_hex = value.partition(KEY_MARK)
    if not mark:
        return value, None
    try:
        key = bytes.fromhex(key_hex.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            "--tracker",
            value,
            f"the part after '{KEY_MARK}' must be the tracker's key, {2 * KEY_BYTES} hex digits (the \"address\" of bootstrap.json)",
        )
    return address, key


def address_line(address: str, key: bytes) -> str:
    """What a volunteer copies: the tracker's `HOST:PORT` and its public key."""
    return f"{address}{KEY_MARK}{key.hex()}"


def pick_key(flag_key: bytes | None, line_key: bytes | None) -> bytes | None:
    """The tracker key from --tracker-key (or bootstrap.json) and from the address line; two that
    differ name two runs, which is refused."""
    if flag_key is not None and line_key is not None and flag_key != line_key:
        raise ConfigError(
            "--tracker-key",
            flag_key.hex()[:16] + "...",
            f"differs from the key in --tracker ({line_key.hex()[:16]}...): they name two runs",
        )
    return flag_key if flag_key is not None else line_key


NO_KEY_HINT = (
    "the tracker is not on this machine and the peer does not know the tracker's key: pass --tracker HOST:PORT#KEY "
    '(the "address" of the operator\'s bootstrap.json), --tracker-key KEY or --token @bootstrap.json'
)


def require_key(hosts: Iterable[str | None], key: bytes | None, where: str, value: object) -> None:
    """A peer off loopback without the tracker's key would follow a member's lone tracker record
    (or wait for ever between two): refuse to start instead, saying where the key is."""
    if key is None and exposed(hosts):
        raise ConfigError(where, value, NO_KEY_HINT)


@dataclass
class Access:
    """How a client reaches the run: the tracker (`HOST:PORT`; None: found through the DHT), its
    key, the run CA when a file gave it, and whether TLS is on with a CA to fetch from the tracker."""

    tracker: str | None
    key: bytes | None
    ca: bytes | None
    fetch: bool


def _hosts(tracker: str | None, initial_peers: Sequence[str]) -> list[str]:
    from peer.address import host_of

    try:
        return [host_of(tracker)] if tracker else [host_of(m) for m in initial_peers]
    except ValueError as exc:
        raise ConfigError(
            "--tracker" if tracker else "--initial-peers", tracker or " ".join(initial_peers), str(exc)
        ) from None


def _ca_in_json(token_arg: str | None) -> bytes | None:
    """The "tls_ca" of the bootstrap.json that `--token @FILE` names, if any."""
    if not token_arg or not token_arg.startswith("@"):
        return None
    try:
        text = Path(token_arg[1:]).read_text()
        ca = json.loads(text).get("tls_ca") if text.lstrip().startswith("{") else None
    except (OSError, ValueError):
        return None
    return ca.encode() if isinstance(ca, str) and "BEGIN CERTIFICATE" in ca else None


def resolve_access(
    tracker_arg: str | None,
    initial_peers: Sequence[str],
    key_arg: str | None,
    token_arg: str | None,
    tls_ca_arg: str | None,
    plaintext: bool,
    require: bool = False,
) -> Access:
    """The tracker, its key and the TLS to use, from a client's flags. Off loopback TLS is on
    (the CA from --tls-ca, a bootstrap.json, or fetched from the tracker and checked with its
    key) unless `plaintext`; with `require` (a peer) a missing key off loopback is refused."""
    from peer.security.tls import read_ca
    from peer.security.tracker_record import read_tracker_key

    tracker, line_key = split_address(tracker_arg) if tracker_arg else (None, None)
    key = pick_key(read_tracker_key(key_arg, token_arg), line_key)
    hosts = _hosts(tracker, initial_peers)
    if require:
        require_key(hosts, key, "--tracker" if tracker else "--initial-peers", tracker or " ".join(initial_peers))
    ca = read_ca(tls_ca_arg) or _ca_in_json(token_arg)
    # with the key in the address line a loopback tracker is asked too: a run announced elsewhere uses TLS
    return Access(
        tracker,
        key,
        ca,
        fetch=ca is None and key is not None and not plaintext and (exposed(hosts) or line_key is not None),
    )


def run_ca(tracker: str, key: bytes, stop: threading.Event | None = None) -> bytes | None:
    """The run CA fetched from the tracker and checked with its key. With `stop` it retries while
    the tracker does not answer (a peer started before its bootstrap); without, one try. A
    tracker on loopback that speaks no TLS is dialled plain (None): only this machine is on that
    path; anywhere else that is refused."""
    from peer.address import host_of
    from peer.security.tls import PlainTracker, fetch_ca

    delay = 0.5
    while True:
        try:
            return fetch_ca(tracker, key)
        except PlainTracker:
            if is_loopback(host_of(tracker)):
                return None
            raise
        except OSError as exc:
            if stop is None:
                raise SystemExit(f"anchormesh: tracker {tracker} unreachable: {exc.strerror or exc}") from None
            log.warning(
                "tracker %s unreachable for its TLS CA (%s); retrying in %.1fs", tracker, exc.strerror or exc, delay
            )
            if stop.wait(delay):
                raise SystemExit(1) from None
            delay = min(delay * 2, 30.0)


def client_ca(access: Access) -> bytes | None:
    """What a one-shot client (`status`) dials with: the given CA, the fetched one, or None (plain)."""
    if access.fetch and access.tracker is not None and access.key is not None:
        return run_ca(access.tracker, access.key)
    return access.ca
