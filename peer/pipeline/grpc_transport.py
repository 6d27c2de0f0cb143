"""The `Transport` over gRPC: one `Stage` server per local worker, one client stream per link.

Each worker address served here gets its own gRPC server (as each peer of the swarm will; the
serving half, which vets every inbound message, is peer/pipeline/stage_server.py), and every
(destination, channel) pair gets one long-lived client stream fed from a queue, so `send` never
blocks on the receiver. A stream the receiver ended (a refused chunk: INVALID_ARGUMENT naming
the problem) is reopened after a back-off; a destination that stops acknowledging is excluded
for a while so the caller routes around it. Message sizes are set explicitly on both ends; flow
control is gRPC's (HTTP/2 windows).

In a swarm (`gate` and `creds` given) every call is authenticated (peer/security/auth.py): the gate checks
the caller's certificate before a handler runs and caps concurrent calls before any request is
read (peer/security/admission.py), a message's header.sender must be the caller, and each sender's
messages are rate-limited. A local run's transport (one process, loopback) has neither.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator

import grpc

from peer.errors import AnchormeshError
from peer.pipeline.linkmeter import LinkMeter
from peer.pipeline.parking import Parking
from peer.pipeline.stage_server import (
    METHOD,
    SERVICE,
    PingInfo,
    ShardSource,
    StageServing,
    Validator,
    default_ping_info,
)
from peer.pipeline.transport import CHANNELS, Address, Transport
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger(__name__)
RECENT = 64  # refusals and send errors kept for inspection (counted beyond that)
# a destination whose stream holds this many unacknowledged messages, or whose oldest waited this
# long, is stalled (a peer that accepts a stream and never reads it): its queue is dropped, the
# stream cut, and sends to it refused for STALL_S so the caller routes around it
MAX_UNACKED, MESSAGE_DEADLINE_S, STALL_S = 64, 60.0, 120.0
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
# which credentials a swarm peer's Stage methods take (peer/security/auth.py); the fast and anchor circuits
# (unlisted) take members only. Ping stays open (container health checks); GetShard also takes the
# run token (anchormesh export on the operator's machine is not a member).
STAGE_POLICY = {
    f"/{SERVICE}/Ping": frozenset({auth.OPEN}),
    f"/{SERVICE}/GetShard": frozenset({auth.TOKEN, auth.MEMBER, auth.OPERATOR}),
}


class GrpcTransport(StageServing, Transport):
    """Carries the runner's messages over real gRPC streams (loopback or network).

    Args:
        run_id: messages and pings for another run are refused.
        ping_info: answers Ping for a served address.
        shard_source: answers GetShard (the stage's weights); without one GetShard is UNIMPLEMENTED.
        host: interface the servers bind to.
        max_message_bytes: bound on one message, on both ends.
    """

    def __init__(
        self,
        run_id: str,
        ping_info: PingInfo | None = None,
        host: str = "127.0.0.1",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        shard_source: ShardSource | None = None,
        gate: auth.Gate | None = None,
        creds: auth.Credentials | None = None,
        tls_server=None,
        tls_ca: bytes | None = None,
        messages_per_s: float = 200.0,
    ) -> None:
        super().__init__()
        self.run_id, self.host, self.max_bytes = run_id, host, max_message_bytes
        self.gate, self.creds, self.tls_server, self.tls_ca = gate, creds, tls_server, tls_ca
        self.messages = auth.RateLimit(messages_per_s)
        self._validators: dict[Address, Validator] = {}
        self.ping_info = ping_info or default_ping_info
        self.shard_source = shard_source
        self.endpoints: dict[Address, str] = {}
        self.parking = Parking()  # messages for destinations whose address is not known yet
        self._servers: list[grpc.Server] = []
        self._inbox: dict[tuple[Address, str], deque[bytes]] = defaultdict(deque)
        self._arrived = threading.Condition()
        self._outgoing: dict[tuple[Address, str], queue.Queue] = {}
        self.meters: dict[tuple[Address, str], LinkMeter] = defaultdict(
            LinkMeter
        )  # (destination, channel) -> its stream's measured rate
        self._senders: list[threading.Thread] = []
        self._channels: dict[str, grpc.Channel] = {}
        # bounded: anyone who reaches the port can make refusals (2,000 bad Pings grew a list by 6 MB)
        self.rejected: deque[str] = deque(maxlen=RECENT)  # why inbound chunks were refused, newest last (server side)
        self.rejected_count = 0
        self.send_errors: deque[str] = deque(maxlen=RECENT)  # why outbound streams ended with an error (client side)
        self.send_error_count = 0
        self.stalled: dict[
            Address, tuple[float, str]
        ] = {}  # destination -> (monotonic time it may be tried again, why)
        self._calls: dict[tuple[Address, str], grpc.Call] = {}  # the live outbound stream per (destination, channel)
        self._closed = False
        self.bytes_in = 0  # accepted inbound bytes

    @property
    def _options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_bytes),
            ("grpc.max_receive_message_length", self.max_bytes),
            ("grpc.keepalive_time_ms", 20_000),  # notice a neighbour that vanished without a reset
            ("grpc.keepalive_timeout_ms", 10_000),
            # no compressed messages: gRPC would inflate them before any size check of ours (a
            # 64 MiB gzip Ping was), and the codecs already compress what travels
            ("grpc.compression_enabled_algorithms_bitset", 1),
        ]

    # -- client side ------------------------------------------------------------------------
    def channel(self, target: str) -> grpc.Channel:
        if target not in self._channels:
            self._channels[target] = auth.open_channel(target, self.creds, self._options, self.tls_ca)
        return self._channels[target]

    def send(self, src: Address, dst: Address, channel: str, data: bytes) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"channel={channel!r}: must be one of {CHANNELS}")
        if (
            dst not in self.endpoints
        ):  # a peer that started serving after our last heartbeat: its address comes with the next
            self.parking.park(dst, (src, channel, data), len(data))
            return
        key = (dst, channel)
        self._check_stalled(dst, channel)
        self._count(src, dst, channel, data)
        self.meters[key].sent(len(data))
        if key not in self._outgoing:
            self._outgoing[key] = queue.Queue()
            t = threading.Thread(
                target=self._sender, args=(dst, channel, self._outgoing[key]), name=f"send-{dst}-{channel}", daemon=True
            )
            t.start()
            self._senders.append(t)
        self._outgoing[key].put(data)

    def flush_parked(self) -> None:
        """Send what waited for an address now known; one whose address never came is a send error."""
        ready, dropped = self.parking.take(self.endpoints)
        for dst, (src, channel, data) in ready:
            with contextlib.suppress(AnchormeshError):  # excluded meanwhile: logged and counted as a send error there
                self.send(src, dst, channel, data)
        for dst in dict.fromkeys(dropped):
            self.send_errors.append(f"{dst}: its address never became known")
            self.send_error_count += 1
            log.warning("dropped messages for %s: its address was not known within %.0f s", dst, self.parking.wait_s)

    def excluding(self) -> list[str]:
        """The destinations sends route around now: "DST: why (N s left)" (the status shows them)."""
        now = time.monotonic()
        return [
            f"{dst}: {why} ({until - now:.0f} s left)"
            for dst, (until, why) in list(self.stalled.items())
            if until > now
        ]

    def usable(self, dst: Address) -> bool:
        """Whether `dst` may be sent to now (not stalled, or its exclusion has passed)."""
        until = self.stalled.get(dst)
        return until is None or time.monotonic() >= until[0]

    def _check_stalled(self, dst: Address, channel: str) -> None:
        """Refuse a send to a stalled destination; stall one whose stream stopped taking
        messages (too many unacknowledged, or the oldest past its deadline)."""
        now = time.monotonic()
        if dst in self.stalled:
            until, why = self.stalled[dst]
            if now < until:
                raise AnchormeshError(f"{dst} is excluded for {until - now:.0f}s more: {why}")
            del self.stalled[dst]
        meter = self.meters.get((dst, channel))
        if meter is None:
            return
        n, age = meter.waiting(now)
        if n >= MAX_UNACKED or age > MESSAGE_DEADLINE_S:
            why = f"its {channel} stream took {n} messages without acknowledging them, the oldest {age:.0f}s ago"
            self.stalled[dst] = (now + STALL_S, why)
            out = self._outgoing.get((dst, channel))
            while out is not None and not out.empty():  # the caller resends elsewhere (stage 0 retries)
                try:
                    out.get_nowait()
                except queue.Empty:
                    break
            meter.clear()
            call = self._calls.get((dst, channel))
            if call is not None:
                call.cancel()
            self.send_errors.append(f"{dst}: {why}")
            self.send_error_count += 1
            log.warning("excluding %s for %.0fs: %s", dst, STALL_S, why)
            raise AnchormeshError(f"{dst} is excluded for {STALL_S:.0f}s: {why}")

    def _sender(self, dst: Address, channel: str, out: queue.Queue) -> None:
        """Feed one long-lived stream; after an error, back off and open a new one.

        Each attempt's request generator ends when its call does, so no thread is left waiting
        on the queue; messages taken by a failed attempt are lost (stage 0 retries micro-batches).
        """
        delay = 0.1
        while not self._closed:
            # resolved on every attempt: a peer that restarted may serve on a new address
            call = self.channel(self.endpoints[dst]).stream_stream(
                f"/{SERVICE}/{METHOD[channel]}", request_serializer=None, response_deserializer=pb.Ack.FromString
            )
            attempt_over = threading.Event()
            taken = [0, 0]  # messages this attempt took from the queue, acks it got

            def requests() -> Iterator[bytes]:
                while not attempt_over.is_set():
                    try:
                        item = out.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                    taken[0] += 1
                    yield item

            meter = self.meters[(dst, channel)]
            try:
                responses = self._calls[(dst, channel)] = call(requests())
                for _ack in responses:
                    meter.acked()
                    taken[1] += 1
                    delay = 0.1
                return  # the queue was closed
            except grpc.RpcError as exc:
                attempt_over.set()
                meter.lost(taken[0] - taken[1])
                if self._closed:
                    return
                self.send_errors.append(f"{exc.code().name}: {exc.details()}")
                self.send_error_count += 1
                log.warning(
                    "stream to %s (%s) ended: %s %s; reopening in %.1fs",
                    dst,
                    channel,
                    exc.code().name,
                    exc.details(),
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def link_bps(self, dst: Address, channel: str) -> float | None:
        meter = self.meters.get((dst, channel))
        return meter.bps() if meter is not None else None

    def close(self) -> None:
        self._closed = True
        for out in self._outgoing.values():
            out.put(None)
        for t in self._senders:
            t.join(timeout=5)
        for ch in self._channels.values():
            ch.close()
        for server in self._servers:
            server.stop(grace=0.5).wait()
