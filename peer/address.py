"""Which address a node tells others to dial: announced hosts, their multiaddrs, `auto`.

Why one module: the bootstrap and the peer both bind one address (often 0.0.0.0) and must
publish another; libp2p wants the published DHT port up front, and a volunteer behind Docker or
a LAN should not have to look up their own address by hand.
"""

from __future__ import annotations

import ipaddress
import socket

AUTO = "auto"
# a Join the tracker refused because it could not dial the peer's announced addresses back
# (bootstrap/dial_back.py) carries this trailing metadata: the peer exits 1 (a runtime fault), not 2
REFUSAL_KEY, UNREACHABLE = "anchormesh-refusal", "unreachable"


def announce_maddr(announce_host: str, port: int) -> str:
    """The multiaddr other nodes dial for `announce_host`: /ip4 or /ip6 for an address, /dns4 for a
    name (a compose service name, a domain; libp2p resolves it when dialing)."""
    try:
        ip = ipaddress.ip_address(announce_host)
    except ValueError:
        return f"/dns4/{announce_host}/tcp/{port}"
    return f"/ip{ip.version}/{announce_host}/tcp/{port}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_of(target: str) -> str:
    """The host of a `host:port` or of a multiaddr (`/ip4/H/tcp/P/...`, `/dns4/H/...`)."""
    if target.startswith("/"):
        parts = target.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            return parts[2]
        raise ValueError(f"{target!r}: not an /ip4, /ip6 or /dns multiaddr")
    host, sep, _ = target.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{target!r}: expected host:port")
    return host.strip("[]")


def outward_address(target: str) -> str:
    """The local address this machine uses to reach `target` (`host:port` or a multiaddr): the
    interface the kernel routes that way. A UDP `connect` picks the route without sending
    anything. Right on a LAN, on a public host and with `docker run --network host`; behind NAT
    or a port forward the public address must be given instead (the kernel cannot know it)."""
    host = host_of(target)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc.strerror}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as exc:
            raise ValueError(f"no route to {host!r}: {exc.strerror}") from None
        return s.getsockname()[0]


def add_port(server, address: str, credentials=None) -> int:
    """Bind a gRPC `server` to `address` (TLS when `credentials` are given); the port bound, 0 when
    it could not be: grpc raises on a taken port in some versions and returns 0 in others."""
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0
