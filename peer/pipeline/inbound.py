"""What an inbound pipeline message must be before a stage worker queues it.

The checks run on the transport's threads, before the message reaches the worker's inbox: each
raises WireError / TensorError naming the field (wrong boundary, token ids out of range, shapes
or dtypes that do not fit the stage, NaN/Inf values, values far above their link's running RMS
or over the cap: peer/pipeline/bounds.py). They decode the tensors once here and the
worker again when it uses them (a cost accepted for now).
"""

from __future__ import annotations

import torch

from peer.config import PipelineConfig
from peer.errors import WireError
from peer.model.stages import StageModule
from peer.pipeline.bounds import LinkBounds
from peer.pipeline.codecs.base import LinkCodec
from peer.pipeline.inflight import InFlight
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import parse_message, proto_to_tensor

MAX_MESSAGE_BYTES = 256 * 2**20


def parse_inbound(channel: str, data: bytes, run_id: str, name: str) -> pb.ActivationChunk | pb.GradientChunk:
    """A message polled on `channel` ("forward" or "backward") for worker `name`, parsed within
    MAX_MESSAGE_BYTES; WireError when it belongs to another run than `run_id`."""
    cls = pb.ActivationChunk if channel == "forward" else pb.GradientChunk
    msg = parse_message(cls, data, MAX_MESSAGE_BYTES)
    if msg.header.run_id != run_id:
        raise WireError(f"{name}: message for run {msg.header.run_id!r}, expected {run_id!r}")
    return msg


def check_token_window(
    payload: pb.TensorPayload, vocab_size: int, shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """An inbound token window [B, T+1] (inputs and targets), vetted: integer, 2-D with T >= 1,
    of `shape` when given, every id in [0, vocab_size). Raises WireError naming the problem."""
    window = proto_to_tensor(payload)
    want = f"[{shape[0]}, {shape[1]}] (the run's micro-batch)" if shape else "[B, T+1]"
    if (
        window.is_floating_point()
        or window.ndim != 2
        or window.shape[1] < 2
        or (shape and tuple(window.shape) != shape)
    ):
        raise WireError(f"token_ids: expected integer {want}, got {window.dtype} {tuple(window.shape)}")
    if int(window.min()) < 0 or int(window.max()) >= vocab_size:
        raise WireError(f"token_ids: values must be in [0, {vocab_size})")
    return window


def check_activation(
    msg: pb.ActivationChunk, s: StageModule, p: PipelineConfig, link: LinkCodec, bounds: LinkBounds | None = None
) -> None:
    """An activation for stage `s`: on its inbound boundary, a token window of the run's
    micro-batch shape `p`, a payload its codec's receiving end (`link`) accepts for it and, with
    `bounds`, values within its link's bounds (peer/pipeline/bounds.py)."""
    b = msg.header.boundary
    if b != s.index - 1:
        raise WireError(f"header.boundary={b}: stage {s.index} receives activations on boundary {s.index - 1}")
    # the run's micro-batch shape, pinned: a larger one would cost this stage more than its sender
    ids = check_token_window(msg.token_ids, s.vocab_size, (p.micro_batch_size, p.seq_len + 1))[:, :-1].long()
    scale = link.check_activation(msg, ids)
    if bounds is not None:
        bounds.check("forward", msg.header.sender, *scale)


def check_gradient(
    msg: pb.GradientChunk,
    s: StageModule,
    inflight: dict[tuple[int, int], InFlight],
    link: LinkCodec,
    bounds: LinkBounds | None = None,
) -> None:
    """A gradient for stage `s`: on its outbound boundary, for a micro-batch in flight here, of
    the shape (and codec) its output was sent with and, with `bounds`, values within its link's bounds."""
    b = msg.header.boundary
    if b != s.index:
        raise WireError(f"header.boundary={b}: stage {s.index} receives gradients on boundary {s.index}")
    job = inflight.get((msg.header.step, msg.header.micro_batch_id))
    if job is None:
        raise WireError(
            f"gradient for unknown micro-batch (step={msg.header.step}, micro_batch_id={msg.header.micro_batch_id})"
        )
    scale = link.check_gradient(msg, job.sent, tuple(job.out.shape))
    if bounds is not None:
        bounds.check("backward", msg.header.sender, *scale)
