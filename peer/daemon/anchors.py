"""The anchor and evaluation jobs the tracker hands this peer, from the heartbeat to stage 0's loop.

The heartbeat thread queues them (`take`); the main loop of a stage-0 peer turns them into
passes of its anchor circuit (peer/pipeline/swarm_anchor.py) between two units of fast work
(`schedule`). An anchor job's batches are micro-batches this peer trained recently, picked by the
job's id (an anchor pass spends no window of the run's data); an evaluation pass uses the run's
fixed eval windows (peer/daemon/feed.py): the same on every peer and at every pass.
"""

from __future__ import annotations

from collections import deque

from peer.config import TrainConfig
from peer.daemon.feed import WorkFeed
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.wire import anchormesh_pb2 as pb


class AnchorJobs:
    """Anchor and evaluation passes asked for by the tracker and not scheduled yet."""

    def __init__(self) -> None:
        self.anchors: deque[tuple[int, int]] = deque()  # (anchor id, micro-batches) from the tracker
        self.evals: deque[int] = deque()  # evaluation pass ids from the tracker

    def take(self, directive: pb.Directive, anchor: SwarmAnchor | None) -> None:
        """From a heartbeat reply: the newest anchor id issued, and a job for this peer if any."""
        if anchor is not None and directive.anchors_issued:
            anchor.issued = max(anchor.issued or 0, directive.anchors_issued)
        if directive.anchor_id:
            self.anchors.append((directive.anchor_id, directive.anchor_micro_batches))
        if directive.eval_id:
            self.evals.append(directive.eval_id)

    def schedule(self, anchor: SwarmAnchor, feed: WorkFeed, cfg: TrainConfig) -> None:
        """Stage 0: every queued job becomes a pass of the anchor circuit (a job waits while
        this peer has trained nothing yet, or its eval windows are not fetched yet)."""
        p = cfg.pipeline
        while self.anchors:
            anchor_id, n = self.anchors[0]
            batches = feed.anchor_batches(anchor_id, n)
            if batches is None:
                break
            self.anchors.popleft()
            anchor.schedule(anchor_id, batches)
        while self.evals:
            held = feed.eval_batches(p.micro_batch_size, p.eval_batches * p.micro_batch_size)
            if not held:
                break
            anchor.schedule_eval(self.evals.popleft(), [held[i % len(held)] for i in range(p.eval_batches)])
