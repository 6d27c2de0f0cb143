"""`anchormesh bootstrap`: the first hivemind DHT node plus the tracker and status gRPC services.

It publishes the tracker's address in the DHT (key `anchormesh/tracker`, signed with the
tracker's Ed25519 key: peer/security/dht_auth.py), so a peer given only `--initial-peers` finds it, and
writes `STATE_DIR/bootstrap.json` = `{"run_id", "dht_maddrs", "tracker", "tracker_key", "token",
"operator"[, "tls_ca"]}` (mode 0600: it holds the run's secrets) once it accepts peers; stdout
gets the same without the secrets. Its DHT node admits only run-token holders (`RunAuthorizer`)
and stores only tracker records its own key signed.

Every call is checked by a `Gate` (peer/security/auth.py): Join takes the run token, Heartbeat and Leave a
member certificate (issued at Join), Ban the operator key, Status the token too when the run is
private. A run off loopback (peer/security/exposure.py) serves TLS and a private status unless
the operator opts out by name (`--insecure-plaintext`, `--public-status`; the `security` settings
ask for them on loopback too); bootstrap.json's "address" (`HOST:PORT#KEY`) carries the tracker key.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import asdict, replace
from pathlib import Path

import grpc

from bootstrap import keys, persist
from bootstrap.prepare import prepare_run
from bootstrap.roster import Banned, JoinRefused
from bootstrap.run_data import DataFiles, data_order, drop_prepared, open_run_data
from bootstrap.tracker import Tracker
from peer.address import announce_maddr, free_port
from peer.atomic import write_atomic
from peer.config import TrainConfig
from peer.dataset.hub import HubData, is_hub
from peer.dataset.shards import PreparedData
from peer.errors import AnchormeshError, ConfigError
from peer.logs import setup_logging
from peer.model.loading import resolve_dims
from peer.runtoml import config_digest, config_from_dict, resolve_run
from peer.security import auth, dht_auth
from peer.security.exposure import address_line, exposed
from peer.security.identity import Identity, certificate_bytes
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.tensors import parse_message

log = logging.getLogger("anchormesh.bootstrap")
DHT_TRACKER_KEY = dht_auth.TRACKER_RECORD_KEY
DHT_TTL_S = 60.0


def default_run() -> TrainConfig:
    """The run of a bootstrap started without --config: the recommended run on the tiny model
    (its departures are `TINY_RUN` in peer/config.py), 2 stages."""
    return resolve_run().config


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


def _same_peer(context: grpc.ServicerContext, peer_id: str) -> None:
    """A member may speak only for itself: the request's peer id must be the certified caller's."""
    caller, _ = auth.caller(context)
    if peer_id != caller:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"peer_id={peer_id!r}: the caller is {caller!r}; a peer speaks only for itself",
        )


class TrackerService(pbg.TrackerServicer):
    def __init__(
        self,
        tracker: Tracker,
        identity: Identity | None = None,
        ca=None,
        files: DataFiles | None = None,
        commit: Callable[[], None] | None = None,
    ) -> None:
        self.tracker, self.identity, self.ca, self.files, self.commit = tracker, identity, ca, files, commit

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.Assignment:
        _, key = auth.caller(context)
        if self.identity is not None:
            _same_peer(context, request.peer_id)
            if not key:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Join needs the peer's identity key ({auth.H_KEY})")
        try:
            a = self.tracker.join(request, key)
        except Banned as exc:
            log.warning("refused join of %r: %s", request.peer_id, exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except JoinRefused as exc:
            log.warning("refused join of %r: %s", request.peer_id, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if self.identity is not None:
            a.certificate = self.identity.sign(certificate_bytes(a.run_id, request.peer_id, key))
            a.tracker_key = self.identity.public
        if self.ca is not None:
            if not request.tls_public_key:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this run uses TLS: the peer must send its tls_public_key; start it with the address line (--tracker HOST:PORT#KEY) or --tls-ca",
                )
            try:
                a.tls_certificate = self.ca.issue(request.peer_id, request.tls_public_key)
            except ConfigError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sec = self.tracker.config.security
        a.calls_per_s, a.messages_per_s = sec.calls_per_s, sec.messages_per_s
        log.info("peer %s joined: stage %d, address %s", request.peer_id, a.stage, request.grpc_address)
        return a

    def Heartbeat(
        self, request_iterator: Iterator[pb.PeerReport], context: grpc.ServicerContext
    ) -> Iterator[pb.Directive]:
        for report in request_iterator:
            if self.identity is not None:
                _same_peer(context, report.peer.peer_id)
            try:
                directive = self.tracker.report(report)
            except Banned as exc:  # banned while its stream was open
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            except JoinRefused as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            if self.commit is not None:  # work handed out or released is on disk before the peer may train it
                self.commit()
            yield directive

    def GetData(self, request: pb.DataRequest, context: grpc.ServicerContext) -> Iterator[pb.DataChunk]:
        if self.files is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this tracker serves no prepared data (a run on hub data: its peers download the shards from the hub)",
            )
        yield from self.files.GetData(request, context)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        if self.identity is not None:
            _same_peer(context, request.peer_id)
        self.tracker.leave(request)
        log.info("peer %s left: %s", request.peer_id, request.reason)
        return pb.LeaveReply()

    def GetConfig(self, request: pb.ConfigRequest, context: grpc.ServicerContext) -> pb.RunConfig:
        return self.tracker.run_config()

    def Ban(self, request: pb.BanRequest, context: grpc.ServicerContext) -> pb.BanReply:
        try:
            banned = self.tracker.ban(request.peer_id, request.reason, request.unban)
        except JoinRefused as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        log.warning(
            "operator %s %s (%s); banned now: %s",
            "readmitted" if request.unban else "banned",
            request.peer_id,
            request.reason or "no reason given",
            "; ".join(banned) or "none",
        )
        return pb.BanReply(banned=banned)


class StatusService(pbg.StatusServicer):
    def __init__(self, tracker: Tracker, gate: auth.Gate | None = None) -> None:
        self.tracker, self.gate = tracker, gate
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)

    def _status(self) -> pb.RunStatus:
        st = self.tracker.status()
        if self.gate is not None:
            st.refused_calls = sum(self.gate.refused.values())
        return st

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.RunStatus:
        return self._status()

    def WatchStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Iterator[pb.RunStatus]:
        """A status stream, within its own budget: each holds a server thread, and anonymous
        watchers must not take the ones Join and the heartbeats need (240 streams did)."""
        if not self._watchers.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_WATCHERS} status streams are open already; use GetStatus (anchormesh status without --watch) or try later",
            )
        ended = threading.Event()  # a watcher that goes away frees its place at once, not after its interval
        context.add_callback(ended.set)
        try:
            interval = min(max(request.interval_s or 1.0, 0.2), 60.0)
            while context.is_active():
                yield self._status()
                ended.wait(interval)
        finally:
            self._watchers.release()


MAX_REQUEST_BYTES = 1 << 20
MAX_WATCHERS = 32  # concurrent WatchStatus streams; the server's other 208 calls stay for peers


def _parse(cls, data: bytes, context: grpc.ServicerContext):
    """A request from raw bytes; bytes that are not a `cls` end the call with INVALID_ARGUMENT
    naming the message (gRPC's own deserializer would answer INTERNAL, as for a server bug)."""
    try:
        return parse_message(cls, data, MAX_REQUEST_BYTES)
    except AnchormeshError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _unary(cls, method, reply_cls) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        lambda data, ctx: method(_parse(cls, data, ctx), ctx),
        request_deserializer=None,
        response_serializer=reply_cls.SerializeToString,
    )


