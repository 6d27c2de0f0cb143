"""The transform coder (peer/codec/transform.py) and its wire form (transform_wire.py): packing,
bit allocation, reconstruction error, unbiased gradients, and every malformed input refused."""

from __future__ import annotations

import math

import pytest
import torch

from peer.codec import transform_wire as tw
from peer.codec.act_coder import TransformLearner
from peer.codec.bitpack import pack, packed_bytes, unpack
from peer.codec.grad_coder import FixedCoder, random_coder, run_rotation
from peer.codec.transform import MSE, allocate, row_budget
from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.errors import ConfigError, WireError
from peer.model.loading import load_causal_lm
from peer.pipeline.local import LocalPipelineRunner
from peer.wire import anchormesh_pb2 as pb

H = 48


def correlated(n: int, seq: int = 17, seed: int = 0) -> torch.Tensor:
    """[n, seq, H] rows with a decaying spectrum, an offset, and a huge first position (a sink)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(H, H, generator=torch.Generator().manual_seed(99)) * torch.logspace(0, -2, H)
    x = torch.randn(n, seq, H, generator=g) @ mix.T * 3 + 1
    x[:, 0] *= 300
    return x


def learner_state(bits: float = 3.0):
    learner = TransformLearner(H, bits, refresh=10)
    learner.observe(correlated(40, seed=1), sink=1)
    return learner.maybe_refresh(0)


@pytest.mark.parametrize("width", range(1, 9))
def test_pack_unpack_round_trip(width: int) -> None:
    codes = torch.randint(0, 2**width, (1001,), generator=torch.Generator().manual_seed(width))
    data = pack(codes, width)
    assert len(data) == packed_bytes(1001, width) == math.ceil(1001 * width / 8)
    assert torch.equal(unpack(data, width, 1001), codes)


def test_allocation_is_the_greedy_reverse_water_filling() -> None:
    var = torch.rand(40, generator=torch.Generator().manual_seed(0)) ** 4
    bits = allocate(var, 100)
    naive = torch.zeros(40, dtype=torch.long)  # one bit at a time, where it removes the most error
    for _ in range(100):
        gain = torch.tensor(
            [float(var[i]) * (MSE[int(b)] - MSE[min(int(b) + 1, 8)]) if b < 8 else -1.0 for i, b in enumerate(naive)]
        )
        naive[int(gain.argmax())] += 1
    assert int(bits.sum()) == 100
    assert torch.equal(bits, naive)
    assert int(bits[var.argmax()]) == int(bits.max())


def test_error_falls_with_bits_and_the_sink_travels_in_bf16() -> None:
    x = correlated(4)
    errs = []
    for bits in (1.0, 2.0, 3.0, 4.0):
        state = learner_state(bits)
        y = state.decode(state.encode(x, sink=1), 4, 17, sink=1)
        errs.append(float((y - x)[:, 1:].norm() / (x[:, 1:] - x[:, 1:].mean((0, 1))).norm()))
        torch.testing.assert_close(y[:, 0], x[:, 0].bfloat16().float())
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.05, errs
    state = learner_state(3.0)
    assert (
        len(state.encode(x, sink=1))
        == state.payload_bytes(4, 17, 1)
        == 4 * H * 2 + 4 * 16 * 2 + math.ceil(4 * 16 * int(state.bits.sum()) / 8)
    )


def test_stochastic_rounding_is_unbiased_where_components_have_bits() -> None:
    """Averaged over draws, stochastic rounding leaves only the int8 rotation's own error (the
    round trip through R R^T without any quantiser); rounding to the nearest level does not."""
    state = learner_state(8.0)  # every component gets bits: no component dropped
    assert int(state.bits.min()) >= 1
    x = correlated(2, seed=5)
    resid = x[:, 1:] - state.mean
    floor = float((resid - resid @ state.rotation @ state.rotation.T).norm())
    mean = torch.stack(
        [
            state.decode(state.encode(x, 1, stochastic=True, generator=torch.Generator().manual_seed(i)), 2, 17, 1)
            for i in range(300)
        ]
    ).mean(0)
    nearest = state.decode(state.encode(x, 1), 2, 17, 1)
    assert float((mean - x)[:, 1:].norm()) < 1.1 * floor < 1.1 / 1.3 * float((nearest - x)[:, 1:].norm())
    assert floor < 0.02 * float(resid.norm())  # int8 columns: about 1 % of the signal


def test_the_learner_fits_early_refits_once_it_spans_every_direction_then_on_its_cadence() -> None:
    learner = TransformLearner(H, 2.0, refresh=5)
    learner.observe(correlated(1, seq=8), sink=1)
    assert learner.maybe_refresh(0) is None  # 7 rows < H / 4: dense until then
    learner.observe(correlated(1), sink=1)
    first = learner.maybe_refresh(0)
    assert (
        first.version == 1 and int(first.bits.min()) == 1
    )  # every direction gets a bit, even those 23 rows do not span
    assert learner.maybe_refresh(1) is None
    learner.observe(correlated(10), sink=1)
    assert learner.maybe_refresh(1).version == 2  # 2 H rows now: refit before the cadence
    assert int(learner.current.bits.sum()) == 2 * H
    assert learner.maybe_refresh(5) is None
    assert learner.maybe_refresh(6).version == 3
    for bad in (9.0, 0.5):
        with pytest.raises(ConfigError, match="bits_per_value"):
            TransformLearner(H, bad, refresh=5)


def test_the_gradient_coder_is_a_fixed_random_rotation_with_even_bits() -> None:
    """Nothing in it depends on data: it never goes stale. Rotated rows of any distribution come
    out about unit-variance per component (the row's own gain taken out), so one uniform
    quantiser fits all. Stochastic rounding averages out, but only inside the quantiser's range:
    at 1-2 bits the outer levels clip (the Gaussian-optimal step), a bias that stays."""
    coder = FixedCoder(H, 1.5, seed=7)
    state = coder.current
    assert coder.maybe_refresh(100) is None and coder.current is state
    assert int(state.bits.sum()) == 72 and set(state.bits.tolist()) == {1, 2}
    assert torch.equal(state.rotation_q, random_coder(H, 72, 7).rotation_q)  # the same seed, the same coder
    torch.testing.assert_close(state.rotation.T @ state.rotation, torch.eye(H), atol=0.03, rtol=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, H, generator=g) * torch.logspace(-6, -3, H)  # a lopsided, tiny gradient
    z = (x.reshape(-1, H) / x.reshape(-1, H).pow(2).mean(1, keepdim=True).sqrt()) @ state.rotation
    assert 0.7 < float(z.var()) < 1.3
    mean = torch.stack(
        [
            state.decode(state.encode(x, 0, stochastic=True, generator=torch.Generator().manual_seed(i)), 2, 40, 0)
            for i in range(200)
        ]
    ).mean(0)
    one = state.decode(state.encode(x, 0, stochastic=True, generator=torch.Generator().manual_seed(0)), 2, 40, 0)
    assert float((mean - x).norm()) < 0.75 * float((one - x).norm())


def test_subtractive_dither_halves_stochastic_rounding_s_error_and_stays_unbiased() -> None:
    """mask.grad_rounding "dither": the receiver subtracts the offset the sender added, so the
    error is uniform in half a step whatever the value: about half the mean square of stochastic
    rounding at the same bits and bytes, still unbiased over draws; decoded with another seed it
    is not the tensor sent (the offset is part of the code)."""
    state = random_coder(H, row_budget(2.0, H), seed=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, H, generator=g) * torch.rand(2, 40, 1, generator=g) * 3

    def rel(d: torch.Tensor) -> float:
        return float(((d - x) ** 2).mean() / (x**2).mean())

    stochastic = rel(
        state.decode(state.encode(x, 0, stochastic=True, generator=torch.Generator().manual_seed(0)), 2, 40, 0)
    )
    payload = state.encode(x, 0, dither_seed=11)
    assert len(payload) == state.payload_bytes(2, 40, 0)
    dithered = rel(state.decode(payload, 2, 40, 0, dither_seed=11))
    assert 0.35 < dithered / stochastic < 0.65, (dithered, stochastic)
    assert rel(state.decode(payload, 2, 40, 0, dither_seed=12)) > 2 * dithered
    mean = torch.stack(
        [state.decode(state.encode(x, 0, dither_seed=i), 2, 40, 0, dither_seed=i) for i in range(200)]
    ).mean(0)
    assert rel(mean) < 0.05 * dithered


def test_dither_offsets_are_uniform_and_fixed_by_seed_row_and_column() -> None:
    """The offsets are a hash of (seed, row, column), so any device draws the same; roughly uniform."""
    from peer.codec.bitpack import dither

    cols = torch.tensor([3, 7, 40])
    u = dither(2**40 + 5, 5000, cols, H)
    assert u.shape == (5000, 3) and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.003
    assert torch.equal(
        u[:, 1], dither(2**40 + 5, 5000, torch.tensor([7]), H)[:, 0]
    )  # a column's offsets do not depend on the others
    assert not torch.equal(u, dither(2**40 + 6, 5000, cols, H)) and not torch.equal(u, dither(5, 5000, cols, H))


def test_both_ends_of_a_link_dither_by_the_run_s_config_and_a_run_trains() -> None:
    """Both ends read mask.grad_rounding from the run: a gradient crosses a pair of links with the
    dither's error (about half stochastic rounding's), and a run with it learns."""
    from peer.pipeline.transform_link import TransformLinks

    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2))
    err = {}
    for rounding in ("stochastic", "dither"):
        mask = MaskConfig(scheme="transform", grad_bits=2.0, grad_rounding=rounding, grad_step_scale=2.0)
        producer, consumer = TransformLinks(mask, 32, False, True), TransformLinks(mask, 32, True, False)
        payload, coder = producer.encode("backward", x, "stage0.r0", boundary=0, step=3, micro_batch=1)
        msg = pb.GradientChunk(
            header=pb.MicroBatchHeader(sender="stage1.r0", step=3, micro_batch_id=1, boundary=0),
            grad=payload,
            coder=coder,
        )
        got = consumer.decode(msg, expect_shape=(4, 16, 32), boundary=0, step=3, micro_batch=1)
        err[rounding] = float(((got - x) ** 2).mean() / (x**2).mean())
    assert 0.35 < err["dither"] / err["stochastic"] < 0.65, err

    def windows(step: int, replica: int, j: int) -> torch.Tensor:  # counting sequences: learnable in a few steps
        start = torch.randint(0, 256, (4, 1), generator=torch.Generator().manual_seed(10 * step + j))
        return (start + torch.arange(17)) % 256

    losses = {}
    for rounding in ("stochastic", "dither"):
        cfg = TrainConfig(
            model=MODEL,
            pipeline=PIPE,
            optim=OptimConfig(lr=1e-2),
            steps=8,
            mask=MaskConfig(scheme="transform", grad_rounding=rounding),
        )
        runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=0), windows)
        losses[rounding] = [r.loss for r in runner.run(8)]
        runner.close()
    assert all(math.isfinite(v) for v in losses["dither"])
    assert losses["dither"][-1] < losses["dither"][0]
    assert losses["dither"][0] == pytest.approx(
        losses["stochastic"][0]
    )  # the first forward is the same: only gradients differ


def test_the_gradients_step_width_travels_with_their_coder() -> None:
    """mask.grad_step_scale sets the sender's steps; the receiver reads them from the coder it is
    sent (no setting of its own): with dither at 1 bit, steps of the Gaussian-optimal width give
    about half the error of the default's doubled ones."""
    from peer.pipeline.transform_link import TransformLinks

    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(5))
    err = {}
    for scale in (1.0, 2.0):
        producer = TransformLinks(
            MaskConfig(scheme="transform", grad_bits=1.0, grad_rounding="dither", grad_step_scale=scale),
            32,
            False,
            True,
        )
        consumer = TransformLinks(
            MaskConfig(scheme="transform", grad_bits=1.0, grad_rounding="dither"), 32, True, False
        )  # its own scale: the default
        payload, coder = producer.encode("backward", x, "stage0.r0", boundary=0, step=2, micro_batch=0)
        assert coder.run_rotation and not coder.HasField("rotation")  # the run's rotation: each end makes it
        assert torch.equal(
            tw.coder_from_proto(coder, 32, row_budget(1.0, 32), run_rotation=run_rotation(32, 0)).std,
            torch.full((32,), scale),
        )
        msg = pb.GradientChunk(
            header=pb.MicroBatchHeader(sender="stage1.r0", step=2, micro_batch_id=0, boundary=0),
            grad=payload,
            coder=coder,
        )
        got = consumer.decode(msg, expect_shape=(4, 16, 32), boundary=0, step=2, micro_batch=0)
        err[scale] = float(((got - x) ** 2).mean() / (x**2).mean())
    assert 0.35 < err[1.0] / err[2.0] < 0.65, err
    with pytest.raises(ConfigError, match="codec.transform.grad_step_scale"):
        MaskConfig(scheme="transform", grad_step_scale=0.0)


