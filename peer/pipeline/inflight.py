"""A micro-batch between its forward and its backward on one stage worker: what the backward,
the gradient sent back and the checks of an inbound gradient need of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InFlight:
    step: int
    x: torch.Tensor | None  # received input (leaf, requires grad, on the device) for stages > 0
    out: torch.Tensor
    stash: (
        dict[str, torch.Tensor] | None
    )  # weights the forward ran on when not the live ones (ran ahead, or the low-precision working copy)
    window: torch.Tensor  # token windows [B, T+1], on the host
    sender: str = ""  # who sent the input (the gradient goes back there)
    sent: object = None  # the codec's note on how the output was sent (LinkCodec.encode_activation): what the gradient's decode needs
    received: object = (
        None  # the codec's note on how the input came (LinkCodec.decode_activation): what the gradient sent back needs
    )
    retry_key: tuple | None = None  # swarm: the input's identity for a sender's retries (StageWorker.retry_key)
    dst: object = None  # where the output went (its gradient comes from there): routing counts what each next hop holds
    sent_s: float = 0.0  # time.monotonic() when the output went: routing times each next hop's round trip from it
