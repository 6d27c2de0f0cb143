"""The daemon's main loop: one unit of work per tick (a step when its gradients are in, else fast
work, else anchor work) and the throughput figures that work gives (tokens/s, capacity).

Apart from the daemon's wiring (main.py) because this is the part that runs for the peer's whole
life once its stage is up: what it reads and writes of the peer is the `Looped` view below, and
an error in one message never ends it (each repeat waits longer: pacing.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from peer.config import TrainConfig
from peer.daemon.anchors import AnchorJobs
from peer.daemon.averaging import apply_step
from peer.daemon.checkpointing import Checkpointer
from peer.daemon.feed import WorkFeed
from peer.daemon.pacing import ErrorPacing
from peer.daemon.routing import Router
from peer.daemon.runlog import MetricsLog
from peer.daemon.startup import StartupClock
from peer.dp.group import GroupAverager
from peer.errors import AnchormeshError
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.worker import StageWorker, mean_loss

log = logging.getLogger("anchormesh.peer")


class Looped(Protocol):
    """What the main loop reads (the stage's parts) and writes (the figures and state it reports)."""

    stop: threading.Event
    worker: StageWorker | None
    anchor: SwarmAnchor | None
    averager: GroupAverager | None
    feed: WorkFeed | None
    transport: GrpcTransport
    router: Router
    jobs: AnchorJobs
    checkpointer: Checkpointer
    startup: StartupClock
    state: str
    reason: str
    loss: float
    tokens: int
    tokens_per_s: float
    capacity: float
    dropped: int
    steps_done: int
    startup_s: float

    def step_lock(self) -> threading.Lock: ...


class StageLoop:
    """Runs the stage until the peer stops (`run`); `tick` is one unit of work."""

    def __init__(self, peer: Looped, cfg: TrainConfig, metrics: MetricsLog | None) -> None:
        self.peer, self.cfg = peer, cfg
        self.metrics = metrics  # last stage with a state dir: its failures are logged and counted, never fatal
        self._rate = (time.monotonic(), peer.tokens)
        self._busy = 0.0  # seconds spent computing since the last rate update

    def run(self, max_steps: int | None = None) -> None:
        """Tick until the peer's stop is set or its worker reaches `max_steps`."""
        d = self.peer
        errors_seen, pacing = 0, ErrorPacing(log)  # an error that repeats waits longer each time
        while not d.stop.is_set() and (max_steps is None or d.worker.version < max_steps):
            d.transport.flush_parked()  # what waited for an address the last heartbeat brought
            if d.transport.send_error_count != errors_seen:  # a lost message may have carried a basis
                errors_seen = d.transport.send_error_count
                d.worker.forget_sent()
            try:
                self.tick()
            except AnchormeshError as exc:  # one bad or late message never ends the peer
                d.dropped += 1
                pacing.failed(exc)

    def tick(self) -> None:
        """One unit of work: a step when its gradients are in, else fast work, else anchor work."""
        d, cfg = self.peer, self.cfg
        w, p = d.worker, cfg.pipeline
        t0 = time.perf_counter()
        w.drain()
        d.anchor.drain()
        d.anchor.apply_priors()
        if w.ready(w.version):
            w.gradients()
            apply_step(w, d.averager, d.step_lock(), d.router.siblings)
            d.steps_done += 1
            if d.steps_done == 1:
                d.startup_s = d.startup.done()  # logs where the time went
            if cfg.checkpoint.every and w.version % cfg.checkpoint.every == 0:
                d.checkpointer.write()
            if w.stage.is_last:
                losses = [x for step_losses in w.losses.values() for x in step_losses]
                w.losses.clear()
                d.loss = mean_loss(losses) if losses else d.loss  # one read of the device per step
                if self.metrics is not None:
                    self.metrics.write({"step": w.version, "loss": d.loss, "time": time.time()})
            d.tokens += p.micro_batches * p.micro_batch_size * p.seq_len
            self._busy += time.perf_counter() - t0
            self.update_rate()
            return
        if not w.stage.is_last:
            d.router.watch(w)
        if w.stage.is_first:
            d.router.retry_stale(w)
            d.jobs.schedule(d.anchor, d.feed, cfg)
        moved = w.backward_one() or (not w.stage.is_first and w.forward_one())
        if w.stage.is_first and not moved:
            step, j = divmod(w.next_mb, p.micro_batches)
            if w.can_forward(step) and len(w.inflight) < p.micro_batches * (p.max_staleness + 1):
                batch = None if not d.router.neighbours.get(1) else d.feed.take(p.micro_batch_size)
                if batch is not None:
                    w.inject(batch, step, j)
                    w.next_mb += 1
                    d.state, d.reason, moved = "active", "", True
                else:
                    d.state, d.reason = (
                        "idle",
                        d.feed.waiting if d.router.neighbours.get(1) else "waiting for a peer of stage 1",
                    )
        elif moved:
            d.state, d.reason = "active", ""
        if moved:  # capacity counts fast-circuit work only
            self._busy += time.perf_counter() - t0
        else:  # the fast queues are empty: anchor work
            moved = d.anchor.tick(d.router.next_hop, d.router.resolve)
        if not moved:
            d.transport.wait(0.05)
        self.update_rate()

    def update_rate(self) -> None:
        """Every 2 s: tokens/s, and capacity = tokens/s over the fraction of time spent computing."""
        d = self.peer
        now = time.monotonic()
        t0, n0 = self._rate
        if now - t0 > 2.0:
            d.tokens_per_s = (d.tokens - n0) / (now - t0)
            busy = self._busy / (now - t0)
            if d.tokens_per_s > 0:  # smoothed: one window on a shared machine says little
                now_capacity = d.tokens_per_s / max(busy, 0.05)
                d.capacity = now_capacity if d.capacity == 0 else 0.7 * d.capacity + 0.3 * now_capacity
            self._rate, self._busy = (now, d.tokens), 0.0
