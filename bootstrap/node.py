"""`anchormesh bootstrap`: the first hivemind DHT node plus the tracker and status gRPC services.

It publishes the tracker's address in the DHT (key `anchormesh/tracker`), so a peer given only
`--initial-peers` finds it, and writes `STATE_DIR/bootstrap.json` =
`{"run_id", "dht_maddrs", "tracker"}` once it accepts peers (the same JSON goes to stdout).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import uuid
from dataclasses import asdict, replace
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from bootstrap import persist
from bootstrap.tracker import JoinRefused, Tracker
from peer.address import announce_maddr, free_port
from peer.atomic import write_atomic
from peer.config import config_from_dict, check_swarm, AnchorConfig, DPConfig, MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.errors import AnchormeshError, ConfigError
from peer.logs import setup_logging
from peer.model.loading import resolve_dims
from peer.model.stages import layer_ranges
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import parse_message
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.bootstrap")
DHT_TRACKER_KEY = "anchormesh/tracker"
DHT_TTL_S = 60.0


def default_run() -> TrainConfig:
    """The tiny default run: 2 stages of the tiny model, low-rank PP codec."""
    return TrainConfig(
        model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128),
        mask=MaskConfig(scheme="lowrank", rank=20, values="int8"),
        anchor=AnchorConfig(every=0),
        # fp32 parameters every 10 steps: the 8-bit deltas showed a +9% eval-loss gap at a
        # 5-step cadence in the throughput bench (docs/benchmarks.md), not yet explained
        dp=DPConfig(inner_steps=10, outer_compression="none"),
        optim=OptimConfig(lr=2e-3),
        pipeline=PipelineConfig(micro_batch_size=8, micro_batches=2, seq_len=128),
        steps=10**9,
    )


class TrackerService(pbg.TrackerServicer):
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.Assignment:
        try:
            a = self.tracker.join(request)
        except JoinRefused as exc:
            log.warning("refused join of %r: %s", request.peer_id, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info("peer %s joined: stage %d, address %s", request.peer_id, a.stage, request.grpc_address)
        return a

    def Heartbeat(self, request_iterator: Iterator[pb.PeerReport], context: grpc.ServicerContext) -> Iterator[pb.Directive]:
        for report in request_iterator:
            try:
                yield self.tracker.report(report)
            except JoinRefused as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.tracker.leave(request)
        log.info("peer %s left: %s", request.peer_id, request.reason)
        return pb.LeaveReply()

    def GetConfig(self, request: pb.ConfigRequest, context: grpc.ServicerContext) -> pb.RunConfig:
        return self.tracker.run_config()


class StatusService(pbg.StatusServicer):
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.RunStatus:
        return self.tracker.status()

    def WatchStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Iterator[pb.RunStatus]:
        interval = min(max(request.interval_s or 1.0, 0.2), 60.0)
        while context.is_active():
            yield self.tracker.status()
            time.sleep(interval)


MAX_REQUEST_BYTES = 1 << 20


def _parse(cls, data: bytes, context: grpc.ServicerContext):
    """A request from raw bytes; bytes that are not a `cls` end the call with INVALID_ARGUMENT
    naming the message (gRPC's own deserializer would answer INTERNAL, as for a server bug)."""
    try:
        return parse_message(cls, data, MAX_REQUEST_BYTES)
    except AnchormeshError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _unary(cls, method, reply_cls) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(lambda data, ctx: method(_parse(cls, data, ctx), ctx), request_deserializer=None, response_serializer=reply_cls.SerializeToString)


def _handlers(tracker: Tracker) -> tuple[grpc.GenericRpcHandler, ...]:
    """The Tracker and Status services on raw bytes (see `_parse`)."""
    t, st = TrackerService(tracker), StatusService(tracker)

    def heartbeat(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[pb.Directive]:
        return t.Heartbeat((_parse(pb.PeerReport, data, ctx) for data in requests), ctx)

    def watch(data: bytes, ctx: grpc.ServicerContext) -> Iterator[pb.RunStatus]:
        return st.WatchStatus(_parse(pb.StatusRequest, data, ctx), ctx)

    return (
        grpc.method_handlers_generic_handler("anchormesh.v1.Tracker", {
            "Join": _unary(pb.JoinRequest, t.Join, pb.Assignment),
            "GetConfig": _unary(pb.ConfigRequest, t.GetConfig, pb.RunConfig),
            "Leave": _unary(pb.LeaveRequest, t.Leave, pb.LeaveReply),
            "Heartbeat": grpc.stream_stream_rpc_method_handler(heartbeat, request_deserializer=None, response_serializer=pb.Directive.SerializeToString),
        }),
        grpc.method_handlers_generic_handler("anchormesh.v1.Status", {
            "GetStatus": _unary(pb.StatusRequest, st.GetStatus, pb.RunStatus),
            "WatchStatus": grpc.unary_stream_rpc_method_handler(watch, request_deserializer=None, response_serializer=pb.RunStatus.SerializeToString),
        }),
    )


def serve_tracker(tracker: Tracker, host: str, port: int) -> tuple[grpc.Server, str]:
    # every peer holds a Heartbeat stream and every `status --watch` a WatchStatus stream: one thread each
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=256),
        maximum_concurrent_rpcs=240,
        options=[("grpc.max_receive_message_length", 1 << 20), ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000), ("grpc.so_reuseport", 0)],  # a second tracker on the port fails instead of sharing it
    )
    server.add_generic_rpc_handlers(_handlers(tracker))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc raises on a taken port (older versions returned 0)
        bound = 0
    if bound == 0:
        raise ConfigError("--port", port, f"cannot bind the tracker on {host}:{port}: the port is taken or the address is not local")
    server.start()
    return server, f"{host}:{bound}"


