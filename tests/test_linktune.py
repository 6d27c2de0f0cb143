"""Per-link codec tuning: the meter, the rule, and a pipeline whose slow link sends fewer coefficients."""

from __future__ import annotations

import pytest
import torch

from peer.config import MaskConfig, OptimConfig, TrainConfig
from peer.errors import ConfigError, WireError
from peer.model.loading import load_causal_lm
from peer.pipeline.linktune import ComputeClock, LinkMeter, coefficients, keep_fraction
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.transport import LocalTransport
from peer.wire import anchormesh_pb2 as pb
from tests.test_runner import MODEL, PIPE, windows


def test_meter_measures_back_to_back_messages_at_the_link_rate() -> None:
    m = LinkMeter(min_samples=3)
    for i in range(4):  # queued together at t=0; the link delivers 1000 bytes every 0.1 s
        m.sent(1000, now=0.0)
    assert m.bps() is None  # nothing acked yet
    for i in range(4):
        m.acked(now=0.1 * (i + 1))
    assert m.bps() == pytest.approx(10_000)
    assert m.backlog() == 0


def test_meter_takes_the_backlogged_rate_over_lone_messages_round_trips() -> None:
    m = LinkMeter(min_samples=2)
    for t in (0.0, 1.0, 2.0):  # lone messages: 0.01 s on the wire plus a 0.09 s round trip each
        m.sent(1000, now=t)
        m.acked(now=t + 0.1)
    assert m.bps() == pytest.approx(10_000)  # all it knows: a lower bound
    for i in range(3):  # three queued at once: acks 0.01 s apart, the link's own rate
        m.sent(1000, now=5.0)
    for i in range(3):
        m.acked(now=5.1 + 0.01 * i)
    assert m.bps() == pytest.approx(100_000)


def test_meter_counts_idle_time_out_and_forgets_lost_messages() -> None:
    m = LinkMeter(min_samples=2)
    m.sent(500, now=10.0)
    m.acked(now=10.05)  # 0.05 s of service: the link was idle before it
    m.sent(500, now=20.0)  # queued long after: the 10 s gap is not link time
    m.acked(now=20.05)
    assert m.bps() == pytest.approx(10_000)
    m.sent(100, now=30.0)
    m.sent(100, now=30.0)
    m.lost(1)  # a stream broke after taking one message: that one will never be acked
    assert m.backlog() == 100
    m.acked(now=30.01)
    assert m.backlog() == 0


def test_keep_fraction_fits_the_bytes_into_the_compute_time() -> None:
    # 1 MB/s link, 0.1 s of compute per micro-batch, target 0.8: 80 KB per micro-batch may travel
    assert keep_fraction(160_000, 0, 1e6, 0.1, 0.8, 0.1) == pytest.approx(0.5)
    assert keep_fraction(40_000, 0, 1e6, 0.1, 0.8, 0.1) == 1.0  # a fast link sends everything
    assert keep_fraction(10_000_000, 0, 1e6, 0.1, 0.8, 0.25) == 0.25  # bounded below by config
    assert keep_fraction(160_000, 40_000, 1e6, 0.1, 0.8, 0.1) == pytest.approx(0.25)  # fixed bytes come first
    assert keep_fraction(160_000, 0, None, 0.1, 0.8, 0.1) == 1.0  # not measured yet
    assert keep_fraction(160_000, 0, 1e6, None, 0.8, 0.1) == 1.0


def test_coefficients_round_down_within_the_configured_bounds() -> None:
    assert coefficients(20, 1.0, 0.25) == 20
    assert coefficients(20, 0.52, 0.25) == 10
    assert coefficients(20, 0.0, 0.25) == 5
    assert coefficients(3, 0.0, 0.1) == 1


def test_compute_clock_averages_seconds_per_micro_batch_over_steps() -> None:
    c = ComputeClock(alpha=0.5)
    c.step()
    assert c.per_micro_batch is None  # no micro-batch finished yet
    for _ in range(2):
        c.add(0.1)
        c.micro_batch_done()
    c.step()
    assert c.per_micro_batch == pytest.approx(0.1)
    c.add(0.6)
    c.micro_batch_done()
    c.micro_batch_done()
    c.step()
    assert c.per_micro_batch == pytest.approx(0.2)


