"""What a gRPC server takes on before it reads a request: caps, rates and a receive deadline.

Why at call start: grpcio's sync server runs its interceptors when a call's headers arrive, on
its polling thread, before any request message; a unary handler then takes a pool thread that
waits for the message with no deadline of its own. A client that sends headers and never the
message (a "headers-only" call) so held a thread, and a slot of `maximum_concurrent_rpcs`, for as
long as it liked: 240 of them made a valid Join fail, 32 took every thread of a Stage server.

So every handler the `Gate` hands out is request-streaming on the server side (the wire is the
same: a unary call is a stream of one message), and the call's first act, before it reads
anything, is to take its place:
- a verified caller (member, token holder, operator) counts against its own cap
  (`caller_calls`, keyed by peer id, or by role and host for token and operator callers);
- an anonymous call of an open method counts against its host's cap (`open_calls_per_host`),
  the open methods' total (`open_calls`) and its host's rate (`open_calls_per_s`);
so anonymous callers never hold the capacity Join, the heartbeats and the pipeline's streams use.
A unary request must then arrive within `receive_deadline_s`, or the call is cancelled and its
thread freed. Refusals are RESOURCE_EXHAUSTED naming the cap; the server serves on.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

# (host or caller, code, text) -> None: counts and logs a refusal (the Gate's `_refuse`)
Refuse = Callable[[str, grpc.StatusCode, str], None]


def host_of(peer: str) -> str:
    """The host of gRPC's `context.peer()` ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", "unix:..."), port dropped."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


def refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, text: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` at once, without reading its request: request-
    streaming on the server side, whatever `handler` is (a unary one would wait for the message)."""

    def abort(_requests, context: grpc.ServicerContext):
        context.abort(code, text)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.stream_unary_rpc_method_handler(abort)


class RateLimit:
    """Token buckets per key: `rate` per second, bursts of `burst_s` seconds' worth."""

    def __init__(self, rate: float, burst_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst_s, self.clock = rate, burst_s, clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> bool:
        """Spend one token of `key`'s bucket; False when it is empty."""
        burst, now = self.rate * self.burst_s, self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (burst, now))
            tokens = min(burst, tokens + (now - at) * self.rate)
            if len(self._buckets) > 4096:  # bounded: full buckets carry no state
                self._buckets = {k: v for k, v in self._buckets.items() if v[0] < burst}
            self._buckets[key] = (tokens - 1 if tokens >= 1 else tokens, now)
            return tokens >= 1


class Deadlines:
    """One thread that cancels calls whose request has not arrived in time (a timer thread per
    call would cost a thread per call of a flood)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.expired = 0

    def watch(self, context: grpc.ServicerContext, seconds: float) -> int:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="receive-deadlines", daemon=True)
                self._thread.start()
            n = next(self._ids)
            self._live.add(n)
            heapq.heappush(self._heap, (time.monotonic() + seconds, n, context))
            self._cv.notify()
            return n

    def done(self, n: int) -> None:
        with self._cv:
            self._live.discard(n)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, n, context = heapq.heappop(self._heap)
                if n not in self._live:
                    continue
                self._live.discard(n)
                self.expired += 1
            context.cancel()  # outside the lock: it wakes the handler's receive


@dataclass
class Admission:
    """The caps a Gate applies when a call starts (see the module doc); the defaults fit a
    Stage server (serve_tracker sets the tracker's from `security`).

    Args:
        receive_deadline_s: seconds a unary call's request may take to arrive.
        open_calls: concurrent calls of open methods (Ping, a public status), all hosts together.
        open_calls_per_host: concurrent calls of open methods from one host.
        open_calls_per_s: new calls of open methods per second from one host (bursts of 10 s worth).
        caller_calls: concurrent calls of one verified caller.
    """

    receive_deadline_s: float = 10.0
    open_calls: int = 8
    open_calls_per_host: int = 4
    open_calls_per_s: float = 20.0
    caller_calls: int = 32
    active: collections.Counter = field(default_factory=collections.Counter)
    deadlines: Deadlines = field(default_factory=Deadlines)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rate = RateLimit(self.open_calls_per_s)

    def _enter(self, context: grpc.ServicerContext, method: str, who: str | None, role: str, refuse: Refuse) -> None:
        """Take this call's place, or abort it with RESOURCE_EXHAUSTED naming the cap it hit."""
        host = host_of(context.peer())
        name = method.rsplit("/", 1)[-1]
        if who is None:
            keys = [("open", ""), ("host", host)]
            caps = {
                "open": (self.open_calls, f"{self.open_calls} calls of open methods are running"),
                "host": (
                    self.open_calls_per_host,
                    f"{host} has {self.open_calls_per_host} calls of open methods running",
                ),
            }
        else:
            keys = [("caller", who if role == "member" else f"{role}@{host}")]
            caps = {"caller": (self.caller_calls, f"{who} has {self.caller_calls} calls running")}
        text = None
        with self._lock:
            for key in keys:
                cap, why = caps[key[0]]
                if self.active[key] >= cap:
                    text = f"{name} refused: {why}; try later"
                    break
            if text is None and who is None and not self._rate.take(host):
                text = f"{method} is called from {host} faster than {self.open_calls_per_s:g}/s; slow down"
            if text is None:
                for key in keys:
                    self.active[key] += 1
        if text is not None:
            refuse(who or host, grpc.StatusCode.RESOURCE_EXHAUSTED, text)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, text)
        released = []

        def release() -> None:
            with self._lock:
                if released:
                    return
                released.append(True)
                for key in keys:
                    self.active[key] -= 1
                    if self.active[key] <= 0:
                        del self.active[key]

        if not context.add_callback(release):  # the call ended already
            release()

    def _receive(self, requests: Iterator, context: grpc.ServicerContext, method: str):
        """A unary call's one request, or the call ends: cancelled when it has not arrived within
        `receive_deadline_s`, INVALID_ARGUMENT when the client closed without one."""
        n = self.deadlines.watch(context, self.receive_deadline_s)
        try:
            request = next(requests, None)
        except grpc.RpcError:
            request = None
        finally:
            self.deadlines.done(n)
        if request is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: no request message arrived within {self.receive_deadline_s:g}s",
            )
        return request

    def admit(
        self, handler: grpc.RpcMethodHandler, method: str, who: str | None, role: str, refuse: Refuse
    ) -> grpc.RpcMethodHandler:
        """`handler` as a request-streaming handler that takes its place before it reads (`who`:
        the verified caller's name, None for an anonymous call of an open method)."""
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

        def unary(behaviour: Callable) -> Callable:
            def call(requests: Iterator, context: grpc.ServicerContext):
                self._enter(context, method, who, role, refuse)
                return behaviour(self._receive(requests, context, method), context)

            return call

        def stream(behaviour: Callable) -> Callable:
            def call(requests: Iterator, context: grpc.ServicerContext):
                self._enter(context, method, who, role, refuse)
                return behaviour(requests, context)

            return call

        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(unary(handler.unary_stream), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(stream(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kw)