def _handlers(
    tracker: Tracker,
    identity: Identity | None = None,
    gate: auth.Gate | None = None,
    ca=None,
    files: DataFiles | None = None,
    commit: Callable[[], None] | None = None,
) -> tuple[grpc.GenericRpcHandler, ...]:
    """The Tracker and Status services on raw bytes (see `_parse`)."""
    t, st = TrackerService(tracker, identity, ca, files, commit), StatusService(tracker, gate)

    def heartbeat(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[pb.Directive]:
        return t.Heartbeat((_parse(pb.PeerReport, data, ctx) for data in requests), ctx)

    def watch(data: bytes, ctx: grpc.ServicerContext) -> Iterator[pb.RunStatus]:
        return st.WatchStatus(_parse(pb.StatusRequest, data, ctx), ctx)

    def get_data(data: bytes, ctx: grpc.ServicerContext) -> Iterator[pb.DataChunk]:
        return t.GetData(_parse(pb.DataRequest, data, ctx), ctx)

    return (
        grpc.method_handlers_generic_handler(
            "anchormesh.v1.Tracker",
            {
                "Join": _unary(pb.JoinRequest, t.Join, pb.Assignment),
                "GetConfig": _unary(pb.ConfigRequest, t.GetConfig, pb.RunConfig),
                "Leave": _unary(pb.LeaveRequest, t.Leave, pb.LeaveReply),
                "Ban": _unary(pb.BanRequest, t.Ban, pb.BanReply),
                "Heartbeat": grpc.stream_stream_rpc_method_handler(
                    heartbeat, request_deserializer=None, response_serializer=pb.Directive.SerializeToString
                ),
                "GetData": grpc.unary_stream_rpc_method_handler(
                    get_data, request_deserializer=None, response_serializer=pb.DataChunk.SerializeToString
                ),
            },
        ),
        grpc.method_handlers_generic_handler(
            "anchormesh.v1.Status",
            {
                "GetStatus": _unary(pb.StatusRequest, st.GetStatus, pb.RunStatus),
                "WatchStatus": grpc.unary_stream_rpc_method_handler(
                    watch, request_deserializer=None, response_serializer=pb.RunStatus.SerializeToString
                ),
            },
        ),
    )


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
) -> tuple[grpc.Server, str]:
    """The Tracker and Status services; with `secrets` every call goes through a Gate (tests may
    leave it out to drive the services bare). With `ca` (peer/tls.RunCA) it serves TLS, vouched
    by the tracker's key, and certifies joining peers' TLS keys. `files` serves the run's
    prepared data (GetData); `commit` runs before each heartbeat reply (the bootstrap saves a
    changed data order); `private_status` as `tracker_policy`."""
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
    server.add_generic_rpc_handlers(_handlers(tracker, secrets.tracker if secrets else None, gate, ca, files, commit))
    try:
        if ca is not None:
            bound = server.add_secure_port(
                f"{host}:{port}",
                grpc.ssl_server_credentials([ca.server_pair(tracker_key=secrets.tracker if secrets else None)]),
            )
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc raises on a taken port (older versions returned 0)
        bound = 0
    if bound == 0:
        raise ConfigError(
            "--port", port, f"cannot bind the tracker on {host}:{port}: the port is taken or the address is not local"
        )
    server.start()
    return server, f"{host}:{bound}"


