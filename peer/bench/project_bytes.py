"""Bytes for `bench project`: the serialized ActivationChunk / GradientChunk of a micro-batch
(sized by building the real proto), their gRPC/HTTP/2/TCP/Ethernet framing, and the DP round's
bytes per peer. See peer/bench/project.py's docstring, "bytes"."""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer.bench.project_model import ModelDims, Shape
from peer.bench.throughput_modes import mode_config
from peer.config import TINY_MODEL_PREFIX
from peer.errors import ConfigError


@dataclass(frozen=True)
class Names:
    """Header fields that set a message's size (varints, strings): the swarm's by default."""

    run_id: str = "run-00000000"
    sender: str = "peer-00000000"
    micro_batch_id: int = 1 << 20  # replica id (20 bits) * M + j: three varint bytes
    step: int = 1000
    basis_version: int = 50  # one refresh per 20 steps


SWARM_NAMES = Names()  # the default of every sizing and timing (one frozen instance, shared)


def mode_mask(mode: str):
    from peer.config import MaskConfig

    return MaskConfig(**mode_config(mode, 2, 1, 1)["mask"])


def link_codec(mask):
    """The codec on the link, as StageWorker builds it: coefficients (low-rank) or hidden states."""
    from peer.codec.mask import MaskCodec
    from peer.config import MaskConfig

    return (
        MaskCodec(MaskConfig(scheme="mask", values=mask.values, seed=mask.seed))
        if mask.scheme == "lowrank"
        else MaskCodec(mask)
    )


def _payload(codec, shape: tuple[int, ...], boundary: int, names: Names, n_bytes: int):
    """A TensorPayload as `codec.encode` makes it for a tensor of `shape`, with a payload of n bytes."""
    import torch

    msg = codec.encode(
        torch.zeros((1,) * len(shape)), boundary=boundary, step=names.step, micro_batch=names.micro_batch_id
    )
    del msg.shape[:]
    msg.shape.extend(shape)
    msg.payload = b"\0" * n_bytes
    return msg


