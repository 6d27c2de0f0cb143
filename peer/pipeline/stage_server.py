"""The serving half of the gRPC transport (peer/pipeline/grpc_transport.py): the `Stage` service.

Why a module of its own: what a peer accepts is the security boundary, and it reads best apart
from how a peer sends. Each local worker address gets its own gRPC server; requests arrive as
raw bytes, and a stream's handler bounds their size, parses them, checks the run id, that
header.sender is the authenticated caller (in a swarm), the sender's message rate, and the
owner's validator before anything is queued for the worker. A chunk that fails ends its stream
with INVALID_ARGUMENT naming the problem; the server keeps serving. Ping and GetShard are small
unary requests answered by the callables the transport was given.

`StageServing` holds no state of its own: `GrpcTransport` sets the fields it reads (run_id, host,
gate, tls_server, messages, shard_source, ping_info, _validators, _servers, endpoints, _inbox,
_arrived, rejected, rejected_count, bytes_in, max_bytes, _options).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from peer.address import add_port
from peer.errors import AnchormeshError, WireError
from peer.pipeline.transport import CHANNELS, Address
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import parse_message

log = logging.getLogger(__name__)
STAGE_CALLS = 64  # concurrent calls of one Stage server: every neighbour's few streams, a state download, Pings
MAX_INBOX = 512  # messages queued per (served address, channel) before senders are told to slow down


def log_now(n: int) -> bool:
    """Whether the n-th occurrence of a repeated event gets a log line: the first ten, then every hundredth."""
    return n <= 10 or n % 100 == 0


SERVICE = "anchormesh.v1.Stage"
METHOD = {
    "forward": "Forward",
    "backward": "Backward",
    "anchor_forward": "AnchorForward",
    "anchor_backward": "AnchorBackward",
    "prior": "Prior",
}
MESSAGE = {
    "forward": pb.ActivationChunk,
    "backward": pb.GradientChunk,
    "anchor_forward": pb.ActivationChunk,
    "anchor_backward": pb.GradientChunk,
    "prior": pb.AnchorPrior,
}
# (channel, parsed message) -> None, or raises AnchormeshError naming the problem
Validator = Callable[[str, object], None]
# destination -> PingReply fields (peer_id, stage, version, state)
PingInfo = Callable[[Address], pb.PingReply]
# (destination, ShardRequest) -> the stage's weights as ShardChunks (raises AnchormeshError when it has none)
ShardSource = Callable[[Address, pb.ShardRequest], Iterator[pb.ShardChunk]]


def default_ping_info(dst: Address) -> pb.PingReply:
    """A local worker (stage, replica) names itself "stage<k>.r<replica>"; any other address
    (a swarm peer's id) is its own name."""
    if isinstance(dst, tuple):
        return pb.PingReply(peer_id=f"stage{dst[0]}.r{dst[1]}", stage=dst[0])
    return pb.PingReply(peer_id=str(dst))


class StageServing:
    """The `Stage` server side of `GrpcTransport` (a mixin: the transport holds the state)."""

    def attach(self, addr: Address, validate: Validator | None = None, port: int = 0, start: bool = True) -> str:
        """Start a Stage server for the local worker at `addr`; `validate(channel, msg)` vets every
        inbound message before it is queued. Returns the server's "host:port". With start=False
        the port is bound but serving waits for `start()` (a process that still has to fork,
        e.g. for hivemind, must not have gRPC calls running)."""
        self._validators[addr] = validate or (lambda channel, msg: None)
        # no SO_REUSEPORT: a second process on a taken port must fail, not split the traffic
        # capped: a call over STAGE_CALLS is refused at once, not queued behind the streams (the gate keeps anonymous ones to a few)
        options = [*self._options, ("grpc.so_reuseport", 0)]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=STAGE_CALLS),
            maximum_concurrent_rpcs=STAGE_CALLS,
            interceptors=[self.gate] if self.gate else None,
            options=options,
        )
        handlers = {
            METHOD[ch]: grpc.stream_stream_rpc_method_handler(
                self._stream_handler(addr, ch), request_deserializer=None, response_serializer=pb.Ack.SerializeToString
            )
            for ch in CHANNELS
        }
        handlers["Ping"] = grpc.unary_unary_rpc_method_handler(
            self._ping_handler(addr), request_deserializer=None, response_serializer=pb.PingReply.SerializeToString
        )
        handlers["GetShard"] = grpc.unary_stream_rpc_method_handler(
            self._shard_handler(addr), request_deserializer=None, response_serializer=pb.ShardChunk.SerializeToString
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        tls = self.tls_server.credentials if self.tls_server is not None else None
        bound = add_port(server, f"{self.host}:{port}", tls)
        if bound == 0:
            raise AnchormeshError(
                f"cannot bind a Stage server on {self.host}:{port}: the port is taken or the address is not local"
            )
        if start:
            server.start()
        self._servers.append(server)
        self.endpoints[addr] = f"{self.host}:{bound}"
        return self.endpoints[addr]

    def _reject(self, context: grpc.ServicerContext, addr: Address, why: str) -> None:
        self.rejected.append(why)
        self.rejected_count += 1
        if log_now(self.rejected_count):  # a flood of bad calls must not become a flood of log lines
            log.warning("stage server %s refused a chunk (%d so far): %s", addr, self.rejected_count, why)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    def _stream_handler(self, addr: Address, channel: str):
        cls = MESSAGE[channel]

        def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[pb.Ack]:
            caller = auth.caller(context)[0] if self.gate is not None else None
            for data in requests:
                if caller is not None and not self.messages.take(caller):
                    self.gate.refused["RESOURCE_EXHAUSTED"] += 1
                    log.warning(
                        "stage server %s: %s sends over %g messages/s; stream ended", addr, caller, self.messages.rate
                    )
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{caller} sends more than {self.messages.rate:g} messages/s (security.messages_per_s); slow down",
                    )
                try:
                    msg = parse_message(cls, data, self.max_bytes)
                    if msg.header.run_id != self.run_id:
                        raise AnchormeshError(
                            f"header.run_id={msg.header.run_id!r}: this server trains run {self.run_id!r}"
                        )
                    if caller is not None and msg.header.sender != caller:
                        self.gate.refused["PERMISSION_DENIED"] += 1
                        self.rejected.append(f"sender {msg.header.sender!r} is not the caller {caller!r}")
                        self.rejected_count += 1
                        log.warning(
                            "stage server %s: %s sent a message signed as %r; stream ended",
                            addr,
                            caller,
                            msg.header.sender,
                        )
                        context.abort(
                            grpc.StatusCode.PERMISSION_DENIED,
                            f"header.sender={msg.header.sender!r}: the caller is {caller!r}; a peer sends only as itself",
                        )
                    self._validators[addr](channel, msg)
                except AnchormeshError as exc:
                    self._reject(context, addr, f"{cls.__name__}: {exc}")
                    return
                with self._arrived:
                    inbox = self._inbox[(addr, channel)]
                    full = len(inbox) >= MAX_INBOX
                    if not full:
                        self.bytes_in += len(data)
                        inbox.append(data)
                        self._arrived.notify_all()
                if full:  # bounded: a sender that outruns this peer is told so, nothing piles up
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{addr}'s {channel} inbox holds {MAX_INBOX} messages: it is behind; send elsewhere or later",
                    )
                yield pb.Ack(micro_batch_id=msg.header.micro_batch_id, ok=True)

        return handle

    def _small_request(self, cls, data: bytes, context: grpc.ServicerContext, addr: Address):
        """Parse a small request (Ping, GetShard) and check its run id, or abort the call. An
        empty run id is allowed: a health check or an export does not know the run."""
        try:
            req = parse_message(cls, data, 4096)
        except AnchormeshError as exc:
            self._reject(context, addr, f"{cls.__name__}: {exc}")
        if req.run_id and req.run_id != self.run_id:
            self._reject(context, addr, f"{cls.__name__}.run_id={req.run_id!r}: this server trains run {self.run_id!r}")
        return req

    def _ping_handler(self, addr: Address):
        def handle(data: bytes, context: grpc.ServicerContext) -> pb.PingReply:
            self._small_request(pb.PingRequest, data, context, addr)
            reply = self.ping_info(addr)
            if not reply.run_id:
                reply.run_id = self.run_id
            return reply

        return handle

    def _shard_handler(self, addr: Address):
        def handle(data: bytes, context: grpc.ServicerContext) -> Iterator[pb.ShardChunk]:
            req = self._small_request(pb.ShardRequest, data, context, addr)
            if self.shard_source is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not hand out its weights")
            try:
                chunks = self.shard_source(addr, req)
            except WireError as exc:  # a request this peer will not serve as asked (a sketch's size)
                self._reject(context, addr, str(exc))
            except AnchormeshError as exc:  # e.g. no stage yet: not the caller's fault
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except KeyError as exc:  # a stage's state it does not hold
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            what = {
                pb.ShardRequest.STATE: f"the state of stage {req.stage}",
                pb.ShardRequest.SKETCH: "a sketch of its weights",
            }.get(req.what, "its weights")
            log.info("stage server %s: sending %s to %s", addr, what, req.sender or "an unnamed caller")
            yield from chunks

        return handle

    def start(self) -> None:
        """Start serving on every bound server (after attach(..., start=False))."""
        for server in self._servers:
            server.start()

    def poll(self, dst: Address, channel: str) -> bytes | None:
        with self._arrived:
            q = self._inbox.get((dst, channel))
            return q.popleft() if q else None

    def wait(self, timeout: float) -> bool:
        """Block until some inbound message is queued (True) or `timeout` seconds pass (False)."""
        with self._arrived:
            return self._arrived.wait_for(lambda: any(self._inbox.values()), timeout=timeout)
