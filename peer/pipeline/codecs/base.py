"""`LinkCodec`: one stage worker's ends of its pipeline links for one PP codec (`mask.scheme`).

A worker sends its stage's output forward and the gradient of its input backward, and receives
the reverse; how each tensor travels (masked entries, low-rank coefficients, a transform code)
is the codec's business alone. The worker, the inbound checks, the memory plan and the local
runner talk to this interface and never ask which codec it is, so a new codec is one new class
in the table (peer/pipeline/codecs/__init__.py), as a DP scheme is one class in peer/dp/.

The four halves of a micro-batch's trip across one boundary:

    sender (stage s)                             receiver (stage s + 1)
    encode_activation(h)  -- ActivationChunk -->  decode_activation() -> (x leaf, h rebuilt)
    decode_gradient()     <-- GradientChunk ---   encode_gradient(x.grad)

`encode_activation` returns what the sender keeps for the gradient's decode (its "sent" note, in
the micro-batch's InFlight record) and `decode_activation` what the receiver keeps for the
gradient it will send back (its "received" note). The checks run on the transport's threads
before a message is queued and return the (RMS, largest magnitude) its values decode to, for
the link bounds (peer/pipeline/bounds.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from peer.config import MaskConfig
from peer.model.placement import Placement
from peer.model.stages import StageModule
from peer.pipeline.linktune import ComputeClock
from peer.pipeline.transport import Address, Transport
from peer.wire import anchormesh_pb2 as pb

Scale = tuple[float, float]  # (RMS, largest magnitude) of what a message decodes to
# what every link tensor declares as its logical dtype, whatever its peers compute in: values
# travel as `mask.values`, so a bf16 peer and an fp32 peer of one run talk to each other
LINK_DTYPE = torch.float32


def key_of(msg: pb.ActivationChunk | pb.GradientChunk) -> dict[str, int]:
    """The (boundary, step, micro-batch) a message's codec keys (masks, dither) derive from."""
    return {"boundary": msg.header.boundary, "step": msg.header.step, "micro_batch": msg.header.micro_batch_id}


def fixed_bytes(msg: pb.ActivationChunk | pb.GradientChunk) -> int:
    """A message's bytes besides its tensor (header, token ids, framing): what a link tuner adds."""
    return msg.header.ByteSize() + (msg.token_ids.ByteSize() if isinstance(msg, pb.ActivationChunk) else 0) + 16


class LinkCodec(ABC):
    """One stage worker's ends of its PP links for one `mask.scheme`: it encodes what the stage
    sends and decodes (after checking) what it receives, on both directions of every link. Built
    once per worker by `make_link` (peer/pipeline/codecs/__init__.py); a test builds one directly.

    Args:
        cfg: the run's codec settings (`TrainConfig.mask`, the run.toml's `[codec]` tables). Pass
            the run's own, unchanged: both ends of a link derive masks, coders, rates and dither
            offsets from the same values, and the tracker hands every peer the same run config.
            For a new run choose the default scheme ("transform"); the subclasses say what each
            scheme's settings do.
        stage: the stage this worker serves (its index, sizes and vocabulary): which ends exist
            (stage 0 decodes no activations, the last stage encodes none) and the tensors' shapes.
        placement: where the stage computes; decoded tensors land there. Pass the placement the
            stage was built with, so that decoding happens on its device and nothing crosses twice.
        transport: the worker's transport; an adapting link (`mask.adapt`) reads each link's
            measured rate from it (`link_bps`). Pass the one the worker sends on; a
            `LocalTransport` (no measured rate) keeps every link at its configured payload.
        compute: the worker's compute time per micro-batch, the budget an adapting link fits its
            bytes into (`mask.link_target` of it). Pass the worker's own clock.
    """

    scheme: ClassVar[str]  # the `mask.scheme` value that selects it

    def __init__(
        self, cfg: MaskConfig, stage: StageModule, placement: Placement, transport: Transport, compute: ComputeClock
    ) -> None:
        self.cfg, self.stage, self.placement, self.transport, self.compute = cfg, stage, placement, transport, compute
        self.keep_sent: dict[
            Address, float
        ] = {}  # destination -> share of the configured payload last sent (status's pp_keep)
        self.state_bytes_sent = 0  # bytes of codec state (bases, coders) shipped in messages: amortised over a run

    # -- the sender of activations, the receiver of their gradients -------------------------
    @abstractmethod
    def encode_activation(self, msg: pb.ActivationChunk, h: torch.Tensor, ids: torch.Tensor, dst: Address) -> object:
        """Put `h` [B, T, H] (this stage's output, on the device; `ids` [B, T] its tokens, on the
        device) into `msg` for `dst`; returns what `decode_gradient` will need."""

    @abstractmethod
    def decode_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> torch.Tensor:
        """The gradient w.r.t. the output that was sent (`sent`: `encode_activation`'s note), [B, T, H] on the device."""

    @abstractmethod
    def check_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> Scale:
        """Vet an inbound gradient for that output; WireError / TensorError naming the field."""

    # -- the receiver of activations, the sender of their gradients -------------------------
    @abstractmethod
    def decode_activation(
        self, msg: pb.ActivationChunk, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(x, h, note): x the leaf whose gradient goes back (requires grad, on the device), h the
        hidden state the stage runs on (in its compute dtype), note what `encode_gradient` will
        need. `ids` [B, T]: the micro-batch's tokens, on the host."""

    @abstractmethod
    def encode_gradient(self, msg: pb.GradientChunk, x: torch.Tensor, received: object, dst: Address) -> None:
        """Put the gradient of `x` (`x.grad`) into `msg` for `dst`, as `decode_activation` noted."""

    @abstractmethod
    def check_activation(self, msg: pb.ActivationChunk, ids: torch.Tensor) -> Scale:
        """Vet an inbound activation for tokens `ids` [B, T] (host); WireError naming the field."""

    # -- what the rest of the worker asks ----------------------------------------------------
    def forget_sent(self) -> None:
        """A message may have been lost with codec state in it (a basis, a coder): ship it again."""

    def anchor_fill(self, ids: torch.Tensor) -> torch.Tensor | None:
        """What the local runner's masked anchor twin fills dropped entries with (the element
        mask's learned token prior); None: nothing to fill."""
        return None

    @classmethod
    def state_bytes(cls, cfg: MaskConfig, vocab_size: int, hidden_size: int, sends: bool, receives: bool) -> int:
        """Device memory of this codec's state on one stage (priors, bases, coders, learners): the memory plan."""
        return 0

    @classmethod
    def label(cls, cfg: MaskConfig) -> str:
        """A few words for people: what travels."""
        return cls.scheme
