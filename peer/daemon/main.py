"""`anchormesh peer`: the long-lived daemon a volunteer runs.

It finds the tracker (given, or through the DHT from `--initial-peers`), joins and gets a stage,
builds that stage's layers, serves the `Stage` gRPC service, heartbeats (learning its
neighbours from the replies), and runs the stage: stage 0 feeds micro-batches from its data,
the last stage computes the loss, every stage steps its own optimizer when a step's gradients
are in. SIGTERM or SIGINT makes it leave cleanly.

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
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from peer import __version__
from peer.address import announce_maddr, free_port
from peer.capacity import fill_unmeasured, step_ceiling
from peer.codec.mask import MaskCodec
from peer.config import config_from_dict
from peer.daemon.memory import (
    anchor_snapshot_slots,
    check_fits,
    free_bytes,
    plan_stages,
)
from peer.daemon.runlog import MetricsLog
from peer.data import TokenStream, load_training_data
from peer.dp.group import GroupAverager, connect_peers
from peer.errors import AnchormeshError, ConfigError, WireError
from peer.logs import setup_logging
from peer.model.loading import load_stage
from peer.model.placement import CPU_FP32, DTYPE_NAMES, parse_device, resolve_placement
from peer.pipeline.grpc_transport import STAGE_POLICY, GrpcTransport
from peer.pipeline.swarm_anchor import ANCHOR_CHANNELS, SwarmAnchor
from peer.pipeline.worker import StageWorker, mean_loss
from peer.security import auth
from peer.security.identity import IDENTITY_ENV, Identity
from peer.store.checkpoint import ShardCheckpoints
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.peer")
PEER_ID_ENV = "ANCHORMESH_PEER_ID"  # set by a MOVE's exec so the peer keeps its id


# gRPC backs off reconnecting to an address that refused it, up to 120 s by default; a tracker
# that restarts must hear the heartbeats within its reconnect grace (bootstrap/persist.py)
TRACKER_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 4000)]


def find_tracker(dht, stop: threading.Event, tracker_key: bytes | None = None, run_id: str | None = None) -> str:
    """The tracker address from the DHT's signed records (peer/security/dht_auth.py), newest first: one
    signed by `tracker_key` (and of `run_id` when given). Without a key it takes a record only
    when all well-signed ones have one signer: a member posing as the tracker makes that
    ambiguous, and then it waits for the key. Logs what it refused; retries with backoff."""
    from peer.security import dht_auth

    delay, said = 0.5, set()

    def once(level: int, text: str, *args) -> None:
        if (text, args) not in said:
            said.add((text, args))
            log.log(level, text, *args)

    while not stop.is_set():
        found = dht.get(dht_auth.TRACKER_RECORD_KEY, latest=True)
        good, refused = dht_auth.verified_trackers(found, tracker_key, run_id)
        for signer, why in refused:
            once(logging.WARNING, "refused a tracker record in the DHT signed by %s: %s", signer, why)
        signers = {r["key"] for _, r in good}
        if good and (tracker_key is not None or len(signers) == 1):
            if tracker_key is None:
                once(logging.WARNING, "took the tracker record signed by %s without checking that it is the tracker's key: pass --tracker-key or --token @bootstrap.json", good[0][1]["key"][:16])
            return good[0][1]["tracker"]
        if len(signers) > 1:
            once(logging.ERROR, "tracker records from %d keys in the DHT: cannot tell the tracker from a member posing as it; pass --tracker-key (the \"tracker_key\" of bootstrap.json) or --token @bootstrap.json", len(signers))
        log.info("no tracker in the DHT yet; retrying in %.1fs", delay)
        stop.wait(delay)
        delay = min(delay * 2, 10.0)
    raise SystemExit(1)


# the tracker refused this peer's credentials: retrying cannot help, the operator must act
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def dht_maddrs_from_tracker(tracker: str, stop: threading.Event, creds: auth.Credentials | None = None, tls_ca: bytes | None = None) -> list[str]:
    """The run's DHT addresses from the tracker's status; retries with backoff and says so.

    The channel is closed before returning: hivemind starts its DHT and averager by fork(), and
    a fork while gRPC calls are running can deadlock, so the daemon forks only between calls.
    """
    delay = 0.5
    while not stop.is_set():
        try:
            with auth.tracker_channel(tracker, creds, tls_ca=tls_ca) as channel:
                return list(pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=10).dht_maddrs)
        except grpc.RpcError as exc:
            if exc.code() in REFUSALS:
                log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                raise SystemExit(2) from None
            log.warning("tracker %s unreachable (%s: %s%s); retrying in %.1fs", tracker, exc.code().name, exc.details(), auth.tls_hint(exc.details(), tls_ca is not None), delay)
            stop.wait(delay)
            delay = min(delay * 2, 30.0)
    raise SystemExit(1)


def join(stub: pbg.TrackerStub, req: pb.JoinRequest, stop: threading.Event, tls: bool = False) -> pb.Assignment:
    """Join, retrying with backoff while the tracker is unreachable; a refusal ends the daemon."""
    delay = 0.5
    while not stop.is_set():
        try:
            return stub.Join(req, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, *REFUSALS):
                log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                raise SystemExit(2) from None
            log.warning("tracker unreachable (%s: %s%s); retrying in %.1fs", exc.code().name, exc.details(), auth.tls_hint(exc.details(), tls), delay)
            stop.wait(delay)
            delay = min(delay * 2, 30.0)
    raise SystemExit(1)


_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc, so imports and the DHT's start count;
    elsewhere: since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
        with open("/proc/uptime") as f:
            return max(float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class PeerDaemon:
    """One peer: its stage worker, its gRPC server, its heartbeat and its main loop."""

    def __init__(self, tracker: str, host: str = "127.0.0.1", grpc_port: int = 0, device: str = "cpu", dht=None, state_dir: Path | None = None, announce_host: str | None = None, token: str | None = None, tls_ca: bytes | None = None) -> None:
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
        self._weights_lock = threading.Lock()  # the step's lock when there is no averager (see _step_lock)
        self.transport = GrpcTransport(run_id="", host=host, ping_info=self._ping_info, shard_source=self._shard, gate=self.gate, creds=self.creds, tls_server=self.tls_server, tls_ca=tls_ca)
        self.worker: StageWorker | None = None
        try:
            bound = self.transport.attach(self.peer_id, self._validate, port=grpc_port, start=False)
        except AnchormeshError as exc:
            raise ConfigError("--grpc-port", grpc_port, str(exc)) from None
        # what other peers dial: the bound address, or the announced one (needed behind 0.0.0.0 or NAT)
        self.address = f"{announce_host}:{bound.rsplit(':', 1)[1]}" if announce_host else bound
        self.neighbours: dict[int, list[pb.PeerInfo]] = {}
        self._route_gen = torch.Generator().manual_seed(uuid.uuid4().int & 0xFFFF)
        self.dht = dht  # the run's DHT, started by the caller before any gRPC (see dht_maddrs_from_tracker)
        self.averager: GroupAverager | None = None
        self.tokens = 0
        self.state, self.reason = "joining", ""
        self.loss = math.nan
        self._rate = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self.dropped = 0  # messages dropped after they failed in the stage loop
        self._sent_at: dict[tuple[int, int], float] = {}
        self.round_trips: deque[float] = deque(maxlen=64)  # stage 0: seconds from sending a micro-batch to its gradient
        self.anchor: SwarmAnchor | None = None
        self._anchor_jobs: deque[tuple[int, int]] = deque()  # (anchor id, micro-batches) from the tracker
        self._eval_jobs: deque[int] = deque()  # evaluation pass ids from the tracker
        self._eval_windows: list[torch.Tensor] | None = None  # stage 0: the held-out windows, the same every pass
        self.move_reason = ""  # set when the tracker moves this peer to another stage
        self.terminated = False  # SIGTERM/SIGINT: leave for good, even when a move was asked
        self._busy = 0.0  # seconds spent computing since the last rate update
        self.capacity = 0.0
        self.checkpoints: ShardCheckpoints | None = None  # with --state-dir, once the stage is known
        self._checkpointed = 0  # the step of the newest checkpoint written
        self.steps_done = 0  # optimizer steps this peer has taken itself
        self.startup_s = 0.0  # process start to its first optimizer step (0: not yet)
        self.state_step = -1  # the step of the stage state taken from a checkpoint or the group; -1 = initial weights
        self._run_clock: tuple[float, int] | None = None  # (when it joined, the run's step then): bounds a downloaded state's step
        self._checkpoint_thread: threading.Thread | None = None
        self.checkpoint_failures = 0  # checkpoint writes that failed (full disk, I/O error): logged, training goes on
        self.metrics_log: MetricsLog | None = None  # last stage with --state-dir: metrics.jsonl
        self.resumed_from = "initial weights"  # where the stage state came from: initial weights, checkpoint step N, group step N

    def _step_lock(self) -> threading.Lock:
        """The lock every change of the stage's weights holds: the averager's (its download and
        averaging threads use it too) or, without one, the daemon's own."""
        return self.averager.lock if self.averager is not None else self._weights_lock

    def _ping_info(self, addr: object) -> pb.PingReply:
        """Ping's answer: who this peer is, which stage it serves, its step and state."""
        w = self.worker
        return pb.PingReply(peer_id=self.peer_id, stage=w.stage.index if w else 0, version=w.version if w else 0, state=self.state, run_id=self.transport.run_id)

    def _shard(self, addr: object, req: pb.ShardRequest) -> Iterator[pb.ShardChunk]:
        """GetShard: the stage's weights, copied between steps (under the step's lock), sent in chunks."""
        from peer.store.shard import shard_chunks, snapshot

        w = self.worker
        if w is None or self.state == "joining":
            raise AnchormeshError(f"peer {self.peer_id} serves no stage yet")
        with self._step_lock():
            tensors, step = snapshot(w.stage), w.version
        return shard_chunks(tensors, run_id=self.transport.run_id, peer_id=self.peer_id, stage=w.stage.index, num_stages=w.stage.num_stages, step=step)

    def _validate(self, channel: str, msg: object) -> None:
        if self.worker is None or self.anchor is None:
            raise WireError("this peer has no stage yet")
        if channel in ANCHOR_CHANNELS:
            self.anchor.validate(channel, msg)
        else:
            self.worker.validate(channel, msg)

    # -- routing ----------------------------------------------------------------------------
    def _next_hop(self) -> str:
        """A live next-stage peer, chosen with probability proportional to its measured capacity
        (tokens/s it could do if never waiting). Not its throughput: a peer that gets little work
        shows little throughput, and routing by it would starve that peer further. A peer not
        measured yet counts as the median of the others. A peer whose stream stopped taking
        messages is left out while the transport excludes it, unless it is the only one."""
        peers = self.neighbours.get(self.worker.stage.index + 1, [])
        if not peers:
            raise AnchormeshError(f"no live peer of stage {self.worker.stage.index + 1} to send to")
        peers = [p for p in peers if self.transport.usable(p.peer_id)] or peers
        weights = torch.tensor(fill_unmeasured([p.capacity_tokens_per_s for p in peers]))
        return peers[int(torch.multinomial(weights, 1, generator=self._route_gen))].peer_id

    def _resolve(self, sender: str) -> str:
        return sender

    def _apply_neighbours(self, directive: pb.Directive) -> None:
        by_stage: dict[int, list[pb.PeerInfo]] = {}
        for n in directive.neighbours:
            by_stage.setdefault(n.stage, []).append(n)
            self.transport.endpoints[n.peer_id] = n.address
        self.neighbours = by_stage

    def _siblings(self) -> list[str]:
        """The other live peers of this peer's stage group."""
        return [n.peer_id for n in self.neighbours.get(self.worker.stage.index, []) if n.peer_id != self.peer_id]

    def retry_after_s(self) -> float:
        """How long stage 0 waits for a micro-batch's gradient before sending it again: three
        times the slowest recent round trip, within [5 s, 60 s] (20 s before any is measured)."""
        if len(self.round_trips) < 4:
            return 20.0
        return min(max(3.0 * max(self.round_trips), 5.0), 60.0)

    def uplink_bps(self) -> float | None:
        """Bytes/s of its slowest measured outbound pipeline stream (None: not measured yet): what
        its uplink carries, as far as this peer can tell."""
        rates = [bps for (_, ch), m in list(self.transport.meters.items()) if ch in ("forward", "backward") and (bps := m.bps()) is not None]
        return min(rates) if rates else None

    def links(self) -> tuple[float, float]:
        """(its slowest measured outbound pipeline link in Mbit/s or 0, the fraction of the codec's
        configured payload (mask.rank, or mask.drop's keep) it sends on its most constrained link,
        or 0 when it sends no activations)."""
        w, bps = self.worker, self.uplink_bps()
        keep = min(w.keep_sent.values()) if w is not None and w.keep_sent else 0.0
        return (bps * 8 / 1e6 if bps else 0.0), keep

    def metrics(self) -> dict:
        """This peer's figures for its Prometheus endpoint (`--metrics-port`)."""
        w, t = self.worker, self.transport
        link_mbit, pp_keep = self.links()
        return {
            "id": self.peer_id, "stage": w.stage.index if w else "", "state": self.state, "step": w.version if w else 0,
            "tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "capacity_tokens_per_s": self.capacity,
            "loss": self.loss if w is not None and w.stage.is_last else None,
            "queue_depth": len(w.inbox_fwd) + len(w.inbox_bwd) if w else 0, "bytes_in": t.bytes_in, "bytes_out": t.total_bytes(),
            "dp_rounds": self.averager.rounds if self.averager else 0, "dp_rejected": self.averager.rejected if self.averager else 0,
            "dp_partial": self.averager.partial if self.averager else 0, "dropped": self.dropped,
            "refused_calls": sum(self.gate.refused.values()),
            "link_mbit": link_mbit, "pp_keep": pp_keep, "dp_period_s": self.averager.period_s if self.averager else 0.0,
            "checkpoint_step": self._checkpointed if self.checkpoints is not None and self._checkpointed else None,
        }

    # -- heartbeat --------------------------------------------------------------------------
    def _report(self) -> pb.PeerReport:
        w = self.worker
        link_mbit, pp_keep = self.links()
        return pb.PeerReport(
            run_id=self.transport.run_id,
            tokens=self.tokens,
            peer=pb.PeerInfo(
                peer_id=self.peer_id, stage=w.stage.index, address=self.address, state=self.state, tokens_per_s=self.tokens_per_s,
                bytes_in=self.transport.bytes_in, bytes_out=self.transport.total_bytes(), step=w.version, loss=self.loss,
                queue_depth=len(w.inbox_fwd) + len(w.inbox_bwd), startup_s=self.startup_s,
                # before its first step, how long it has been starting (what it waits on is the reason)
                reason=self.reason if self.steps_done else f"{self.reason or 'starting'} ({process_age_s():.0f} s since start)",
                dp_rounds=self.averager.rounds if self.averager else 0,
                anchor_id=self.anchor.newest_id if self.anchor else 0,
                anchor_bytes_out=self.anchor.bytes_out if self.anchor else 0,
                capacity_tokens_per_s=self.capacity,
                dp_bytes_out=self.averager.bytes_out if self.averager else 0,
                dp_dense_bytes=self.averager.dense_bytes if self.averager else 0,
                dp_rejected=self.averager.rejected if self.averager else 0,
                eval_id=self.anchor.eval_result[0] if self.anchor else 0,
                eval_loss=self.anchor.eval_result[1] if self.anchor else math.nan,
                refused_calls=sum(self.gate.refused.values()),
                dp_suspects=list(self.averager.suspects) if self.averager else [],
                key_fingerprint=self.identity.fingerprint,
                link_mbit=link_mbit, pp_keep=pp_keep, dp_period_s=self.averager.period_s if self.averager else 0.0,
                excluding=self.transport.excluding()[:4],  # the tracker keeps 4
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
                    if directive.kind == pb.Directive.MOVE:
                        log.info("the tracker moves this peer: %s", directive.reason)
                        self.move_reason = directive.reason
                        self.stop.set()
                        return
                    self._apply_neighbours(directive)
                    if set(directive.banned) != set(self.gate.banned):  # in place: the gate reads it on every call
                        for fp in set(self.gate.banned) - set(directive.banned):
                            del self.gate.banned[fp]
                        self.gate.banned.update({fp: "banned by the run's operator" for fp in directive.banned})
                        log.warning("banned keys in this run: %s", ", ".join(directive.banned) or "none")
                    if self.averager is not None:  # a banned peer's averaging process may live on: keep it out of rounds
                        for hid in directive.banned_dht:
                            self.averager.excluded.setdefault(hid, "banned by the run's operator")
                        if directive.member_dht:
                            self.averager.members = set(directive.member_dht)
                    if self.anchor is not None and directive.anchors_issued:
                        self.anchor.issued = max(self.anchor.issued or 0, directive.anchors_issued)
                    if directive.anchor_id:
                        self._anchor_jobs.append((directive.anchor_id, directive.anchor_micro_batches))
                    if directive.eval_id:
                        self._eval_jobs.append(directive.eval_id)
                    if directive.kind == pb.Directive.STOP:
                        log.info("tracker says stop: %s", directive.reason)
                        self.stop.set()
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    return
                if exc.code() in REFUSALS:  # banned, or its credentials no longer pass: leave for good
                    log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                    self.refused = exc.details() or exc.code().name
                    self.stop.set()
                    return
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # the tracker dropped us (declared dead): join again
                    log.warning("the tracker no longer lists this peer (%s); joining again", exc.details())
                    self.move_reason = f"the tracker dropped this peer: {exc.details()}"
                    self.stop.set()
                    return
                log.warning("heartbeat stream ended (%s: %s); reconnecting in %.0fs", exc.code().name, exc.details(), interval)
                self.stop.wait(interval)

    def _retry_stale(self, w: StageWorker) -> None:
        """Stage 0: a micro-batch without its gradient for `retry_after_s()` is sent again (same window,
        same id) to a live next-stage peer; its old forward is dropped. Covers a neighbour that died."""
        now = time.monotonic()
        limit = self.retry_after_s()
        for key, job in list(w.inflight.items()):
            sent = self._sent_at.setdefault(key, now)
            if now - sent > limit and self.neighbours.get(1):
                step, mb = key
                w.inflight.pop(key)
                w.basis_sent.clear()  # the lost message may have carried the receiver's basis
                log.warning("no gradient for micro-batch %s of step %d after %.0fs; sending it again", mb, step, now - sent)
                w.inject(job.window, step, mb - w.replica * w.cfg.pipeline.micro_batches)
                self._sent_at[key] = now
        for key in list(self._sent_at):
            if key not in w.inflight:
                self.round_trips.append(now - self._sent_at.pop(key))

    def _start_averaging(self, prefix: str, every: int, compression: str, link_share: float) -> None:
        """Join the stage group's averaging; without a DHT the peer trains alone. Rounds are
        spaced so they take at most `link_share` of the uplink this peer measures."""
        if self.dht is None:
            log.warning("no DHT: this peer will not average with its stage group")
            return
        self.averager = GroupAverager(
            self.dht, list(self.worker.stage.parameters()), prefix, every=every, state_fn=self._stage_state, compression=compression,
            peer_id=self.peer_id, link_bps=self.uplink_bps, link_share=link_share,
        )
        log.info("stage-group averaging every %d steps at least, %s on the wire, at most %.0f%% of the uplink (group key %s)", every, compression, 100 * link_share, prefix)

    # -- state transfer ---------------------------------------------------------------------
    def _stage_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joiner of this stage group downloads and what a checkpoint holds: parameters and
        AdamW moments, in named_parameters order, plus the step counts (taken under the step's lock)."""
        w = self.worker
        with self._step_lock():  # host copies: hivemind and torch.save must never touch the device
            params = [p.detach().to("cpu", copy=True) for _, p in w.stage.named_parameters()]
            opt = w.optimizer.opt
            moments, adam_step = [], 0.0
            for key in ("exp_avg", "exp_avg_sq"):
                for _, p in w.stage.named_parameters():
                    st = opt.state.get(p, {})
                    moments.append(st[key].detach().to("cpu", copy=True) if key in st else torch.zeros(p.shape, dtype=p.dtype))
                    adam_step = max(adam_step, float(st.get("step", 0.0)))
            return {"version": w.version, "adam_step": adam_step}, params + moments

    def _load_group_state(self) -> None:
        """A joiner takes the most-trained group member's state when there is one and it is newer
        than what this peer holds (a checkpoint may be)."""
        if self.averager is not None:
            log.info("waiting up to 60s for a stage-group member to send its state (the run is at step %d)", self.worker.version)
        got = self.averager.load_state(timeout=60.0) if self.averager is not None else None
        if got is not None and self._apply_state(*got, source="a group member"):
            self.resumed_from = f"group step {self.state_step}"
            return
        behind = f"the run is at step {self.worker.version}"
        if self.state_step >= 0:
            behind = f"{behind}, {max(self.worker.version - self.state_step, 0)} steps of this stage's training are lost"
        self.reason = f"no stage-group member answered: resumed from {self.resumed_from} ({behind})"
        log.warning("no stage state to download (first peer of its group, a group that emptied, or no donor answered): resumed from %s (%s)", self.resumed_from, behind)

    def _check_state(self, named: list, tensors: list, version: int) -> None:
        """What a donor (or a disk) hands over must be a state honest training can reach; raises
        ValueError saying why not. Its step is at most the run's step when this peer joined plus
        what the run can have done since. Each weight's norm is within 10x of this peer's own
        (initial or checkpointed) weight, plus a root-mean-square of 2: a state of 1e30 weights would
        wreck the group.
        AdamW's moments satisfy |m| <= c sqrt(v) elementwise, c = (1 - b1) / sqrt((1 - b2)(1 -
        b1^2 / b2)) (Cauchy-Schwarz on the two EMAs of one gradient sequence, when b1^2 < b2):
        a first moment larger than that would make the next step huge."""
        n = len(named)
        if self._run_clock is not None:
            start = self._run_clock[1]
            ceiling = step_ceiling(start, time.monotonic() - self._run_clock[0])
            if version > ceiling:
                raise ValueError(f"step {version} is past the run's ({start} when this peer joined, at most {ceiling:.0f} now)")
        for (name, p), t in zip(named, tensors[:n]):
            own, new = float(p.detach().float().norm()), float(t.float().norm())
            if new > 10 * own + 2 * t.numel() ** 0.5:  # 10x its own, plus a root-mean-square of 2 per value
                raise ValueError(f"weight {name}: norm {new:.3g}, over 10x this peer's {own:.3g} (+ 2 per value)")
        b1, b2 = self.worker.cfg.optim.beta1, self.worker.cfg.optim.beta2
        if b1 * b1 < b2:
            c = (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)) ** 0.5
            for (name, _), m, v in zip(named, tensors[n : 2 * n], tensors[2 * n :]):
                if bool((m.float().abs() > 1.01 * c * v.float().sqrt() + 1e-12).any()):
                    raise ValueError(f"AdamW moments of {name}: |exp_avg| exceeds {c:.3f} sqrt(exp_avg_sq), which no gradient sequence gives")

    def _apply_state(self, metadata: object, tensors: list, source: str) -> bool:
        """Put a stage state (from the group or a checkpoint) into the stage, whole or not at all:
        one that does not fit (count, shape, dtype, non-finite values) or is not newer than the
        step this peer holds is ignored. Returns whether it was applied."""
        w = self.worker
        named = list(w.stage.named_parameters())
        n = len(named)
        try:
            if not isinstance(metadata, dict) or len(tensors) != 3 * n:
                raise ValueError(f"{len(tensors)} tensors, expected {3 * n}")
            for i, t in enumerate(tensors):
                name, p = named[i % n]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or not t.is_floating_point() or not torch.isfinite(t).all():
                    raise ValueError(f"tensor {i} ({name}): {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} does not fit {tuple(p.shape)} or is not finite")
                if i >= 2 * n and bool((t < 0).any()):  # a second moment is a mean of squares: a negative one poisons AdamW
                    raise ValueError(f"tensor {i} (exp_avg_sq of {name}): {int((t < 0).sum())} negative values")
            version, adam_step = int(metadata["version"]), float(metadata["adam_step"])
            self._check_state(named, tensors, version)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("stage state from %s ignored: %s", source, exc)
            return False
        if version <= self.state_step:
            log.info("stage state from %s (step %d) is not newer than the state this peer holds (step %d): kept its own", source, version, self.state_step)
            return False
        with torch.no_grad(), self._step_lock():
            for (name, p), t in zip(named, tensors[:n]):
                p.copy_(t.to(p.dtype))
            if adam_step > 0:
                fused = bool(w.optimizer.opt.defaults.get("fused"))  # fused AdamW keeps its step count on the device
                for (name, p), m, v in zip(named, tensors[n : 2 * n], tensors[2 * n :]):
                    step_t = torch.tensor(adam_step, dtype=torch.float32, device=p.device if fused else "cpu")
                    w.optimizer.opt.state[p] = {"step": step_t, "exp_avg": m.to(device=p.device, dtype=p.dtype, copy=True), "exp_avg_sq": v.to(device=p.device, dtype=p.dtype, copy=True)}
            if self.averager is not None:
                self.averager.rebase()
            w.version = max(w.version, version)
            self.state_step = version
            if w.stage.is_first:
                w.next_mb = w.version * w.cfg.pipeline.micro_batches
        log.info("took the stage state of %s at step %d (AdamW step %d)", source, version, adam_step)
        return True

    # -- checkpoints ------------------------------------------------------------------------
    def _resume_from_checkpoint(self) -> None:
        """A restarted peer takes its newest valid checkpoint of this stage (checked like a download)."""
        if self.checkpoints is None:
            return
        got = self.checkpoints.newest()
        if got is None:
            return
        expected = [name for name, _ in self.worker.stage.named_parameters()]
        if got.names != expected * 3:
            log.warning("checkpoint in %s ignored: its tensors are not this stage's parameters", self.checkpoints.dir)
            return
        if self._apply_state(got.metadata, got.tensors, source=f"checkpoint {self.checkpoints.dir}"):
            self.resumed_from = f"checkpoint step {got.step}"
            self._checkpointed = got.step  # already on disk: not written again at this step

    def _checkpoint(self, wait: bool = False) -> None:
        """Write a checkpoint of the state as it is now; the copy is taken between steps, the
        write runs in a background thread so the fast circuit never waits on the disk. A
        checkpoint still being written makes a new one wait (`wait`, at exit) or be skipped."""
        if self.checkpoints is None or self.worker is None or self.worker.version == self._checkpointed:
            return
        if self.steps_done == 0 and self.state_step < 0:  # initial weights: nothing worth keeping
            return
        busy = self._checkpoint_thread is not None and self._checkpoint_thread.is_alive()
        if busy and not wait:
            log.warning("checkpoint at step %d skipped: the previous one is still being written", self.worker.version)
            return
        if busy:
            self._checkpoint_thread.join()
        meta, tensors = self._stage_state()
        stage = self.worker.stage
        names = [name for name, _ in stage.named_parameters()] * 3
        hf_names = [stage.hf_names[name] for name, _ in stage.named_parameters()]
        step, before = int(meta["version"]), self._checkpointed
        self._checkpointed = step

        def write() -> None:
            try:
                self.checkpoints.save(meta, names, tensors, hf_names)
            except Exception as exc:  # a full disk or any other failure: counted and logged, never the end of the peer
                self.checkpoint_failures += 1
                if self._checkpointed == step:  # not written: the step may be tried again (at exit, say)
                    self._checkpointed = before
                log.error("checkpoint at step %d failed (%d so far), training goes on: %s", step, self.checkpoint_failures, exc)

        self._checkpoint_thread = threading.Thread(target=write, name="checkpoint", daemon=True)
        self._checkpoint_thread.start()
        if wait:
            self._checkpoint_thread.join()

    # -- main loop --------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> None:
        def terminate(*_) -> None:
            self.terminated = True
            self.stop.set()

        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGINT, terminate)
        with auth.tracker_channel(self.tracker, self.creds, tls_ca=self.tls_ca) as join_channel:
            own_maddrs = [str(m) for m in self.dht.get_visible_maddrs()] if self.dht is not None else []
            req = pb.JoinRequest(peer_id=self.peer_id, grpc_address=self.address, code_version=__version__, dht_maddrs=own_maddrs)
            try:
                plans = self._plan_memory(pbg.TrackerStub(join_channel), req)
            except ConfigError as exc:  # the run cannot run on this device: nothing to leave yet
                log.error("cannot serve this run here: %s", exc)
                self.transport.close()
                if self.dht is not None:
                    self.dht.shutdown()
                raise SystemExit(2) from None
            if self.tls_server is not None:
                from peer.security.tls import public_der

                req.tls_public_key = public_der(self.tls_server.key)
            a = join(pbg.TrackerStub(join_channel), req, self.stop, self.tls_ca is not None)
        cfg = config_from_dict(json.loads(a.run_config_json))
        self._run_clock = (time.monotonic(), a.start_step)
        self.transport.run_id = a.run_id
        # from now on: calls carry the certificate; the gate checks others' with the tracker's key
        self.creds.certificate = a.certificate
        self.gate.configure(a.run_id, a.tracker_key, self.creds.token, a.calls_per_s or None)
        self.transport.messages = auth.RateLimit(a.messages_per_s or self.transport.messages.rate)
        if self.tls_server is not None:
            if not a.tls_certificate:
                raise ConfigError("--tls-ca", "given", "the tracker issued no TLS certificate: this run does not use TLS (security.tls); drop --tls-ca")
            self.tls_server.install(a.tls_certificate)
        log.info("%s joined %s: stage %d of %d (layers %d-%d), serving on %s", self.peer_id, a.run_id, a.stage, a.num_stages, a.layer_start, a.layer_end - 1, self.address)
        try:
            self.placement = resolve_placement(self.device, cfg.compute)
            plan = plans[a.stage] if plans else plan_stages(cfg, self.placement, dp_group=True)[a.stage]
            free = free_bytes(self.placement.device)
            check_fits(plan, free, cfg.compute.memory_budget_gib, self.placement.device)
        except ConfigError as exc:  # the run's precision or this stage does not fit this device: say so and leave
            self._refuse_config(a.run_id, exc)
        log.info("computing on %s; stage %d plans %.2f GiB of %.2f GiB free", self.placement.describe(), a.stage, plan.need(self.placement.device) / 2**30, free / 2**30)
        stage = load_stage(cfg.model, a.stage, seed=cfg.seed, device=self.placement.device, dtype=self.placement.master_dtype)  # only this stage's layers
        vocab_size = stage.vocab_size
        stage.train()
        replica = uuid.uuid4().int % (1 << 20)  # makes this peer's micro-batch ids (and masks) its own
        self.worker = StageWorker(stage, replica, cfg, MaskCodec(cfg.mask), self.transport, a.run_id, peer_id=self.peer_id, next_hop=self._next_hop, resolve=self._resolve, local_steps=True, placement=self.placement)
        self.worker.version = a.start_step  # continue the run's step numbering (the group's state may raise it)
        self.worker.next_mb = a.start_step * cfg.pipeline.micro_batches
        snapshot_bytes = plan.anchor_snapshot or sum(p.numel() for p in stage.parameters()) * self.placement.compute_dtype.itemsize
        slots = anchor_snapshot_slots(free - plan.need(self.placement.device), snapshot_bytes, cfg.compute.anchor_snapshot_share)
        self.anchor = SwarmAnchor(self.worker, cfg.anchor.micro_batches, self._siblings, eval_batches=cfg.pipeline.eval_batches, max_jobs=slots)
        if self.dht is not None and a.group_dht_maddrs:
            log.info("dialled %d of %d stage mates' DHT nodes", connect_peers(self.dht, list(a.group_dht_maddrs)), len(a.group_dht_maddrs))
        self._start_averaging(f"{a.run_id}_stage{a.stage}", cfg.dp.inner_steps, cfg.dp.outer_compression, cfg.dp.link_share)  # forks: before any gRPC runs
        channel = auth.tracker_channel(self.tracker, self.creds, TRACKER_CHANNEL_OPTIONS, self.tls_ca)
        stub = pbg.TrackerStub(channel)
        # heartbeats start now, so a slow state download does not get this peer declared dead;
        # while it reports "joining" nobody routes to it
        threading.Thread(target=self._heartbeat, args=(stub, a.heartbeat_interval_s), name="heartbeat", daemon=True).start()
        if self.state_dir is not None:
            run_info = {"run_id": a.run_id, "code_version": __version__, "config": json.loads(a.run_config_json)}
            self.checkpoints = ShardCheckpoints(self.state_dir, a.run_id, a.stage, keep=cfg.checkpoint.keep, run_info=run_info)
            self.reason = "checking its checkpoints"
            self._resume_from_checkpoint()
        if a.start_step > max(self.state_step, 0):  # the run has trained past what this peer holds: ask the group
            self.reason = "downloading its stage's state from the group"
            self._load_group_state()
        stream = gen = None
        if stage.is_first:
            self.reason = "reading the run's data"
            try:
                stream, source = load_training_data(cfg, vocab_size)
            except ConfigError as exc:  # this machine cannot serve stage 0 with the run's data: say so and leave
                log.error("cannot read the run's data: %s", exc)
                self.stop.set()
                self._leave(stub, a.run_id, f"cannot read the run's data: {exc}")
                self._shutdown(channel)
                raise SystemExit(2) from None
            # each stage-0 peer draws its own batches (seeded by its id, so two peers never repeat each other)
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(self.peer_id.encode()))
            log.info("stage 0 reads %s (%d training tokens, %s tokenizer)", source.split(",")[0], len(stream.train), cfg.data.tokenizer)
        self.transport.start()
        resumed = f" (resumed from {self.resumed_from})" if a.start_step > 0 or self.state_step >= 0 else ""
        self.state, self.reason = "idle", f"serving; waiting for work{resumed}"
        metrics = None
        if self.state_dir is not None and stage.is_last:  # its failures are logged and counted, never fatal
            metrics = self.metrics_log = MetricsLog(self.state_dir / "metrics.jsonl")
        try:
            errors_seen = 0
            while not self.stop.is_set() and (max_steps is None or self.worker.version < max_steps):
                if self.transport.send_error_count != errors_seen:  # a lost message may have carried a basis
                    errors_seen = self.transport.send_error_count
                    self.worker.basis_sent.clear()
                try:
                    self._tick(stream, gen, cfg, metrics)
                except AnchormeshError as exc:  # one bad or late message never ends the peer
                    self.dropped += 1
                    log.warning("dropped a message: %s", exc)
        finally:
            self.state = "left"
            moving = bool(self.move_reason) and not self.terminated
            self.reason = f"moving: {self.move_reason}" if moving else "shutting down"
            why = "SIGTERM" if self.terminated else f"refused: {self.refused}" if self.refused else "done"
            self.stop.set()
            self._checkpoint(wait=True)  # before saying goodbye: a peer told to stop may be killed soon after
            self._leave(stub, a.run_id, self.reason if moving else why)
            self._shutdown(channel)
            if metrics is not None:
                metrics.close()
            log.info("%s left after %d steps", self.peer_id, self.worker.version)

    def _plan_memory(self, stub: pbg.TrackerStub, req: pb.JoinRequest) -> list | None:
        """Before joining: the run's config, this peer's placement for it and its memory plan of
        every stage, put in the JoinRequest so the tracker gives it a stage that fits. A tracker
        that cannot say its config (unreachable: Join retries and says so) leaves the plan to
        after the Join. A device or precision that cannot run the run exits 2 here."""
        try:
            cfg = config_from_dict(json.loads(stub.GetConfig(pb.ConfigRequest(), timeout=10).run_config_json))
        except grpc.RpcError as exc:
            if exc.code() in REFUSALS:  # a wrong token: Join would be refused the same way
                log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                raise ConfigError("--token", "given", f"the tracker refused it ({exc.code().name}: {exc.details()})") from None
            log.info("no run config before joining (%s): the memory plan waits for the assignment", exc.code().name)
            return None
        placement = resolve_placement(self.device, cfg.compute)
        plans = plan_stages(cfg, placement, dp_group=True)
        free = free_bytes(placement.device)
        budget = int(cfg.compute.memory_budget_gib * 2**30)
        req.memory_bytes = min(budget, free) if budget else free
        req.stage_memory_bytes.extend(p.need(placement.device) for p in plans)
        name = torch.cuda.get_device_name(placement.device) if placement.cuda else ""
        req.device = " ".join(x for x in (str(placement.device), name, DTYPE_NAMES[placement.compute_dtype]) if x)
        log.info("memory plan on %s (%.2f GiB usable): %s GiB per stage", req.device, req.memory_bytes / 2**30, ", ".join(f"{p.need(placement.device) / 2**30:.2f}" for p in plans))
        return plans

    def _refuse_config(self, run_id: str, exc: ConfigError) -> None:
        """This peer cannot serve the stage it was given (its device, its memory): it tells the
        tracker why, leaves, and exits 2 with the reason, before anything loads."""
        log.error("cannot serve this run here: %s", exc)
        self.stop.set()
        with auth.tracker_channel(self.tracker, self.creds, tls_ca=self.tls_ca) as channel:
            self._leave(pbg.TrackerStub(channel), run_id, f"cannot serve: {exc}")
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

    def _leave(self, stub: pbg.TrackerStub, run_id: str, reason: str) -> None:
        try:
            stub.Leave(pb.LeaveRequest(run_id=run_id, peer_id=self.peer_id, reason=reason), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not say goodbye to the tracker: %s", exc.details())

    def _tick(self, stream: TokenStream | None, gen: torch.Generator | None, cfg, metrics: MetricsLog | None) -> None:
        """One unit of work: a step when its gradients are in, else fast work, else anchor work."""
        w, p = self.worker, cfg.pipeline
        t0 = time.perf_counter()
        w.drain()
        self.anchor.drain()
        self.anchor.apply_priors()
        if w.ready(w.version):
            w.gradients()
            if self.averager is not None:
                with self.averager.lock:  # a joiner downloading our state sees whole steps and whole averaging results
                    w.apply_step()
                    self.averager.after_step(w.version, alone=not self._siblings())
                if w.version % max(cfg.dp.inner_steps, 1) == 0:
                    self.averager.share_state(priority=w.version)
            else:
                with self._weights_lock:
                    w.apply_step()
            self.steps_done += 1
            if self.steps_done == 1:
                self.startup_s = process_age_s()
                log.info("first step %.1f s after the process started", self.startup_s)
            if cfg.checkpoint.every and w.version % cfg.checkpoint.every == 0:
                self._checkpoint()
            if w.stage.is_last:
                losses = [x for step_losses in w.losses.values() for x in step_losses]
                w.losses.clear()
                self.loss = mean_loss(losses) if losses else self.loss  # one read of the device per step
                if metrics is not None:
                    metrics.write({"step": w.version, "loss": self.loss, "time": time.time()})
            self.tokens += p.micro_batches * p.micro_batch_size * p.seq_len
            self._busy += time.perf_counter() - t0
            self._update_rate()
            return
        if w.stage.is_first:
            self._retry_stale(w)
            while self._anchor_jobs:
                anchor_id, n = self._anchor_jobs.popleft()
                # the anchor batch comes from this peer's data, seeded by the job id (reproducible)
                agen = torch.Generator().manual_seed(cfg.seed * 7_919 + anchor_id)
                self.anchor.schedule(anchor_id, [stream.batch(p.micro_batch_size, p.seq_len, agen) for _ in range(n)])
            while self._eval_jobs:
                if self._eval_windows is None:
                    held = stream.eval_batches(p.micro_batch_size, p.seq_len, p.eval_batches)
                    self._eval_windows = [held[i % len(held)] for i in range(p.eval_batches)]
                self.anchor.schedule_eval(self._eval_jobs.popleft(), self._eval_windows)
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
        if moved:  # capacity counts fast-circuit work only
            self._busy += time.perf_counter() - t0
        else:  # the fast queues are empty: anchor work
            moved = self.anchor.tick(self._next_hop, self._resolve)
        if not moved:
            self.transport.wait(0.05)
        self._update_rate()

    def _update_rate(self) -> None:
        """Every 2 s: tokens/s, and capacity = tokens/s over the fraction of time spent computing."""
        now = time.monotonic()
        t0, n0 = self._rate
        if now - t0 > 2.0:
            self.tokens_per_s = (self.tokens - n0) / (now - t0)
            busy = self._busy / (now - t0)
            if self.tokens_per_s > 0:  # smoothed: one window on a shared machine says little
                now_capacity = self.tokens_per_s / max(busy, 0.05)
                self.capacity = now_capacity if self.capacity == 0 else 0.7 * self.capacity + 0.3 * now_capacity
            self._rate, self._busy = (now, self.tokens), 0.0


def run_peer(initial_peers: list[str], tracker: str | None, host: str, grpc_port: int, device: str, max_steps: int | None = None, state_dir: Path | None = None, announce_host: str | None = None, dht_port: int = 0, metrics_port: int | None = None, threads: int = 1, token: str | None = None, tls_ca: bytes | None = None, tracker_key: bytes | None = None) -> None:
    """`tracker_key` (the bootstrap's public key, from bootstrap.json or --tracker-key) is what the
    tracker's DHT record must be signed with; the token admits this node to the run's DHT."""
    setup_logging()
    torch.set_num_threads(threads)  # 1 by default: many peers share few cores on one machine
    if not initial_peers and tracker is None:
        raise SystemExit("anchormesh peer: error: give --initial-peers or --tracker")
    if not token:
        raise ConfigError("--token", None, f"a peer joins with the run's token: {auth.NO_TOKEN_HINT}")
    import hivemind

    from peer.security import dht_auth

    stop = threading.Event()
    if not initial_peers:
        log.info("asking the tracker %s for the run's DHT addresses", tracker)
        initial_peers = dht_maddrs_from_tracker(tracker, stop, auth.Credentials(token=token), tls_ca)
    log.info("starting a DHT node (initial peers: %s)", ", ".join(initial_peers))
    announce = None
    if announce_host:  # others dial this node at the announced host (hivemind needs the port up front)
        dht_port = dht_port or free_port(host)
        announce = [announce_maddr(announce_host, dht_port)]
    # before any gRPC; only run-token holders take part in the run's DHT (peer/security/dht_auth.py)
    dht_args = dict(initial_peers=initial_peers, host_maddrs=[f"/ip4/{host}/tcp/{dht_port}"], announce_maddrs=announce, start=True, **dht_auth.dht_kwargs(token, tracker_key))
    try:
        dht = hivemind.DHT(**dht_args)
    except RuntimeError as exc:
        if "bootstrap failed" not in str(exc):
            raise
        why = f"no DHT node of the run answered ({', '.join(initial_peers)}): they refuse a node without the run token (check --token), or the addresses are wrong or unreachable"
        if tracker is None:
            log.error("%s", why)
            raise SystemExit(2) from None
        log.error("%s; asking the tracker whether the token is right", why)  # its Join says so, or the peer trains on
        dht = hivemind.DHT(**dht_args, ensure_bootstrap_success=False)
    log.info("DHT node up")
    if tracker is None:
        tracker = find_tracker(dht, stop, tracker_key)
        log.info("found the tracker at %s through the DHT", tracker)
    daemon = PeerDaemon(tracker, host, grpc_port, device, dht=dht, state_dir=state_dir, announce_host=announce_host, token=token, tls_ca=tls_ca)
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
        os.environ[PEER_ID_ENV] = daemon.peer_id
        if state_dir is None:  # the same identity after the exec (with a state dir it is on disk)
            os.environ[IDENTITY_ENV] = daemon.identity.private_bytes().hex()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "peer.cli", *sys.argv[1:]])
