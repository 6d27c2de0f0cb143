"""The `[checkpoint]` section: the shard checkpoints and replicas peers keep."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import positive


@dataclass
class CheckpointConfig:
    """Shard checkpoints that peers with `--state-dir` write (peer/store/checkpoint.py).

    Args:
        every: run steps between checkpoints of a peer's stage (weights, AdamW moments, step);
            0 = only the final one when the run ends or the peer leaves.
        keep: how many of the newest checkpoints each stage keeps on each peer.
        replicate_every_s: seconds between the pulls with which two peers of each stage copy the
            next stage's training state (the last stage copies stage 0's) from its most-trained peers,
            so a stage whose whole group dies comes back from that copy, not from the initial
            weights (peer/daemon/replicas.py). A pull that took T seconds waits at least 9 T
            before the next, so copies use at most a tenth of the link; 0 = off.
    """

    every: int = 100
    keep: int = 2
    replicate_every_s: float = 300.0

    def __post_init__(self) -> None:
        positive("checkpoint.every", self.every, allow_zero=True)
        positive("checkpoint.keep", self.keep)
        positive("checkpoint.replicate_every_s", self.replicate_every_s, allow_zero=True)
