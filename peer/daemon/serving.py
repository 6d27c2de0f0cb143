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
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from peer.daemon.replicas import Replicas
from peer.daemon.routing import Router
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
    router: Router

    def step_lock(self) -> threading.Lock: ...


class Serving:
    """The handlers the daemon gives its transport: `ping_info`, `shard`, `validate`."""

    def __init__(self, peer: Served) -> None:
        self.peer = peer
        self.senders = AdjacentSenders()

    def ping_info(self, addr: object) -> pb.PingReply:
        """Ping's answer: who this peer is, which stage it serves, its step and state."""
        d, w = self.peer, self.peer.worker
        return pb.PingReply(
            peer_id=d.peer_id,
            stage=w.stage.index if w else 0,
            version=w.version if w else 0,
            state=d.state,
            run_id=d.transport.run_id,
        )

    def shard(self, addr: object, req: pb.ShardRequest) -> Iterator[pb.ShardChunk]:
        """GetShard: the stage's weights, copied between steps (under the step's lock), sent in
        chunks, or (what = SKETCH) their count sketches (peer/store/sketch.py); or (what = STATE) a stage's training state: this peer's own, or the replica it
        keeps of another stage (KeyError when it holds neither)."""
        from peer.store.shard import shard_chunks, snapshot, state_tensors
        from peer.store.sketch import MAX_SIZE, MIN_SIZE, sketches

        d, w = self.peer, self.peer.worker
        if req.what == pb.ShardRequest.STATE:
            if w is not None and d.state != "joining" and w.stage.index == req.stage:
                meta, tensors = d.state_sync.stage_state()
                names = [name for name, _ in w.stage.named_parameters()]
                return shard_chunks(
                    state_tensors(meta, names, tensors),
                    run_id=d.transport.run_id,
                    peer_id=d.peer_id,
                    stage=req.stage,
                    num_stages=w.stage.num_stages,
                    step=int(meta["version"]),
                )
            return d.replicas.chunks(req.stage, w.stage.num_stages if w else 0)
        if w is None or d.state == "joining":
            raise AnchormeshError(f"peer {d.peer_id} serves no stage yet")
        if req.what == pb.ShardRequest.SKETCH and not MIN_SIZE <= req.sketch_size <= MAX_SIZE:
            raise WireError(f"ShardRequest.sketch_size={req.sketch_size}: must be in [{MIN_SIZE}, {MAX_SIZE}]")
        with d.step_lock():
            tensors, step = snapshot(w.stage), w.version
        if req.what == pb.ShardRequest.SKETCH:  # computed outside the step's lock, from the copy
            tensors = dict(zip(tensors, sketches(list(tensors.values()), req.sketch_seed, req.sketch_size)))
        return shard_chunks(
            tensors,
            run_id=d.transport.run_id,
            peer_id=d.peer_id,
            stage=w.stage.index,
            num_stages=w.stage.num_stages,
            step=step,
        )

    def validate(self, channel: str, msg: object) -> None:
        d = self.peer
        if d.worker is None or d.anchor is None:
            raise WireError("this peer has no stage yet")
        if channel != "prior":  # a prior comes from a stage mate: SwarmAnchor checks that
            self.senders.check(channel, msg.header.sender, d.worker.stage.index, d.router.neighbours)
        if channel in ANCHOR_CHANNELS:
            d.anchor.validate(channel, msg)
        else:
            d.worker.validate(channel, msg)


GRACE_S = 10.0  # how long a sender the roster does not list at the adjacent stage is taken anyway


class AdjacentSenders:
    """Pipeline messages only from the peers the tracker lists for the adjacent stage: activations
    from stage k-1, gradients from stage k+1 (the roster of the last heartbeat's directive).

    Why a grace: this peer learns of a new or moved neighbour at its next heartbeat, which may
    come after that neighbour learned of this peer and sent to it; refusing at once would lose
    its first micro-batches (stage 0 retries them only after 5-60 s). A sender not listed there
    is taken for GRACE_S from its first such message, then refused until the roster lists it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._unlisted: dict[str, float] = {}  # sender -> when its first message not listed came

    def check(self, channel: str, sender: str, stage: int, neighbours: dict[int, list[pb.PeerInfo]]) -> None:
        want = stage - 1 if channel in ("forward", "anchor_forward") else stage + 1
        if any(n.peer_id == sender for n in neighbours.get(want, [])):
            self._unlisted.pop(sender, None)
            return
        now = self.clock()
        if len(self._unlisted) > 1024:  # bounded: forget the oldest half
            self._unlisted = dict(sorted(self._unlisted.items(), key=lambda kv: kv[1])[512:])
        first = self._unlisted.setdefault(sender, now)
        if now - first > GRACE_S:
            listed = [n.stage for ns in neighbours.values() for n in ns if n.peer_id == sender]
            where = f"lists it at stage {listed[0]}" if listed else "does not list it"
            raise WireError(
                f"header.sender={sender!r}: stage {stage} takes {channel} messages from the peers of stage {want}, and the tracker {where}"
            )
