"""How a stage worker picks the codec of each link, and what codec choices of a sender it accepts.

With `mask.adapt`, a sender whose link's measured bandwidth cannot carry the configured payload
within `mask.link_target` of its compute time per micro-batch sends less on that link
(peer/pipeline/linktune.py): the low-rank codec fewer coefficients per token, the mask scheme a
higher drop on a grid of 1/KEEP_GRID, the transform coder fewer bits per row (either direction).
The receiving end accepts only choices within those bounds (the transform coder's:
peer/pipeline/transform_link.py), and checks the low-rank basis a message carries against the
stage's sizes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from peer.codec.basis import BasisState
from peer.codec.mask import MaskCodec, as_f32
from peer.codec.transform import grid_bits
from peer.config import MaskConfig
from peer.errors import WireError
from peer.pipeline.linktune import ComputeClock, coefficients, keep_fraction
from peer.pipeline.transform_link import TransformLinks
from peer.pipeline.transport import Address, Transport
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import proto_to_tensor

KEEP_GRID = 256  # mask scheme, adapting: keep fractions are multiples of 1/256 (exact in float32)


@dataclass
class LinkCodecs:
    """One worker's codecs per link: the config's, the adapted ones it sends with (per
    destination), and the bounds on what an adapting sender may send it."""

    mask: MaskConfig
    codec: MaskCodec  # the config's
    coef_codec: MaskCodec | None  # low-rank codec: encodes the coefficients
    transport: Transport
    compute: ComputeClock  # seconds of compute per micro-batch
    hidden_size: int
    vocab_size: int
    device: torch.device | str  # where a received basis is used
    keep_sent: dict = field(default_factory=dict)  # destination -> fraction of the configured payload last sent (mask.adapt)
    mask_codecs: dict = field(default_factory=dict)  # mask scheme, adapting: drop -> its codec

    @property
    def link(self) -> MaskCodec:
        """What encodes tensors on the links: coefficients (low-rank) or hidden states."""
        return self.coef_codec or self.codec

    def coef_shape(self, hidden: pb.TensorPayload, ids: torch.Tensor) -> tuple[int, ...]:
        """The coefficient shape a low-rank message may have: [*ids, k] with k between the
        adapting sender's floor (mask.min_keep of mask.rank) and mask.rank."""
        m = self.mask
        lo = coefficients(m.rank, 0.0, m.min_keep) if m.adapt else m.rank
        k = int(hidden.shape[-1]) if len(hidden.shape) == ids.dim() + 1 else -1
        if not lo <= k <= m.rank:
            raise WireError(f"hidden.shape={list(hidden.shape)}: expected [{', '.join(map(str, ids.shape))}, k] with k in [{lo}, {m.rank}] coefficients per token")
        return (*ids.shape, k)

    def coefs_for(self, dst: Address, tokens: int, fixed: int) -> int:
        """Low-rank codec: coefficients per token for `dst` (peer/pipeline/linktune.py): all
        `mask.rank` unless the link's measured bandwidth cannot carry them within
        `mask.link_target` of this stage's compute time per micro-batch. `fixed`: the message's
        bytes besides the coefficients (token ids, header)."""
        m = self.mask
        if not m.adapt:
            self.keep_sent[dst] = 1.0
            return m.rank
        per_coef = self.link.bytes_per_element() * tokens
        f = keep_fraction(m.rank * per_coef, fixed, self.transport.link_bps(dst, "forward"), self.compute.per_micro_batch, m.link_target, m.min_keep)
        k = coefficients(m.rank, f, m.min_keep)
        self.keep_sent[dst] = k / m.rank
        return k

    def row_bits_for(self, dst: Address, channel: str, links: TransformLinks, shape: tuple[int, ...], fixed: int) -> int:
        """Transform scheme: bits per coded row for `dst` on `channel`: the run's unless the
        link's measured bandwidth cannot carry them within `mask.link_target` of this stage's
        compute time per micro-batch; then the most on the 1/8-bit grid that fits, down to
        `links.min_row_bits`. `fixed`: the message's bytes besides the tensor (header, token ids)."""
        full, floor = links.max_bits(channel), links.min_row_bits(channel)
        if floor is None:  # keep_sent (status's pp_keep) names what can adapt: activations, and gradients above their floor
            if channel == "forward":
                self.keep_sent[dst] = 1.0
            return full
        codes, besides = links.code_bytes(channel, shape)
        f = keep_fraction(codes, fixed + besides, self.transport.link_bps(dst, channel), self.compute.per_micro_batch, self.mask.link_target, floor / full)
        bits = full if f >= 1 else max(floor, grid_bits(f * full, links.hidden_size))  # full may lie off the grid (mask.bits 2.3)
        self.keep_sent[dst] = bits / full
        return bits

    def mask_codec_for(self, dst: Address, elements: int, fixed: int) -> MaskCodec:
        """Mask scheme: the codec for `dst`: the config's drop unless the link's measured
        bandwidth cannot carry its kept values within `mask.link_target` of this stage's compute
        time per micro-batch; then a higher drop on a grid of 1/256 (exact in float32, which the
        message carries), keep at least `mask.min_keep` of the configured keep. drop = 0 means
        dense: never masked."""
        m = self.mask
        if not (m.adapt and m.enabled):
            self.keep_sent[dst] = 1.0
            return self.codec
        f = keep_fraction(elements * self.codec.bytes_per_element(), fixed, self.transport.link_bps(dst, "forward"), self.compute.per_micro_batch, m.link_target, m.min_keep)
        j = max(self.keep_floor(), math.floor(f * m.keep * KEEP_GRID + 1e-9))
        if j >= m.keep * KEEP_GRID:
            self.keep_sent[dst] = 1.0
            return self.codec
        self.keep_sent[dst] = j / KEEP_GRID / m.keep
        return self.mask_codec((KEEP_GRID - j) / KEEP_GRID)

    def keep_floor(self) -> int:
        """Mask scheme, adapting: the least keep, in 1/KEEP_GRID steps (min_keep of the configured keep, at least one step)."""
        return max(math.ceil(self.mask.min_keep * self.mask.keep * KEEP_GRID - 1e-9), 1)

    def mask_codec(self, drop: float) -> MaskCodec:
        if drop not in self.mask_codecs:
            self.mask_codecs[drop] = MaskCodec(dataclasses.replace(self.mask, drop=drop))
        return self.mask_codecs[drop]

    def inbound_codec(self, hidden: pb.TensorPayload) -> MaskCodec:
        """Mask scheme: the codec for an inbound tensor: the config's, or (an adapting sender)
        one of a higher drop on the 1/256 grid, keeping at least `mask.min_keep` of the
        configured keep. Anything else: WireError naming the drop."""
        m, c = self.mask, hidden.compression
        if c.kind != pb.Compression.BERNOULLI_MASK or c.drop == as_f32(m.drop):
            return self.codec
        keep = 1.0 - c.drop
        j = keep * KEEP_GRID
        floor = self.keep_floor()
        if not (m.adapt and m.enabled and j == int(j) and floor <= j < m.keep * KEEP_GRID):
            raise WireError(f"Compression.drop={c.drop:.7g}: this peer masks with drop={m.drop!r}" + (f" or, adapting, 1 - j/{KEEP_GRID} with j in [{floor}, {m.keep * KEEP_GRID:.4g})" if m.adapt and m.enabled else ""))
        return self.mask_codec(c.drop)

    def decode_basis(self, msg: pb.ActivationChunk) -> BasisState:
        """The (prior, basis) pair a message carries, checked against this stage's sizes: the prior
        is [V, H], or [R, H] with R-1 distinct-enough token ids in range (`basis_prior_ids`)."""
        H, r, V = self.hidden_size, self.mask.rank, self.vocab_size
        row_ids = None
        if msg.HasField("basis_prior_ids"):
            row_ids = proto_to_tensor(msg.basis_prior_ids, expect_dtype=torch.int32)
            if row_ids.dim() != 1 or not 0 < len(row_ids) < V or int(row_ids.min()) < 0 or int(row_ids.max()) >= V:
                raise WireError(f"basis_prior_ids: must be 1-D with 1..{V - 1} token ids in [0, {V}); got shape {tuple(row_ids.shape)}")
        rows = V if row_ids is None else len(row_ids) + 1
        prior = proto_to_tensor(msg.basis_prior, expect_shape=(rows, H), expect_dtype=torch.float16).float()
        basis = proto_to_tensor(msg.basis, expect_shape=(H, r), expect_dtype=torch.float16).float()
        dev = self.device
        return BasisState(msg.basis_version, prior.to(dev), basis.to(dev), None if row_ids is None else row_ids.to(dev), V)
