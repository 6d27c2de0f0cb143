"""`anchormesh peer`: the long-lived daemon a volunteer runs.

It finds the tracker (given, or through the DHT from `--initial-peers`), joins and gets a stage,
builds that stage's layers, serves the `Stage` gRPC service, heartbeats (learning its
neighbours from the replies), and runs the stage: stage 0 feeds micro-batches from its data,
the last stage computes the loss, every stage steps its own optimizer when a step's gradients
are in. SIGTERM or SIGINT makes it leave cleanly.

Not yet (see the swarm issue's note): several peers per stage (DP sync), anchor passes on idle
peers, retry of in-flight micro-batches when a neighbour dies.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import torch

from peer import __version__
from peer.codec.mask import MaskCodec
from peer.config import config_from_dict
from peer.data import TokenStream, default_corpus
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.runner import StageWorker
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.peer")


def find_tracker(initial_peers: list[str], stop: threading.Event) -> str:
    """The tracker address published in the DHT; retries with backoff and says so."""
    import hivemind

    from bootstrap.node import DHT_TRACKER_KEY

    dht = hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True)
    try:
        delay = 0.5
        while not stop.is_set():
            found = dht.get(DHT_TRACKER_KEY, latest=True)
            if found is not None:
                return found.value["tracker"]
            log.info("no tracker in the DHT yet; retrying in %.1fs", delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)
        raise SystemExit(1)
    finally:
        dht.shutdown()


def join(stub: pbg.TrackerStub, req: pb.JoinRequest, stop: threading.Event) -> pb.Assignment:
    """Join, retrying with backoff while the tracker is unreachable; a refusal ends the daemon."""
    delay = 0.5
    while not stop.is_set():
        try:
            return stub.Join(req, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.error("the tracker refused this peer: %s", exc.details())
                raise SystemExit(2) from None
            log.warning("tracker unreachable (%s: %s); retrying in %.1fs", exc.code().name, exc.details(), delay)
            stop.wait(delay)
            delay = min(delay * 2, 30.0)
    raise SystemExit(1)


class PeerDaemon:
    """One peer: its stage worker, its gRPC server, its heartbeat and its main loop."""

    def __init__(self, tracker: str, host: str = "127.0.0.1", grpc_port: int = 0, device: str = "cpu") -> None:
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device={device!r}: must be auto, cpu or cuda")
        self.tracker, self.host = tracker, host
        self.peer_id = f"peer-{uuid.uuid4().hex[:8]}"
        self.stop = threading.Event()
        self.transport = GrpcTransport(run_id="")
        self.worker: StageWorker | None = None
        self.address = self.transport.attach(self.peer_id, self._validate, port=grpc_port)
        self.neighbours: dict[int, list[pb.PeerInfo]] = {}
        self._rr = 0
        self.tokens = 0
        self.state, self.reason = "joining", ""
        self.loss = math.nan
        self._rate = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self._sent_at: dict[tuple[int, int], float] = {}

    def _validate(self, channel: str, msg: object) -> None:
        if self.worker is None:
            from peer.errors import WireError

            raise WireError("this peer has no stage yet")
        self.worker.validate(channel, msg)

    # -- routing ----------------------------------------------------------------------------
    def _next_hop(self) -> str:
        peers = self.neighbours.get(self.worker.stage.index + 1, [])
        p = peers[self._rr % len(peers)]
        self._rr += 1
        return p.peer_id

    def _resolve(self, sender: str) -> str:
        return sender

    def _apply_neighbours(self, directive: pb.Directive) -> None:
        by_stage: dict[int, list[pb.PeerInfo]] = {}
        for n in directive.neighbours:
            by_stage.setdefault(n.stage, []).append(n)
            self.transport.endpoints[n.peer_id] = n.address
        self.neighbours = by_stage

    # -- heartbeat --------------------------------------------------------------------------
    def _report(self) -> pb.PeerReport:
        w = self.worker
        return pb.PeerReport(
            run_id=self.transport.run_id,
            tokens=self.tokens,
            peer=pb.PeerInfo(
                peer_id=self.peer_id, stage=w.stage.index, address=self.address, state=self.state, tokens_per_s=self.tokens_per_s,
                bytes_in=self.transport.bytes_in, bytes_out=self.transport.total_bytes(), step=w.version, loss=self.loss,
                queue_depth=len(w.inbox_fwd) + len(w.inbox_bwd), reason=self.reason,
            ),
        )

    def _heartbeat(self, stub: pbg.TrackerStub, interval: float) -> None:
        while not self.stop.is_set():
            def requests() -> Iterator[pb.PeerReport]:
                while not self.stop.is_set():
                    yield self._report()
                    self.stop.wait(interval)

            try:
                for directive in stub.Heartbeat(requests()):
                    self._apply_neighbours(directive)
                    if directive.kind == pb.Directive.STOP:
                        log.info("tracker says stop: %s", directive.reason)
                        self.stop.set()
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    return
                log.warning("heartbeat stream ended (%s: %s); reconnecting in %.0fs", exc.code().name, exc.details(), interval)
                self.stop.wait(interval)

    def _retry_stale(self, w: StageWorker) -> None:
        """Stage 0: a micro-batch without its gradient for RETRY_AFTER_S is sent again (same window,
        same id) to a live next-stage peer; its old forward is dropped. Covers a neighbour that died."""
        now = time.monotonic()
        for key, job in list(w.inflight.items()):
            sent = self._sent_at.setdefault(key, now)
            if now - sent > RETRY_AFTER_S and self.neighbours.get(1):
                step, mb = key
                w.inflight.pop(key)
                w.basis_sent.clear()  # the lost message may have carried the receiver's basis
                log.warning("no gradient for micro-batch %s of step %d after %.0fs; sending it again", mb, step, now - sent)
                w.inject(job.window, step, mb - w.replica * w.cfg.pipeline.micro_batches)
                self._sent_at[key] = now
        for key in list(self._sent_at):
            if key not in w.inflight:
                del self._sent_at[key]

    # -- main loop --------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        channel = grpc.insecure_channel(self.tracker)
        stub = pbg.TrackerStub(channel)
        a = join(stub, pb.JoinRequest(peer_id=self.peer_id, grpc_address=self.address, code_version=__version__), self.stop)
        cfg = config_from_dict(json.loads(a.run_config_json))
        self.transport.run_id = a.run_id
        log.info("%s joined %s: stage %d of %d (layers %d-%d), serving on %s", self.peer_id, a.run_id, a.stage, a.num_stages, a.layer_start, a.layer_end - 1, self.address)
        stage = split_model(load_causal_lm(cfg.model, seed=cfg.seed), cfg.model.num_stages)[a.stage]
        stage.train()
        self.worker = StageWorker(stage, 0, cfg, MaskCodec(cfg.mask), self.transport, a.run_id, peer_id=self.peer_id, next_hop=self._next_hop, resolve=self._resolve)
        self.worker.version = a.start_step  # continue the run's step numbering (weights: fresh, no state transfer yet)
        self.worker.next_mb = a.start_step * cfg.pipeline.micro_batches
        threading.Thread(target=self._heartbeat, args=(stub, a.heartbeat_interval_s), name="heartbeat", daemon=True).start()
        stream = None
        if stage.is_first:
            data, source = default_corpus("b")
            stream, gen = TokenStream(data), torch.Generator().manual_seed(cfg.seed)
            log.info("stage 0 reads %s", source.split(",")[0])
        p = cfg.pipeline
        try:
            while not self.stop.is_set() and (max_steps is None or self.worker.version < max_steps):
                self._tick(stream, gen if stream else None, p)
        finally:
            self.state, self.reason = "left", "shutting down"
            try:
                stub.Leave(pb.LeaveRequest(run_id=a.run_id, peer_id=self.peer_id, reason="SIGTERM" if self.stop.is_set() else "done"), timeout=5)
            except grpc.RpcError as exc:
                log.warning("could not say goodbye to the tracker: %s", exc.details())
            self.stop.set()
            self.transport.close()
            channel.close()
            log.info("%s left after %d steps", self.peer_id, self.worker.version)

    def _tick(self, stream: TokenStream | None, gen: torch.Generator | None, p) -> None:
        w = self.worker
        w.drain()
        if w.ready(w.version):
            w.gradients()
            w.apply_step()
            if w.stage.is_last:
                losses = w.losses.pop(w.version - 1, [])
                self.loss = sum(losses) / len(losses) if losses else self.loss
            self.tokens += p.micro_batches * p.micro_batch_size * p.seq_len
            now = time.monotonic()
            t0, n0 = self._rate
            if now - t0 > 2.0:
                self.tokens_per_s, self._rate = (self.tokens - n0) / (now - t0), (now, self.tokens)
            return
        if w.stage.is_first:
            self._retry_stale(w)
        elif w.inbox_fwd and w.inbox_fwd[0].header.step > w.version and not w.inflight and not w.done[w.version]:
            # nothing of our own step is under way and the pipeline is already further on
            # (we joined late, or our predecessor on this stage left mid-run): catch up
            log.info("catching up from step %d to the pipeline's step %d", w.version, w.inbox_fwd[0].header.step)
            w.version = w.inbox_fwd[0].header.step
        moved = w.backward_one() or (not w.stage.is_first and w.forward_one())
        if w.stage.is_first and not moved:
            step, j = divmod(w.next_mb, p.micro_batches)
            if w.can_forward(step) and len(w.inflight) < p.micro_batches * (p.max_staleness + 1):
                if not self.neighbours.get(1):
                    self.state, self.reason = "idle", "waiting for a peer of stage 1"
                else:
                    w.inject(stream.batch(p.micro_batch_size, p.seq_len, gen), step, j)
                    w.next_mb += 1
                    self.state, self.reason, moved = "active", "", True
        elif moved:
            self.state, self.reason = "active", ""
        if not moved:
            self.transport.wait(0.05)


RETRY_AFTER_S = 10.0


def run_peer(initial_peers: list[str], tracker: str | None, host: str, grpc_port: int, device: str, max_steps: int | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # many peers share few cores on one machine
    if tracker is None:
        if not initial_peers:
            raise SystemExit("anchormesh peer: error: give --initial-peers or --tracker")
        tracker = find_tracker(initial_peers, threading.Event())
        log.info("found the tracker at %s through the DHT", tracker)
    PeerDaemon(tracker, host, grpc_port, device).run(max_steps)
