"""Dial-back at Join: before it admits a peer, the tracker checks that the addresses the peer
announced answer, and refuses the Join with what failed and what to forward when none does.

Why: a peer behind NAT or a closed port joins fine (it dials out), then every stage mate's call
to it times out and the run stalls on it while the volunteer sees nothing wrong. Refused at
Join, the volunteer reads which address failed and which port to forward.

What is dialed: a TCP connect (no gRPC, no TLS: cheap, and the peer's Stage server accepts
connections from the moment its port is bound, before it starts serving) to the peer's gRPC
address and to the host:port of each of its announced DHT multiaddrs, all at once, each within
`timeout_s`. One that answers admits the peer. At most `max_dialing` Joins dial at once (each
holds a server thread for up to `timeout_s`); more are answered UNAVAILABLE and the peer retries.
`anchormesh bootstrap --no-dial-back` turns the check off (a tracker that cannot reach its
peers' networks by design, e.g. one behind a one-way tunnel).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from concurrent import futures

from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.bootstrap")
DIAL_TIMEOUT_S = 3.0
MAX_DIALING = 16  # Joins dialing back at once
MAX_TARGETS = 5  # the gRPC address and up to 4 DHT multiaddrs (the tracker keeps 4 per peer)


class Unreachable(Exception):
    """No address the peer announced answered; the message says which were tried, why each failed
    and what to forward."""


class Busy(Exception):
    """`max_dialing` Joins are dialing back already; the peer retries its Join."""


def _unspecified_or_loopback(host: str) -> tuple[bool, bool]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False, host == "localhost"
    return ip.is_unspecified, ip.is_loopback


def targets(req: pb.JoinRequest) -> list[tuple[str, str, int]]:
    """(what, host, port) to dial for a JoinRequest: its gRPC address first, then the TCP multiaddrs
    (/ip4, /ip6, /dns*; no relays, no UDP). A loopback DHT address is dialed only when the gRPC
    address is on loopback too (hivemind lists 127.0.0.1 among a peer's addresses; from another
    machine that would reach the tracker's own host)."""
    out: list[tuple[str, str, int]] = []
    host, _, port = req.grpc_address.rpartition(":")
    host = host.strip("[]")
    if host and port.isdigit():
        out.append(("gRPC", host, int(port)))
    grpc_loopback = bool(out) and _unspecified_or_loopback(host)[1]
    for m in req.dht_maddrs:
        parts = m.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
            continue
        if "p2p-circuit" in parts or not parts[4].isdigit():
            continue
        if _unspecified_or_loopback(parts[2])[1] and not grpc_loopback:
            continue
        if ("DHT", parts[2], int(parts[4])) not in out:
            out.append(("DHT", parts[2], int(parts[4])))
    return out[:MAX_TARGETS]


def dial(host: str, port: int, timeout_s: float) -> str:
    """Why `host:port` cannot be reached by TCP within `timeout_s`, or "" when it answers."""
    if _unspecified_or_loopback(host)[0]:
        return f"{host} is no address another machine can dial"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refusal(tried: list[tuple[str, str, int, str]]) -> str:
    """The message of a refused Join: every address tried with its error, and what to forward."""
    if not tried:
        return "tracker could not reach this peer: it announced no address to dial (grpc_address is not host:port)"
    what, host, port, why = tried[0]
    head = f"tracker could not reach {_hostport(host, port)} ({why})"
    more = "".join(f"; nor {w} {_hostport(h, p)} ({e})" for w, h, p, e in tried[1:])
    ports = ", ".join(dict.fromkeys(str(p) for _, _, p, _ in tried))
    return (
        f"{head}{more}: forward TCP {ports} to this machine (fix them with --grpc-port / --dht-port) "
        "or pass --announce-host with the address other machines reach it at"
    )


class DialBack:
    """The dial-back check of one tracker; `check` is called from Join's server thread.

    Args:
        timeout_s: how long each address may take to answer.
        max_dialing: Joins checked at once; one more raises `Busy` at once.
        dial: the probe (tests pass a fake): (host, port, timeout_s) -> error text, "" when it answers.
    """

    def __init__(
        self,
        timeout_s: float = DIAL_TIMEOUT_S,
        max_dialing: int = MAX_DIALING,
        dial: Callable[[str, int, float], str] = dial,
    ) -> None:
        self.timeout_s, self.dial = timeout_s, dial
        self._slots = threading.BoundedSemaphore(max_dialing)
        self._pool = futures.ThreadPoolExecutor(max_workers=max_dialing * 2, thread_name_prefix="dial-back")

    def check(self, req: pb.JoinRequest) -> None:
        """Return when one of the peer's addresses answers; raise `Unreachable` when none does."""
        if not self._slots.acquire(blocking=False):
            raise Busy("the tracker is checking other joiners' addresses; retry")
        try:
            plan = targets(req)
            pending = {self._pool.submit(self.dial, h, p, self.timeout_s): (w, h, p) for w, h, p in plan}
            errors: dict[tuple[str, str, int], str] = {}
            try:
                for f in futures.as_completed(pending, timeout=self.timeout_s + 1.0):
                    why = f.result()
                    if not why:
                        if plan[0] in errors:
                            log.warning("peer %s: its gRPC address did not answer, its DHT did", req.peer_id)
                        return
                    errors[pending[f]] = why
            except futures.TimeoutError:
                pass
            tried = [(w, h, p, errors.get((w, h, p), f"no answer in {self.timeout_s:g} s")) for w, h, p in plan]
            raise Unreachable(refusal(tried))
        finally:
            self._slots.release()
