"""How the tracker listens: its gRPC server, TLS, and the gate that says which credential each
call takes (peer/security/auth.py).

Apart from the services (bootstrap/services.py) because this is the security boundary: the
method policy, the admission budget and the server's limits read together here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

from bootstrap import keys
from bootstrap.dial_back import DialBack
from bootstrap.run_data import DataFiles
from bootstrap.services import MAX_WATCHERS, handlers
from bootstrap.tracker import Tracker
from peer.address import add_port
from peer.config import TrainConfig
from peer.errors import ConfigError
from peer.security import auth


def tracker_policy(config: TrainConfig, private_status: bool | None = None) -> dict[str, frozenset[str]]:
    """Which credentials each tracker method takes (peer/security/auth.py); `private_status`
    (None: the config's `security.private_status`) closes the status to outsiders."""
    private = config.security.private_status if private_status is None else private_status
    watch = frozenset({auth.TOKEN, auth.MEMBER, auth.OPERATOR}) if private else frozenset({auth.OPEN})
    return {
        "/anchormesh.v1.Tracker/Join": frozenset({auth.TOKEN, auth.MEMBER}),
        "/anchormesh.v1.Tracker/GetConfig": frozenset({auth.TOKEN, auth.MEMBER, auth.OPERATOR}),
        "/anchormesh.v1.Tracker/Heartbeat": frozenset({auth.MEMBER}),
        "/anchormesh.v1.Tracker/GetData": frozenset({auth.MEMBER}),  # the run's data is for its members only
        "/anchormesh.v1.Tracker/Leave": frozenset({auth.MEMBER}),
        "/anchormesh.v1.Tracker/Ban": frozenset({auth.OPERATOR}),
        "/anchormesh.v1.Status/GetStatus": watch,
        "/anchormesh.v1.Status/WatchStatus": watch,
    }


def tracker_gate(tracker: Tracker, secrets: keys.RunSecrets, private_status: bool | None = None) -> auth.Gate:
    """The tracker's gate; it shares the tracker's ban list (a ban takes effect on the next call)."""
    sec = tracker.config.security
    return auth.Gate(
        tracker_policy(tracker.config, private_status),
        token=secrets.token,
        operator=secrets.operator,
        tracker_key=secrets.tracker.public,
        run_id=tracker.run_id,
        calls_per_s=sec.calls_per_s,
        banned=tracker.banned,
    )


def serve_tracker(
    tracker: Tracker,
    host: str,
    port: int,
    secrets: keys.RunSecrets | None = None,
    ca=None,
    files: DataFiles | None = None,
    commit: Callable[[], None] | None = None,
    private_status: bool | None = None,
    dial_back: bool = True,
) -> tuple[grpc.Server, str]:
    """The Tracker and Status services; with `secrets` every call goes through a Gate (tests may
        leave it out to drive the services bare). With `ca` (peer/tls.RunCA) it serves TLS, vouched
        by the tracker's key, and certifies joining peers' TLS keys. `files` serves the run's
        prepared data (GetData); `commit` runs before each heartbeat reply (the bootstrap saves a
        changed data order); `private_status` as `tracker_policy`. `dial_back`: Join checks that the
    peer's announced addresses answer (bootstrap/dial_back.py); off with `--no-dial-back`."""
    gate = tracker_gate(tracker, secrets, private_status) if secrets is not None else None
    if (
        gate is not None
    ):  # anonymous calls (the status: watchers and 16 more) take at most 48 of the 240: Join and heartbeats keep the rest
        sec = tracker.config.security
        gate.admission = auth.Admission(
            receive_deadline_s=sec.receive_deadline_s,
            open_calls=MAX_WATCHERS + 16,
            open_calls_per_host=sec.open_calls_per_host,
        )
    # every peer holds a Heartbeat stream and every `status --watch` a WatchStatus stream: one thread each
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=256),
        maximum_concurrent_rpcs=240,
        interceptors=[gate] if gate is not None else None,
        # no SO_REUSEPORT: a second tracker on the port fails instead of sharing it; no compressed
        # calls: gRPC would inflate them before any size check
        options=[
            ("grpc.max_receive_message_length", 1 << 20),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.so_reuseport", 0),
            ("grpc.compression_enabled_algorithms_bitset", 1),
        ],
    )
    checker = DialBack() if dial_back else None
    server.add_generic_rpc_handlers(
        handlers(tracker, secrets.tracker if secrets else None, gate, ca, files, commit, checker)
    )
    credentials = (
        grpc.ssl_server_credentials([ca.server_pair(tracker_key=secrets.tracker if secrets else None)])
        if ca is not None
        else None
    )
    bound = add_port(server, f"{host}:{port}", credentials)
    if bound == 0:
        raise ConfigError(
            "--port", port, f"cannot bind the tracker on {host}:{port}: the port is taken or the address is not local"
        )
    server.start()
    return server, f"{host}:{bound}"