@pytest.mark.parametrize(
    "field,value", [("min_keep", 0.0), ("min_keep", 1.5), ("link_target", 0.0), ("link_target", 2.0)]
)
def test_bad_bounds_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"codec.{field}"):
        MaskConfig(scheme="lowrank", **{field: value})


class SlowLinks(LocalTransport):
    """In-process queues that report a measured link rate (bytes/s) per destination stage."""

    def __init__(self, bps: dict[int, float]) -> None:
        super().__init__()
        self.bps = bps

    def link_bps(self, dst, channel):
        return self.bps.get(dst[0])


def test_a_slow_link_sends_fewer_coefficients_and_the_pipeline_still_learns() -> None:
    """Three stages: the link into stage 1 is slow, the one into stage 2 fast. The sender into
    stage 1 drops to the floor, the other keeps the full rank, every gradient fits its forward,
    and the loss falls as with fixed ranks."""
    cfg = TrainConfig(
        model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3, "num_layers": 3}),
        pipeline=PIPE,
        steps=12,
        optim=OptimConfig(lr=3e-3),
        mask=MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=4, min_keep=0.25),
    )
    runner = LocalPipelineRunner(
        cfg, load_causal_lm(cfg.model, seed=3), windows, transport=SlowLinks({1: 1.0, 2: 1e12})
    )
    losses = [r.loss for r in runner.run(12)]
    runner.close()
    s0, s1 = runner.workers[0][0], runner.workers[1][0]
    assert s0.keep_sent == {(1, 0): 2 / 8}  # ceil(0.25 * 8) = 2 coefficients: the floor
    assert s1.keep_sent == {(2, 0): 8 / 8}
    assert s0.compute.per_micro_batch is not None and s0.compute.per_micro_batch > 0
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_a_coefficient_count_outside_the_bounds_is_refused() -> None:
    cfg = TrainConfig(model=MODEL, pipeline=PIPE, mask=MaskConfig(scheme="lowrank", rank=8, min_keep=0.5))
    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows)
    w = runner.workers[1][0]
    ids = torch.zeros(PIPE.micro_batch_size, PIPE.seq_len, dtype=torch.long)
    for k in (3, 9):  # below ceil(0.5 * 8) = 4, above the rank
        with pytest.raises(WireError, match=r"k in \[4, 8\]"):
            w.link.coef_shape(pb.TensorPayload(shape=[*ids.shape, k]), ids)
    assert w.link.coef_shape(pb.TensorPayload(shape=[*ids.shape, 4]), ids) == (*ids.shape, 4)
    fixed = LocalPipelineRunner(
        TrainConfig(model=MODEL, pipeline=PIPE, mask=MaskConfig(scheme="lowrank", rank=8, adapt=False)),
        load_causal_lm(MODEL, seed=3),
        windows,
    )
    with pytest.raises(WireError, match=r"k in \[8, 8\]"):  # not adapting: only the full rank
        fixed.workers[1][0].link.coef_shape(pb.TensorPayload(shape=[*ids.shape, 4]), ids)
    runner.close()
    fixed.close()


