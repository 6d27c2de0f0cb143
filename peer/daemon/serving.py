"""What this peer's `Stage` service answers besides the pipeline's streams: Ping, GetShard (the
stage's weights, or a stage's training state: its own or the replica it keeps), and which part
checks an inbound message (the worker's fast circuit or the anchor circuit).

The transport (peer/pipeline/grpc_transport.py) calls these from its server threads while the
main loop steps, so a shard is copied under the step's lock. A part of `PeerDaemon`
(peer/daemon/main.py), reading its stage through the narrow `Served` view: the daemon serves
before it has a stage (it answers Ping while joining) and gets one at its Join.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from peer.daemon.replicas import Replicas
from peer.daemon.state_sync import StateSync
from peer.errors import AnchormeshError, WireError
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.swarm_anchor import ANCHOR_CHANNELS, SwarmAnchor
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb


class Served(Protocol):
    """What the service's answers read of the peer."""

    peer_id: str
    state: str
    worker: StageWorker | None
    anchor: SwarmAnchor | None
    transport: GrpcTransport
    state_sync: StateSync
    replicas: Replicas

    def step_lock(self) -> threading.Lock: ...


class Serving:
    """The handlers the daemon gives its transport: `ping_info`, `shard`, `validate`."""

    def __init__(self, peer: Served) -> None:
        self.peer = peer

    def ping_info(self, addr: object) -> pb.PingReply:
        """Ping's answer: who this peer is, which stage it serves, its step and state."""
        d, w = self.peer, self.peer.worker
        return pb.PingReply(peer_id=d.peer_id, stage=w.stage.index if w else 0, version=w.version if w else 0, state=d.state, run_id=d.transport.run_id)

    def shard(self, addr: object, req: pb.ShardRequest) -> Iterator[pb.ShardChunk]:
        """GetShard: the stage's weights, copied between steps (under the step's lock), sent in
        chunks; or (what = STATE) a stage's training state: this peer's own, or the replica it
        keeps of another stage (KeyError when it holds neither)."""
        from peer.store.shard import shard_chunks, snapshot, state_tensors

        d, w = self.peer, self.peer.worker
        if req.what == pb.ShardRequest.STATE:
            if w is not None and d.state != "joining" and w.stage.index == req.stage:
                meta, tensors = d.state_sync.stage_state()
                names = [name for name, _ in w.stage.named_parameters()]
                return shard_chunks(state_tensors(meta, names, tensors), run_id=d.transport.run_id, peer_id=d.peer_id, stage=req.stage, num_stages=w.stage.num_stages, step=int(meta["version"]))
            return d.replicas.chunks(req.stage, w.stage.num_stages if w else 0)
        if w is None or d.state == "joining":
            raise AnchormeshError(f"peer {d.peer_id} serves no stage yet")
        with d.step_lock():
            tensors, step = snapshot(w.stage), w.version
        return shard_chunks(tensors, run_id=d.transport.run_id, peer_id=d.peer_id, stage=w.stage.index, num_stages=w.stage.num_stages, step=step)

    def validate(self, channel: str, msg: object) -> None:
        d = self.peer
        if d.worker is None or d.anchor is None:
            raise WireError("this peer has no stage yet")
        if channel in ANCHOR_CHANNELS:
            d.anchor.validate(channel, msg)
        else:
            d.worker.validate(channel, msg)
