"""`anchormesh health`: one gRPC call that says whether a peer's Stage service or a tracker answers.

Written for container health checks (docker/): it imports no torch (a check every 30 s must be
cheap), prints one line and exits 0 (answers) or 1 (does not, with the address and gRPC status).

A health check does not know the run, so it pings with an empty run id, which a peer answers as a
liveness probe (peer id, stage, step, state). Peers of older versions refused it instead
(INVALID_ARGUMENT naming the server's run); that refusal also comes from a live server that has
joined a run, so it still counts as an answer; any other error does not. A run off loopback serves
TLS, and a check without the run's CA cannot make the call: a server that completes a TLS handshake
on the port counts as up then (the container's check needs no CA).
"""

from __future__ import annotations

import sys

import grpc

from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

# what GrpcTransport's Ping handler says when the run id differs (peer/pipeline/stage_server.py);
# older peers said it to an empty run id too
RUN_REFUSAL = "this server trains run"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def check(address: str, tracker: bool = False, timeout_s: float = 5.0, tls_ca: bytes | None = None) -> tuple[bool, str]:
    """(answers?, the line to print) for the Stage service at `address`, or its Status service with
    `tracker`. Never raises for a gRPC failure: a health check reports, it does not crash."""
    from peer.security.auth import open_channel, tracker_channel

    with (tracker_channel if tracker else open_channel)(address, None, tls_ca=tls_ca) as channel:
        try:
            if tracker:
                s = pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=timeout_s)
                live = sum(p.state not in ("dead", "left") for p in s.peers)
                return (
                    True,
                    f"ok tracker {address}: run {s.run_id}, {s.state or 'state unknown'}, step {s.step}, {live} live peers",
                )
            r = pbg.StageStub(channel).Ping(pb.PingRequest(sender="anchormesh-health"), timeout=timeout_s)
            state = f", {r.state}" if r.state else ""
            return True, f"ok stage server {address}: peer {r.peer_id}, stage {r.stage}, step {r.version}{state}"
        except grpc.RpcError as exc:
            code, details = exc.code(), _one_line(exc.details())
            if not tracker and code == grpc.StatusCode.INVALID_ARGUMENT and RUN_REFUSAL in details:
                return True, f"ok stage server {address}: serving ({details[details.index(RUN_REFUSAL) :]})"
            if (
                tracker and code == grpc.StatusCode.UNAUTHENTICATED
            ):  # security.private_status: it answers, to members only
                return True, f"ok tracker {address}: serving (its status needs the run token)"
            what = "tracker" if tracker else "stage server"
            if tls_ca is None and code == grpc.StatusCode.UNAVAILABLE and _serves_tls(address, timeout_s):
                return True, f"ok {what} {address}: serving TLS (pass --tls-ca to make the call)"
            return False, f"anchormesh health: {what} {address}: {code.name if code else 'UNKNOWN'}: {details}"


def _serves_tls(address: str, timeout_s: float) -> bool:
    """Whether a TLS server answers a handshake at `address` (nothing is verified: liveness only)."""
    import ssl

    from peer.security.tls import leaf_certificate

    try:
        return bool(leaf_certificate(address, timeout_s))
    except (OSError, ssl.SSLError, ValueError):
        return False


def run_health(address: str, tracker: bool = False, timeout_s: float = 5.0, tls_ca: bytes | None = None) -> int:
    """Print the check's line (stdout when it answers, stderr when not); return the exit code."""
    ok, line = check(address, tracker, timeout_s, tls_ca)
    print(line, file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1
