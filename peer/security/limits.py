"""How many bytes each method's request may have, checked before it is parsed.

A server's `grpc.max_receive_message_length` is one number for all its methods, and the Stage
server's must fit activations (256 MiB): without a per-method bound a Ping, a Join or a heartbeat
report of that size would be parsed whole. `bound` checks the raw length first: a request over its
method's limit is never parsed and its call ends with RESOURCE_EXHAUSTED naming both sizes
(tests/test_method_limits.py measures the realistic largest request of each method).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

KIB = 1024
STAGE, TRACKER, STATUS = "/anchormesh.v1.Stage/", "/anchormesh.v1.Tracker/", "/anchormesh.v1.Status/"
# None: the server-wide limit (the tensor streams' messages are sized by the run's model and codec)
METHOD_LIMITS: dict[str, int | None] = {
    STAGE + "Forward": None,
    STAGE + "Backward": None,
    STAGE + "AnchorForward": None,
    STAGE + "AnchorBackward": None,
    STAGE + "Prior": None,
    STAGE + "Ping": 4 * KIB,  # two ids: at most ~130 bytes
    STAGE + "GetShard": 4 * KIB,  # two ids, two numbers: ~40 bytes
    TRACKER + "Join": 64
    * KIB,  # ids, address, TLS key, DHT addresses, a per-stage plan: 6.2 KB with 32 addresses and 256 stages
    TRACKER + "GetConfig": 4 * KIB,  # empty
    # a PeerReport: 3.4 KB with every string at the tracker's 300-character cap and every counter at its max,
    # plus 8.7 KB of work ids (stage 0 holds at most 256 and gives back at most 256)
    TRACKER + "Heartbeat": 64 * KIB,
    TRACKER + "GetData": 4 * KIB,  # a file name from the manifest and an offset: ~30 bytes
    TRACKER + "Leave": 4 * KIB,  # two ids and a reason: 340 bytes with a 300-character reason
    TRACKER + "Ban": 4 * KIB,  # an id and the operator's reason: ~100 bytes
    STATUS + "GetStatus": 4 * KIB,  # one double: 9 bytes
    STATUS + "WatchStatus": 4 * KIB,
}

# (call context, why) -> None: counts and logs a refusal; the call is aborted after it returns
Refuse = Callable[[grpc.ServicerContext, str], None]


@dataclass(frozen=True)
class TooBig:
    """What the deserializer hands on instead of an oversized request: raising there would make
    gRPC answer INTERNAL ("Exception deserializing request!"), which blames the server."""

    size: int


def bound(handler: grpc.RpcMethodHandler, method: str, limit: int, refuse: Refuse) -> grpc.RpcMethodHandler:
    """`handler` whose requests over `limit` bytes are not parsed and end the call with
    RESOURCE_EXHAUSTED (for a request stream: at the first such message). A handler that takes raw
    bytes (`request_deserializer=None`) is checked the same way and still gets raw bytes."""
    parse = handler.request_deserializer
    name = method.rsplit("/", 1)[-1]

    def deserialize(raw: bytes):
        if len(raw) > limit:
            return TooBig(len(raw))
        return parse(raw) if parse is not None else raw

    def check(request, context: grpc.ServicerContext):
        if isinstance(request, TooBig):
            text = f"{name} request is {request.size} bytes; this method takes at most {limit}"
            refuse(context, text)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, text)
        return request

    def one(behaviour: Callable) -> Callable:
        def call(request, context: grpc.ServicerContext):
            return behaviour(check(request, context), context)

        return call

    def each(behaviour: Callable) -> Callable:
        def call(requests: Iterator, context: grpc.ServicerContext):
            return behaviour((check(r, context) for r in requests), context)

        return call

    wrapped = {"unary_unary": one, "unary_stream": one, "stream_unary": each, "stream_stream": each}
    return handler._replace(
        request_deserializer=deserialize,
        **{k: wrap(getattr(handler, k)) for k, wrap in wrapped.items() if getattr(handler, k) is not None},
    )
