"""The anchor and evaluation jobs the tracker hands this peer, from the heartbeat to stage 0's loop.

The heartbeat thread queues them (`take`); the main loop of a stage-0 peer turns them into
passes of its anchor circuit (peer/pipeline/swarm_anchor.py) between two units of fast work
(`schedule`). The batches come from this peer's data: an anchor job's are seeded by its id (so
the pass is reproducible), an evaluation pass uses the same held-out windows every time.
"""

from __future__ import annotations

from collections import deque

import torch

from peer.config import TrainConfig
from peer.data import TokenStream
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.wire import anchormesh_pb2 as pb


class AnchorJobs:
    """Anchor and evaluation passes asked for by the tracker and not scheduled yet."""

    def __init__(self) -> None:
        self.anchors: deque[tuple[int, int]] = deque()  # (anchor id, micro-batches) from the tracker
        self.evals: deque[int] = deque()  # evaluation pass ids from the tracker
        self._eval_windows: list[torch.Tensor] | None = None  # stage 0: the held-out windows, the same every pass

    def take(self, directive: pb.Directive, anchor: SwarmAnchor | None) -> None:
        """From a heartbeat reply: the newest anchor id issued, and a job for this peer if any."""
        if anchor is not None and directive.anchors_issued:
            anchor.issued = max(anchor.issued or 0, directive.anchors_issued)
        if directive.anchor_id:
            self.anchors.append((directive.anchor_id, directive.anchor_micro_batches))
        if directive.eval_id:
            self.evals.append(directive.eval_id)

    def schedule(self, anchor: SwarmAnchor, stream: TokenStream, cfg: TrainConfig) -> None:
        """Stage 0: every queued job becomes a pass of the anchor circuit."""
        p = cfg.pipeline
        while self.anchors:
            anchor_id, n = self.anchors.popleft()
            # the anchor batch comes from this peer's data, seeded by the job id (reproducible)
            agen = torch.Generator().manual_seed(cfg.seed * 7_919 + anchor_id)
            anchor.schedule(anchor_id, [stream.batch(p.micro_batch_size, p.seq_len, agen) for _ in range(n)])
        while self.evals:
            if self._eval_windows is None:
                held = stream.eval_batches(p.micro_batch_size, p.seq_len, p.eval_batches)
                self._eval_windows = [held[i % len(held)] for i in range(p.eval_batches)]
            anchor.schedule_eval(self.evals.popleft(), self._eval_windows)