def link_payload_bytes(mask, numel: int) -> int:
    """Payload bytes of `numel` link values: kept values (drop 0 here: all) + int8 block scales."""
    from peer.codec.mask import _SCALE_BYTES, _VALUE_BYTES, DEFAULT_BLOCK_SIZE, VALUE_WIRE
    from peer.wire import anchormesh_pb2 as pb

    if mask.scheme == "mask" and mask.drop:
        raise ConfigError("codec.mask.drop", mask.drop, "the projection sizes drop = 0 codecs only (the bench's modes)")
    values = VALUE_WIRE[mask.values]
    return numel * _VALUE_BYTES[values] + (_SCALE_BYTES * -(-numel // DEFAULT_BLOCK_SIZE) if values == pb.INT8 else 0)


def prior_rows(mask, vocab: int) -> tuple[int, bool]:
    """(rows of the token prior that travel, whether their token ids travel too): the whole
    [V, H] table up to `mask.prior_rows` rows, else the most frequent tokens' rows plus one
    shared row (peer/codec/basis.py; assumes the sender has seen that many distinct tokens)."""
    cap = getattr(mask, "prior_rows", None)  # older configs ship the whole table
    if cap is None or vocab <= cap:
        return vocab, False
    return cap, True


@dataclass
class MessageBytes:
    """App bytes (serialized protos) of one micro-batch on one stage link."""

    activation: int
    gradient: int
    basis: int  # extra bytes of the message that ships a new (prior, basis) pair or activation coder; 0 without one
    grad_coder: int = (
        0  # extra bytes of the gradient that ships the gradients' coder (transform: once per link and run)
    )


def message_bytes(
    mode: str, dims: ModelDims, shape: Shape, boundary: int = 0, names: Names = SWARM_NAMES
) -> MessageBytes:
    """Sizes of the ActivationChunk and GradientChunk one micro-batch sends over `boundary`."""
    return mask_message_bytes(mode_mask(mode), dims, shape, boundary, names)


def mask_message_bytes(
    mask, dims: ModelDims, shape: Shape, boundary: int = 0, names: Names = SWARM_NAMES
) -> MessageBytes:
    """`message_bytes` for any drop-0 MaskConfig (`bench quality` sizes its rows' codecs with it)."""
    import torch

    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import tensor_to_proto, token_dtype

    if mask.scheme == "transform":
        return _transform_bytes(mask, dims, shape, boundary, names)
    codec = link_codec(mask)
    B, T = shape.micro_batch_size, shape.seq_len
    width = mask.rank if mask.scheme == "lowrank" else dims.hidden
    header = pb.MicroBatchHeader(
        run_id=names.run_id,
        micro_batch_id=names.micro_batch_id,
        step=names.step,
        sender=names.sender,
        boundary=boundary,
    )
    ids = tensor_to_proto(torch.zeros(B, T + 1, dtype=token_dtype(dims.vocab)))
    act = pb.ActivationChunk(header=header, token_ids=ids)
    act.hidden.CopyFrom(_payload(codec, (B, T, width), boundary, names, link_payload_bytes(mask, B * T * width)))
    basis = 0
    if mask.scheme == "lowrank":
        act.basis_version = names.basis_version
        with_basis = pb.ActivationChunk()
        with_basis.CopyFrom(act)
        rows, with_ids = prior_rows(mask, dims.vocab)
        with_basis.basis_prior.CopyFrom(tensor_to_proto(torch.zeros(rows, dims.hidden, dtype=torch.float16)))
        with_basis.basis.CopyFrom(tensor_to_proto(torch.zeros(dims.hidden, mask.rank, dtype=torch.float16)))
        if with_ids:
            with_basis.basis_prior_ids.CopyFrom(tensor_to_proto(torch.zeros(rows - 1, dtype=torch.int32)))
        basis = with_basis.ByteSize() - act.ByteSize()
    grad = pb.GradientChunk(header=header)
    grad.grad.CopyFrom(_payload(codec, (B, T, width), boundary, names, link_payload_bytes(mask, B * T * width)))
    return MessageBytes(act.ByteSize(), grad.ByteSize(), basis)


def transform_coders(mask, hidden: int, version: int = 1):
    """(activation coder, gradient coder) of the transform scheme with the run's bit budgets: a
    seeded random rotation stands in for the fitted one (the same fields and budget: a fitted
    coder's bits are spread unevenly, which moves each bit width's padding by under a byte)."""
    from peer.codec.grad_coder import FixedCoder, random_coder
    from peer.codec.transform import row_budget

    return random_coder(hidden, row_budget(mask.bits, hidden), seed=mask.seed, version=version), FixedCoder(
        hidden, mask.grad_bits, seed=mask.seed, step_scale=mask.grad_step_scale
    ).current


def _transform_bytes(mask, dims: ModelDims, shape: Shape, boundary: int, names: Names) -> MessageBytes:
    """The transform scheme's messages, built by its own encoder on a micro-batch of zeros."""
    import torch

    from peer.codec import transform_wire as tw
    from peer.pipeline.transform_link import TransformLinks
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import tensor_to_proto, token_dtype

    B, T, H = shape.micro_batch_size, shape.seq_len, dims.hidden
    act_coder, grad_coder = transform_coders(mask, H, version=max(1, names.basis_version))
    key = dict(boundary=boundary, step=names.step, micro_batch=names.micro_batch_id)
    header = pb.MicroBatchHeader(
        run_id=names.run_id,
        micro_batch_id=names.micro_batch_id,
        step=names.step,
        sender=names.sender,
        boundary=boundary,
    )
    ids = tensor_to_proto(torch.zeros(B, T + 1, dtype=token_dtype(dims.vocab)))
    row = torch.zeros(1, T, H)  # payloads grow by whole sequences: one is encoded, the rest sized
    links = TransformLinks(mask, H, produces_forward=False, produces_backward=False)  # the link's own rules
    stats, rates = links.msg_stats("forward"), links.row_rates("backward")
    act = pb.ActivationChunk(
        header=header,
        token_ids=ids,
        hidden=_batched(
            tw.encode(act_coder, row, sink=mask.sink, stochastic=False, msg_stats=stats, **key),
            act_coder,
            B,
            T,
            mask.sink,
            stats,
        ),
    )
    # mask.grad_outliers: a pretrained model's gradient rows at its first positions travel dense (SmolLM2's
    # massive activations sit there: on Python and licence text at 64-2,048 tokens no other row passed 20x);
    # a tiny model built from a config has none
    pretrained = not dims.name.startswith(TINY_MODEL_PREFIX)
    firsts = torch.arange(0, B * T, T) if mask.scheme == "transform" and mask.grad_outliers and pretrained else None
    grad = pb.GradientChunk(
        header=header,
        grad=_batched(
            tw.encode(grad_coder, row, sink=0, stochastic=True, dither=rates, row_rates=rates, **key),
            grad_coder,
            B,
            T,
            0,
            row_rates=rates,
            dense_rows=firsts,
        ),
    )
    coder_act = pb.ActivationChunk(coder=tw.coder_to_proto(act_coder)).ByteSize()
    coder_grad = pb.GradientChunk(
        coder=tw.coder_to_proto(grad_coder, run_rotation=True)
    ).ByteSize()  # its rotation is the run's: not shipped
    return MessageBytes(act.ByteSize(), grad.ByteSize(), coder_act, coder_grad)


def _batched(one, state, B: int, T: int, sink: int, msg_stats: bool = False, row_rates: bool = False, dense_rows=None):
    """`one` (a payload of one sequence) as the payload of B sequences: the exact length (with
    rates per row, the most it may take), and `dense_rows` named and sent."""
    one.shape[0] = B
    if dense_rows is not None:
        one.compression.dense_rows.extend(dense_rows.tolist())
    one.payload = b"\0" * state.payload_bytes(
        B, T, sink, msg_stats, row_rates, dense=0 if dense_rows is None else len(dense_rows)
    )
    return one


@dataclass(frozen=True)
class Framing:
    """What a message of n app bytes costs on an Ethernet link (defaults: MTU 1500, TCP timestamps)."""

    mtu: int = 1500
    ip_tcp_header: int = 52  # IPv4 20 + TCP 20 + timestamps option 12
    ethernet_header: int = 14  # counted by tbf and by the interface byte counters
    http2_frame: int = 16384  # default max DATA frame
    http2_header: int = 9
    grpc_prefix: int = 5
    segments_per_ack: int = 2  # delayed ACK

    @property
    def mss(self) -> int:
        return self.mtu - self.ip_tcp_header

    @property
    def segment_header(self) -> int:
        return self.ip_tcp_header + self.ethernet_header

    def segments(self, n: float) -> tuple[int, float]:
        """(TCP segments, HTTP/2 bytes) of one gRPC message of n app bytes."""
        body = n + self.grpc_prefix
        body += self.http2_header * math.ceil(body / self.http2_frame)
        return math.ceil(body / self.mss), body

    def wire(self, n: float) -> float:
        """Bytes on the sending link for one message of n app bytes."""
        segs, body = self.segments(n)
        return body + segs * self.segment_header

    def acks(self, n: float) -> float:
        """Bytes of the ACKs the receiver sends back for it."""
        segs, _ = self.segments(n)
        return math.ceil(segs / self.segments_per_ack) * self.segment_header


def dp_round_bytes(dims: ModelDims, stage: int, stages: int, replicas: int, compression: str) -> int:
    """Bytes one peer of `stage` uploads (and downloads) per averaging round (peer/dp/group.py)."""
    from peer.dp.schedule import round_bytes

    return round_bytes(dims.stage_params(stage, stages), replicas, compression) if replicas > 1 else 0
