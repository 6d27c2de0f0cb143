"""A stage worker's transform-coded links (mask.scheme = "transform", peer/codec/transform.py).

Each tensor's producer makes the coder of what it produces and ships it: a stage has one for its
outputs (forward: a KLT refitted every `mask.basis_refresh` steps, `mask.bits` per value) and
one for the gradients w.r.t. its input (backward: a fixed random rotation, `mask.grad_bits` per
value, made once), and sends each new version to each destination once. The gradients' rotation
is the run's (grad_coder.run_rotation of `codec.seed`): each end makes it, and their coder ships
without it (its stds and bits still travel). The coders a worker
received are kept per (channel, producer), the two newest versions each, so a message still
queued from before a refit decodes. Checks on the transport's threads and the worker's own
decode share that store (dict operations only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peer.codec import transform_wire as tw
from peer.codec.act_coder import TransformLearner
from peer.codec.grad_coder import FixedCoder, run_rotation
from peer.codec.transform import BITS_GRID, TransformState, fixed_bytes, grid_bits, row_budget
from peer.config import MaskConfig
from peer.errors import WireError
from peer.wire import anchormesh_pb2 as pb

KEEP_VERSIONS = 2


@dataclass
class TransformLinks:
    """What one worker produces (its learners) and the coders its peers produced."""

    mask: MaskConfig
    hidden_size: int
    produces_forward: bool  # not the last stage: it sends activations
    produces_backward: bool  # not the first stage: it sends gradients
    learners: dict[str, TransformLearner | FixedCoder] = field(
        default_factory=dict
    )  # channel -> what makes this worker's coder
    sent: dict[tuple[str, object], int] = field(
        default_factory=dict
    )  # (channel, destination) -> coder version it holds
    coders: dict[tuple[str, str], dict[int, TransformState]] = field(
        default_factory=dict
    )  # (channel, producer) -> version -> coder

    def __post_init__(self) -> None:
        m, H = self.mask, self.hidden_size
        if self.produces_forward:
            self.learners["forward"] = TransformLearner(H, m.bits, m.basis_refresh)
        if self.produces_backward:
            self.learners["backward"] = FixedCoder(H, m.grad_bits, seed=m.seed, step_scale=m.grad_step_scale)

    def sink(self, channel: str) -> int:
        """Leading positions sent dense: the activations' attention sink; gradients have none
        (every row is coded: its own gain takes a large one)."""
        return self.mask.sink if channel == "forward" else 0

    def dithers(self, channel: str) -> bool:
        """Whether `channel`'s values round with subtractive dither (mask.grad_rounding for the
        gradients, mask.act_rounding for the activations): both ends read it from the run's config."""
        return (self.mask.grad_rounding if channel == "backward" else self.mask.act_rounding) == "dither"

    def shuffles(self, channel: str) -> bool:
        """Whether `channel`'s rows are signed and permuted per message before the rotation (the
        gradients, with mask.grad_rotation "message"): both ends read it from the run's config."""
        return channel == "backward" and self.mask.grad_rotation == "message"

    def msg_stats(self, channel: str) -> bool:
        """Whether `channel`'s messages carry their own component statistics (the activations,
        with mask.act_stats "message"): both ends read it from the run's config."""
        return channel == "forward" and self.mask.act_stats == "message"

    def row_rates(self, channel: str) -> bool:
        """Whether `channel`'s rows each take their own rate (the gradients, with mask.grad_rates
        "row"): both ends read it from the run's config."""
        return channel == "backward" and self.mask.grad_rates == "row"

    def max_bits(self, channel: str) -> int:
        """The run's bits per coded row on `channel`: the most a received coder may allocate."""
        return row_budget(self.mask.bits if channel == "forward" else self.mask.grad_bits, self.hidden_size)

    def min_row_bits(self, channel: str) -> int | None:
        """The fewest bits per row an adapting sender sends on `channel` (mask.adapt): `min_keep`
        of the run's, rounded up to the grid (at least one step); gradients at least
        `mask.grad_min_bits` per value (below one, other components of their rotation every
        message: transform_wire._shuffled), activations below a bit per value leave the KLT's
        weakest components unsent. None when it cannot adapt (adapt off, or 1-bit gradients at
        the default floor)."""
        full, H = self.max_bits(channel), self.hidden_size
        if not self.mask.adapt:
            return None
        floor = max(round(H / BITS_GRID), grid_bits(self.mask.min_keep * full, H, up=True))
        floor = max(floor, grid_bits(self.mask.grad_min_bits * H, H, up=True)) if channel == "backward" else floor
        return floor if floor < full else None

    def code_bytes(self, channel: str, shape: tuple[int, ...]) -> tuple[float, float]:
        """(bytes of the codes at the run's bits, bytes besides them: sink rows, gains, message
        statistics, dense rows) of a [B, T, H] tensor on `channel`: what a link must carry."""
        B, T, H = shape
        rows = B * (T - min(self.sink(channel), T))
        outliers = (
            2 * H * B if self.mask.grad_outliers and channel == "backward" else 0
        )  # about one massive row a sequence
        return rows * self.max_bits(channel) / 8, fixed_bytes(
            H, B, T, self.sink(channel), self.msg_stats(channel), self.row_rates(channel)
        ) + outliers

    # ---- producing ------------------------------------------------------------------------
    def dense_rows(self, channel: str, ref: torch.Tensor | None) -> torch.Tensor | None:
        """Gradient rows to send dense: those whose activation `ref` [B, T, H] (what this stage
        received) has an RMS above mask.grad_outliers times the message's median (SmolLM2's
        massive activations: the first position and a few tokens, 100x+ the median). Why: such a
        row's tiny gradient multiplies a huge activation in the sender's weight gradients (on
        SmolLM2 it alone can outweigh the rest), so its coding error, a clipped 1-bit value,
        would bias them; sent in bf16 it costs 2 H bytes a row."""
        ratio = self.mask.grad_outliers
        if channel != "backward" or not ratio or ref is None or not ref.numel():
            return None
        rms = ref.detach().float().pow(2).mean(-1).sqrt().reshape(-1)
        rows = (rms > ratio * rms.median()).nonzero().flatten()
        return rows.cpu() if len(rows) else None

    def encode(
        self,
        channel: str,
        x: torch.Tensor,
        dst: object,
        *,
        boundary: int,
        step: int,
        micro_batch: int,
        ref: torch.Tensor | None = None,
        row_bits: int | None = None,
    ) -> tuple[pb.TensorPayload, pb.TransformCoder | None]:
        """`x` [B, T, H] coded for `dst`, and the coder to ship with it when `dst` lacks it.
        Gradients round stochastically, with dither or to the nearest level, through a fixed
        rotation or one signed and permuted per message; activations to the nearest level or
        with dither: as the run's mask.grad_rounding / grad_rotation / act_rounding say.
        `ref`: for a gradient, the activation it is the gradient of (`dense_rows`); `row_bits`:
        fewer bits per row for a slow link (mask.adapt: at least `min_row_bits`)."""
        learner = self.learners[channel]
        learner.observe(x, self.sink(channel))
        learner.maybe_refresh(step)
        state = learner.current
        coder = None
        if state is not None and self.sent.get((channel, dst)) != state.version:
            coder = tw.coder_to_proto(state, run_rotation=channel == "backward")
            self.sent[(channel, dst)] = state.version
        payload = tw.encode(
            state,
            x,
            sink=self.sink(channel),
            stochastic=channel == "backward" and self.mask.grad_rounding == "stochastic",
            boundary=boundary,
            step=step,
            micro_batch=micro_batch,
            dither=self.dithers(channel),
            channel=channel,
            msg_stats=self.msg_stats(channel),
            row_rates=self.row_rates(channel),
            dense_rows=self.dense_rows(channel, ref) if state is not None else None,
            shuffle=self.shuffles(channel),
            row_bits=row_bits,
            run_seed=self.mask.seed,
        )
        return payload, coder

    def forget_sent(self) -> None:
        """A message may have been lost with a coder in it: ship the current ones again."""
        self.sent.clear()

    # ---- consuming ------------------------------------------------------------------------
    def take_coder(self, channel: str, producer: str, coder: pb.TransformCoder) -> None:
        """Check and keep a coder `producer` shipped (WireError when it is malformed)."""
        rotation = run_rotation(self.hidden_size, self.mask.seed) if channel == "backward" else None
        state = tw.coder_from_proto(coder, self.hidden_size, self.max_bits(channel), run_rotation=rotation)
        kept = self.coders.setdefault((channel, producer), {})
        kept[state.version] = state
        for old in sorted(kept)[:-KEEP_VERSIONS]:
            kept.pop(old, None)

    def _state(self, msg: pb.ActivationChunk | pb.GradientChunk) -> tuple[str, pb.TensorPayload, TransformState | None]:
        """(channel, payload, the coder it names); a coder shipped with it is checked and kept
        first. WireError for a malformed coder or one this end lacks."""
        channel = "forward" if isinstance(msg, pb.ActivationChunk) else "backward"
        payload, producer = (msg.hidden if channel == "forward" else msg.grad), msg.header.sender
        if msg.HasField("coder"):
            self.take_coder(channel, producer, msg.coder)
        state = None
        if payload.compression.kind == pb.Compression.NONE and (channel, producer) in self.coders:
            # the dense warm-up format is for a producer without a coder: one that shipped a coder codes
            # from then on (a restarted one is refused until it ships its new one, a few micro-batches)
            have = max(self.coders[(channel, producer)])
            raise WireError(
                f"Compression.kind=NONE: {producer!r} shipped a {channel} coder (v{have}); its {channel} messages must be coded from then on"
            )
        if payload.compression.kind == pb.Compression.TRANSFORM:
            state = self.coders.get((channel, producer), {}).get(payload.compression.coder_version)
            if state is None:
                have = sorted(self.coders.get((channel, producer), {}))
                raise WireError(
                    f"Compression.coder_version={payload.compression.coder_version}: no such {channel} coder from {producer!r} here (have {have}); send it again"
                )
        return channel, payload, state

    def check(
        self,
        msg: pb.ActivationChunk | pb.GradientChunk,
        *,
        expect_shape: tuple[int, ...],
        boundary: int,
        step: int,
        micro_batch: int,
    ) -> tuple[float, float]:
        """The inbound check of an activation or gradient, on the host, without decoding it; returns
        the (RMS, largest magnitude) it decodes to, estimated (transform_wire.magnitude)."""
        channel, payload, state = self._state(msg)
        return tw.check(
            payload,
            state,
            expect_shape=expect_shape,
            sink=self.sink(channel),
            boundary=boundary,
            step=step,
            micro_batch=micro_batch,
            msg_stats=self.msg_stats(channel),
            row_rates=self.row_rates(channel),
            min_row_bits=self.min_row_bits(channel),
        )

    def decode(
        self,
        msg: pb.ActivationChunk | pb.GradientChunk,
        *,
        expect_shape: tuple[int, ...],
        boundary: int,
        step: int,
        micro_batch: int,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """The float32 tensor an activation or gradient carries, decoded on `device`."""
        channel, payload, state = self._state(msg)
        return tw.decode(
            payload,
            state,
            expect_shape=expect_shape,
            sink=self.sink(channel),
            boundary=boundary,
            step=step,
            micro_batch=micro_batch,
            device=device,
            dither=self.dithers(channel),
            channel=channel,
            msg_stats=self.msg_stats(channel),
            row_rates=self.row_rates(channel),
            shuffle=self.shuffles(channel),
            min_row_bits=self.min_row_bits(channel),
            run_seed=self.mask.seed,
        )
