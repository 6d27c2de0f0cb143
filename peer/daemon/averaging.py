"""The daemon's side of stage-group averaging (peer/dp/group.py): starting the averager, the lock
every change of the stage's weights holds, and an optimizer step with the averaging that follows.

Kept apart from the main loop because the averager's threads (its rounds, a joiner's download)
touch the same weights as the step: whoever changes them goes through `step_lock`, and a step
with an averager is taken and reported to it under that one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from peer.dp.group import GroupAverager
from peer.dp.schedule import MIN_PERIOD_S
from peer.dp.signed_claims import ClaimSigner
from peer.pipeline.worker import StageWorker

log = logging.getLogger("anchormesh.peer")


def start_averaging(
    dht,
    params: list[torch.nn.Parameter],
    prefix: str,
    every: int,
    compression: str,
    link_share: float,
    peer_id: str,
    link_bps: Callable[[], float | None],
    signer: ClaimSigner | None = None,
    min_period_s: float = MIN_PERIOD_S,
    on_stuck: Callable[[], None] | None = None,
) -> GroupAverager | None:
    """Join the stage group's averaging; without a DHT the peer trains alone (None). Rounds are
    spaced so they take at most `link_share` of the uplink this peer measures (`link_bps`).
    `params`: the stage's, or its meta stage's (the daemon forks before it loads the stage, then
    binds the live ones: GroupAverager.bind). hivemind forks here: the caller starts it while no
    gRPC call runs; `on_stuck` is called if the fork itself never returns (GroupAverager)."""
    if dht is None:
        log.warning("no DHT: this peer will not average with its stage group")
        return None
    averager = GroupAverager(
        dht,
        params,
        prefix,
        every=every,
        compression=compression,
        peer_id=peer_id,
        link_bps=link_bps,
        link_share=link_share,
        signer=signer,
        min_period_s=min_period_s,
        on_stuck=on_stuck,
    )
    log.info(
        "stage-group averaging every %d steps at least, %s on the wire, at most %.0f%% of the uplink (group key %s)",
        every,
        compression,
        100 * link_share,
        prefix,
    )
    return averager


def bind_stage(averager: GroupAverager | None, stage: torch.nn.Module) -> None:
    """Give an averager made from the meta stage the live parameters, once the stage is built."""
    if averager is not None:
        averager.bind(list(stage.parameters()))


def step_lock(averager: GroupAverager | None, own: threading.Lock) -> threading.Lock:
    """The lock every change of the stage's weights holds: the averager's (its download and
    averaging threads use it too) or, without one, the peer's own."""
    return averager.lock if averager is not None else own


def apply_step(
    w: StageWorker, averager: GroupAverager | None, own: threading.Lock, siblings: Callable[[], list[str]]
) -> None:
    """The optimizer step of the stage once its gradients are in; with an averager, the step is
    reported to it (alone: no live stage mate)."""
    if averager is not None:
        with averager.lock:  # a joiner downloading our state sees whole steps and whole averaging results
            w.apply_step()
            averager.after_step(w.version, alone=not siblings())
    else:
        with own:
            w.apply_step()