def test_activations_dither_by_mask_act_rounding_with_their_own_offsets() -> None:
    """mask.act_rounding "dither": an activation's error has nearest rounding's size but averages
    out over messages (nearest rounding's is the same every time: a staircase the next stage
    trains on); the offsets are the forward direction's own, so the backward's seed decodes wrong."""
    from peer.pipeline.transform_link import TransformLinks

    state = learner_state(2.0)
    x = correlated(2, seq=20, seed=7)
    rel = lambda y: float(((y - x)[:, 1:] ** 2).mean() / (x[:, 1:] ** 2).mean())  # noqa: E731  (position 0: the sink, dense)

    def roundtrip(step: int, dither: bool, decode_as: str = "forward", seeds: tuple[int, int] = (0, 0)) -> torch.Tensor:
        key = dict(sink=1, boundary=0, step=step, micro_batch=1)
        msg = tw.encode(state, x, stochastic=False, dither=dither, channel="forward", run_seed=seeds[0], **key)
        return tw.decode(
            msg, state, expect_shape=(2, 20, H), dither=dither, channel=decode_as, run_seed=seeds[1], **key
        )

    nearest, dithered = rel(roundtrip(3, False)), rel(roundtrip(3, True))
    assert 0.6 < dithered / nearest < 1.6, (dithered, nearest)
    assert rel(roundtrip(3, True, decode_as="backward")) > 1.5 * dithered
    # the run's codec.seed draws other offsets: a replicate redraws the codec's noise, and only
    # a receiver of the same run seed decodes it
    assert rel(roundtrip(3, True, seeds=(5, 5))) == pytest.approx(dithered, rel=0.5)
    assert not torch.equal(roundtrip(3, True, seeds=(5, 5)), roundtrip(3, True))
    assert rel(roundtrip(3, True, seeds=(5, 0))) > 1.5 * dithered
    mean = torch.stack([roundtrip(step, True) for step in range(100)]).mean(0)
    assert (
        rel(mean) < 0.5 * nearest
    )  # unbiased inside the range (what is left: clipped values); nearest rounding's error never averages out
    links = TransformLinks(
        MaskConfig(scheme="transform", act_rounding="dither", grad_rounding="stochastic"), H, True, True
    )
    assert links.dithers("forward") and not links.dithers("backward")
    with pytest.raises(ConfigError, match="codec.transform.act_rounding"):
        MaskConfig(scheme="transform", act_rounding="stochastic")


