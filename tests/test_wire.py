"""Wire contract: generated stubs are current, tensors round-trip, every bad field is refused."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.errors import TensorError, WireError
from peer.wire import anchormesh_pb2 as pb
from peer.wire.gen import WIRE_DIR, generate
from peer.wire.tensors import parse_message, proto_to_tensor, tensor_to_proto

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64]


def sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, dtype=dtype)


# ---- generated code ----------------------------------------------------------------------------
def test_generated_stubs_are_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    names = {p.name for p in fresh}
    assert {"anchormesh_pb2.py", "anchormesh_pb2.pyi", "anchormesh_pb2_grpc.py"} <= names
    for path in fresh:
        committed = WIRE_DIR / path.name
        assert committed.exists(), f"{committed} missing: run `python -m peer.wire.gen`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `python -m peer.wire.gen`"
    stale = {p.name for p in WIRE_DIR.glob("*_pb2*.py*")} - names
    assert not stale, f"generated files without a .proto source: {stale}"


def test_stubs_import_as_package_modules() -> None:
    from peer.wire import anchormesh_pb2_grpc  # noqa: F401 - imports peer.wire.anchormesh_pb2 by package path

    assert pb.DESCRIPTOR.package == "anchormesh.v1"
    assert pb.DESCRIPTOR.name == "peer/wire/anchormesh.proto"
    assert pb.Compression.BERNOULLI_MASK == 1 and pb.BFLOAT16 == 3


# ---- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_each_dtype(dtype: torch.dtype) -> None:
    x = sample((3, 4, 5), dtype)
    msg = pb.TensorPayload.FromString(tensor_to_proto(x).SerializeToString())
    assert msg.compression.kind == pb.Compression.NONE and list(msg.shape) == [3, 4, 5]
    y = proto_to_tensor(msg, expect_shape=(3, 4, 5), expect_dtype=dtype)
    assert y.dtype == dtype and torch.equal(y, x)


def test_byte_layout_little_endian_and_bf16_raw_words() -> None:
    assert tensor_to_proto(torch.tensor([1.0])).payload == struct.pack("<f", 1.0)
    assert tensor_to_proto(torch.tensor([1.0], dtype=torch.bfloat16)).payload == b"\x80\x3f"  # top half of fp32 1.0
    assert tensor_to_proto(torch.tensor([258], dtype=torch.int32)).payload == b"\x02\x01\x00\x00"
    bf = torch.tensor([3.140625, -0.0, 1e38], dtype=torch.bfloat16)
    assert torch.equal(proto_to_tensor(tensor_to_proto(bf)).view(torch.int16), bf.view(torch.int16))  # bit-exact


def test_scalar_empty_and_noncontiguous() -> None:
    assert torch.equal(proto_to_tensor(tensor_to_proto(torch.tensor(2.5))), torch.tensor(2.5))
    empty = proto_to_tensor(tensor_to_proto(torch.zeros(0, 7)))
    assert empty.shape == (0, 7)
    x = torch.randn(4, 6).t()
    assert torch.equal(proto_to_tensor(tensor_to_proto(x)), x)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=4), dtype=st.sampled_from(DTYPES))
def test_round_trip_property(shape: list[int], dtype: torch.dtype) -> None:
    x = sample(tuple(shape), dtype)
    data = tensor_to_proto(x).SerializeToString()
    msg = parse_message(pb.TensorPayload, data, max_bytes=1 << 20)
    y = proto_to_tensor(msg, expect_shape=tuple(shape), expect_dtype=dtype)
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)


def test_messages_round_trip() -> None:
    x = torch.randn(2, 3, 4)
    chunk = pb.ActivationChunk(
        header=pb.MicroBatchHeader(
            run_id="r", micro_batch_id=9, step=3, sender="p", signature=b"s", boundary=1, dense=True
        ),
        hidden=tensor_to_proto(x),
        token_ids=tensor_to_proto(torch.zeros(2, 3, dtype=torch.int64)),
    )
    back = parse_message(pb.ActivationChunk, chunk.SerializeToString(), max_bytes=1 << 16)
    assert back.header.micro_batch_id == 9 and back.header.dense
    assert torch.equal(proto_to_tensor(back.hidden), x)
    assert not back.HasField("labels")
    ack = parse_message(pb.Ack, pb.Ack(micro_batch_id=9, ok=False, error="bad").SerializeToString(), max_bytes=64)
    assert ack.error == "bad"


# ---- validation errors -----------------------------------------------------------------------------
def payload(dtype: int = pb.FLOAT32, shape: list[int] | None = None, data: bytes | None = None) -> pb.TensorPayload:
    shape = [2, 3] if shape is None else shape
    return pb.TensorPayload(dtype=dtype, shape=shape, payload=bytes(24) if data is None else data)


def test_rejects_unspecified_and_unknown_dtype() -> None:
    with pytest.raises(WireError, match="TensorPayload.dtype=DTYPE_UNSPECIFIED"):
        proto_to_tensor(payload(dtype=pb.DTYPE_UNSPECIFIED))
    with pytest.raises(WireError, match="TensorPayload.dtype=99: unknown element type"):
        proto_to_tensor(payload(dtype=99))


def test_rejects_bad_shapes() -> None:
    with pytest.raises(WireError, match=r"TensorPayload.shape\[1\]=-3: dimensions must be >= 0"):
        proto_to_tensor(payload(shape=[2, -3]))
    with pytest.raises(WireError, match=r"shape=\[1024, 1024\]: 1048576 elements exceed max_numel=1000"):
        proto_to_tensor(payload(shape=[1024, 1024]), max_numel=1000)
    with pytest.raises(WireError, match="exceed max_numel"):
        proto_to_tensor(payload(shape=[2**40, 2**40, 2**40]))  # product beyond int64: no overflow
    with pytest.raises(WireError, match="rank 17 exceeds 16"):
        proto_to_tensor(payload(shape=[1] * 17, data=b"\0" * 4))


def test_rejects_payload_length_mismatch() -> None:
    with pytest.raises(WireError, match=r"payload: 23 bytes, expected 24 \(= 6 elements of FLOAT32 x 4 bytes"):
        proto_to_tensor(payload(data=bytes(23)))
    with pytest.raises(WireError, match="payload: 25 bytes, expected 24"):
        proto_to_tensor(payload(data=bytes(25)))
    with pytest.raises(WireError, match="payload: 24 bytes, expected 12"):
        proto_to_tensor(payload(dtype=pb.BFLOAT16))


def test_rejects_unexpected_shape_and_dtype() -> None:
    with pytest.raises(WireError, match=r"TensorPayload.shape=\[2, 3\]: expected \[3, 2\]"):
        proto_to_tensor(payload(), expect_shape=(3, 2))
    with pytest.raises(WireError, match="TensorPayload.dtype=FLOAT32: expected INT64"):
        proto_to_tensor(payload(), expect_dtype=torch.int64)


def test_rejects_nonfinite_with_count() -> None:
    data = struct.pack("<6f", 0.0, float("nan"), 1.0, float("inf"), float("-inf"), 2.0)
    with pytest.raises(WireError, match="3 of 6 values are NaN or Inf"):
        proto_to_tensor(payload(data=data))
    t = proto_to_tensor(payload(data=data), allow_nonfinite=True)
    assert int((~torch.isfinite(t)).sum()) == 3


def test_rejects_compressed_payload_and_unsendable_dtypes() -> None:
    msg = payload()
    msg.compression.kind = pb.Compression.BERNOULLI_MASK
    with pytest.raises(WireError, match="compression.kind=BERNOULLI_MASK"):
        proto_to_tensor(msg)
    with pytest.raises(TensorError, match="dtype=torch.float64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TensorError, match="dtype=torch.bool"):
        tensor_to_proto(torch.zeros(2, dtype=torch.bool))


def test_parse_message_bounds_and_garbage() -> None:
    data = tensor_to_proto(torch.randn(100)).SerializeToString()
    with pytest.raises(WireError, match=rf"TensorPayload: {len(data)} bytes exceed max_bytes=100"):
        parse_message(pb.TensorPayload, data, max_bytes=100)
    with pytest.raises(WireError, match="ActivationChunk: cannot parse 4 bytes"):
        parse_message(pb.ActivationChunk, b"\x12\x05ab", max_bytes=100)  # field 2, length 5, only 2 bytes
    with pytest.raises(WireError, match="cannot parse"):
        parse_message(pb.Ack, b"\xff\xff\xff\xff", max_bytes=100)
    with pytest.raises(WireError, match="expected bytes, got str"):
        parse_message(pb.Ack, "hello", max_bytes=100)  # type: ignore[arg-type]
