"""How wire messages travel between stage workers.

The runner only sees this interface: `send` bytes to a (stage, replica) address on a channel
("forward" activations or "backward" gradients; the swarm's anchor circuit adds
"anchor_forward", "anchor_backward" and "prior") and `poll` for the next message. The local
transport is a set of in-process queues; the gRPC transport of the swarm implements the same
two calls over streams. Every message is the serialized proto (ActivationChunk /
GradientChunk), so the bytes counted here are the bytes a network would carry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

Address = tuple[int, int]  # (stage, replica)
CHANNELS = ("forward", "backward", "anchor_forward", "anchor_backward", "prior")


@dataclass
class LinkStats:
    messages: int = 0
    bytes: int = 0


class Transport(ABC):
    """Moves serialized messages between stage workers and counts bytes per link."""

    def __init__(self) -> None:
        self.links: dict[tuple[Address, Address, str], LinkStats] = defaultdict(LinkStats)

    @abstractmethod
    def send(self, src: Address, dst: Address, channel: str, data: bytes) -> None:
        """Queue `data` for `dst`; never blocks the caller on the receiver's compute."""

    @abstractmethod
    def poll(self, dst: Address, channel: str) -> bytes | None:
        """The next message for `dst` on `channel`, or None when there is none yet."""

    def attach(self, addr: Address, validate: Callable[[str, object], None] | None = None) -> str:
        """Make `addr` (a local worker) reachable; `validate(channel, msg)` vets its inbound messages."""
        return "local"

    def wait(self, timeout: float) -> bool:
        """Block until a message may have arrived; False if none can arrive (nothing in flight)."""
        return False

    def close(self) -> None:
        """Release servers, streams and threads."""

    def link_bps(self, dst: Address, channel: str) -> float | None:
        """Measured bytes/s of the link to `dst` on `channel`; None when not measured (in-process
        queues have no link)."""
        return None

    def _count(self, src: Address, dst: Address, channel: str, data: bytes) -> None:
        stats = self.links[(src, dst, channel)]
        stats.messages += 1
        stats.bytes += len(data)

    def total_bytes(self, channel: str | None = None) -> int:
        return sum(s.bytes for (_, _, ch), s in self.links.items() if channel in (None, ch))


class LocalTransport(Transport):
    """In-process FIFO queues, one per (address, channel)."""

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[tuple[Address, str], deque[bytes]] = defaultdict(deque)

    def send(self, src: Address, dst: Address, channel: str, data: bytes) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"channel={channel!r}: must be one of {CHANNELS}")
        self._count(src, dst, channel, data)
        self._queues[(dst, channel)].append(data)

    def poll(self, dst: Address, channel: str) -> bytes | None:
        q = self._queues.get((dst, channel))
        return q.popleft() if q else None

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())
