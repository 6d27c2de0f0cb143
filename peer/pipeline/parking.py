"""Messages that wait for their destination's address.

A peer learns its neighbours' addresses from the tracker's heartbeat replies, and the tracker
lists a peer only once it serves. So a peer that starts serving sends its first micro-batches to
a next-stage peer that has not heard of it yet, and that peer's gradients had nowhere to go: they
were dropped, and the sender waited its 20 s resend timeout before its first step (measured in
`anchormesh demo`: one stage-0 peer's first step came 20 s after its mate's). The next heartbeat
(1 s) brings the address; until then the message waits here, bounded in count and time, so an
unknown or forged destination costs a little memory for a few seconds and nothing more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Hashable
from typing import Any

from peer.errors import AnchormeshError

PARK_S = 10.0  # how long a message waits for its destination's address (several heartbeats)
PARK_MAX = 64  # messages waiting at once, all destinations together
PARK_BYTES = 1 << 28  # and their bytes (256 MiB: a few of a large model's activations)


class Parking:
    """Parked messages by destination, oldest first; thread-safe."""

    def __init__(
        self, limit: int = PARK_MAX, wait_s: float = PARK_S, clock=time.monotonic, limit_bytes: int = PARK_BYTES
    ) -> None:
        self.limit, self.wait_s, self.clock, self.limit_bytes = limit, wait_s, clock, limit_bytes
        self._items: list[tuple[float, Hashable, Any, int]] = []  # (deadline, destination, message, its bytes)
        self._lock = threading.Lock()
        self.expired = 0  # messages dropped because their address never came

    def __len__(self) -> int:
        return len(self._items)

    def park(self, dst: Hashable, message: Any, nbytes: int = 0) -> None:
        """Keep `message` (`nbytes` long) for `dst` until its address is known; AnchormeshError when full."""
        with self._lock:
            if len(self._items) >= self.limit or sum(x[3] for x in self._items) + nbytes > self.limit_bytes:
                raise AnchormeshError(
                    f"no address known for {dst}, and {len(self._items)} messages already wait for theirs (at most {self.limit}, {self.limit_bytes} bytes)"
                )
            self._items.append((self.clock() + self.wait_s, dst, message, nbytes))

    def take(self, known: Container) -> tuple[list[tuple[Hashable, Any]], list[Hashable]]:
        """The messages whose destination is now in `known` (to send, in order) and the
        destinations of those that waited past their deadline (dropped)."""
        if not self._items:  # the main loop asks every turn
            return [], []
        now = self.clock()
        with self._lock:
            ready = [(dst, m) for _, dst, m, _ in self._items if dst in known]
            dropped = [dst for t, dst, _, _ in self._items if dst not in known and t <= now]
            self._items = [x for x in self._items if x[1] not in known and x[0] > now]
        self.expired += len(dropped)
        return ready, dropped
