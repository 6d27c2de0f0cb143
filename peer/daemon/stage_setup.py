"""Building this peer's stage for the assignment the tracker gave it: where it computes (device,
precision, memory plan), its stage group's averager, and the stage worker and anchor runner that
compute there.

Apart from the daemon because both are built once, from explicit arguments, before any of the
daemon's loops runs: what goes into a stage is read here, not among the daemon's fields.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import torch

from peer.config import TrainConfig
from peer.daemon.averaging import start_averaging
from peer.daemon.memory import MemoryPlan, anchor_snapshot_slots, check_fits, free_bytes, plan_stages
from peer.daemon.routing import Router
from peer.dp.group import GroupAverager
from peer.dp.hivemind_averager import connect_peers
from peer.dp.signed_claims import ClaimSigner
from peer.model.loading import load_stage, meta_stages
from peer.model.placement import Placement, resolve_placement
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")


def place_stage(
    device: torch.device, cfg: TrainConfig, plans: list[MemoryPlan] | None, stage: int, replica_in_memory: bool
) -> tuple[Placement, MemoryPlan, int]:
    """Where stage `stage` computes on `device` at the run's precision, its memory plan (the
    tracker's `plans` when it sent them) and the bytes free there. Raises ConfigError when the
    precision is not available or the plan does not fit, before anything loads."""
    placement = resolve_placement(device, cfg.compute)
    plan = (
        plans[stage]
        if plans
        else plan_stages(cfg, placement, dp_group=True, replica_in_memory=replica_in_memory)[stage]
    )
    free = free_bytes(placement.device)
    check_fits(plan, free, cfg.compute.memory_budget_gib, placement.device)
    log.info(
        "computing on %s; stage %d plans %.2f GiB of %.2f GiB free",
        placement.describe(),
        stage,
        plan.need(placement.device) / 2**30,
        free / 2**30,
    )
    return placement, plan, free


def build_worker(
    cfg: TrainConfig,
    a: pb.Assignment,
    placement: Placement,
    plan: MemoryPlan,
    free: int,
    transport: GrpcTransport,
    router: Router,
    peer_id: str,
) -> tuple[StageWorker, SwarmAnchor]:
    """Load only stage `a.stage`'s layers and build the worker that runs them (numbering its
    steps from the run's `a.start_step`) and the anchor runner beside it, which keeps as many
    weight snapshots as `cfg.compute.anchor_snapshot_share` of the memory left after `plan` holds."""
    stage = load_stage(cfg.model, a.stage, seed=cfg.seed, device=placement.device, dtype=placement.master_dtype)
    stage.train()
    replica = uuid.uuid4().int % (1 << 20)  # makes this peer's micro-batch ids (and masks) its own
    worker = StageWorker(
        stage,
        replica,
        cfg,
        transport,
        a.run_id,
        peer_id=peer_id,
        next_hop=router.next_hop,
        resolve=router.resolve,
        local_steps=True,
        placement=placement,
    )
    worker.version = a.start_step  # continue the run's step numbering (the group's state may raise it)
    worker.next_mb = a.start_step * cfg.pipeline.micro_batches
    snapshot_bytes = (
        plan.anchor_snapshot or sum(p.numel() for p in stage.parameters()) * placement.compute_dtype.itemsize
    )
    slots = anchor_snapshot_slots(free - plan.need(placement.device), snapshot_bytes, cfg.compute.anchor_snapshot_share)
    anchor = SwarmAnchor(
        worker, cfg.anchor.micro_batches, router.siblings, eval_batches=cfg.pipeline.eval_batches, max_jobs=slots
    )
    anchor.issued = (
        a.anchors_issued
    )  # the Join reply's ceiling: forged anchor ids are refused before the first heartbeat
    return worker, anchor


def start_group_averaging(
    dht,
    cfg: TrainConfig,
    a: pb.Assignment,
    placement: Placement,
    peer_id: str,
    link_bps: Callable[[], float | None],
    signer: ClaimSigner | None,
    on_stuck: Callable[[], None],
) -> GroupAverager | None:
    """Dial the stage mates the tracker named and join stage `a.stage`'s group averaging (None
    without a DHT: the peer trains alone). Built on the meta stage, before the stage's weights
    fill this process: the averager forks, and its child would keep each page written later."""
    if dht is not None and a.group_dht_maddrs:
        log.info(
            "dialled %d of %d stage mates' DHT nodes",
            connect_peers(dht, list(a.group_dht_maddrs)),
            len(a.group_dht_maddrs),
        )
    return start_averaging(
        dht,
        list(meta_stages(cfg.model, [a.stage], dtype=placement.master_dtype)[0].parameters()),
        f"{a.run_id}_stage{a.stage}",
        cfg.dp.inner_steps,
        cfg.dp.outer_compression,
        cfg.dp.link_share,
        peer_id=peer_id,
        link_bps=link_bps,
        signer=signer,
        min_period_s=cfg.dp.min_period_s,
        on_stuck=on_stuck,
    )
