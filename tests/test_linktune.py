"""Per-link codec tuning: the meter, the rule, and a pipeline whose slow link sends fewer coefficients."""

from __future__ import annotations

import math
import random

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


def drive(meter: LinkMeter, bw, answer, T: float = 0.5, full: float = 200_000, n: int = 80, in_flight: int = 4) -> list[tuple[float, float | None]]:
    """A stage on a fake clock: every T seconds it sends `keep_fraction` of `full` bytes (at most
    `in_flight` unacknowledged, as a pipeline's micro-batches) over a link of `bw` (or `bw(k)`) bytes/s, one
    message after another; `answer(k, delivered, last_ack)` is when message k's ack arrives.
    Returns (kept fraction, meter's reading) per message."""
    pending: list[float] = []
    acks: list[float] = []
    out = []
    t = drained = 0.0
    for k in range(n):
        if len(acks) >= in_flight:
            t = max(t, acks[-in_flight])
        while pending and pending[0] <= t:
            meter.acked(now=pending.pop(0))
        f = keep_fraction(full, 0, meter.bps(now=t), T, 0.8, 0.125)
        meter.sent(int(f * full), now=t)
        drained = max(t, drained) + f * full / (bw(k) if callable(bw) else bw)
        acks.append(max(answer(k, drained, acks[-1] if acks else 0.0), acks[-1] if acks else 0.0))
        pending.append(acks[-1])
        out.append((f, meter.bps(now=t)))
        t += T
    return out


BW = 250_000  # 2 Mbit/s
FIT = 0.8 * BW * 0.5 / 200_000  # the fraction of the payload a 2 Mbit/s link carries in 0.8 of 0.5 s


@pytest.mark.parametrize("receiver,answer", [
    ("fast", lambda k, delivered, last: delivered + 0.002),
    ("acks 200 ms late", lambda k, delivered, last: delivered + 0.2),
    # one message at a time, 50-250 ms each
    ("slow to answer", lambda k, delivered, last: max(delivered, last) + 0.05 + 0.2 * random.Random(k).random()),
])
def test_meter_reads_the_link_not_the_answer_and_the_bits_do_not_run_down(receiver: str, answer) -> None:
    """The payload starts at twice what the link carries, so messages back up and the meter
    learns the link; then the tuner fits it, every message goes out alone, and only the round
    trip is left to see. A meter that counted the round trip as link time would cut again and
    again (the old one fell to 0.72 of the link within 30 s with acks 200 ms late)."""
    out = drive(LinkMeter(), BW, answer)
    for f, bps in out[20:]:
        assert bps == pytest.approx(BW, rel=0.1), (receiver, out)
        assert f == pytest.approx(FIT, rel=0.1), (receiver, out)


def test_meter_follows_a_link_that_slows_and_skips_one_that_keeps_up() -> None:
    """At 20 s the link halves: the messages back up again and the meter reads the new rate
    within two windows. A link that carries everything sent never backs up: no estimate, full payload."""
    out = drive(LinkMeter(), lambda k: BW if k < 40 else BW / 2, lambda k, delivered, last: delivered + 0.2, n=100)
    assert out[39][1] == pytest.approx(BW, rel=0.05)
    # the round trip, learnt at the old rate, reads a little high
    assert out[-1][1] == pytest.approx(BW / 2, rel=0.2) and out[-1][0] == pytest.approx(FIT / 2, rel=0.2)
    idle = drive(LinkMeter(), BW, lambda k, delivered, last: delivered + 0.2, full=50_000, n=40)
    assert all(bps is None and f == 1.0 for f, bps in idle)


def test_back_to_back_messages_give_a_lower_bound_that_tightens_as_the_round_trip_is_learned() -> None:
    """Four messages queued at once on a link that delivers 1000 bytes every 0.1 s, acked `late`
    after: bytes over send-to-ack, less the round trip known so far, never more than the rate.
    Each lone message after a burst measures the round trip (less the time its bytes took at the
    estimate); from CONFIRM of them on, the next burst's bound is tighter."""
    for late in (0.0, 0.2, 1.0):
        m, t = LinkMeter(), 0.0
        for burst in range(12):
            for i in range(4):
                m.sent(1000, now=t)
            assert burst or m.bps(now=t) is None  # nothing acked yet
            for i in range(4):
                m.acked(now=t + 0.1 * (i + 1) + late)
            assert burst or m.bps(now=t + 0.5 + late) == pytest.approx(4000 / (0.4 + late))  # round trip unknown
            assert m.backlog() == 0
            t += 1 + late
            m.sent(1000, now=t)  # alone on the stream
            m.acked(now=t + 0.1 + late)
            t += 1 + late
        assert 0.96 * 10_000 <= m.bps(now=t) <= 10_000 + 1e-6, late
        assert m.rtt(now=t) == pytest.approx(late, abs=0.02), late
        assert m.pipe(now=t) == 1 + math.ceil(m.bps(now=t) * m.rtt(now=t) / 1000 - 1e-9)


