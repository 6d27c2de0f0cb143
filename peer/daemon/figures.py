"""This peer's figures for its Prometheus endpoint (`anchormesh peer --metrics-port`; rendered by
peer/metrics.py `peer_exposition`): its stage, step, throughput, queues, bytes, averaging rounds.

Apart from the daemon because it is a read-only view over the parts that hold the figures: what
it reads is the `Figured` view below, and a figure added to the endpoint is one line here.
"""

from __future__ import annotations

from typing import Protocol

from peer.daemon.checkpointing import Checkpointer
from peer.daemon.routing import Router
from peer.dp.group import GroupAverager
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.worker import StageWorker
from peer.security.auth import Gate
from peer.store.checkpoint import ShardCheckpoints


class Figured(Protocol):
    """What the figures read of the peer."""

    peer_id: str
    state: str
    worker: StageWorker | None
    transport: GrpcTransport
    averager: GroupAverager | None
    router: Router
    checkpointer: Checkpointer
    checkpoints: ShardCheckpoints | None
    gate: Gate
    tokens: int
    tokens_per_s: float
    capacity: float
    loss: float
    dropped: int


def peer_figures(peer: Figured) -> dict:
    """The figures by name, as `peer.metrics.peer_exposition` renders them."""
    w, t = peer.worker, peer.transport
    link_mbit, pp_keep = peer.router.links()
    written = peer.checkpointer.written
    return {
        "id": peer.peer_id,
        "stage": w.stage.index if w else "",
        "state": peer.state,
        "step": w.version if w else 0,
        "tokens": peer.tokens,
        "tokens_per_s": peer.tokens_per_s,
        "capacity_tokens_per_s": peer.capacity,
        "loss": peer.loss if w is not None and w.stage.is_last else None,
        "queue_depth": len(w.inbox_fwd) + len(w.inbox_bwd) if w else 0,
        "bytes_in": t.bytes_in,
        "bytes_out": t.total_bytes(),
        "dp_rounds": peer.averager.rounds if peer.averager else 0,
        "dp_rejected": peer.averager.rejected if peer.averager else 0,
        "dp_partial": peer.averager.partial if peer.averager else 0,
        "dp_leaning": peer.averager.leaning if peer.averager else 0,
        "dropped": peer.dropped,
        "refused_calls": sum(peer.gate.refused.values()),
        "link_mbit": link_mbit,
        "pp_keep": pp_keep,
        "dp_period_s": peer.averager.period_s if peer.averager else 0.0,
        "checkpoint_step": written if peer.checkpoints is not None and written else None,
    }
