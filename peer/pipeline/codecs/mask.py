"""The element mask on a link (`mask.scheme = "mask"`; the paper's method, peer/codec/mask.py).

Both ends derive the same Bernoulli mask from the message's key, so only kept values travel; the
gradient goes back on the entries the forward kept. The receiver rebuilds the hidden state by
`mask.fill` (peer/codec/fill.py), from a per-token prior it learns when the fill wants one.
With `drop = 0` every value travels: the dense baseline.

With `mask.adapt`, a sender whose link cannot carry the kept values within `mask.link_target` of
its compute time per micro-batch masks harder on that link: a drop on a grid of 1/KEEP_GRID
(exact in float32, which the message carries), keeping at least `mask.min_keep` of the
configured keep; the receiver accepts only drops within those bounds.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from peer.codec.fill import USES_PRIOR, reconstruct
from peer.codec.mask import MaskCodec, as_f32
from peer.codec.prior import TokenPrior
from peer.config import MaskConfig
from peer.errors import WireError
from peer.pipeline.bounds import scale_of
from peer.pipeline.codecs.base import LINK_DTYPE, LinkCodec, Scale, fixed_bytes, key_of
from peer.pipeline.linktune import keep_fraction
from peer.pipeline.transport import Address
from peer.wire import anchormesh_pb2 as pb

KEEP_GRID = 256  # adapting: keep fractions are multiples of 1/256 (exact in float32)


class MaskLink(LinkCodec):
    """`mask.scheme = "mask"`: the paper's element mask (peer/codec/mask.py). Each boundary element
    is dropped with probability `mask.drop`, both ends deriving the same mask from the run's seed
    and the message's key, and the kept values travel as `mask.values`; the receiver rebuilds the
    rest by `mask.fill`. With drop 0 it sends every value: the dense baseline of the benches.

    Choose it for a dense run (drop 0, fp16) or to reproduce the paper; for training that should
    reach dense's loss, "transform" is the better codec (SmolLM2, 40 steps: the paper's M95 mask
    +30.5 % over dense's eval loss, the transform codec +0.86 %; docs/benchmarks.md).

    Args:
        cfg: the run's codec settings, read here: `drop` (0 = dense; the paper's 0.90 / 0.95), `values` ("fp16"
            for dense; "int8", blockwise absmax, about halves the kept values' bytes), `fill` (with a drop above
            0, "prior_rescale", an unbiased fill around a token prior the receiver learns at no extra bytes, cut
            the toy's gap to dense from 77 % to 19 % against the paper's "zero"; docs/benchmarks.md), `seed`,
            and with `adapt` the link's keep fraction between `min_keep * (1 - drop)` and `1 - drop`.
        stage: the stage this worker serves; a stage after the first learns the token prior
            (fills "token_prior" and "prior_rescale") over its vocabulary and hidden size.
        placement: where the stage computes; decoded tensors and the token prior live there.
        transport: the worker's transport; an adapting link reads its measured rate from it.
        compute: the worker's compute time per micro-batch, the budget an adapting link fits into.
    """

    scheme = "mask"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        m, s = self.cfg, self.stage
        self.codec = MaskCodec(m)  # the config's
        self.codecs: dict[float, MaskCodec] = {}  # adapting: drop -> its codec
        self.prior = (
            TokenPrior(s.vocab_size, s.hidden_size, m.prior_momentum, device=self.placement.device)
            if s.index > 0 and m.enabled and m.fill in USES_PRIOR
            else None
        )

    # -- adapting ----------------------------------------------------------------------------
    def codec_for(self, dst: Address, elements: int, fixed: int) -> MaskCodec:
        """The codec for `dst`: the config's drop unless the link's measured bandwidth cannot
        carry its kept values within `mask.link_target` of this stage's compute time per
        micro-batch; then a higher drop on the grid. drop = 0 means dense: never masked."""
        m = self.cfg
        if not (m.adapt and m.enabled):
            self.keep_sent[dst] = 1.0
            return self.codec
        f = keep_fraction(
            elements * self.codec.bytes_per_element(),
            fixed,
            self.transport.link_bps(dst, "forward"),
            self.compute.per_micro_batch,
            m.link_target,
            m.min_keep,
        )
        j = max(self.keep_floor(), math.floor(f * m.keep * KEEP_GRID + 1e-9))
        if j >= m.keep * KEEP_GRID:
            self.keep_sent[dst] = 1.0
            return self.codec
        self.keep_sent[dst] = j / KEEP_GRID / m.keep
        return self.masking((KEEP_GRID - j) / KEEP_GRID)

    def keep_floor(self) -> int:
        """The least keep an adapting sender sends, in 1/KEEP_GRID steps (min_keep of the configured keep, at least one step)."""
        return max(math.ceil(self.cfg.min_keep * self.cfg.keep * KEEP_GRID - 1e-9), 1)

    def masking(self, drop: float) -> MaskCodec:
        """The codec of another drop (cached: an adapting link uses a few)."""
        if drop not in self.codecs:
            self.codecs[drop] = MaskCodec(dataclasses.replace(self.cfg, drop=drop))
        return self.codecs[drop]

    def inbound_codec(self, hidden: pb.TensorPayload) -> MaskCodec:
        """The codec of an inbound tensor: the config's, or (an adapting sender) one of a higher
        drop on the grid, keeping at least `mask.min_keep` of the configured keep. Anything else:
        WireError naming the drop."""
        m, c = self.cfg, hidden.compression
        if c.kind != pb.Compression.BERNOULLI_MASK or c.drop == as_f32(m.drop):
            return self.codec
        j = (1.0 - c.drop) * KEEP_GRID
        floor = self.keep_floor()
        if not (m.adapt and m.enabled and j == int(j) and floor <= j < m.keep * KEEP_GRID):
            raise WireError(
                f"Compression.drop={c.drop:.7g}: this peer masks with drop={m.drop!r}"
                + (
                    f" or, adapting, 1 - j/{KEEP_GRID} with j in [{floor}, {m.keep * KEEP_GRID:.4g})"
                    if m.adapt and m.enabled
                    else ""
                )
            )
        return self.masking(c.drop)

    # -- the link ----------------------------------------------------------------------------
    def encode_activation(self, msg: pb.ActivationChunk, h: torch.Tensor, ids: torch.Tensor, dst: Address) -> MaskCodec:
        codec = self.codec_for(dst, h.numel(), fixed_bytes(msg))
        msg.hidden.CopyFrom(codec.encode(self.placement.to_host(h), **key_of(msg)))
        return codec  # the gradient comes back masked as the output was

    def decode_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> torch.Tensor:
        return self.placement.to_device(sent.decode(msg.grad, expect_shape=out_shape, **key_of(msg)))

    def check_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> Scale:
        return scale_of(sent.decode(msg.grad, expect_shape=out_shape, expect_dtype=LINK_DTYPE, **key_of(msg)))

    def decode_activation(
        self, msg: pb.ActivationChunk, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        pl, key = self.placement, key_of(msg)
        shape = (*ids.shape, self.stage.hidden_size)
        codec = self.inbound_codec(msg.hidden)
        x = pl.to_device(codec.decode(msg.hidden, expect_shape=shape, **key), pl.compute_dtype)
        x.requires_grad_(True)  # the leaf whose gradient goes back: kept entries only
        h = x
        if self.cfg.enabled:
            keep = codec.keep_mask(shape, **key, device=pl.device)
            prior = self.prior.fill(ids) if self.prior is not None else None
            h = reconstruct(x, keep, codec.cfg.keep, self.cfg.fill, prior)
            if self.prior is not None:
                self.prior.observe(ids, x.detach(), keep, checked=True)  # decoded values: already vetted as finite
        return x, h, codec

    def encode_gradient(self, msg: pb.GradientChunk, x: torch.Tensor, received: object, dst: Address) -> None:
        msg.grad.CopyFrom(received.encode(self.placement.to_host(x.grad), **key_of(msg)))

    def check_activation(self, msg: pb.ActivationChunk, ids: torch.Tensor) -> Scale:
        codec = self.inbound_codec(msg.hidden)
        return scale_of(
            codec.decode(
                msg.hidden, expect_shape=(*ids.shape, self.stage.hidden_size), expect_dtype=LINK_DTYPE, **key_of(msg)
            )
        )

    def anchor_fill(self, ids: torch.Tensor) -> torch.Tensor | None:
        return self.prior.fill(ids) if self.prior is not None else None

    @classmethod
    def state_bytes(cls, cfg: MaskConfig, vocab_size: int, hidden_size: int, sends: bool, receives: bool) -> int:
        """The receiving end's token prior for a prior fill: mean and count, [V, H] and [H]."""
        return (
            2 * (vocab_size * hidden_size + hidden_size) * 4
            if cfg.enabled and cfg.fill in USES_PRIOR and receives
            else 0
        )

    @classmethod
    def label(cls, cfg: MaskConfig) -> str:
        return f"mask drop={cfg.drop:.2f} fill={cfg.fill} {cfg.values}" if cfg.enabled else f"dense {cfg.values}"