def test_two_micro_batches_a_step_are_enough_to_measure_a_slow_link() -> None:
    """A stage with `pipeline.micro_batches = 2` sends two messages, then waits for their
    gradients: each step's pair is a run the link was busy for."""
    m = LinkMeter()
    for step in range(3):
        t = 10.0 * step
        m.sent(1000, now=t)
        m.sent(1000, now=t + 0.01)
        m.acked(now=t + 1.0)
        m.acked(now=t + 2.0)  # 1000 bytes/s
    assert m.bps(now=25.0) == pytest.approx(1000, rel=0.01)


def test_a_stalled_link_holds_its_estimate_and_says_why() -> None:
    m = LinkMeter(bw_window_s=5.0)
    for i in range(4):
        m.sent(1000, now=0.0)
    for i in range(4):
        m.acked(now=0.1 * (i + 1))
    for t in (1.0, 2.0, 3.0):
        m.sent(1000, now=t)  # never acknowledged
    assert m.bps(now=100.0) == pytest.approx(10_000)  # the window is long past: the last estimate holds
    assert m.held(now=100.0) == "no ack for 99 s (3 messages in flight)"
    assert m.waiting(now=100.0) == (3, 99.0)
    m.lost(3)
    m.acked(now=101.0)  # an ack for a message the broken stream lost: nothing to take
    assert m.held(now=101.0) == "an ack for no message in flight: ignored" and m.bps(now=101.0) == pytest.approx(10_000)


def test_acks_twice_or_out_of_order_give_no_sample() -> None:
    m = LinkMeter()
    for key in range(5):
        m.sent(1000, now=0.0, key=key)
    m.acked(now=0.1, key=0)
    m.acked(now=0.2, key=2)  # before 1
    assert m.held(now=0.2) == "an ack out of order: sample dropped"
    m.acked(now=0.3, key=2)  # twice
    assert m.held(now=0.3) == "an ack for no message in flight: ignored"
    assert m.waiting(now=0.3)[0] == 3 and m.bps(now=0.3) is None
    for i, key in enumerate((1, 3, 4)):
        m.acked(now=0.4 + 0.1 * i, key=key)
    assert m.held(now=0.6) == "" and m.bps(now=1.0) == pytest.approx(3000 / 0.6)  # 1, 3, 4: sent at 0, the link busy with 0 and 2 first


def test_a_clock_that_steps_back_or_stands_still_gives_no_rate() -> None:
    m = LinkMeter()
    for i in range(4):
        m.sent(1000, now=10.0)
    for i in range(4):
        m.acked(now=9.0 + 0.1 * i)  # before they were sent: the clock stepped back
        assert m.held(now=9.5) == "the clock went backwards: sample dropped"
    for i in range(4):
        m.sent(1000, now=20.0)
    for i in range(4):
        m.acked(now=20.0)  # at the instant they were sent
    assert m.bps(now=20.0) is None and m.held(now=20.0) == "acks at their messages' send time: sample dropped"
    for i in range(4):
        m.sent(1000, now=30.0)
    for i in range(4):
        m.acked(now=30.1 + 0.1 * i)
    assert m.bps(now=30.5) == pytest.approx(10_000) and m.held(now=30.5) == ""
    assert m.bps(now=5.0) == pytest.approx(10_000)  # read with an earlier clock: still the estimate, finite


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


