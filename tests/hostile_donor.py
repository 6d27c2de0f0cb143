"""A hostile member for the real-process tests: an ordinary `anchormesh peer` that serves its
stage state (GetShard, what = STATE) with its weights negated and its AdamW moments zeroed, the
state a joiner on a bounds-only check takes (cosine -1.00 to its own weights).

    python tests/hostile_donor.py peer --tracker ... --token ...
"""

from __future__ import annotations

import torch

from peer.cli import main
from peer.daemon.state_sync import StateSync

honest = StateSync.stage_state


def negated(self: StateSync) -> tuple[dict, list[torch.Tensor]]:
    meta, tensors = honest(self)
    n = len(tensors) // 3
    return meta, [-t for t in tensors[:n]] + [torch.zeros_like(t) for t in tensors[n:]]


StateSync.stage_state = negated  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
