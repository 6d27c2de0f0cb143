"""An attacker for the flood tests: opens calls that send their headers and never a request
message ("headers-only"), and holds them until stdin closes.

    python tests/headers_only.py TARGET CALLS METHOD [METHOD ...]

Each call is a client-streaming call whose request iterator blocks: gRPC sends the headers at
once and the server, for a unary method, waits for a message that never comes. The calls spread
over 8 connections (a flood is not one connection's streams). Prints "ready N" once started.
"""

from __future__ import annotations

import sys
import threading
import time

import grpc


def main() -> None:
    target, calls, methods = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    hold = threading.Event()

    def never():
        hold.wait()
        return
        yield  # a generator that yields nothing until released

    channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
    futures = []
    for i in range(calls):
        call = channels[i % len(channels)].stream_unary(
            methods[i % len(methods)], request_serializer=None, response_deserializer=None
        )
        futures.append(call.future(never()))
    time.sleep(0.5)  # the headers are out
    print(f"ready {len(futures)}", flush=True)
    sys.stdin.read()  # until the test closes our stdin or kills us
    hold.set()
    for f in futures:
        f.cancel()


if __name__ == "__main__":
    main()