def test_the_mask_scheme_adapts_its_keep_fraction_per_link() -> None:
    """Mask scheme: the sender into the slow link masks with a higher drop on the 1/256 grid (down
    to min_keep of the configured keep), the fast link keeps the config's drop, the receiver
    rebuilds and masks the gradient back with the message's drop, and the loss falls."""
    cfg = TrainConfig(
        model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3, "num_layers": 3}),
        pipeline=PIPE,
        steps=12,
        optim=OptimConfig(lr=3e-3),
        mask=MaskConfig(scheme="mask", drop=0.5, fill="prior_rescale", min_keep=0.25),
    )
    runner = LocalPipelineRunner(
        cfg, load_causal_lm(cfg.model, seed=3), windows, transport=SlowLinks({1: 1.0, 2: 1e12})
    )
    losses = [r.loss for r in runner.run(12)]
    runner.close()
    s0, s1 = runner.workers[0][0], runner.workers[1][0]
    assert s0.keep_sent == {(1, 0): 0.25}  # 0.25 of keep 0.5: drop 1 - 32/256
    assert list(s0.link.codecs) == [1 - 32 / 256]
    assert s1.keep_sent == {(2, 0): 1.0}
    assert list(s1.link.codecs) == [
        1 - 32 / 256
    ]  # the codec it received with (and masks the gradient back with), none to send
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_a_drop_off_the_grid_or_below_the_floor_is_refused() -> None:
    cfg = TrainConfig(model=MODEL, pipeline=PIPE, mask=MaskConfig(scheme="mask", drop=0.5, min_keep=0.25))
    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows)
    w = runner.workers[1][0]

    def payload(drop: float) -> pb.TensorPayload:
        return pb.TensorPayload(compression=pb.Compression(kind=pb.Compression.BERNOULLI_MASK, drop=drop))

    assert w.link.inbound_codec(payload(0.5)) is w.link.codec
    assert w.link.inbound_codec(payload(1 - 40 / 256)).cfg.drop == 1 - 40 / 256
    for drop in (1 - 31 / 256, 0.8001, 0.25):  # below the floor (keep 32/256), off the grid, under the config's drop
        with pytest.raises(WireError, match="Compression.drop"):
            w.link.inbound_codec(payload(drop))
    runner.close()


def test_the_mixed_bench_slows_the_second_peer_of_each_stage() -> None:
    from peer.bench.mixed import slow_hosts

    status = {
        "peers": [
            {"id": "bed-peer3", "stage": 0, "state": "active"},
            {"id": "bed-peer1", "stage": 0, "state": "active"},
            {"id": "bed-peer2", "stage": 1, "state": "idle"},
            {"id": "bed-peer4", "stage": 1, "state": "active"},
            {"id": "bed-peer5", "stage": 1, "state": "dead"},
        ]
    }
    assert slow_hosts(status) == [3, 4]


def test_the_mixed_bench_runs_the_swarm_s_codec_or_the_low_rank_one_fixed_or_adapting() -> None:
    from peer.bench.mixed import mixed_config
    from peer.pipeline.transform_link import TransformLinks

    fixed, adaptive = (mixed_config(mode, 2, 70, 5)["mask"] for mode in ("fixed", "adaptive"))
    assert fixed["scheme"] == "transform" and not fixed["adapt"] and fixed["min_keep"] == 0.125
    assert (
        MaskConfig(**fixed).grad_bits == MaskConfig().grad_bits == 1.0
    )  # the recommended run's codec, not the tiny model's profile
    links = TransformLinks(MaskConfig(**adaptive), 128, True, True)
    assert (
        links.min_row_bits("forward") == 32 and links.min_row_bits("backward") is None
    )  # 2 bits down to a quarter bit per value; 1-bit gradients stay
    assert TransformLinks(MaskConfig(**fixed), 128, True, True).min_row_bits("forward") is None
    assert mixed_config("adaptive", 2, 70, 5, codec="lowrank")["mask"] == {
        "scheme": "lowrank",
        "rank": 64,
        "values": "int8",
        "adapt": True,
        "min_keep": 0.125,
    }
    with pytest.raises(ConfigError, match="--codec"):
        mixed_config("fixed", 2, 70, 5, codec="mask")
    low = TransformLinks(MaskConfig(**mixed_config("adaptive", 2, 70, 5, grad_min_bits=0.125)["mask"]), 128, True, True)
    assert low.min_row_bits("backward") == 16  # --grad-min-bits 0.125: the 1-bit gradients down to min_keep's eighth
    with pytest.raises(ConfigError, match="--grad-min-bits"):
        mixed_config("adaptive", 2, 70, 5, codec="lowrank", grad_min_bits=0.5)