@pytest.mark.parametrize("field,value", [("min_keep", 0.0), ("min_keep", 1.5), ("link_target", 0.0), ("link_target", 2.0)])
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
    cfg = TrainConfig(model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3, "num_layers": 3}), pipeline=PIPE, steps=12, optim=OptimConfig(lr=3e-3), mask=MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=4, min_keep=0.25))
    runner = LocalPipelineRunner(cfg, load_causal_lm(cfg.model, seed=3), windows, transport=SlowLinks({1: 1.0, 2: 1e12}))
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
    fixed = LocalPipelineRunner(TrainConfig(model=MODEL, pipeline=PIPE, mask=MaskConfig(scheme="lowrank", rank=8, adapt=False)), load_causal_lm(MODEL, seed=3), windows)
    with pytest.raises(WireError, match=r"k in \[8, 8\]"):  # not adapting: only the full rank
        fixed.workers[1][0].link.coef_shape(pb.TensorPayload(shape=[*ids.shape, 4]), ids)
    runner.close()
    fixed.close()


def test_the_mask_scheme_adapts_its_keep_fraction_per_link() -> None:
    """Mask scheme: the sender into the slow link masks with a higher drop on the 1/256 grid (down
    to min_keep of the configured keep), the fast link keeps the config's drop, the receiver
    rebuilds and masks the gradient back with the message's drop, and the loss falls."""
    cfg = TrainConfig(model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3, "num_layers": 3}), pipeline=PIPE, steps=12, optim=OptimConfig(lr=3e-3),
                      mask=MaskConfig(scheme="mask", drop=0.5, fill="prior_rescale", min_keep=0.25))
    runner = LocalPipelineRunner(cfg, load_causal_lm(cfg.model, seed=3), windows, transport=SlowLinks({1: 1.0, 2: 1e12}))
    losses = [r.loss for r in runner.run(12)]
    runner.close()
    s0, s1 = runner.workers[0][0], runner.workers[1][0]
    assert s0.keep_sent == {(1, 0): 0.25}  # 0.25 of keep 0.5: drop 1 - 32/256
    assert list(s0.link.codecs) == [1 - 32 / 256]
    assert s1.keep_sent == {(2, 0): 1.0}
    assert list(s1.link.codecs) == [1 - 32 / 256]  # the codec it received with (and masks the gradient back with), none to send
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

    status = {"peers": [
        {"id": "bed-peer3", "stage": 0, "state": "active"}, {"id": "bed-peer1", "stage": 0, "state": "active"},
        {"id": "bed-peer2", "stage": 1, "state": "idle"}, {"id": "bed-peer4", "stage": 1, "state": "active"},
        {"id": "bed-peer5", "stage": 1, "state": "dead"},
    ]}
    assert slow_hosts(status) == [3, 4]


def test_the_mixed_bench_runs_the_swarm_s_codec_or_the_low_rank_one_fixed_or_adapting() -> None:
    from peer.bench.mixed import mixed_config
    from peer.pipeline.transform_link import TransformLinks

    fixed, adaptive = (mixed_config(mode, 2, 70, 5)["mask"] for mode in ("fixed", "adaptive"))
    assert fixed["scheme"] == "transform" and not fixed["adapt"] and fixed["min_keep"] == 0.125
    assert MaskConfig(**fixed).grad_bits == MaskConfig().grad_bits == 1.0  # the recommended run's codec, not the tiny model's profile
    links = TransformLinks(MaskConfig(**adaptive), 128, True, True)
    assert links.min_row_bits("forward") == 32 and links.min_row_bits("backward") is None  # 2 bits down to a quarter bit per value; 1-bit gradients stay
    assert TransformLinks(MaskConfig(**fixed), 128, True, True).min_row_bits("forward") is None
    assert mixed_config("adaptive", 2, 70, 5, codec="lowrank")["mask"] == {"scheme": "lowrank", "rank": 64, "values": "int8", "adapt": True, "min_keep": 0.125}
    with pytest.raises(ConfigError, match="--codec"):
        mixed_config("fixed", 2, 70, 5, codec="mask")
    low = TransformLinks(MaskConfig(**mixed_config("adaptive", 2, 70, 5, grad_min_bits=0.125)["mask"]), 128, True, True)
    assert low.min_row_bits("backward") == 16  # --grad-min-bits 0.125: the 1-bit gradients down to min_keep's eighth
    with pytest.raises(ConfigError, match="--grad-min-bits"):
        mixed_config("adaptive", 2, 70, 5, codec="lowrank", grad_min_bits=0.5)
