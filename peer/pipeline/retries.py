"""Swarm: a sender retries a micro-batch whose gradient it lost (or gave up waiting for), so a
stage worker may get one micro-batch twice. It takes each once and answers a retry with the
gradient it sent back, from a cache of the newest ones, rather than computing it twice."""

from __future__ import annotations

from peer.pipeline.transport import Address
from peer.wire import anchormesh_pb2 as pb

Key = tuple[str, int, int]  # (sender, step, micro-batch)


class Retries:
    """The micro-batches a worker took recently, and the gradient messages it sent back."""

    def __init__(self, seen: int = 4096, gradients: int = 64) -> None:
        self._seen: dict[Key, None] = {}  # taken recently, oldest first
        # the newest gradient messages sent back, by the same key, so a sender's retry gets its
        # gradient again (its retry window is a few steps of micro-batches; 64 covers it)
        self._grad_cache: dict[Key, tuple[Address, bytes]] = {}
        self._max_seen, self._max_grads = seen, gradients

    def take(self, key: Key) -> bool:
        """True the first time `key` comes; False for a retry of a micro-batch taken already."""
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > self._max_seen:
            self._seen.pop(next(iter(self._seen)))
        return True

    def gradient(self, key: Key) -> tuple[Address, bytes] | None:
        """(destination, message) of the gradient sent back for `key`, if still cached."""
        return self._grad_cache.get(key)

    def sent(self, key: Key, dst: Address, data: bytes) -> None:
        """Cache the gradient message for `key` (before sending it: a send that fails, the
        sender not known yet, is redone on its retry)."""
        self._grad_cache[key] = (dst, data)
        while len(self._grad_cache) > self._max_grads:
            self._grad_cache.pop(next(iter(self._grad_cache)))


def retry_key(msg: pb.ActivationChunk) -> tuple:
    """What makes two activations the same micro-batch for a sender's retries: its sender, step
    and id, and how it was encoded (low-rank basis version and coefficient count, mask drop).
    Why the encoding: a retry is encoded anew, and with `mask.adapt` or a refreshed basis it may
    differ; the gradient cached for the first one would not fit it, and the sender would refuse
    it on every retry for good (seen in the swarm checkpoint test: [4, 32, 4] vs [4, 32, 2])."""
    return (
        msg.header.sender,
        msg.header.step,
        msg.header.micro_batch_id,
        msg.basis_version,
        tuple(msg.hidden.shape),
        msg.hidden.compression.drop,
    )