def run_bootstrap(config: TrainConfig | None, host: str, port: int, dht_port: int, state_dir: Path, peer_timeout_s: float = 10.0, metrics_port: int | None = None, announce_host: str | None = None, new_run: bool = False) -> None:
    """Run until SIGTERM/SIGINT. With `announce_host`, the published tracker address and the DHT's
    multiaddrs name that host instead of the bound one (needed behind 0.0.0.0: peers elsewhere
    cannot dial 0.0.0.0, and hivemind would list the container's own addresses)."""
    import hivemind
    from hivemind.utils import get_dht_time

    setup_logging()
    saved = None if new_run else persist.load(state_dir)
    if saved is not None:  # a restart: the same run, unless the operator asks for another config
        if config is not None and asdict(replace(config, model=resolve_dims(config.model))) != saved["config"]:
            raise ConfigError("--config", "run.toml", f"{state_dir} holds run {saved['run_id']} with another config; pass --new-run to start a new run there, or use another --state-dir")
        config = config_from_dict(saved["config"])
        port = port or saved.get("ports", {}).get("tracker", 0)  # the same address, so peers reconnect
        dht_port = dht_port or saved.get("ports", {}).get("dht", 0)
    config = config or default_run()
    check_swarm(config)  # before anything starts
    config.model = resolve_dims(config.model)
    layer_ranges(config.model.num_layers, config.model.num_stages)  # a bad stage count fails here, not after the DHT is up
    state_dir.mkdir(parents=True, exist_ok=True)
    announce = None
    if announce_host or saved is not None:
        dht_port = dht_port or free_port(host)  # hivemind needs the announced port up front; a run keeps its port
    if announce_host:
        announce = [announce_maddr(announce_host, dht_port)]
    # a persistent identity: the DHT's /p2p/ id (in every peer's --initial-peers) survives a restart
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/{dht_port}"], announce_maddrs=announce, identity_path=str(state_dir / "dht.key"), start=True)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    if saved is not None:
        tracker = persist.restore(saved, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    else:
        tracker = Tracker(f"run-{uuid.uuid4().hex[:8]}", config, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    run_id = tracker.run_id
    server, address = serve_tracker(tracker, host, port)
    ports = {"tracker": int(address.rsplit(":", 1)[1]), "dht": int(maddrs[0].split("/tcp/")[1].split("/")[0]) if maddrs else dht_port}
    if announce_host:
        address = f"{announce_host}:{address.rsplit(':', 1)[1]}"
    metrics = None
    if metrics_port is not None:
        from peer.metrics import serve_metrics
        from peer.status import status_dict

        metrics = serve_metrics(metrics_port, lambda: status_dict(tracker.status()), host=host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics.server_address[1])
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            dht.store(DHT_TRACKER_KEY, {"run_id": run_id, "tracker": address}, get_dht_time() + DHT_TTL_S)
            stop.wait(DHT_TTL_S / 3)

    threading.Thread(target=publish, name="dht-publish", daemon=True).start()

    def keep_state() -> None:  # the run state on disk, so a killed bootstrap resumes it
        while not stop.wait(persist.SAVE_EVERY_S):
            try:
                persist.save(state_dir, persist.snapshot(tracker, ports))
            except OSError as exc:
                log.error("cannot save the tracker state in %s: %s", state_dir, exc)

    persist.save(state_dir, persist.snapshot(tracker, ports))
    threading.Thread(target=keep_state, name="tracker-state", daemon=True).start()
    info = {"run_id": run_id, "dht_maddrs": maddrs, "tracker": address}
    write_atomic(state_dir / "bootstrap.json", json.dumps(info).encode())
    print(json.dumps(info), flush=True)
    log.info("tracker for %s on %s; DHT %s", run_id, address, maddrs[0] if maddrs else "?")
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    persist.save(state_dir, persist.snapshot(tracker, ports))
    server.stop(grace=1).wait()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    dht.shutdown()
