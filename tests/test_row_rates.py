"""Per-row rates for the gradients (peer/codec/row_rates.py, mask.grad_rates = "row"): the
allocation keeps the message's bits, spends them where rows are large, cuts the error of uneven
rows, decodes alike on both ends of a link, and every malformed payload is refused."""

from __future__ import annotations

import math

import pytest
import torch

from peer.codec import row_rates as rr
from peer.codec.bitpack import pack
from peer.codec.grad_coder import random_coder
from peer.codec.transform import row_budget
from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.errors import ConfigError, WireError
from peer.model.loading import load_causal_lm
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.transform_link import TransformLinks
from peer.wire import anchormesh_pb2 as pb

H = 64


def uneven(rows: int, seed: int = 0) -> torch.Tensor:
    """[1, rows, H] rows whose norms spread over two orders of magnitude (as a gradient's do)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, rows, H, generator=g) * torch.rand(1, rows, 1, generator=g) ** 3 * 5


def test_the_allocation_keeps_the_budget_and_gives_larger_rows_more_bits() -> None:
    energy = torch.rand(500, generator=torch.Generator().manual_seed(1)) ** 4
    classes = rr.allocate_rows(energy, H, row_budget(1.0, H))
    bits = rr.class_bits(H)
    assert float(bits[classes].sum()) <= 500 * H
    assert float(bits[classes].sum()) > 0.9 * 500 * H  # the budget is spent, not hoarded
    order = energy.argsort()
    assert bool((classes[order].diff() >= 0).all())  # a larger row never gets a smaller rate
    assert int(classes.min()) < 3 < int(classes.max())  # uneven rows: below and above 1 bit
    even = rr.allocate_rows(torch.ones(500), H, row_budget(1.0, H))
    assert bool((even == 3).all())  # equal rows: every one at 1 bit, as the even coder
    assert bool((rr.allocate_rows(torch.zeros(7), H, H) == 0).all())  # all-zero rows: the fewest bits
    assert rr.allocate_rows(torch.zeros(0), H, H).shape == (0,)


def test_the_classes_form_a_convex_rate_distortion_curve() -> None:
    """Why the Lagrangian choice is optimal: each extra bit buys less than the one before."""
    bits, dist = rr.class_bits(576), rr.distortion(576)
    slopes = (dist.diff() / bits.diff()).tolist()
    assert all(s < 0 for s in slopes) and slopes == sorted(slopes)


def test_rates_per_row_cut_the_error_of_uneven_rows_at_the_same_bytes() -> None:
    state = random_coder(H, row_budget(1.0, H), seed=3, step_scale=1.0)
    x = uneven(600)

    def rel(d: torch.Tensor) -> float:
        return float(((d - x) ** 2).sum() / (x**2).sum())

    even = state.encode(x, 0, dither_seed=5)
    rows = state.encode(x, 0, dither_seed=5, row_rates=True)
    assert len(rows) <= state.payload_bytes(1, 600, 0, row_rates=True)
    codes = len(rows) - 2 * 600 - math.ceil(600 * rr.CLASS_BITS / 8)
    assert codes <= len(even) - 2 * 600 + len(rr.CLASSES)  # no more code bytes than the even coder
    e_even = rel(state.decode(even, 1, 600, 0, dither_seed=5))
    e_rows = rel(state.decode(rows, 1, 600, 0, dither_seed=5, row_rates=True))
    assert e_rows < 0.6 * e_even, (e_rows, e_even)
    assert (
        rel(state.decode(rows, 1, 600, 0, dither_seed=6, row_rates=True)) > 1.5 * e_rows
    )  # the seed is part of the code
    # errors average out over draws (the kept components and offsets are new each message)
    small = x[:, :40]
    mean = torch.stack(
        [
            state.decode(state.encode(small, 0, dither_seed=i, row_rates=True), 1, 40, 0, dither_seed=i, row_rates=True)
            for i in range(100)
        ]
    ).mean(0)
    one = state.decode(state.encode(small, 0, dither_seed=0, row_rates=True), 1, 40, 0, dither_seed=0, row_rates=True)
    assert float(((mean - small) ** 2).sum()) < 0.5 * float(((one - small) ** 2).sum())


def test_kept_components_are_fixed_by_seed_and_row_and_ascending() -> None:
    idx = torch.tensor([0, 5, 9])
    cols = rr._columns(123, idx, 576, 72)
    assert cols.shape == (3, 72) and bool((cols.diff(dim=1) > 0).all())
    assert torch.equal(
        cols[1], rr._columns(123, torch.tensor([5]), 576, 72)[0]
    )  # a row's set does not depend on the others
    assert not torch.equal(cols, rr._columns(124, idx, 576, 72))
    hits = torch.bincount(rr._columns(7, torch.arange(4000), 576, 144).flatten(), minlength=576).double()
    assert (
        abs(float(hits.mean()) / 4000 - 0.25) < 1e-9 and float(hits.std() / hits.mean()) < 0.1
    )  # each component about equally often


def test_both_ends_read_the_row_rates_from_the_run_and_a_run_trains() -> None:
    mask = MaskConfig(scheme="transform", grad_bits=1.0, grad_rates="row")
    producer, consumer = TransformLinks(mask, 32, False, True), TransformLinks(mask, 32, True, False)
    assert producer.row_rates("backward") and not producer.row_rates("forward")
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2)) * torch.rand(4, 16, 1) ** 2
    payload, coder = producer.encode("backward", x, "stage0.r0", boundary=0, step=3, micro_batch=1)
    msg = pb.GradientChunk(
        header=pb.MicroBatchHeader(sender="stage1.r0", step=3, micro_batch_id=1, boundary=0), grad=payload, coder=coder
    )
    consumer.check(msg, expect_shape=(4, 16, 32), boundary=0, step=3, micro_batch=1)
    got = consumer.decode(msg, expect_shape=(4, 16, 32), boundary=0, step=3, micro_batch=1)
    assert float(((got - x) ** 2).sum() / (x**2).sum()) < 0.6
    even = TransformLinks(MaskConfig(scheme="transform", grad_bits=1.0), 32, True, False)
    with pytest.raises(WireError, match="payload"):  # an end that codes rows evenly cannot read it
        even.decode(msg, expect_shape=(4, 16, 32), boundary=0, step=3, micro_batch=1)

    model = ModelConfig(name="tiny-llama", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)

    def windows(step: int, replica: int, j: int) -> torch.Tensor:  # counting sequences: learnable in a few steps
        start = torch.randint(0, 256, (4, 1), generator=torch.Generator().manual_seed(10 * step + j))
        return (start + torch.arange(17)) % 256

    cfg = TrainConfig(
        model=model,
        pipeline=PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=16, max_staleness=0),
        optim=OptimConfig(lr=1e-2),
        steps=8,
        mask=mask,
    )
    runner = LocalPipelineRunner(cfg, load_causal_lm(model, seed=0), windows)
    losses = [r.loss for r in runner.run(8)]
    runner.close()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_a_malformed_row_rate_payload_is_refused() -> None:
    state = random_coder(H, row_budget(1.0, H), seed=3, step_scale=1.0)
    x = uneven(40)
    payload = state.encode(x, 0, dither_seed=5, row_rates=True)
    with pytest.raises(WireError, match="bytes, expected"):
        state.check(payload[:-1], 1, 40, 0, row_rates=True)
    with pytest.raises(WireError, match="bytes, expected"):
        state.check(payload[:10], 1, 40, 0, row_rates=True)  # too short to hold the classes
    greedy = bytearray(payload)  # every row claims 5 bits: five times the run's budget
    classes = pack(torch.full((40,), 7), rr.CLASS_BITS)
    greedy[80 : 80 + len(classes)] = classes
    with pytest.raises(WireError, match="more than 64 per row"):
        state.check(bytes(greedy), 1, 40, 0, row_rates=True)
    nan = bytearray(payload)
    nan[0:2] = b"\xc0\x7f"  # the first gain: bf16 NaN
    with pytest.raises(WireError, match="gain"):
        state.decode(bytes(nan), 1, 40, 0, dither_seed=5, row_rates=True)
    huge = bytearray(payload)
    huge[0:2] = b"\x7f\x7f"  # a finite gain that decodes past float32
    with pytest.raises(WireError, match="not finite"):
        state.decode(bytes(huge), 1, 40, 0, dither_seed=5, row_rates=True)
    with pytest.raises(ValueError, match="dither_seed"):
        state.encode(x, 0, row_rates=True)
    with pytest.raises(ConfigError, match="codec.transform.grad_rates"):
        MaskConfig(scheme="transform", grad_rates="row", grad_rounding="stochastic")
    with pytest.raises(ConfigError, match="codec.transform.grad_rates"):
        MaskConfig(scheme="transform", grad_rates="rows")
