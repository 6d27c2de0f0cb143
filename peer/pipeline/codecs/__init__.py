"""The PP link codecs: one `LinkCodec` class per `mask.scheme` (base.py), in one table.

A new codec is one class registered here (or, from outside the package, with `register`): the
stage worker, the inbound checks, the memory plan and the demo find it by its scheme.
"""

from __future__ import annotations

from peer.config import MASK_SCHEMES, MaskConfig
from peer.errors import ConfigError
from peer.model.placement import Placement
from peer.model.stages import StageModule
from peer.pipeline.codecs.base import LINK_DTYPE, LinkCodec
from peer.pipeline.codecs.lowrank import LowRankLink
from peer.pipeline.codecs.mask import MaskLink
from peer.pipeline.codecs.transform import TransformLink
from peer.pipeline.linktune import ComputeClock
from peer.pipeline.transport import Transport

__all__ = ["CODECS", "LINK_DTYPE", "LinkCodec", "codec_class", "make_link", "register"]

CODECS: dict[str, type[LinkCodec]] = {cls.scheme: cls for cls in (MaskLink, LowRankLink, TransformLink)}


def register(cls: type[LinkCodec]) -> type[LinkCodec]:
    """Add a codec to the table (usable as a class decorator): `mask.scheme = cls.scheme` then
    selects it, and the Join request lists it among this build's codecs."""
    CODECS[cls.scheme] = cls
    if cls.scheme not in MASK_SCHEMES:
        MASK_SCHEMES.append(cls.scheme)
    return cls


def codec_class(scheme: str) -> type[LinkCodec]:
    if scheme not in CODECS:
        raise ConfigError("codec.scheme", scheme, f"must be one of {', '.join(CODECS)}")
    return CODECS[scheme]


def make_link(
    cfg: MaskConfig, stage: StageModule, placement: Placement, transport: Transport, compute: ComputeClock
) -> LinkCodec:
    """The worker's ends of its links for the run's codec."""
    return codec_class(cfg.scheme)(cfg, stage, placement, transport, compute)