def run_protection(
    config: TrainConfig, host: str, announce_host: str | None, insecure_plaintext: bool, public_status: bool
) -> tuple[bool, bool]:
    """(TLS, private status) of a run: on when the config asks, or when an address is off
    loopback and the operator did not opt out; an opt-out against the config's ask is refused."""
    if insecure_plaintext and config.security.tls:
        raise ConfigError("--insecure-plaintext", True, "the run config sets security.tls = true")
    if public_status and config.security.private_status:
        raise ConfigError("--public-status", True, "the run config sets security.private_status = true")
    off_loopback = exposed([host, announce_host])
    tls = config.security.tls or (off_loopback and not insecure_plaintext)
    if off_loopback and not tls:
        log.warning(
            "UNSAFE: --insecure-plaintext on %s: activations, gradients and token ids cross the network in the clear",
            announce_host or host,
        )
    return tls, config.security.private_status or (off_loopback and not public_status)


def attach_data(tracker: Tracker, data) -> None:
    """The run's prepared data on the tracker: a new run's order, or the saved one checked against the data."""
    order, tracker.eval_windows = data_order(data, tracker.config)
    if tracker.data is None:
        tracker.data = order
    elif tracker.data.windows != order.windows:
        raise ConfigError(
            "data",
            str(data.folder),
            f"holds {order.windows} training windows; the saved run's order covers {tracker.data.windows}: the data changed under the run (pass --new-run)",
        )
    tracker.data.budget = order.budget  # the run.toml's budget, also for a resumed order
    tracker.data_manifest = data.manifest.to_json().decode()
    tracker.data_hub = data.hub if isinstance(data, HubData) else ""
    log.info(
        "data: %s, %d training windows of %d tokens, epoch %d at window %d; %d eval windows",
        data.manifest.source,
        order.windows,
        order.seq_len,
        tracker.data.epoch,
        tracker.data.cursor,
        tracker.eval_windows,
    )


