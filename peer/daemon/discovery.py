"""Reaching the run before joining it: this peer's node in the run's DHT (`start_dht`), the
tracker's address from the DHT's signed records (`find_tracker`), the run's DHT addresses from the
tracker (`dht_maddrs_from_tracker`), and how every call to the tracker is made (channel options,
the refusals that end a peer).

Apart from membership.py (Join, heartbeat, Leave) because these run before the daemon exists
(`run_peer`), in the order hivemind needs: the DHT starts before any gRPC runs, since it forks.
"""

from __future__ import annotations

import logging
import threading

import grpc

from peer.address import announce_maddr, free_port
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.peer")

# gRPC backs off reconnecting to an address that refused it, up to 120 s by default; a tracker
# that restarts must hear the heartbeats within its reconnect grace (bootstrap/persist.py)
TRACKER_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 4000),
]


# the tracker refused this peer's credentials: retrying cannot help, the operator must act
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def find_tracker(dht, stop: threading.Event, tracker_key: bytes | None = None, run_id: str | None = None) -> str:
    """The tracker address from the DHT's signed records (peer/security/tracker_record.py), newest first: one
    signed by `tracker_key` (and of `run_id` when given). Without a key it takes a record only
    when all well-signed ones have one signer: a member posing as the tracker makes that
    ambiguous, and then it waits for the key. Logs what it refused; retries with backoff."""
    from peer.security import tracker_record

    delay, said = 0.5, set()

    def once(level: int, text: str, *args) -> None:
        if (text, args) not in said:
            said.add((text, args))
            log.log(level, text, *args)

    while not stop.is_set():
        found = dht.get(tracker_record.TRACKER_RECORD_KEY, latest=True)
        good, refused = tracker_record.verified_trackers(found, tracker_key, run_id)
        for signer, why in refused:
            once(logging.WARNING, "refused a tracker record in the DHT signed by %s: %s", signer, why)
        signers = {r["key"] for _, r in good}
        if good and (tracker_key is not None or len(signers) == 1):
            if tracker_key is None:
                once(
                    logging.WARNING,
                    "took the tracker record signed by %s without checking that it is the tracker's key: pass --tracker-key or --token @bootstrap.json",
                    good[0][1]["key"][:16],
                )
            return good[0][1]["tracker"]
        if len(signers) > 1:
            once(
                logging.ERROR,
                'tracker records from %d keys in the DHT: cannot tell the tracker from a member posing as it; pass --tracker-key (the "tracker_key" of bootstrap.json) or --token @bootstrap.json',
                len(signers),
            )
        log.info("no tracker in the DHT yet; retrying in %.1fs", delay)
        stop.wait(delay)
        delay = min(delay * 2, 10.0)
    raise SystemExit(1)


def dht_maddrs_from_tracker(
    tracker: str, stop: threading.Event, creds: auth.Credentials | None = None, tls_ca: bytes | None = None
) -> list[str]:
    """The run's DHT addresses from the tracker's status; retries with backoff and says so.

    The channel is closed before returning: hivemind starts its DHT and averager by fork(), and
    a fork while gRPC calls are running can deadlock, so the daemon forks only between calls.
    """
    delay = 0.5
    while not stop.is_set():
        try:
            with auth.tracker_channel(tracker, creds, tls_ca=tls_ca) as channel:
                return list(pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=10).dht_maddrs)
        except grpc.RpcError as exc:
            if exc.code() in REFUSALS:
                log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                raise SystemExit(2) from None
            log.warning(
                "tracker %s unreachable (%s: %s%s); retrying in %.1fs",
                tracker,
                exc.code().name,
                exc.details(),
                auth.tls_hint(exc.details(), tls_ca is not None),
                delay,
            )
            stop.wait(delay)
            delay = min(delay * 2, 30.0)
    raise SystemExit(1)


def start_dht(
    initial_peers: list[str],
    host: str,
    dht_port: int,
    announce_host: str | None,
    token: str,
    tracker_key: bytes | None,
    tracker_known: bool,
):
    """This node in the run's DHT, started before any gRPC runs (hivemind forks). Only run-token
    holders take part (peer/security/dht_auth.py). When no node of the run answers, a peer
    without a tracker address exits 2; one with it starts alone and lets the Join say whether
    its token is right."""
    import hivemind

    from peer.security import dht_auth

    log.info("starting a DHT node (initial peers: %s)", ", ".join(initial_peers))
    announce = None
    if announce_host:  # others dial this node at the announced host (hivemind needs the port up front)
        dht_port = dht_port or free_port(host)
        announce = [announce_maddr(announce_host, dht_port)]
    # before any gRPC; only run-token holders take part in the run's DHT (peer/security/dht_auth.py)
    dht_args = dict(
        initial_peers=initial_peers,
        host_maddrs=[f"/ip4/{host}/tcp/{dht_port}"],
        announce_maddrs=announce,
        start=True,
        **dht_auth.dht_kwargs(token, tracker_key),
    )
    try:
        dht = hivemind.DHT(**dht_args)
    except RuntimeError as exc:
        if "bootstrap failed" not in str(exc):
            raise
        why = f"no DHT node of the run answered ({', '.join(initial_peers)}): they refuse a node without the run token (check --token), or the addresses are wrong or unreachable"
        if not tracker_known:
            log.error("%s", why)
            raise SystemExit(2) from None
        log.error("%s; asking the tracker whether the token is right", why)  # its Join says so, or the peer trains on
        dht = hivemind.DHT(**dht_args, ensure_bootstrap_success=False)
    log.info("DHT node up")
    return dht