def _coder(**override) -> pb.TransformCoder:
    msg = tw.coder_to_proto(learner_state())
    for key, value in override.items():
        getattr(msg, key).CopyFrom(value) if isinstance(value, pb.TensorPayload) else setattr(msg, key, value)
    return msg


def test_a_coder_travels_intact() -> None:
    state = learner_state()
    back = tw.coder_from_proto(tw.coder_to_proto(state), H, row_budget(3.0, H))
    assert back.version == state.version and torch.equal(back.bits, state.bits)
    for name in ("mean", "rotation_q", "rotation_scale", "std"):
        assert torch.equal(getattr(back, name), getattr(state, name)), name


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(version=0), "version=0"),
        (dict(mean=tw.tensor_to_proto(torch.full((H,), float("nan")))), "NaN"),
        (dict(mean=tw.tensor_to_proto(torch.zeros(H + 1))), "shape"),
        (dict(rotation=tw.tensor_to_proto(torch.full((H, H), 127, dtype=torch.int8))), "orthonormal"),
        (dict(rotation=tw.tensor_to_proto(torch.zeros(H, H))), "dtype"),
        (dict(rotation=tw.tensor_to_proto(torch.zeros(H, H + 1, dtype=torch.int8))), "shape"),
        (dict(rotation_scale=tw.tensor_to_proto(torch.full((H,), 0.5))), "rotation_scale"),
        (dict(std=tw.tensor_to_proto(torch.zeros(H).half())), "std"),
        (dict(bits=bytes([9] * H)), "bits"),
        (dict(bits=bytes([0] * H)), "bits"),
        (dict(bits=bytes([8] * H)), "sum to <= 144"),
        (dict(bits=bytes(H + 1)), "one per component"),
    ],
)
def test_a_malformed_coder_is_refused_with_the_field(override: dict, match: str) -> None:
    with pytest.raises(WireError, match=match):
        tw.coder_from_proto(_coder(**override), H, row_budget(3.0, H))