def run_bootstrap(
    config: TrainConfig | None,
    host: str,
    port: int,
    dht_port: int,
    state_dir: Path,
    peer_timeout_s: float = 10.0,
    metrics_port: int | None = None,
    announce_host: str | None = None,
    new_run: bool = False,
    token: str | None = None,
    insecure_plaintext: bool = False,
    public_status: bool = False,
) -> None:
    """Run until SIGTERM/SIGINT. With `announce_host`, the published tracker address and the DHT's
    multiaddrs name that host instead of the bound one (needed behind 0.0.0.0: peers elsewhere
    cannot dial 0.0.0.0, and hivemind would list the container's own addresses). `token` sets
    the run token (default: the stored one, or a new random one). Off loopback the run uses TLS
    and a private status unless `insecure_plaintext` / `public_status` say otherwise."""
    import hivemind

    setup_logging()
    saved = None if new_run else persist.load(state_dir)
    if saved is not None:  # a restart: the same run, unless the operator asks for another config
        if config is not None and asdict(replace(config, model=resolve_dims(config.model))) != saved["config"]:
            raise ConfigError(
                "--config",
                "run.toml",
                f"{state_dir} holds run {saved['run_id']} with another config; pass --new-run to start a new run there, or use another --state-dir",
            )
        config = config_from_dict(saved["config"])
        port = port or saved.get("ports", {}).get("tracker", 0)  # the same address, so peers reconnect
        dht_port = dht_port or saved.get("ports", {}).get("dht", 0)
    config = prepare_run(
        config or default_run()
    )  # before anything starts: a bad config fails here, not after the DHT is up
    state_dir.mkdir(parents=True, exist_ok=True)
    if saved is None:
        keys.forget(state_dir)  # a new run: the old run's certificates must not admit anyone
        if not config.data.prepared or is_hub(
            config.data.prepared
        ):  # ... and the data it prepared or pinned may be another config's (an operator's folder is never touched)
            drop_prepared(state_dir)
    data = open_run_data(config, state_dir)  # before the DHT: preparing may take a while, and a bad source fails here
    secrets = keys.load_or_create(state_dir, token)
    tls, private = run_protection(config, host, announce_host, insecure_plaintext, public_status)
    ca = None
    if tls:
        from peer.security.tls import RunCA

        ca = RunCA.load_or_create(state_dir)
    announce = None
    if announce_host or saved is not None:
        dht_port = dht_port or free_port(host)  # hivemind needs the announced port up front; a run keeps its port
    if announce_host:
        announce = [announce_maddr(announce_host, dht_port)]
    # a persistent identity: the DHT's /p2p/ id (in every peer's --initial-peers) survives a restart;
    # only run-token holders take part, and only this tracker's signed record lands under its key
    dht = hivemind.DHT(
        host_maddrs=[f"/ip4/{host}/tcp/{dht_port}"],
        announce_maddrs=announce,
        identity_path=str(state_dir / "dht.key"),
        start=True,
        **dht_auth.dht_kwargs(secrets.token, secrets.tracker.public),
    )
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    if saved is not None:
        tracker = persist.restore(saved, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    else:
        tracker = Tracker(f"run-{uuid.uuid4().hex[:8]}", config, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    attach_data(tracker, data)
    run_id = tracker.run_id
    ports: dict[str, int] = {}
    saver = persist.StateSaver(tracker, state_dir, ports)
    files = DataFiles(data) if isinstance(data, PreparedData) else None  # data on the hub: peers download it there
    server, address = serve_tracker(tracker, host, port, secrets, ca, files, saver.commit, private_status=private)
    ports |= {
        "tracker": int(address.rsplit(":", 1)[1]),
        "dht": int(maddrs[0].split("/tcp/")[1].split("/")[0]) if maddrs else dht_port,
    }
    if announce_host:
        address = f"{announce_host}:{address.rsplit(':', 1)[1]}"
    metrics = None
    if metrics_port is not None:
        from peer.client.view import status_dict
        from peer.metrics import serve_metrics

        metrics = serve_metrics(metrics_port, lambda: status_dict(tracker.status()), host=host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics.server_address[1])
    stop = threading.Event()

    def publish() -> None:  # signed: peers take only a record of this tracker's key (peer/security/dht_auth.py)
        while not stop.is_set():
            dht_auth.publish_tracker(dht, secrets.tracker, run_id, address, DHT_TTL_S)
            stop.wait(DHT_TTL_S / 3)

    threading.Thread(target=publish, name="dht-publish", daemon=True).start()

    def keep_state() -> None:  # the run state on disk, so a killed bootstrap resumes it
        while not stop.wait(persist.SAVE_EVERY_S):
            try:
                saver.save()
            except OSError as exc:
                log.error("cannot save the tracker state in %s: %s", state_dir, exc)

    saver.save()
    threading.Thread(target=keep_state, name="tracker-state", daemon=True).start()
    # public: the address line carries the tracker key, which checks its DHT record and its TLS CA
    info = {
        "run_id": run_id,
        "dht_maddrs": maddrs,
        "tracker": address,
        "tracker_key": secrets.tracker.public.hex(),
        "address": address_line(address, secrets.tracker.public),
    }
    if ca is not None:
        info["tls_ca"] = ca.pem.decode()
    write_atomic(
        state_dir / "bootstrap.json",
        json.dumps({**info, "token": secrets.token, "operator": secrets.operator}).encode(),
        mode=0o600,
    )
    print(
        json.dumps({k: v for k, v in info.items() if k != "tls_ca"}), flush=True
    )  # no secrets on stdout: logs get shared
    log.info(
        "tracker for %s on %s%s, status %s; DHT %s; the run token is in %s",
        run_id,
        address,
        " (TLS)" if ca else " (plaintext)",
        "private" if private else "public",
        maddrs[0] if maddrs else "?",
        state_dir / "bootstrap.json",
    )
    log.info("volunteers join with --tracker %s and the run token", info["address"])
    log.info(
        "run config %s (model %s, %d stages, codec %s): `anchormesh config show` prints a run.toml's settings",
        config_digest(tracker.config),
        tracker.config.model.name,
        tracker.config.model.num_stages,
        tracker.config.mask.scheme,
    )
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    saver.save()
    server.stop(grace=1).wait()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    dht.shutdown()
