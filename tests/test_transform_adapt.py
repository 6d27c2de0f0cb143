"""mask.adapt with the transform coder: a slow link gets fewer bits per row, the receiver derives
their split from the number alone, and refuses any budget it would not send itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peer.codec import transform_wire as tw
from peer.codec.transform import grid_bits, row_budget
from peer.config import MaskConfig, OptimConfig, TrainConfig
from peer.errors import WireError
from peer.model.loading import load_causal_lm
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.transform_link import TransformLinks
from peer.pipeline.transport import LocalTransport
from peer.wire import anchormesh_pb2 as pb
from tests.test_runner import MODEL, PIPE, windows
from tests.test_transform_codec import H, correlated, learner_state

H_TOY = MODEL.hidden_size  # one bit per value: the gradients' floor
KEY = dict(boundary=0, step=3, micro_batch=1)


class SlowLinks(LocalTransport):
    """In-process queues that report a measured link rate (bytes/s) per (destination stage, channel)."""

    def __init__(self, bps: dict[tuple[int, str], float]) -> None:
        super().__init__()
        self.bps = bps
        self.row_bits: dict[tuple[int, str], set[int]] = {}  # what the coded messages carried

    def link_bps(self, dst, channel):
        return self.bps.get((dst[0], channel))

    def send(self, src, dst, channel, data) -> None:
        msg = (pb.ActivationChunk if channel == "forward" else pb.GradientChunk).FromString(data)
        payload = msg.hidden if channel == "forward" else msg.grad
        if payload.compression.kind == pb.Compression.TRANSFORM:
            self.row_bits.setdefault((dst[0], channel), set()).add(payload.compression.row_bits)
        super().send(src, dst, channel, data)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def test_a_smaller_budget_keeps_the_coder_and_both_ends_split_it_alike() -> None:
    state = learner_state(bits=2.0)
    received = tw.coder_from_proto(tw.coder_to_proto(state), H, row_budget(2.0, H))
    for row_bits in (H, grid_bits(1.5 * H, H), grid_bits(1.875 * H, H)):
        mine, theirs = state.at_budget(row_bits), received.at_budget(row_bits)
        assert int(mine.bits.sum()) == row_bits and int(mine.bits.min()) >= 1
        assert torch.equal(mine.bits, theirs.bits)  # from the stds as they travel: no coder ships again
        assert torch.equal(mine.rotation_q, state.rotation_q) and mine.version == state.version
        assert mine is state.at_budget(row_bits)  # kept per budget
    assert state.at_budget(2 * H) is state
    assert grid_bits(1.5 * H - 1, H) == grid_bits(1.375 * H, H) < 1.5 * H  # down to the grid


def test_fewer_bits_cost_fewer_bytes_and_more_error_and_decode_where_the_receiver_accepts_them() -> None:
    state = learner_state(bits=2.0)
    x = correlated(6, seed=5)
    errors, sizes = [], []
    for row_bits in (2 * H, grid_bits(1.5 * H, H), H):
        msg = tw.encode(state, x, sink=1, stochastic=False, row_bits=row_bits, **KEY)
        assert msg.compression.row_bits == (0 if row_bits == 2 * H else row_bits)
        out = tw.decode(msg, state, expect_shape=tuple(x.shape), sink=1, min_row_bits=H, **KEY)
        errors.append(_rel(out[:, 1:], x[:, 1:]))
        sizes.append(len(msg.payload))
    assert sizes[0] > sizes[1] > sizes[2]
    assert errors[0] < errors[1] < errors[2] < 0.5, errors


@pytest.mark.parametrize(
    "row_bits, floor, match",
    [
        (72, None, r"row_bits=72: .*none \(this run does not adapt"),  # the receiver does not adapt
        (48, 60, r"row_bits=48: .*in \[60, 96\)"),  # below its floor
        (73, 48, r"row_bits=73: .*multiples of 48/8"),  # off the grid
        (102, 48, r"row_bits=102: .*in \[48, 96\)"),  # above the coder's own bits
    ],
)
def test_a_budget_the_receiver_would_not_send_is_refused(row_bits: int, floor: int | None, match: str) -> None:
    state = learner_state(bits=2.0)
    x = correlated(2, seed=6)
    msg = tw.encode(state, x, sink=1, stochastic=False, **KEY)
    msg.compression.row_bits = row_bits
    with pytest.raises(WireError, match=match):
        tw.check(msg, state, expect_shape=tuple(x.shape), sink=1, min_row_bits=floor, **KEY)
    with pytest.raises(WireError, match=match):
        tw.decode(msg, state, expect_shape=tuple(x.shape), sink=1, min_row_bits=floor, **KEY)


def test_the_floor_is_min_keep_on_the_grid_and_grad_min_bits_for_gradients() -> None:
    links = TransformLinks(MaskConfig(scheme="transform", bits=3.0, grad_bits=1.0, min_keep=0.6), H, True, True)
    assert links.min_row_bits("forward") == 90  # 0.6 of 144 bits is 86.4: up to the grid of H/8 = 6 bits
    assert (
        links.min_row_bits("backward") is None
    )  # 1-bit gradients at the default floor (grad_min_bits 1) cannot send fewer
    low = TransformLinks(
        MaskConfig(scheme="transform", bits=3.0, grad_bits=1.0, min_keep=0.6, grad_min_bits=0.125), H, True, True
    )
    assert low.min_row_bits("backward") == 30  # 0.6 of 48 is 28.8: min_keep rules once grad_min_bits allows it
    both = TransformLinks(MaskConfig(scheme="transform", bits=2.0, grad_bits=2.0, min_keep=0.25), H, True, True)
    assert (both.min_row_bits("forward"), both.min_row_bits("backward")) == (
        H // 2,
        H,
    )  # activations to half a bit per value, gradients to one
    assert (
        TransformLinks(
            MaskConfig(scheme="transform", bits=2.0, grad_bits=2.0, min_keep=0.1, grad_min_bits=0.3), H, True, True
        ).min_row_bits("backward")
        == 18
    )  # 0.3 up to the grid (0.375) above min_keep's 0.2 (0.25)
    assert (
        TransformLinks(MaskConfig(scheme="transform", bits=2.0, min_keep=0.01), H, True, False).min_row_bits("forward")
        == H // 8
    )  # one grid step
    assert (
        TransformLinks(MaskConfig(scheme="transform", bits=2.0, adapt=False), H, True, False).min_row_bits("forward")
        is None
    )


def test_below_a_bit_per_value_the_weakest_components_go_unsent_and_decode_to_their_mean() -> None:
    state = learner_state(bits=2.0)
    half = state.at_budget(H // 2)
    assert int(half.bits.sum()) == H // 2 and int((half.bits == 0).sum()) > 0
    assert float(state.std[half.bits == 0].max()) <= float(state.std[half.bits > 0].min())  # the weakest ones
    x = correlated(6, seed=7)
    fwd = dict(
        KEY, channel="forward", msg_stats=True
    )  # activations: below a bit per value the same weakest components every message
    msg = tw.encode(state, x, sink=1, stochastic=False, row_bits=H // 2, **fwd)
    out = tw.decode(msg, state, expect_shape=tuple(x.shape), sink=1, min_row_bits=H // 2, **fwd)
    full = tw.decode(
        tw.encode(state, x, sink=1, stochastic=False, **fwd), state, expect_shape=tuple(x.shape), sink=1, **fwd
    )
    assert _rel(full[:, 1:], x[:, 1:]) < _rel(out[:, 1:], x[:, 1:]) < 0.5
    # an unsent component decodes to the message's own mean of it
    rows = out[:, 1:].reshape(-1, H) - state.mean
    z = (rows / rows.pow(2).mean(1, keepdim=True).sqrt()) @ state.rotation
    gone = (half.bits == 0).nonzero().flatten()
    assert float(z[:, gone].std(0).max()) < 0.05 * float(z[:, half.bits > 0].std(0).min())


def test_a_slow_link_sends_fewer_bits_both_ways_and_the_pipeline_still_learns() -> None:
    """Three stages, 2-bit activations and gradients: the links into stage 1 (forward) and into
    stage 0 (backward) are slow, the one into stage 2 fast. The slow ones drop to their floors
    (half a bit per value each way), the fast one keeps two, every message decodes, and the loss falls."""
    model = MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3, "num_layers": 3})
    mask = MaskConfig(
        scheme="transform",
        bits=2.0,
        grad_bits=2.0,
        grad_outliers=0.0,
        basis_refresh=4,
        min_keep=0.25,
        grad_min_bits=0.5,
    )
    cfg = TrainConfig(model=model, pipeline=PIPE, steps=12, optim=OptimConfig(lr=3e-3), mask=mask)
    links = SlowLinks({(1, "forward"): 1.0, (0, "backward"): 1.0, (2, "forward"): 1e12, (1, "backward"): 1e12})
    runner = LocalPipelineRunner(cfg, load_causal_lm(model, seed=3), windows, transport=links)
    losses = [r.loss for r in runner.run(12)]
    runner.close()
    s0, s1, s2 = (runner.workers[k][0] for k in range(3))
    assert s0.keep_sent == {(1, 0): 0.25}  # min_keep of 2 bits per value: the activations' floor
    assert s1.keep_sent == {(2, 0): 1.0, (0, 0): 0.25}  # forward fast, backward slow: at the floor
    assert s2.keep_sent == {(1, 0): 1.0}  # its gradients into stage 1: a fast link
    # what the receivers decoded: the run's bits (0) until the first step timed the compute, then the floor
    assert links.row_bits == {
        (1, "forward"): {0, H_TOY // 2},
        (0, "backward"): {0, H_TOY // 2},
        (2, "forward"): {0},
        (1, "backward"): {0},
    }
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_a_fast_link_sends_the_run_s_bits_even_off_the_grid() -> None:
    """mask.bits 2.3 (110 bits a row at H=48, not a multiple of 6): a link that carries it all
    sends all of it, one that does not takes the grid below."""
    from peer.model.placement import CPU_FP32
    from peer.pipeline.codecs.transform import TransformLink
    from peer.pipeline.linktune import ComputeClock

    mask = MaskConfig(scheme="transform", bits=2.3, min_keep=0.25)
    clock = ComputeClock()
    clock.per_micro_batch = 1.0
    stage0 = SimpleNamespace(index=0, is_last=False, hidden_size=H, vocab_size=256)
    link = TransformLink(mask, stage0, CPU_FP32, SlowLinks({(1, "forward"): 1e12, (2, "forward"): 20.0}), clock)
    assert link.row_bits_for((1, 0), "forward", (2, 9, H), 0) == 110
    assert (
        link.row_bits_for((2, 0), "forward", (2, 9, H), 0) == 30
    )  # 20 B/s carries nothing: the floor, 0.25 of 110 up to the grid
    assert link.keep_sent == {(1, 0): 1.0, (2, 0): 30 / 110}


def test_gradients_that_cannot_adapt_leave_the_keep_alone() -> None:
    """1-bit gradients at the default floor have nothing to give: status's pp_keep of the last
    stage stays null rather than a 1 that no link could lower."""
    from peer.model.placement import CPU_FP32
    from peer.pipeline.codecs.transform import TransformLink
    from peer.pipeline.linktune import ComputeClock

    mask = MaskConfig(scheme="transform", min_keep=0.25)
    last = SimpleNamespace(index=1, is_last=True, hidden_size=H, vocab_size=256)
    link = TransformLink(mask, last, CPU_FP32, SlowLinks({(0, "backward"): 20.0}), ComputeClock())
    assert link.row_bits_for((0, 0), "backward", (2, 9, H), 0) == H
    assert link.keep_sent == {}


def test_a_gradient_floor_off_the_grid_or_below_a_bit_with_row_rates_is_refused() -> None:
    from peer.errors import ConfigError

    for bad in (0.1, 9.0):
        with pytest.raises(ConfigError, match="codec.transform.grad_min_bits"):
            MaskConfig(scheme="transform", grad_min_bits=bad)
    with pytest.raises(ConfigError, match='grad_rates = "row"'):
        MaskConfig(scheme="transform", grad_rates="row", grad_min_bits=0.5)


def test_a_gradient_below_a_bit_per_value_leaves_out_other_directions_every_message() -> None:
    """1-bit gradients at a quarter of a bit per value: each message keeps a quarter of the
    rotation's components, but of its own signed permutation of the coordinates, so over many
    messages no direction is always missing (the fixed rotation alone would drop the same
    three quarters every time: a bias no number of steps averages out)."""
    from peer.codec.grad_coder import random_coder

    state = random_coder(H, H, seed=5)
    x = correlated(4, seed=3)
    quarter = H // 4
    sums = {"shuffled": torch.zeros_like(x), "fixed": torch.zeros_like(x)}
    for mb in range(300):
        key = dict(boundary=0, step=1, micro_batch=mb)
        msg = tw.encode(state, x, sink=0, stochastic=False, dither=True, row_bits=quarter, **key)
        sums["shuffled"] += tw.decode(
            msg, state, expect_shape=tuple(x.shape), sink=0, dither=True, min_row_bits=quarter, **key
        )
        seed = tw._rounding_seed(0, 1, mb)  # the same budget without the permutation: TransformState's own path
        low = state.at_budget(quarter)
        sums["fixed"] += low.decode(low.encode(x, 0, dither_seed=seed), *x.shape[:2], 0, dither_seed=seed)
    cos = {
        k: float(torch.nn.functional.cosine_similarity(v.reshape(-1, H), x.reshape(-1, H)).min())
        for k, v in sums.items()
    }
    assert cos["shuffled"] > 0.97 and cos["fixed"] < 0.7, cos  # sqrt(1/4) of a row's energy survives a fixed projection
    # and the receiver refuses a gradient budget below the floor, as for activations
    msg = tw.encode(state, x, sink=0, stochastic=False, dither=True, row_bits=H // 8, boundary=0, step=1, micro_batch=0)
    with pytest.raises(WireError, match="Compression.row_bits"):
        tw.decode(
            msg,
            state,
            expect_shape=tuple(x.shape),
            sink=0,
            dither=True,
            min_row_bits=quarter,
            boundary=0,
            step=1,
            micro_batch=0,
        )