KEY = dict(boundary=0, step=3, micro_batch=1)


def test_payload_checks() -> None:
    state = learner_state()
    x = correlated(2)
    good = tw.encode(state, x, sink=1, stochastic=False, **KEY)
    torch.testing.assert_close(
        tw.decode(good, state, expect_shape=(2, 17, H), sink=1, **KEY), state.decode(good.payload, 2, 17, 1)
    )
    warm = tw.encode(None, x, sink=1, stochastic=False, **KEY)
    assert warm.dtype == pb.BFLOAT16 and len(warm.payload) == x.numel() * 2
    torch.testing.assert_close(tw.decode(warm, None, expect_shape=(2, 17, H), sink=1, **KEY), x.bfloat16().float())

    def bad(match: str, msg: pb.TensorPayload, st=state, **kw) -> None:
        with pytest.raises(WireError, match=match):
            tw.decode(msg, st, **{"expect_shape": (2, 17, H), "sink": 1, **KEY, **kw})

    short = pb.TensorPayload()
    short.CopyFrom(good)
    short.payload = good.payload[:-1]
    bad("bytes, expected", short)
    bad("coder_version=1: unknown", good, st=None)
    bad("sink=1", good, sink=2)
    bad("step=3", good, step=4)
    bad("shape", good, expect_shape=(2, 16, H))
    nan = pb.TensorPayload()
    nan.CopyFrom(good)
    nan.payload = good.payload[: 2 * H * 2] + b"\xc0\x7f" + good.payload[2 * H * 2 + 2 :]  # a NaN bf16 gain
    bad("gain", nan)
    fp32_dense = pb.TensorPayload(dtype=pb.FLOAT32, shape=[2, 17, H], payload=x.numpy().tobytes())
    bad("BFLOAT16", fp32_dense)
    masked = pb.TensorPayload()
    masked.CopyFrom(good)
    masked.compression.kind = pb.Compression.BERNOULLI_MASK
    bad("transform-coded", masked)


