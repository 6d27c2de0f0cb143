"""`anchormesh peer`: the long-lived daemon a volunteer runs.

It finds the tracker (given, or through the DHT from `--initial-peers`), joins and gets a stage,
builds that stage's layers, serves the `Stage` gRPC service, heartbeats (learning its
neighbours from the replies), and runs the stage: stage 0 feeds micro-batches of the windows the
tracker hands it (feed.py), the last stage computes the loss, every stage steps its own optimizer
when a step's gradients are in. SIGTERM or SIGINT makes it leave cleanly.

Several peers may serve one stage: each steps on its own micro-batches (a step is any M of them)
and the stage group averages parameters every `dp.inner_steps` steps in the background
(peer/dp/group.py). When its fast queues are empty a peer does anchor work (unmasked passes the
tracker schedules; peer/pipeline/swarm_anchor.py), and the priors reach every optimizer of the
stage group. A MOVE directive (a starving stage needs this peer) makes the daemon leave and
start again in the same process (exec), keeping its peer id; the tracker then gives it the
starving stage. A peer that joins a trained run downloads its stage's state (parameters and
AdamW moments) from the most-trained member of its group through hivemind.

Every gRPC call it makes carries its credentials and every call it serves is checked
(peer/security/auth.py): it joins with the run token and its identity key (peer/security/identity.py), and from
then on presents the certificate the tracker gave it; its gate learns the banned keys from the
heartbeat replies.

This module wires the parts, each with one job and testable alone: discovery.py (the DHT node,
finding the tracker), membership.py (join, heartbeat, leave), serving.py (Ping, GetShard),
routing.py (next hops, resends, links), state_sync.py (the stage state to and from the group),
checkpointing.py, averaging.py and anchors.py (the tracker's anchor and evaluation jobs),
stage_setup.py (placing and building the stage, starting its averager), stage_loop.py (the main
loop) and figures.py (the metrics). `PeerDaemon` holds what several parts share (the worker, the
averager, the peer's figures) and runs the startup sequence; `run_peer` is the process entry.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import torch

from peer.build import build
from peer.daemon.anchors import AnchorJobs
from peer.daemon.averaging import bind_stage, step_lock
from peer.daemon.checkpointing import Checkpointer
from peer.daemon.discovery import TRACKER_CHANNEL_OPTIONS, dht_maddrs_from_tracker, find_tracker, start_dht
from peer.daemon.feed import WorkFeed, open_feed
from peer.daemon.figures import peer_figures
from peer.daemon.membership import Membership, leave
from peer.daemon.replicas import Replicas, own_state_bytes
from peer.daemon.restart import PEER_ID_ENV, exec_again
from peer.daemon.routing import Router
from peer.daemon.runlog import MetricsLog
from peer.daemon.serving import Serving
from peer.daemon.stage_loop import StageLoop
from peer.daemon.stage_setup import build_worker, place_stage, start_group_averaging
from peer.daemon.startup import StartupClock, process_age_s
from peer.daemon.state_sync import StateSync
from peer.dp.group import GroupAverager
from peer.dp.signed_claims import ClaimSigner
from peer.errors import AnchormeshError, ConfigError
from peer.logs import setup_logging
from peer.model.placement import CPU_FP32, parse_device
from peer.pipeline.grpc_transport import STAGE_POLICY, GrpcTransport
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.worker import StageWorker
from peer.security import auth
from peer.security.call_check import NO_TOKEN_HINT
from peer.security.exposure import run_ca
from peer.security.identity import Identity
from peer.store.checkpoint import ShardCheckpoints
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.peer")


class PeerDaemon:
    """One peer: its stage worker, its gRPC server, its heartbeat and its main loop."""

    def __init__(
        self,
        tracker: str,
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        device: str = "cpu",
        dht=None,
        state_dir: Path | None = None,
        announce_host: str | None = None,
        token: str | None = None,
        tls_ca: bytes | None = None,
        startup: StartupClock | None = None,
        data_dir: Path | None = None,
    ) -> None:
        """Bind the Stage service's port and build the parts; nothing joins until `run`.

        Args:
            tracker: the tracker's `HOST:PORT` (`run_peer` finds it through the DHT when not given).
            host: the address the Stage service binds to; "0.0.0.0" to accept other machines
                (then give `announce_host`), the default loopback for one-machine runs and tests.
            grpc_port: the Stage service's port; 0 takes any free one (fix it to forward it).
            device: where the stage trains: "auto" (the GPU when one is visible), "cpu", "cuda"
                or "cuda:N"; the precision follows from the run's `[compute]` at Join.
            dht: the run's hivemind DHT, started by the caller before any gRPC runs (hivemind
                forks); None trains without stage-group averaging (tests of a lone peer).
            state_dir: where checkpoints, the identity key and (stage 0) data shards are kept;
                give one to resume after a restart, None keeps everything in memory.
            announce_host: the address other peers dial, when it is not `host` (behind 0.0.0.0,
                NAT or a port forward); None announces the bound address.
            token: the run token from the bootstrap's bootstrap.json; a peer cannot join without it.
            tls_ca: the run CA's PEM when the run uses TLS (`security.tls`); None: plaintext gRPC.
            startup: the clock of the startup phases, from `run_peer` so the DHT's start is timed
                too; None starts one at the process's start.
            data_dir: stage 0: a folder of the run's prepared shards to use instead of downloading
                them (only files whose hashes match the run's manifest are read).
        """
        self.data_dir = (
            data_dir  # the volunteer's own prepared shards (--data-dir): used when their hashes match the run's
        )
        self.feed: WorkFeed | None = None  # stage 0: the windows the tracker hands out
        self.startup = startup or StartupClock(process_age_s)  # run_peer's clock: it timed the DHT's start too
        self.device = parse_device(device)  # the precision follows from the run's config at Join
        self.placement = CPU_FP32
        self.tracker, self.host, self.state_dir = tracker, host, state_dir
        self.identity = Identity.for_peer(state_dir)
        self.peer_id = os.environ.get(PEER_ID_ENV) or self.identity.peer_id  # kept across a MOVE's exec
        self.identity.peer_id = self.peer_id  # the id its calls and its certificate name
        self.creds = auth.Credentials(token=token, identity=self.identity)
        self.gate = auth.Gate(STAGE_POLICY, token=token)
        self.tls_ca, self.tls_server = tls_ca, None
        if tls_ca is not None:
            from peer.security.tls import PeerServerTLS

            self.tls_server = PeerServerTLS()
        self.refused = ""  # why the tracker refused this peer (banned, bad credentials): it does not join again
        self.stop = threading.Event()
        self._weights_lock = threading.Lock()  # the step's lock when there is no averager (see step_lock)
        self.serving = Serving(self)  # Ping, GetShard and message checks, answered from the fields below
        self.transport = GrpcTransport(
            run_id="",
            host=host,
            ping_info=self.serving.ping_info,
            shard_source=self.serving.shard,
            gate=self.gate,
            creds=self.creds,
            tls_server=self.tls_server,
            tls_ca=tls_ca,
        )
        self.worker: StageWorker | None = None
        try:
            bound = self.transport.attach(self.peer_id, self.serving.validate, port=grpc_port, start=False)
        except AnchormeshError as exc:
            raise ConfigError("--grpc-port", grpc_port, str(exc)) from None
        # what other peers dial: the bound address, or the announced one (needed behind 0.0.0.0 or NAT)
        self.address = f"{announce_host}:{bound.rsplit(':', 1)[1]}" if announce_host else bound
        self.dht = dht  # the run's DHT, started by the caller before any gRPC (see dht_maddrs_from_tracker)
        self.averager: GroupAverager | None = None
        self.tokens = 0
        self.state, self.reason = "joining", ""
        self.loss = math.nan
        self.tokens_per_s = 0.0
        self.dropped = 0  # messages dropped after they failed in the stage loop
        self.anchor: SwarmAnchor | None = None
        self.move_reason = ""  # set when the tracker moves this peer to another stage
        self.terminated = False  # SIGTERM/SIGINT: leave for good, even when a move was asked
        self.capacity = 0.0
        self.checkpoints: ShardCheckpoints | None = None  # with --state-dir, once the stage is known
        self.steps_done = 0  # optimizer steps this peer has taken itself
        self.startup_s = 0.0  # process start to its first optimizer step (0: not yet)
        self.state_step = -1  # the step of the stage state taken from a checkpoint or the group; -1 = initial weights
        self.metrics_log: MetricsLog | None = None  # last stage with --state-dir: metrics.jsonl
        self.resumed_from = "initial weights"  # where the stage state came from: initial weights, checkpoint step N, group step N, replica step N from PEER
        # the parts, each with one job; they read the shared fields above when asked
        self.router = Router(self.transport, self.peer_id, lambda: self.worker)
        self.jobs = AnchorJobs()
        self.state_sync = StateSync(self)
        self.checkpointer = Checkpointer(self, self.state_sync)
        self.membership = Membership(self, self.router, self.jobs)
        self.replicas = Replicas(self.transport, self.peer_id)  # the copy of another stage's state it keeps

    def phase(self, name: str) -> None:
        """A new startup phase (peer/daemon/startup.py): its status says what it does, not the last phase's reason."""
        self.startup.begin(name)
        self.reason = ""

    def step_lock(self) -> threading.Lock:
        """The lock every change of the stage's weights holds (peer/daemon/averaging.py)."""
        return step_lock(self.averager, self._weights_lock)

    def metrics(self) -> dict:
        """This peer's figures for its Prometheus endpoint (`--metrics-port`): figures.py."""
        return peer_figures(self)

    # -- the run: startup, the stage loop (stage_loop.py), leaving --------------------------
    def run(self, max_steps: int | None = None) -> None:
        def terminate(*_) -> None:
            self.terminated = True
            self.stop.set()

        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGINT, terminate)
        self.phase("join")
        a, cfg, plans = self.membership.enter()
        self.state_sync.run_clock = (time.monotonic(), a.start_step)
        self.membership.admitted(a)
        try:
            self.placement, plan, free = place_stage(
                self.device, cfg, plans, a.stage, replica_in_memory=self.state_dir is None
            )
        except ConfigError as exc:  # the run's precision or this stage does not fit this device: say so and leave
            self._refuse_config(a.run_id, exc)
        self.phase("averager")
        self.averager = start_group_averaging(  # forks before any gRPC runs and before the stage fills this process
            self.dht,
            cfg,
            a,
            self.placement,
            self.peer_id,
            self.router.uplink_bps,
            ClaimSigner(self.identity, a.run_id, a.certificate, a.tracker_key) if a.certificate else None,
            on_stuck=lambda: exec_again(self.peer_id, self.identity_to_keep()),
        )
        self.phase("stage")
        self.worker, self.anchor = build_worker(
            cfg, a, self.placement, plan, free, self.transport, self.router, self.peer_id
        )  # only this stage's layers
        stage = self.worker.stage
        bind_stage(self.averager, stage)
        channel = auth.tracker_channel(self.tracker, self.creds, TRACKER_CHANNEL_OPTIONS, self.tls_ca)
        stub = pbg.TrackerStub(channel)
        if stage.is_first:  # before the heartbeat: its reports say which work this peer holds
            try:
                self.feed = open_feed(a, cfg, channel, self.state_dir, self.data_dir, stage.vocab_size)
            except (
                AnchormeshError
            ) as exc:  # this peer cannot read the run's data: say so (not why: it may name a local file) and leave
                log.error("cannot use the run's data: %s", exc)
                self.stop.set()
                leave(stub, a.run_id, self.peer_id, "cannot use the run's data (its log says why)")
                self._shutdown(channel)
                raise SystemExit(2) from None
            threading.Thread(target=self.feed.prefetch, args=(self.stop,), name="data-prefetch", daemon=True).start()
        # heartbeats start now, so a slow state download does not get this peer declared dead; while it reports "joining" nobody routes to it
        threading.Thread(
            target=self.membership.heartbeat, args=(stub, a.heartbeat_interval_s), name="heartbeat", daemon=True
        ).start()
        if self.state_dir is not None:
            run_info = {"run_id": a.run_id, "code_version": build(), "config": json.loads(a.run_config_json)}
            self.checkpoints = ShardCheckpoints(
                self.state_dir, a.run_id, a.stage, keep=cfg.checkpoint.keep, run_info=run_info
            )
            self.phase("checkpoint")
            self.checkpointer.resume()
        self.replicas.configure(a.run_id, cfg.checkpoint.replicate_every_s, self.state_dir, own_state_bytes(stage))
        if a.HasField("restore_from"):  # its whole group died: the newest replica another stage's peer keeps
            self.phase("restore")
            holder = a.restore_from
            download = self.replicas.fetchers(stage, self.state_sync.apply_state, f"the replica {holder.peer_id} holds")
            self.state_sync.restore_from_replica(holder, a.start_step, a.stage, download[0])
        elif a.start_step > max(self.state_step, 0):  # the run has trained past what this peer holds: ask the group
            self.phase("state")
            download, weights = self.replicas.fetchers(
                stage, self.state_sync.apply_state
            )  # each donor's state judged by the others' weights
            self.state_sync.load_group_state(list(a.donors), download, weights)
        self.phase("first_step")
        self.transport.start()
        resumed = f" (resumed from {self.resumed_from})" if a.start_step > 0 or self.state_step >= 0 else ""
        self.state, self.reason = "idle", f"serving; waiting for work{resumed}"
        metrics = None  # last stage with a state dir: its failures are logged and counted, never fatal
        if self.state_dir is not None and stage.is_last:
            metrics = self.metrics_log = MetricsLog(self.state_dir / "metrics.jsonl")
        try:
            StageLoop(self, cfg, metrics).run(max_steps)
        finally:
            self.state = "left"
            moving = bool(self.move_reason) and not self.terminated
            self.reason = f"moving: {self.move_reason}" if moving else "shutting down"
            why = "SIGTERM" if self.terminated else f"refused: {self.refused}" if self.refused else "done"
            self.stop.set()
            self.checkpointer.write(wait=True)  # before saying goodbye: a peer told to stop may be killed soon after
            leave(stub, a.run_id, self.peer_id, self.reason if moving else why)
            self._shutdown(channel)
            if metrics is not None:
                metrics.close()
            if self.feed is not None:
                self.feed.close()
            log.info("%s left after %d steps", self.peer_id, self.worker.version)

    def identity_to_keep(self) -> str | None:
        """The key an exec must carry in its environment (with a state dir it is on disk)."""
        return self.identity.private_bytes().hex() if self.state_dir is None else None

    def _refuse_config(self, run_id: str, exc: ConfigError) -> None:
        """This peer cannot serve the stage it was given (its device, its memory): it tells the
        tracker why, leaves, and exits 2 with the reason, before anything loads."""
        log.error("cannot serve this run here: %s", exc)
        self.stop.set()
        with auth.tracker_channel(self.tracker, self.creds, tls_ca=self.tls_ca) as channel:
            leave(pbg.TrackerStub(channel), run_id, self.peer_id, f"cannot serve: {exc}")
        self.transport.close()
        if self.dht is not None:
            self.dht.shutdown()
        raise SystemExit(2)

    def _shutdown(self, channel: grpc.Channel) -> None:
        if self.averager is not None:
            self.averager.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        self.transport.close()
        channel.close()


