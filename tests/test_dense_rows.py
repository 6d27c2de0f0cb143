"""Gradient rows of massive activations travel dense (mask.grad_outliers, Compression.dense_rows):
the producer picks them from the activation, the receiver puts them in place exactly, and a
malformed list or payload is refused."""

from __future__ import annotations

import pytest
import torch

from peer.codec import transform_wire as tw
from peer.codec.grad_coder import random_coder
from peer.codec.transform import row_budget
from peer.config import MaskConfig
from peer.errors import ConfigError, WireError
from peer.pipeline.transform_link import TransformLinks
from peer.wire import anchormesh_pb2 as pb

H = 32
KEY = dict(boundary=0, step=3, micro_batch=1)


def activation_with_massive_rows() -> torch.Tensor:
    """[2, 16, H]: ordinary rows, and rows (0, 0) and (1, 5) 300x larger (flat rows 0 and 21)."""
    ref = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(0))
    ref[0, 0] *= 300
    ref[1, 5] *= 300
    return ref


def message(mask: MaskConfig, grad: torch.Tensor, ref: torch.Tensor | None) -> pb.GradientChunk:
    producer = TransformLinks(mask, H, False, True)
    payload, coder = producer.encode("backward", grad, "stage0.r0", ref=ref, **KEY)
    return pb.GradientChunk(
        header=pb.MicroBatchHeader(sender="stage1.r0", step=3, micro_batch_id=1, boundary=0), grad=payload, coder=coder
    )


@pytest.mark.parametrize("rates", ["even", "row"])
def test_rows_of_massive_activations_arrive_exactly(rates: str) -> None:
    mask = MaskConfig(scheme="transform", grad_rates=rates)
    grad = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1)) * 1e-3
    msg = message(mask, grad, activation_with_massive_rows())
    assert list(msg.grad.compression.dense_rows) == [0, 21]
    consumer = TransformLinks(mask, H, True, False)
    consumer.check(msg, expect_shape=(2, 16, H), **KEY)
    got = consumer.decode(msg, expect_shape=(2, 16, H), **KEY)
    for b, t in ((0, 0), (1, 5)):
        assert torch.equal(got[b, t], grad[b, t].to(torch.bfloat16).float())
    assert not torch.equal(got[0, 1], grad[0, 1].to(torch.bfloat16).float())  # the others are coded
    plain = message(mask, grad, None)
    assert len(plain.grad.compression.dense_rows) == 0
    assert len(msg.grad.payload) - len(plain.grad.payload) in range(
        2 * 2 * H - len(grad) * 8, 2 * 2 * H + 1
    )  # two bf16 rows (a row's codes may pack differently)


def test_which_rows_go_dense() -> None:
    ref = activation_with_massive_rows()
    links = TransformLinks(MaskConfig(scheme="transform"), H, False, True)
    assert links.dense_rows("backward", ref).tolist() == [0, 21]
    assert links.dense_rows("forward", ref) is None  # the activations have their own sink
    assert links.dense_rows("backward", torch.randn(2, 16, H)) is None  # no outlier: nothing dense
    assert (
        TransformLinks(MaskConfig(scheme="transform", grad_outliers=0.0), H, False, True).dense_rows("backward", ref)
        is None
    )
    with pytest.raises(ConfigError, match="codec.transform.grad_outliers"):
        MaskConfig(scheme="transform", grad_outliers=0.5)


def test_a_malformed_dense_row_list_or_payload_is_refused() -> None:
    state = random_coder(H, row_budget(1.0, H), seed=3, step_scale=1.0)
    grad = torch.randn(2, 16, H)

    def payload(rows: list[int], data_rows: list[int] | None = None) -> pb.TensorPayload:
        msg = tw.encode(
            state,
            grad,
            sink=0,
            stochastic=True,
            dither=True,
            dense_rows=torch.tensor(data_rows if data_rows is not None else rows),
            **KEY,
        )
        del msg.compression.dense_rows[:]
        msg.compression.dense_rows.extend(rows)
        return msg

    def check(msg: pb.TensorPayload) -> None:
        tw.check(msg, state, expect_shape=(2, 16, H), sink=0, **KEY)

    check(payload([3, 7]))
    for bad in ([7, 3], [3, 3], [3, 32]):  # 32 rows in the message
        with pytest.raises(WireError, match="dense_rows"):
            check(payload(bad, data_rows=[3, 7]))
    with pytest.raises(WireError, match="bytes, expected"):
        check(payload([3], data_rows=[3, 7]))  # one row named, two sent
    nan = payload([3, 7])
    nan.payload = nan.payload[:-2] + b"\xc0\x7f"  # the last dense value: bf16 NaN
    with pytest.raises(WireError, match="dense rows"):
        check(nan)