def test_config_bounds() -> None:
    with pytest.raises(ConfigError, match="codec.transform.bits"):
        MaskConfig(scheme="transform", bits=0.0)
    with pytest.raises(ConfigError, match="codec.transform.grad_bits"):
        MaskConfig(scheme="transform", grad_bits=8.5)
    with pytest.raises(ConfigError, match="codec.transform.sink"):
        MaskConfig(scheme="transform", sink=-1)
    with pytest.raises(ConfigError, match="codec.transform.grad_rounding"):
        MaskConfig(scheme="transform", grad_rounding="round")
    with pytest.raises(ConfigError, match="codec.mask.drop"):
        MaskConfig(scheme="transform", drop=0.5)


MODEL = ModelConfig(name="tiny-llama", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)
PIPE = PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=16, max_staleness=0)


def test_the_link_warms_up_dense_then_codes_and_a_bad_coder_changes_nothing() -> None:
    """Through the worker: TRANSFORM payloads both ways from the first micro-batch, each coder
    version shipped once per destination (the gradients' coder never changes); a malformed coder is refused by the
    inbound check and leaves the receiver's coders and weights as they were."""
    seen: list[tuple[str, int, bool]] = []

    def windows(step: int, replica: int, j: int) -> torch.Tensor:
        return torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(10 * step + j))

    cfg = TrainConfig(
        model=MODEL,
        pipeline=PIPE,
        optim=OptimConfig(lr=1e-3),
        steps=6,
        mask=MaskConfig(scheme="transform", bits=2.0, grad_bits=1.0, basis_refresh=3),
    )
    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=0), windows)
    send = runner.transport.send

    def spy(src, dst, channel, data):
        msg = (pb.ActivationChunk if channel == "forward" else pb.GradientChunk).FromString(data)
        payload = msg.hidden if channel == "forward" else msg.grad
        seen.append((channel, payload.compression.kind, msg.coder.version if msg.HasField("coder") else 0))
        send(src, dst, channel, data)

    runner.transport.send = spy
    runner.run(6)
    for channel in ("forward", "backward"):
        kinds = [k for c, k, _ in seen if c == channel]
        assert set(kinds) == {pb.Compression.TRANSFORM}  # the first micro-batch has >= H / 4 rows: no dense warm-up
    forward = [v for c, _, v in seen if c == "forward" and v]
    assert forward == sorted(set(forward)) and len(forward) >= 2, (
        forward
    )  # each version once: early fit(s), then every 3 steps
    assert [v for c, _, v in seen if c == "backward" and v] == [1]  # the gradients' coder: made once, shipped once

    receiver = runner.workers[1][0]
    before = {k: dict(v) for k, v in receiver.link.links.coders.items()}
    weights = {n: p.detach().clone() for n, p in receiver.stage.named_parameters()}
    sender = runner.workers[0][0].link.links
    state = sender.learners["forward"].current
    msg = pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id=receiver.run_id, step=6, micro_batch_id=0, sender="stage0.r0", boundary=0)
    )
    msg.token_ids.CopyFrom(tw.tensor_to_proto(windows(6, 0, 0).to(torch.uint8)))
    msg.hidden.CopyFrom(
        tw.encode(state, torch.randn(4, 16, 32), sink=1, stochastic=False, boundary=0, step=6, micro_batch=0)
    )
    broken = tw.coder_to_proto(state)
    broken.version = state.version + 1
    broken.bits = bytes([8] * 32)
    msg.coder.CopyFrom(broken)
    with pytest.raises(WireError, match="TransformCoder.bits"):
        receiver.validate("forward", msg)
    assert {k: dict(v) for k, v in receiver.link.links.coders.items()} == before
    assert all(torch.equal(p, weights[n]) for n, p in receiver.stage.named_parameters())
    runner.close()


