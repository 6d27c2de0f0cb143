"""A micro-batch between its forward and its backward on one stage worker: what the backward,
the gradient sent back and the checks of an inbound gradient need of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.codec.basis import BasisState
from peer.codec.mask import MaskCodec


@dataclass
class InFlight:
    step: int
    x: torch.Tensor | None  # received input (leaf, requires grad, on the device) for stages > 0
    out: torch.Tensor
    stash: dict[str, torch.Tensor] | None  # weights the forward ran on when not the live ones (ran ahead, or the low-precision working copy)
    window: torch.Tensor  # token windows [B, T+1], on the host
    basis: BasisState | None = None  # low-rank codec: the (prior, basis) the output was encoded with
    sender: str = ""  # who sent the input (the gradient goes back there)
    coefs: int = 0  # low-rank codec: coefficients per token the output was sent with
    codec_in: MaskCodec | None = None  # mask scheme: the codec (drop) the input came with; None = the config's
    codec_out: MaskCodec | None = None  # mask scheme: the codec (drop) the output was sent with; None = the config's
    retry_key: tuple | None = None  # swarm: the input's identity for a sender's retries (StageWorker.retry_key)
