"""The tracker's gRPC services: what each Tracker and Status call does, on raw request bytes.

Kept apart from the process that runs them (bootstrap/node.py) and from how they listen and who
may call what (bootstrap/server.py): a reader of a call's behaviour opens this file only. Tests
drive these services through `serve_tracker` without the DHT.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from bootstrap.dial_back import Busy, DialBack, Unreachable
from bootstrap.roster import Banned, JoinRefused
from bootstrap.run_data import DataFiles
from bootstrap.tracker import Tracker
from peer.address import REFUSAL_KEY, UNREACHABLE
from peer.errors import AnchormeshError, ConfigError
from peer.security import auth
from peer.security.identity import Identity, certificate_bytes
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.tensors import parse_message

log = logging.getLogger("anchormesh.bootstrap")
MAX_REQUEST_BYTES = 1 << 20
MAX_WATCHERS = 32  # concurrent WatchStatus streams; the server's other 208 calls stay for peers


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
        dial_back: DialBack | None = None,
    ) -> None:
        self.tracker, self.identity, self.ca, self.files, self.commit = tracker, identity, ca, files, commit
        self.dial_back = dial_back  # None: joiners' addresses are not checked (--no-dial-back)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.Assignment:
        _, key = auth.caller(context)
        if self.identity is not None:
            _same_peer(context, request.peer_id)
            if not key:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Join needs the peer's identity key ({auth.H_KEY})")
        try:
            if self.dial_back is not None:
                self.tracker.admissible(request, key)  # a wrong build hears that, not that it is unreachable
                self.dial_back.check(request)
            a = self.tracker.join(request, key)
        except Unreachable as exc:
            log.warning("refused join of %r: %s", request.peer_id, exc)
            context.set_trailing_metadata(((REFUSAL_KEY, UNREACHABLE),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Busy as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
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


def handlers(
    tracker: Tracker,
    identity: Identity | None = None,
    gate: auth.Gate | None = None,
    ca=None,
    files: DataFiles | None = None,
    commit: Callable[[], None] | None = None,
    dial_back: DialBack | None = None,
) -> tuple[grpc.GenericRpcHandler, ...]:
    """The Tracker and Status services on raw bytes (see `_parse`)."""
    t, st = TrackerService(tracker, identity, ca, files, commit, dial_back), StatusService(tracker, gate)

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
