"""The transform codec on a link (`mask.scheme = "transform"`: peer/codec/transform.py; the coders
each end holds: peer/pipeline/transform_link.py).

Every direction travels at a few bits: activations in a KLT their producer fits and ships,
gradients through a fixed random rotation. With `mask.adapt`, a sender whose link cannot carry a
micro-batch's codes within `mask.link_target` of its compute time sends fewer bits per row on
that link and direction, on a 1/8-bit-per-value grid down to its floor
(`TransformLinks.min_row_bits`); the receiver refuses a budget off the grid or below the floor.
"""

from __future__ import annotations

import torch

from peer.codec.act_coder import BUFFER_ROWS_PER_H
from peer.codec.transform import grid_bits
from peer.config import MaskConfig
from peer.pipeline.codecs.base import LinkCodec, Scale, fixed_bytes, key_of
from peer.pipeline.linktune import keep_fraction
from peer.pipeline.transform_link import TransformLinks
from peer.pipeline.transport import Address
from peer.wire import anchormesh_pb2 as pb


class TransformLink(LinkCodec):
    """`mask.scheme = "transform"` (the default): every direction of the boundary at a few bits
    (peer/codec/transform.py): activations in the KLT of the sender's recent outputs, which it
    fits and ships, gradients through a fixed random rotation; the per-link state lives in
    `TransformLinks` (peer/pipeline/transform_link.py).

    The codec to choose: on SmolLM2 (40 steps) it ended +0.86 % over dense's eval loss with 10.2x
    fewer PP bytes per token than dense (at 2,048 tokens per sequence), where low rank ended +7.1 %
    and the paper's mask +30.5 % (docs/benchmarks.md). Its defaults are the recommended run; change
    them only with a measurement (`anchormesh bench quality`).

    Args:
        cfg: the run's codec settings, read here: `bits` (activations, bits per value: 2 by
            default; more is closer to dense), `grad_bits` (gradients: 1 by default, with
            dithered rounding), `sink` (leading positions sent dense: keep 1 for models with an
            attention sink), `basis_refresh` (steps between the activations' coder refits), the
            rounding, rotation and statistics settings (see `MaskConfig`), and with `adapt` the
            bits per row of each link and direction, down to `min_keep` of the configured (the
            gradients to `grad_min_bits`).
        stage: the stage this worker serves: a stage that is not last produces activations (fits
            a coder), one that is not first produces gradients.
        placement: where the stage computes; coders are applied and tensors decoded there.
        transport: the worker's transport; an adapting link reads its measured rate from it.
        compute: the worker's compute time per micro-batch, the budget an adapting link fits into.
    """

    scheme = "transform"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s = self.stage
        self.links = TransformLinks(
            self.cfg, s.hidden_size, produces_forward=not s.is_last, produces_backward=s.index > 0
        )

    def row_bits_for(self, dst: Address, channel: str, shape: tuple[int, ...], fixed: int) -> int:
        """Bits per coded row for `dst` on `channel`: the run's unless the link's measured
        bandwidth cannot carry them within `mask.link_target` of this stage's compute time per
        micro-batch; then the most on the 1/8-bit grid that fits, down to `min_row_bits`.
        `fixed`: the message's bytes besides the tensor (header, token ids)."""
        links = self.links
        full, floor = links.max_bits(channel), links.min_row_bits(channel)
        if (
            floor is None
        ):  # keep_sent (status's pp_keep) names what can adapt: activations, and gradients above their floor
            if channel == "forward":
                self.keep_sent[dst] = 1.0
            return full
        codes, besides = links.code_bytes(channel, shape)
        f = keep_fraction(
            codes,
            fixed + besides,
            self.transport.link_bps(dst, channel),
            self.compute.per_micro_batch,
            self.cfg.link_target,
            floor / full,
        )
        bits = (
            full if f >= 1 else max(floor, grid_bits(f * full, links.hidden_size))
        )  # full may lie off the grid (mask.bits 2.3)
        self.keep_sent[dst] = bits / full
        return bits

    def _ship(self, msg: pb.ActivationChunk | pb.GradientChunk, coder: pb.TransformCoder | None) -> None:
        """Put the coder the destination lacks into its message, and count it."""
        if coder is not None:
            msg.coder.CopyFrom(coder)
            self.state_bytes_sent += coder.ByteSize()

    def encode_activation(self, msg: pb.ActivationChunk, h: torch.Tensor, ids: torch.Tensor, dst: Address) -> None:
        row_bits = self.row_bits_for(dst, "forward", tuple(h.shape), fixed_bytes(msg))
        payload, coder = self.links.encode("forward", h, dst, **key_of(msg), row_bits=row_bits)
        msg.hidden.CopyFrom(payload)
        self._ship(msg, coder)

    def decode_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> torch.Tensor:
        return self.links.decode(msg, expect_shape=out_shape, **key_of(msg), device=self.placement.device)

    def check_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> Scale:
        return self.links.check(msg, expect_shape=out_shape, **key_of(msg))

    def decode_activation(
        self, msg: pb.ActivationChunk, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        pl = self.placement
        x = self.links.decode(
            msg, expect_shape=(*ids.shape, self.stage.hidden_size), **key_of(msg), device=pl.device
        ).to(pl.compute_dtype)
        x.requires_grad_(True)
        return x, x, None

    def encode_gradient(self, msg: pb.GradientChunk, x: torch.Tensor, received: object, dst: Address) -> None:
        row_bits = self.row_bits_for(dst, "backward", tuple(x.grad.shape), fixed_bytes(msg))
        payload, coder = self.links.encode("backward", x.grad, dst, **key_of(msg), ref=x, row_bits=row_bits)
        msg.grad.CopyFrom(payload)
        self._ship(msg, coder)

    def check_activation(self, msg: pb.ActivationChunk, ids: torch.Tensor) -> Scale:
        return self.links.check(
            msg, expect_shape=(*ids.shape, self.stage.hidden_size), **key_of(msg)
        )  # a coder shipped along is checked and kept here

    def forget_sent(self) -> None:
        self.links.forget_sent()

    @classmethod
    def state_bytes(cls, cfg: MaskConfig, vocab_size: int, hidden_size: int, sends: bool, receives: bool) -> int:
        """Each direction's learner and coders: per coder its mean, int8 rotation, the rotation's
        float32 copy, scales, stds and bits; each producer (outputs if it sends, input gradients
        if it receives) its row buffer, the fit's float64 covariance and eigenvectors and its
        current coder; each consumer the two newest coders of one peer (a stage talks to few)."""
        H = hidden_size
        coder = H * 4 + H * H * 5 + H * 20
        learner = BUFFER_ROWS_PER_H * H * H * 4 + 2 * H * H * 8 + coder
        return (sends + receives) * (learner + 2 * coder)

    @classmethod
    def label(cls, cfg: MaskConfig) -> str:
        return f"transform {cfg.bits:g} bits/value forward, {cfg.grad_bits:g} backward"