def run_peer(
    initial_peers: list[str],
    tracker: str | None,
    host: str,
    grpc_port: int,
    device: str,
    max_steps: int | None = None,
    state_dir: Path | None = None,
    announce_host: str | None = None,
    dht_port: int = 0,
    metrics_port: int | None = None,
    threads: int = 1,
    token: str | None = None,
    tls_ca: bytes | None = None,
    tracker_key: bytes | None = None,
    data_dir: Path | None = None,
    fetch_tls: bool = False,
) -> None:
    """`tracker_key` checks the tracker's DHT record and, with `fetch_tls`, the run CA it serves (peer/security/exposure.py)."""
    setup_logging()
    torch.set_num_threads(threads)  # 1 by default: many peers share few cores on one machine
    if not initial_peers and tracker is None:
        raise SystemExit("anchormesh peer: error: give --initial-peers or --tracker")
    if not token:
        raise ConfigError("--token", None, f"a peer joins with the run's token: {NO_TOKEN_HINT}")
    stop, startup = threading.Event(), StartupClock(process_age_s)
    tls_ca = run_ca(tracker, tracker_key, stop) if fetch_tls and tracker is not None else tls_ca
    if not initial_peers:
        startup.begin("tracker")
        log.info("asking the tracker %s for the run's DHT addresses", tracker)
        initial_peers = dht_maddrs_from_tracker(tracker, stop, auth.Credentials(token=token), tls_ca)
    startup.begin("dht")
    dht = start_dht(initial_peers, host, dht_port, announce_host, token, tracker_key, tracker_known=tracker is not None)
    if tracker is None:
        startup.begin("find_tracker")
        tracker = find_tracker(dht, stop, tracker_key)
        log.info("found the tracker at %s through the DHT", tracker)
        tls_ca = run_ca(tracker, tracker_key, stop) if fetch_tls else tls_ca
    startup.begin("grpc")
    daemon = PeerDaemon(
        tracker,
        host,
        grpc_port,
        device,
        dht=dht,
        state_dir=state_dir,
        announce_host=announce_host,
        token=token,
        tls_ca=tls_ca,
        startup=startup,
        data_dir=data_dir,
    )
    if metrics_port is not None:
        from peer.metrics import peer_exposition, serve_metrics

        server = serve_metrics(metrics_port, daemon.metrics, host=host, render=peer_exposition)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_address[1])
    daemon.run(max_steps)
    if daemon.refused:
        raise SystemExit(2)
    if daemon.move_reason and not daemon.terminated:
        # start again from a clean process (hivemind forks; a fork beside live gRPC threads can hang)
        log.info("%s starts again to join the stage that needs it", daemon.peer_id)
        exec_again(daemon.peer_id, daemon.identity_to_keep())
