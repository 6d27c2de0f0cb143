"""The gradients' per-message rotation (mask.grad_rotation "message") and nearest rounding for
gradients (mask.grad_rounding "nearest")."""

from __future__ import annotations

import math

import pytest
import torch

from peer.codec.bitpack import signed_permutation
from peer.codec.transform import MSE
from peer.config import MaskConfig
from peer.errors import ConfigError
from peer.wire import anchormesh_pb2 as pb

H = 64


def test_a_message_s_signed_permutation_is_fixed_by_its_key() -> None:
    s1, p1 = signed_permutation(11, H)
    s2, p2 = signed_permutation(11, H)
    s3, p3 = signed_permutation(12, H)
    assert torch.equal(s1, s2) and torch.equal(p1, p2)
    assert not torch.equal(p1, p3) and not torch.equal(s1, s3)
    assert sorted(p1.tolist()) == list(range(H)) and set(s1.tolist()) == {-1.0, 1.0}


def links(rotation: str, rounding: str):
    from peer.pipeline.transform_link import TransformLinks

    mask = MaskConfig(
        scheme="transform", grad_bits=1.0, grad_rounding=rounding, grad_rotation=rotation, grad_outliers=0.0
    )
    return TransformLinks(mask, H, False, True), TransformLinks(mask, H, True, False)


def mean_of_messages(rotation: str, rounding: str, x: torch.Tensor, n: int = 48) -> torch.Tensor:
    """The same gradient sent as `n` messages (micro-batches 0..n-1), decoded and averaged."""
    producer, consumer = links(rotation, rounding)
    got = []
    for mb in range(n):
        payload, coder = producer.encode("backward", x, "stage0.r0", boundary=0, step=5, micro_batch=mb)
        msg = pb.GradientChunk(
            header=pb.MicroBatchHeader(sender="stage1.r0", step=5, micro_batch_id=mb, boundary=0),
            grad=payload,
            coder=coder,
        )
        got.append(consumer.decode(msg, expect_shape=tuple(x.shape), boundary=0, step=5, micro_batch=mb))
    return torch.stack(got).mean(0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def test_a_per_message_rotation_turns_the_coding_s_bias_into_noise_that_averages_out() -> None:
    """Nearest rounding at 1 bit through one fixed rotation makes the same error in every message;
    with each message's own signed permutation the errors differ, and their mean falls towards a
    multiple of the gradient (here: 48 messages): what is left is a uniform shrink, 1 - MSE of a
    unit Gaussian at 1 bit (a Lloyd quantiser's error is orthogonal to its output)."""
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(3)) * torch.rand(
        2, 8, 1, generator=torch.Generator().manual_seed(4)
    )
    fixed = mean_of_messages("fixed", "nearest", x)
    message = mean_of_messages("message", "nearest", x)

    def off_scale(m: torch.Tensor) -> float:  # the error left after the best uniform scale
        a = float((m * x).sum() / x.pow(2).sum())
        return float((m / a - x).pow(2).sum() / x.pow(2).sum())

    assert off_scale(message) < 0.25 * off_scale(fixed), (off_scale(message), off_scale(fixed))
    assert float((message * x).sum() / x.pow(2).sum()) == pytest.approx(1 - MSE[1], abs=0.05)
    dithered = mean_of_messages("message", "dither", x)  # dither still works beside it
    assert off_scale(dithered) < 0.25 * off_scale(fixed) and math.isfinite(off_scale(dithered))


def test_the_new_gradient_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="codec.transform.grad_rotation"):
        MaskConfig(scheme="transform", grad_rotation="random")
    with pytest.raises(ConfigError, match="codec.transform.grad_rounding"):
        MaskConfig(scheme="transform", grad_rounding="floor")
    MaskConfig(scheme="transform", grad_rounding="nearest", grad_rotation="message")


def test_a_rotation_per_message_pushes_no_direction_the_gradient_lacks() -> None:
    """Stage 0 of the tiny model at lr 2e-3 grew a vector common to all its output rows without
    bound: at 1 bit the dither clips each rotated component to +-0.8 sigma, and through one fixed
    rotation that clip's bias is the same function of the gradient in every message, so along
    some direction the gradient lacks it adds up over steps (the next stage's RMSNorm leaves that
    direction nearly free). Here: rows orthogonal to the direction `u` in which the fixed rotation
    biases them most; with a rotation drawn per message the mean decoded gradient of 48 messages
    must not point along `u` (a row's expected decode is then a multiple of it)."""
    from peer.codec.grad_coder import run_rotation
    from peer.codec.transform import STEP

    cfg = MaskConfig(grad_outliers=0.0)
    q, scale = run_rotation(H, cfg.seed)
    rotation = q.float().double() * scale.double()
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rows = x.reshape(-1, H)
    # the direction in which the fixed rotation's clip biases these rows, the rows made orthogonal to it
    for _ in range(20):
        gain = rows.pow(2).mean(1, keepdim=True).sqrt()
        bias = (gain * ((rows / gain @ rotation).clamp(-STEP[1] / 2, STEP[1] / 2) @ rotation.T) - rows).sum(0)
        u = bias / bias.norm()
        rows = rows - (rows @ u)[:, None] * u
    x = rows.reshape(x.shape).float()
    u = u.float()
    spread = float(x.reshape(-1, H).norm(dim=1).sum()) / math.sqrt(H)  # a row's typical component, summed over rows

    def along(rotation: str) -> float:
        return float((mean_of_messages(rotation, cfg.grad_rounding, x).reshape(-1, H) @ u).sum())

    assert along("fixed") > 0.2 * spread  # the push a fixed rotation adds up (measured 0.28)
    assert abs(along("message")) < 0.05 * spread, (along("message"), spread)  # measured 0.008