def test_a_gain_that_overflows_once_decoded_is_refused() -> None:
    state = learner_state()
    payload = bytearray(state.encode(correlated(1), sink=1))
    payload[H * 2 : H * 2 + 2] = b"\x7f\x7f"  # the first row's bf16 gain: 3.4e38, finite on the wire
    with pytest.raises(WireError, match="not finite"):
        state.decode(bytes(payload), 1, 17, 1)


def test_decode_runs_its_products_on_the_requested_device_and_the_inbound_check_decodes_nothing() -> None:
    """On a GPU the rotation of every row must run there, not on the host: decoding to the meta
    device (no data, any op) shows where each product ran. The inbound check expands no code."""
    from torch.overrides import TorchFunctionMode

    class Products(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.devices: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul):
                self.devices += [a.device.type for a in args if isinstance(a, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    state = learner_state()
    payload = state.encode(correlated(2), sink=1)
    seen = Products()
    with seen:
        out = state.decode(payload, 2, 17, 1, device="meta")
    assert out.device.type == "meta" and out.shape == (2, 17, H) and seen.devices and set(seen.devices) == {"meta"}
    seen = Products()
    with seen:
        state.check(payload, 2, 17, 1)
    assert seen.devices == []
    with pytest.raises(WireError, match="bytes, expected"):
        state.check(payload[:-1], 2, 17, 1)


def test_activations_may_carry_their_own_statistics() -> None:
    """mask.act_stats "message": each message's own component means and stds (4 H bytes) instead
    of the coder's, so a coder fitted on other data (stale) loses little; the receiver checks
    them (finite, stds > 0) before decoding, and a link pair decodes by the run's config."""
    from peer.pipeline.transform_link import TransformLinks

    state = learner_state(2.0)
    x = correlated(3, seq=20, seed=8) * 2.5 + 4  # drifted: another scale and offset than the coder saw
    rel = lambda y: float(((y - x)[:, 1:] ** 2).mean() / ((x[:, 1:] - x[:, 1:].mean((0, 1))) ** 2).mean())  # noqa: E731
    coder_err = rel(state.decode(state.encode(x, 1), 3, 20, 1))
    payload = state.encode(x, 1, msg_stats=True)
    assert len(payload) == state.payload_bytes(3, 20, 1, msg_stats=True) == state.payload_bytes(3, 20, 1) + 4 * H
    assert rel(state.decode(payload, 3, 20, 1, msg_stats=True)) < 0.5 * coder_err
    n_head, rows = 3 * 1 * H * 2, 3 * 19
    bad = bytearray(payload)
    bad[n_head + 2 * rows + 2 * H : n_head + 2 * rows + 2 * H + 2] = (
        torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    )
    with pytest.raises(WireError, match="stds"):
        state.check(bytes(bad), 3, 20, 1, msg_stats=True)
    mask = MaskConfig(scheme="transform", act_stats="message")
    producer, consumer = TransformLinks(mask, H, True, False), TransformLinks(mask, H, False, True)
    producer.learners["forward"].current = state
    msg, coder = producer.encode("forward", x, "stage1.r0", boundary=0, step=1, micro_batch=0)
    chunk = pb.ActivationChunk(
        header=pb.MicroBatchHeader(sender="stage0.r0", step=1, micro_batch_id=0, boundary=0), hidden=msg, coder=coder
    )
    got = consumer.decode(chunk, expect_shape=(3, 20, H), boundary=0, step=1, micro_batch=0)
    assert rel(got) < 0.5 * coder_err and producer.msg_stats("forward") and not producer.msg_stats("backward")
    with pytest.raises(ConfigError, match="codec.transform.act_stats"):
        MaskConfig(scheme="transform", act_stats="batch")


def test_the_gradients_coder_ships_without_the_run_s_rotation_and_nothing_else_may() -> None:
    """The gradients' rotation is the run's (codec.seed): each end makes it, so their coder ships
    its mean, stds and bits only (H = 576: 0.33 MB less a destination) and decodes alike at the other
    end. An activation coder that says it uses the run's rotation, or a coder that says so and
    carries one anyway, is refused with the field."""
    from peer.pipeline.transform_link import TransformLinks

    H = 576
    mask = MaskConfig(scheme="transform", grad_bits=1.0, grad_rounding="dither")
    producer, consumer = TransformLinks(mask, H, False, True), TransformLinks(mask, H, True, False)
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(3))
    payload, coder = producer.encode("backward", x, "stage0.r0", boundary=0, step=1, micro_batch=0)
    full = tw.coder_to_proto(producer.learners["backward"].current)
    assert (
        coder.ByteSize() < 8 * H and full.ByteSize() > H * H
    )  # mean, stds and bits (4 KB), against the int8 rotation (0.33 MB)
    msg = pb.GradientChunk(
        header=pb.MicroBatchHeader(sender="stage1.r0", step=1, micro_batch_id=0, boundary=0), grad=payload, coder=coder
    )
    got = consumer.decode(msg, expect_shape=(2, 8, H), boundary=0, step=1, micro_batch=0)
    shipped = TransformLinks(mask, H, True, False)  # the same coder with its rotation shipped: the same values
    msg_full = pb.GradientChunk(header=msg.header, grad=payload, coder=full)
    assert torch.equal(got, shipped.decode(msg_full, expect_shape=(2, 8, H), boundary=0, step=1, micro_batch=0))
    with pytest.raises(WireError, match="TransformCoder.run_rotation: only the gradients'"):
        tw.coder_from_proto(coder, H, row_budget(2.0, H))  # read as an activation coder
    both = pb.TransformCoder()
    both.CopyFrom(full)
    both.run_rotation = True
    with pytest.raises(WireError, match="TransformCoder.rotation: a coder on the run's rotation carries none"):
        tw.coder_from_proto(both, H, row_budget(1.0, H), run_rotation=run_rotation(H, 0))
