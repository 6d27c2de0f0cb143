"""A peer's membership of the run: joining, heartbeating, leaving.

The tracker is given or found through the DHT's signed records (discovery.py); the peer asks it
for the run's config first so that its Join carries a memory plan of every stage (the tracker
then gives it a stage that fits), and joins with retries while the tracker is unreachable. From then on a
heartbeat thread sends this peer's report and applies the directives of the replies: its
neighbours, the run's bans and averaging members, anchor and evaluation jobs, MOVE and STOP. A
refusal of its credentials ends the peer for good: retrying cannot help, the operator must act.

`Heartbeat` reads many of the peer's figures for its report, so it is handed the daemon through
the `Member` view (a Protocol) rather than each field; routing and the job queue it feeds are
passed explicitly.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import grpc
import torch

from peer.address import REFUSAL_KEY, UNREACHABLE
from peer.config import TrainConfig
from peer.daemon.anchors import AnchorJobs
from peer.daemon.discovery import REFUSALS
from peer.daemon.feed import MIN_REPORT_GAP_S, WorkFeed
from peer.daemon.memory import free_bytes, plan_stages
from peer.daemon.replicas import Replicas
from peer.daemon.routing import Router
from peer.daemon.startup import StartupClock
from peer.daemon.state_sync import StateSync
from peer.dp.group import GroupAverager
from peer.errors import ConfigError
from peer.model.placement import DTYPE_NAMES, resolve_placement
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.worker import StageWorker
from peer.runtoml import config_from_dict
from peer.security import auth
from peer.security.identity import Identity
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.version import build_fields

log = logging.getLogger("anchormesh.peer")


def plan_memory(
    stub: pbg.TrackerStub, req: pb.JoinRequest, device: torch.device, replica_in_memory: bool = False
) -> list | None:
    """Before joining: the run's config, this peer's placement for it and its memory plan of
    every stage, put in the JoinRequest so the tracker gives it a stage that fits. A tracker
    that cannot say its config (unreachable: Join retries and says so) leaves the plan to
    after the Join. A device or precision that cannot run the run exits 2 here."""
    try:
        cfg = config_from_dict(json.loads(stub.GetConfig(pb.ConfigRequest(), timeout=10).run_config_json))
    except grpc.RpcError as exc:
        if exc.code() in REFUSALS:  # a wrong token: Join would be refused the same way
            log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
            raise ConfigError(
                "--token", "given", f"the tracker refused it ({exc.code().name}: {exc.details()})"
            ) from None
        log.info("no run config before joining (%s): the memory plan waits for the assignment", exc.code().name)
        return None
    placement = resolve_placement(device, cfg.compute)
    plans = plan_stages(cfg, placement, dp_group=True, replica_in_memory=replica_in_memory)
    free = free_bytes(placement.device)
    budget = int(cfg.compute.memory_budget_gib * 2**30)
    req.memory_bytes = min(budget, free) if budget else free
    req.stage_memory_bytes.extend(p.need(placement.device) for p in plans)
    name = torch.cuda.get_device_name(placement.device) if placement.cuda else ""
    req.device = " ".join(x for x in (str(placement.device), name, DTYPE_NAMES[placement.compute_dtype]) if x)
    log.info(
        "memory plan on %s (%.2f GiB usable): %s GiB per stage",
        req.device,
        req.memory_bytes / 2**30,
        ", ".join(f"{p.need(placement.device) / 2**30:.2f}" for p in plans),
    )
    return plans


def join(stub: pbg.TrackerStub, req: pb.JoinRequest, stop: threading.Event, tls: bool = False) -> pb.Assignment:
    """Join, retrying with backoff while the tracker is unreachable; a refusal ends the daemon:
    exit 1 when the tracker could not dial this peer back (its message says what to forward),
    else exit 2 (a wrong token, build or run)."""
    delay = 0.5
    while not stop.is_set():
        try:
            return stub.Join(req, timeout=10)
        except grpc.RpcError as exc:
            if (REFUSAL_KEY, UNREACHABLE) in (exc.trailing_metadata() or ()):  # a runtime fault: exit 1
                log.error("the tracker refused this peer: %s", exc.details())
                raise SystemExit(1) from None
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, *REFUSALS):
                log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                raise SystemExit(2) from None
            log.warning(
                "tracker unreachable (%s: %s%s); retrying in %.1fs",
                exc.code().name,
                exc.details(),
                auth.tls_hint(exc.details(), tls),
                delay,
            )
            stop.wait(delay)
            delay = min(delay * 2, 30.0)
    raise SystemExit(1)


def leave(stub: pbg.TrackerStub, run_id: str, peer_id: str, reason: str) -> None:
    """Say goodbye, so the tracker need not wait to declare this peer dead; best effort."""
    try:
        stub.Leave(pb.LeaveRequest(run_id=run_id, peer_id=peer_id, reason=reason), timeout=5)
    except grpc.RpcError as exc:
        log.warning("could not say goodbye to the tracker: %s", exc.details())


class Member(Protocol):
    """What membership reads of the peer (to join, and for its report) and sets (its
    credentials once admitted, why it stops)."""

    tracker: str
    device: torch.device
    state_dir: Path | None
    dht: object | None
    creds: auth.Credentials
    tls_ca: bytes | None
    tls_server: object | None
    peer_id: str
    address: str
    identity: Identity
    gate: auth.Gate
    transport: GrpcTransport
    stop: threading.Event
    worker: StageWorker | None
    averager: GroupAverager | None
    anchor: SwarmAnchor | None
    state: str
    reason: str
    tokens: int
    tokens_per_s: float
    capacity: float
    loss: float
    steps_done: int
    startup_s: float
    startup: StartupClock
    move_reason: str
    refused: str
    resumed_from: str
    replicas: Replicas
    state_sync: StateSync  # the donors it refused as a joiner, for its report
    feed: WorkFeed | None


class Membership:
    """This peer in the run: its Join, then the heartbeat stream (its report out, the tracker's
    directives in)."""

    def __init__(self, peer: Member, router: Router, jobs: AnchorJobs) -> None:
        self.peer, self.router, self.jobs = peer, router, jobs

    def enter(self) -> tuple[pb.Assignment, TrainConfig, list | None]:
        """Join with a memory plan of every stage, then take what the assignment gives: the
        run's id, a certificate, the run's rate limits and TLS certificate. A device that
        cannot run the run exits 2 before the Join (nothing to leave yet)."""
        d = self.peer
        with auth.tracker_channel(d.tracker, d.creds, tls_ca=d.tls_ca) as join_channel:
            own_maddrs = [str(m) for m in d.dht.get_visible_maddrs()] if d.dht is not None else []
            req = pb.JoinRequest(peer_id=d.peer_id, grpc_address=d.address, **build_fields(), dht_maddrs=own_maddrs)
            try:
                plans = plan_memory(pbg.TrackerStub(join_channel), req, d.device, replica_in_memory=d.state_dir is None)
            except ConfigError as exc:  # the run cannot run on this device: nothing to leave yet
                log.error("cannot serve this run here: %s", exc)
                d.transport.close()
                if d.dht is not None:
                    d.dht.shutdown()
                raise SystemExit(2) from None
            if d.tls_server is not None:
                from peer.security.tls import public_der

                req.tls_public_key = public_der(d.tls_server.key)
            a = join(pbg.TrackerStub(join_channel), req, d.stop, d.tls_ca is not None)
        cfg = config_from_dict(json.loads(a.run_config_json))
        return a, cfg, plans

    def admitted(self, a: pb.Assignment) -> None:
        """From now on: calls carry the certificate; the gate checks others' with the tracker's key."""
        d = self.peer
        d.transport.run_id = a.run_id
        d.creds.certificate = a.certificate
        d.gate.configure(a.run_id, a.tracker_key, d.creds.token, a.calls_per_s or None)
        d.transport.messages = auth.RateLimit(a.messages_per_s or d.transport.messages.rate)
        if d.tls_server is not None:
            if not a.tls_certificate:
                raise ConfigError(
                    "--tls-ca",
                    "given",
                    "the tracker issued no TLS certificate: this run does not use TLS (security.tls); drop --tls-ca",
                )
            d.tls_server.install(a.tls_certificate)
        log.info(
            "%s joined %s: stage %d of %d (layers %d-%d), serving on %s",
            d.peer_id,
            a.run_id,
            a.stage,
            a.num_stages,
            a.layer_start,
            a.layer_end - 1,
            d.address,
        )

    def report(self) -> pb.PeerReport:
        d = self.peer
        w, averager, anchor = d.worker, d.averager, d.anchor
        link_mbit, pp_keep = self.router.links()
        held, returned = d.feed.for_report() if d.feed is not None else ([], [])
        return pb.PeerReport(
            run_id=d.transport.run_id,
            tokens=d.tokens,
            windows_held=held,
            windows_returned=returned,
            peer=pb.PeerInfo(
                peer_id=d.peer_id,
                stage=w.stage.index,
                address=d.address,
                state=d.state,
                tokens_per_s=d.tokens_per_s,
                bytes_in=d.transport.bytes_in,
                bytes_out=d.transport.total_bytes(),
                step=w.version,
                loss=d.loss,
                queue_depth=len(w.inbox_fwd) + len(w.inbox_bwd),
                startup_s=d.startup_s,
                # before its first step: what it is doing (its reason, else its startup phase) and for how long
                reason=d.reason if d.steps_done else d.startup.waiting(d.reason),
                startup_phases=[pb.StartupPhase(name=n, seconds=s) for n, s in d.startup.phases()]
                if d.steps_done
                else [],
                dp_rounds=averager.rounds if averager else 0,
                anchor_id=anchor.newest_id if anchor else 0,
                anchor_bytes_out=anchor.bytes_out if anchor else 0,
                pp_state_bytes_out=w.state_bytes_sent,
                capacity_tokens_per_s=d.capacity,
                dp_bytes_out=averager.bytes_out if averager else 0,
                dp_dense_bytes=averager.dense_bytes if averager else 0,
                dp_rejected=averager.rejected if averager else 0,
                eval_id=anchor.eval_result[0] if anchor else 0,
                eval_loss=anchor.eval_result[1] if anchor else math.nan,
                refused_calls=sum(d.gate.refused.values()),
                dp_suspects=list(averager.suspects) if averager else [],
                key_fingerprint=d.identity.fingerprint,
                link_mbit=link_mbit,
                pp_keep=pp_keep,
                dp_period_s=averager.period_s if averager else 0.0,
                excluding=d.transport.excluding()[:4],  # the tracker keeps 4
                replica_stage=d.replicas.stage,
                replica_step=d.replicas.step,
                resumed_from=d.resumed_from,
                refused_donors=list(d.state_sync.refused),
                refused_senders=w.bounds.senders(),
                dropped_steps=w.dropped_steps,
                links_held=self.router.held_why[:4],
            ),
        )

    def heartbeat(self, stub: pbg.TrackerStub, interval: float) -> None:
        """The heartbeat thread: reconnects after a broken stream; ends on stop, MOVE, a refusal,
        or when the tracker no longer lists this peer (it then joins again)."""
        d = self.peer
        while not d.stop.is_set():

            def requests() -> Iterator[pb.PeerReport]:
                while not d.stop.is_set():
                    yield self.report()
                    if d.feed is None or not d.feed.hungry.wait(interval):  # a hungry stage 0 reports early
                        d.stop.wait(interval if d.feed is None else 0)
                    else:
                        d.feed.hungry.clear()
                        d.stop.wait(MIN_REPORT_GAP_S)

            try:
                for directive in stub.Heartbeat(requests()):
                    if d.feed is not None:  # the reply to the oldest report: what it released may train now
                        d.feed.acked()
                        d.feed.add(directive.windows)
                    if directive.kind == pb.Directive.MOVE:
                        log.info("the tracker moves this peer: %s", directive.reason)
                        d.move_reason = directive.reason
                        d.stop.set()
                        return
                    self.apply(directive)
                    if directive.kind == pb.Directive.STOP:
                        log.info("tracker says stop: %s", directive.reason)
                        d.stop.set()
            except grpc.RpcError as exc:
                if d.feed is not None:
                    d.feed.unacked()
                if d.stop.is_set():
                    return
                if exc.code() in REFUSALS:  # banned, or its credentials no longer pass: leave for good
                    log.error("the tracker refused this peer: %s %s", exc.code().name, exc.details())
                    d.refused = exc.details() or exc.code().name
                    d.stop.set()
                    return
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # the tracker dropped us (declared dead): join again
                    log.warning("the tracker no longer lists this peer (%s); joining again", exc.details())
                    d.move_reason = f"the tracker dropped this peer: {exc.details()}"
                    d.stop.set()
                    return
                log.warning(
                    "heartbeat stream ended (%s: %s); reconnecting in %.0fs", exc.code().name, exc.details(), interval
                )
                d.stop.wait(interval)

    def apply(self, directive: pb.Directive) -> None:
        """A reply's neighbours, bans, averaging members and jobs."""
        d = self.peer
        self.router.apply_neighbours(directive)
        if set(directive.banned) != set(d.gate.banned):  # in place: the gate reads it on every call
            for fp in set(d.gate.banned) - set(directive.banned):
                del d.gate.banned[fp]
            d.gate.banned.update({fp: "banned by the run's operator" for fp in directive.banned})
            log.warning("banned keys in this run: %s", ", ".join(directive.banned) or "none")
        if d.averager is not None:  # a banned peer's averaging process may live on: keep it out of rounds
            for hid in directive.banned_dht:
                d.averager.excluded.setdefault(hid, "banned by the run's operator")
            if directive.member_dht:
                d.averager.members = set(directive.member_dht)
        self.jobs.take(directive, d.anchor)
        if d.state != "joining":  # a joiner's link is for its own download first
            d.replicas.maybe_pull(directive.replicate if directive.HasField("replicate") else None)
