"""Tensors <-> `TensorPayload` and bounded message parsing, with every field validated.

A peer must not crash or corrupt its model because of what another peer sends (docs/design.md, "Security"), so
`proto_to_tensor` checks dtype, shape, size, payload length and finiteness before building a
tensor, and `parse_message` refuses oversized byte strings before protobuf sees them. Every
failure raises `WireError` naming the field and the value.

Byte layout: row-major, little-endian; bf16 travels as its raw 2-byte words.
"""

from __future__ import annotations

import math
import sys
from typing import TypeVar

import torch
from google.protobuf import message as _pb_message

from peer.errors import TensorError, WireError
from peer.wire import anchormesh_pb2 as pb

MAX_NUMEL = 2**28  # default bound on elements per tensor (1 GiB of fp32)
MAX_RANK = 16

TORCH_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int8: pb.INT8,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.uint8: pb.UINT8,
    torch.int16: pb.INT16,
}
WIRE_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_WIRE.items()}

_BIG_ENDIAN = sys.byteorder == "big"

M = TypeVar("M", bound=_pb_message.Message)


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest wire dtype that holds token ids below `vocab_size` (ids cost bytes on every link)."""
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 2**15:
        return torch.int16
    return torch.int32


def dtype_name(wire_dtype: int) -> str:
    """'FLOAT32' for a known enum value, the number as text otherwise (for error messages)."""
    try:
        return pb.DType.Name(wire_dtype)
    except ValueError:
        return str(wire_dtype)


def wire_dtype(dtype: torch.dtype) -> int:
    """The `DType` of a torch dtype; TensorError for dtypes the wire cannot carry."""
    try:
        return TORCH_TO_WIRE[dtype]
    except KeyError:
        allowed = ", ".join(str(d) for d in TORCH_TO_WIRE)
        raise TensorError(f"dtype={dtype}: cannot travel on the wire (allowed: {allowed})") from None


def torch_dtype(wire: int, *, field: str = "TensorPayload.dtype") -> torch.dtype:
    """The torch dtype of a wire `DType`; WireError for unspecified or unknown values."""
    if wire == pb.DTYPE_UNSPECIFIED:
        raise WireError(f"{field}=DTYPE_UNSPECIFIED: the sender did not set the element type")
    try:
        return WIRE_TO_TORCH[wire]
    except KeyError:
        raise WireError(f"{field}={wire}: unknown element type") from None


def to_le_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of `t`'s elements in row-major order (any device)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.numel() == 0:
        return b""
    raw = flat.view(torch.uint8)
    if _BIG_ENDIAN and flat.element_size() > 1:
        raw = raw.view(-1, flat.element_size()).flip(1).reshape(-1)
    return raw.numpy().tobytes()


def from_le_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """1-D tensor of `dtype` from raw little-endian bytes; the caller has checked the length."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # bytearray: writable copy, no warning
    if _BIG_ENDIAN and itemsize > 1:
        raw = raw.view(-1, itemsize).flip(1).reshape(-1).contiguous()
    return raw.view(dtype)


def check_shape(shape: object, *, field: str = "TensorPayload.shape", max_numel: int = MAX_NUMEL) -> tuple[int, ...]:
    """Validate a wire shape (rank, non-negative dims, bounded numel) and return it as a tuple."""
    dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
    if len(dims) > MAX_RANK:
        raise WireError(f"{field}={list(dims)}: rank {len(dims)} exceeds {MAX_RANK}")
    for i, d in enumerate(dims):
        if d < 0:
            raise WireError(f"{field}[{i}]={d}: dimensions must be >= 0 (shape {list(dims)})")
    numel = math.prod(dims)
    if numel > max_numel:
        raise WireError(f"{field}={list(dims)}: {numel} elements exceed max_numel={max_numel}")
    return dims


def check_expected(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    expect_shape: tuple[int, ...] | None,
    expect_dtype: torch.dtype | None,
    field: str = "TensorPayload",
) -> None:
    """WireError if the declared shape/dtype differ from what the receiver expects."""
    if expect_shape is not None and tuple(shape) != tuple(expect_shape):
        raise WireError(f"{field}.shape={list(shape)}: expected {list(expect_shape)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise WireError(
            f"{field}.dtype={dtype_name(TORCH_TO_WIRE.get(dtype, 0))}: expected {dtype_name(wire_dtype(expect_dtype))}"
        )


def check_finite_wire(t: torch.Tensor, *, field: str) -> None:
    """WireError naming how many entries of a received tensor are NaN or Inf."""
    if t.is_floating_point():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise WireError(f"{field}: {bad} of {t.numel()} values are NaN or Inf")


def tensor_to_proto(t: torch.Tensor) -> pb.TensorPayload:
    """Dense `TensorPayload` (compression NONE) holding `t`'s raw little-endian bytes."""
    msg = pb.TensorPayload(dtype=wire_dtype(t.dtype), shape=list(t.shape))
    msg.compression.kind = pb.Compression.NONE
    msg.payload = to_le_bytes(t)
    return msg


def proto_to_tensor(
    msg: pb.TensorPayload,
    *,
    max_numel: int = MAX_NUMEL,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> torch.Tensor:
    """Decode a dense `TensorPayload` to a CPU tensor after validating every field.

    Raises WireError for: a compressed payload (use MaskCodec.decode), an unspecified/unknown
    dtype, a bad shape (rank, negative dims, numel over `max_numel`), a shape/dtype other than
    the expected one, a payload length other than numel * itemsize, or NaN/Inf values (unless
    `allow_nonfinite`).
    """
    if not isinstance(msg, pb.TensorPayload):
        raise WireError(f"expected a TensorPayload, got {type(msg).__name__}")
    kind = msg.compression.kind
    if kind != pb.Compression.NONE:
        kind_name = pb.Compression.Kind.Name(kind) if kind in pb.Compression.Kind.values() else str(kind)
        raise WireError(f"TensorPayload.compression.kind={kind_name}: proto_to_tensor decodes dense payloads only")
    dtype = torch_dtype(msg.dtype)
    shape = check_shape(msg.shape, max_numel=max_numel)
    check_expected(shape, dtype, expect_shape=expect_shape, expect_dtype=expect_dtype)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.payload) != numel * itemsize:
        raise WireError(
            f"TensorPayload.payload: {len(msg.payload)} bytes, expected {numel * itemsize} "
            f"(= {numel} elements of {dtype_name(msg.dtype)} x {itemsize} bytes, shape {list(shape)})"
        )
    t = from_le_bytes(msg.payload, dtype).reshape(shape)
    if not allow_nonfinite:
        check_finite_wire(t, field="TensorPayload.payload")
    return t


def parse_message(cls: type[M], data: bytes, max_bytes: int) -> M:
    """Parse `data` as a `cls` message, refusing more than `max_bytes` before protobuf sees it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{cls.__name__}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"{cls.__name__}: {len(data)} bytes exceed max_bytes={max_bytes}")
    msg = cls()
    try:
        msg.ParseFromString(bytes(data))
    except (_pb_message.DecodeError, ValueError, RuntimeError, RecursionError) as e:
        raise WireError(f"{cls.__name__}: cannot parse {len(data)} bytes: {e}") from e
    return msg
