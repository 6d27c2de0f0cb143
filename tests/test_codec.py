"""MaskCodec (the paper's Bernoulli activation mask) and TokenPrior (the receiver-side fill)."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.codec.mask import MaskCodec, mask_hash, mask_key
from peer.codec.prior import TokenPrior
from peer.config import MaskConfig
from peer.errors import ConfigError, TensorError, WireError
from peer.wire import anchormesh_pb2 as pb

VALUE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
KEY = dict(boundary=1, step=7, micro_batch=3)


def codec(drop: float = 0.9, values: str = "fp32", seed: int = 0) -> MaskCodec:
    return MaskCodec(MaskConfig(scheme="mask", drop=drop, values=values, seed=seed))


# ---- an independent pure-Python reference of the mask PRF (the spec in peer/codec/mask.py) ----
def ref_key(seed: int, boundary: int, step: int, micro_batch: int) -> int:
    data = b"anchormesh.mask.v1" + b"".join(
        (v % 2**64).to_bytes(8, "little") for v in (seed, boundary, step, micro_batch)
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def ref_lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def ref_word(key: int, i: int) -> int:
    k0, k1 = key % 2**32, key >> 32
    return ref_lowbias32(ref_lowbias32(i ^ k0) ^ k1)


def test_lowbias32_reference_vectors() -> None:
    # Pins the reference itself, so the test cannot pass by changing both implementations together.
    assert [ref_lowbias32(x) for x in (0, 1, 2, 0xDEADBEEF)] == [0, 0x688990C0, 0xD1132181, 0xE628C683]
    assert len({ref_lowbias32(x) for x in range(4096)}) == 4096  # a bijection on 32-bit words


def test_hash_matches_pure_python_reference() -> None:
    for seed, boundary, step, mb in [
        (0, 0, 0, 0),
        (1, 2, 3, 4),
        (-5, 7, 10**12, 2**40),
        (2**63, 2**32 - 1, 2**64 - 1, 1),
    ]:
        key = mask_key(seed, boundary, step, mb)
        assert key == ref_key(seed, boundary, step, mb)
        words = mask_hash(key, 1000).tolist()
        assert words == [ref_word(key, i) for i in range(1000)]
        c = codec(drop=0.9, seed=seed)
        mask = c.keep_mask((1000,), boundary=boundary, step=step, micro_batch=mb).tolist()
        threshold = round(0.1 * 2**32)
        assert mask == [ref_word(key, i) < threshold for i in range(1000)]


def test_chunked_mask_equals_one_pass() -> None:
    c = codec(0.9, seed=5)
    key = mask_key(5, **KEY)
    n = 3 * 70_001  # spans several CPU chunks, ending mid-chunk
    assert torch.equal(c.keep_mask((3, 70_001), **KEY).reshape(-1), mask_hash(key, n) < round(0.1 * 2**32))
    assert torch.equal(mask_hash(key, 100, start=65_500), mask_hash(key, 65_600)[65_500:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mask_bit_identical_to_cpu() -> None:
    c = codec(0.95, seed=3)
    shape = (4, 512, 1024)
    assert torch.equal(c.keep_mask(shape, device="cuda", **KEY).cpu(), c.keep_mask(shape, **KEY))
    x = torch.randn(shape, device="cuda")
    assert torch.equal(c.decode(c.encode(x, **KEY)), (x * c.keep_mask(shape, device="cuda", **KEY)).cpu())


def test_hash_pinned_bits() -> None:
    # Computed once with the pure-Python reference above; a change here breaks wire
    # compatibility between anchormesh versions (peers would disagree on the mask).
    key = mask_key(0, 0, 0, 0)
    assert key == 0x304E3B94A3C48764
    assert mask_hash(key, 4).tolist() == [0x1A38CFAE, 0xC4FADA8D, 0xDBB94A3D, 0xEFF47A20]
    bits = codec(drop=0.5).keep_mask((32,), boundary=0, step=0, micro_batch=0)
    assert "".join("1" if b else "0" for b in bits.tolist()) == "10000011101110010100010100111010"


def test_mask_key_rejects_bad_fields() -> None:
    with pytest.raises(ConfigError, match="boundary"):
        mask_key(0, -1, 0, 0)
    with pytest.raises(ConfigError, match="step"):
        mask_key(0, 0, 2**64, 0)
    with pytest.raises(ConfigError, match="micro_batch"):
        mask_key(0, 0, 0, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="boundary=-1"):
        codec().encode(torch.zeros(4), boundary=-1, step=0, micro_batch=0)


# ---- bytes on the wire ----------------------------------------------------------------------------
@pytest.mark.parametrize("drop", [0.9, 0.95])
@pytest.mark.parametrize("values", ["fp32", "fp16", "bf16", "int8"])
def test_bytes_per_element(drop: float, values: str) -> None:
    c = codec(drop, values)
    keep = 1 - drop
    per_kept = VALUE_BYTES[values] + (4 / 256 if values == "int8" else 0)
    assert c.bytes_per_element() == pytest.approx(keep * per_kept, rel=1e-12)
    x = torch.randn(8, 128, 256)
    n = x.numel()
    msg = c.encode(x, **KEY)
    measured = len(msg.payload) / n
    sigma = per_kept * math.sqrt(keep * (1 - keep) / n)  # binomial std of the kept count, in bytes/element
    assert abs(measured - c.bytes_per_element()) < 5 * sigma + 4 / n, (measured, c.bytes_per_element())


def test_paper_ratios() -> None:
    # M90 with fp16 values: 0.2 B/element = 20x fewer bytes than dense fp32; M95 with int8: ~0.05.
    assert codec(0.9, "fp16").bytes_per_element() == pytest.approx(0.2)
    assert codec(0.95, "int8").bytes_per_element() == pytest.approx(0.05 * (1 + 4 / 256))
    assert codec(0.0, "fp32").bytes_per_element() == pytest.approx(4.0)


# ---- round trips ----------------------------------------------------------------------------------
def test_fp32_round_trip_exact_and_zero_or_fill() -> None:
    c = codec(0.9, "fp32")
    x = torch.randn(4, 16, 32)
    mask = c.keep_mask(x.shape, **KEY)
    msg = c.encode(x, **KEY)
    assert msg.compression.kind == pb.Compression.BERNOULLI_MASK and list(msg.shape) == [4, 16, 32]
    assert msg.dtype == pb.FLOAT32 and msg.compression.values == pb.FLOAT32
    y = c.decode(msg, expect_shape=(4, 16, 32))
    assert torch.equal(y[mask], x[mask])
    assert torch.all(y[~mask] == 0)
    fill = torch.full_like(x, 5.0)
    z = c.decode(msg, fill=fill)
    assert torch.equal(z[mask], x[mask]) and torch.all(z[~mask] == 5.0)


@pytest.mark.parametrize("values,rel", [("fp16", 2**-11), ("bf16", 2**-8)])
def test_float_round_trip_within_rounding(values: str, rel: float) -> None:
    c = codec(0.9, values)
    x = torch.randn(4, 16, 64)
    mask = c.keep_mask(x.shape, **KEY)
    y = c.decode(c.encode(x, **KEY))
    err = (y[mask] - x[mask]).abs()
    assert torch.all(err <= rel * x[mask].abs() + 1e-30)
    assert torch.all(y[~mask] == 0)


def test_int8_round_trip_within_half_step() -> None:
    c = codec(0.9, "int8")
    x = torch.randn(4, 32, 128) * torch.linspace(0.01, 100, 128)  # channels of very different scale
    mask = c.keep_mask(x.shape, **KEY)
    msg = c.encode(x, **KEY)
    assert msg.compression.block_size == 256
    y = c.decode(msg)
    kept = x.reshape(-1)[mask.reshape(-1)]
    err = (y.reshape(-1)[mask.reshape(-1)] - kept).abs()
    blocks = torch.arange(kept.numel()) // 256
    absmax = torch.zeros(int(blocks.max()) + 1).scatter_reduce(0, blocks, kept.abs(), "amax")
    assert torch.all(err <= absmax[blocks] / 254 * (1 + 1e-5) + 1e-12)  # half a quantization step
    assert torch.all(y[~mask] == 0)


def test_drop_zero_is_dense_and_exact() -> None:
    c = codec(0.0, "fp32")
    x = torch.randn(3, 5, 7)
    assert c.keep_mask(x.shape, **KEY).all()
    assert torch.equal(c.decode(c.encode(x, **KEY)), x)
    dense = pb.TensorPayload(dtype=pb.FLOAT32, shape=[3, 5, 7], payload=x.numpy().astype("<f4").tobytes())
    assert torch.equal(c.decode(dense), x)  # kind NONE (anchor passes) decodes as sent
    assert torch.equal(codec(0.9).decode(dense), x)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    values=st.sampled_from(["fp32", "fp16", "bf16", "int8"]),
    drop=st.sampled_from([0.0, 0.5, 0.9, 0.95]),
    in_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    step=st.integers(0, 2**64 - 1),
)
def test_round_trip_property(shape: list[int], values: str, drop: float, in_dtype: torch.dtype, step: int) -> None:
    c = codec(drop, values, seed=11)
    x = torch.randn(shape).to(in_dtype)
    msg = c.encode(x, boundary=2, step=step, micro_batch=0)
    assert len(msg.payload) == len(pb.TensorPayload.FromString(msg.SerializeToString()).payload)
    y = c.decode(pb.TensorPayload.FromString(msg.SerializeToString()), expect_shape=tuple(shape))
    mask = c.keep_mask(tuple(shape), boundary=2, step=step, micro_batch=0)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.all(y[~mask] == 0)
    ref = x.float()[mask]
    tol = {"fp32": 0.0, "fp16": 2**-11, "bf16": 2**-8, "int8": 1 / 127}[values]
    scale = ref.abs().max() if values == "int8" and ref.numel() else ref.abs()
    assert torch.all((y[mask] - ref).abs() <= tol * scale)


# ---- both link ends agree; the backward lands on the forward's kept set ---------------------------
def test_sender_receiver_same_mask_and_gradient_path() -> None:
    cfg = dict(scheme="mask", drop=0.9, values="fp32", seed=1234)
    sender, receiver = MaskCodec(MaskConfig(**cfg)), MaskCodec(MaskConfig(**cfg))
    h = torch.randn(2, 8, 64)
    wire = receiver.decode(pb.TensorPayload.FromString(sender.encode(h, **KEY).SerializeToString()))
    m_send = sender.keep_mask(h.shape, **KEY)
    m_recv = receiver.keep_mask(h.shape, **KEY)
    assert torch.equal(m_send, m_recv)
    assert torch.equal(wire, h * m_send)  # = h ⊙ m, the paper's masked activation

    g = torch.randn(2, 8, 64)  # d loss / d (masked input) at the receiver
    back = sender.decode(receiver.encode(g, **KEY))
    assert torch.equal(back != 0, m_send & (g != 0))
    assert torch.equal(back, g * m_send)  # what autograd through h * m would give the sender


def test_same_key_same_mask_twice() -> None:
    a = codec(0.9).keep_mask((4, 64, 32), **KEY)
    b = codec(0.9).keep_mask((4, 64, 32), **KEY)
    c = codec(0.9).keep_mask((4, 64, 32), **KEY)
    assert torch.equal(a, b) and torch.equal(b, c)


# ---- mask statistics ----------------------------------------------------------------------------
@pytest.mark.parametrize("drop", [0.5, 0.9, 0.95])
def test_drop_rate_within_five_sigma(drop: float) -> None:
    n = 1 << 19
    for step in range(2):
        kept = int(codec(drop).keep_mask((n,), boundary=0, step=step, micro_batch=0).sum())
        assert abs((n - kept) / n - drop) < 5 * math.sqrt(drop * (1 - drop) / n)


@pytest.mark.parametrize(
    "other",
    [
        dict(seed=0, boundary=1, step=8, micro_batch=3),
        dict(seed=0, boundary=1, step=7, micro_batch=4),
        dict(seed=0, boundary=2, step=7, micro_batch=3),
        dict(seed=1, boundary=1, step=7, micro_batch=3),
    ],
    ids=["step", "micro_batch", "boundary", "seed"],
)
def test_masks_of_neighbouring_keys_are_independent(other: dict[str, int]) -> None:
    n, keep = 1 << 19, 0.1
    base = codec(0.9, seed=0).keep_mask((n,), **KEY)
    seed = other.pop("seed")
    m = codec(0.9, seed=seed).keep_mask((n,), **other)
    assert not torch.equal(base, m)
    overlap = float((base & m).float().mean())
    assert abs(overlap - keep**2) < 5 * math.sqrt(keep**2 * (1 - keep**2) / n)


def test_neighbouring_elements_are_independent() -> None:
    n, keep = 1 << 20, 0.1
    m = codec(0.9).keep_mask((n,), **KEY)
    for lag in (1, 2, 128, 4096):
        pair = float((m[:-lag] & m[lag:]).float().mean())
        assert abs(pair - keep**2) < 5 * math.sqrt(keep**2 * (1 - keep**2) / (n - lag))


def test_mask_speed() -> None:
    import time

    c = codec(0.9)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        c.keep_mask((8, 128, 128), **KEY)
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.05  # ~1 ms on one idle CPU core; generous bound for loaded CI machines


# ---- bad input -------------------------------------------------------------------------------------
def test_encode_rejects_nonfinite_with_count() -> None:
    x = torch.randn(2, 4, 8)
    x[0, 0, 0] = float("nan")
    x[1, 2, 3] = float("inf")
    x[1, 3, 7] = float("-inf")
    with pytest.raises(TensorError, match=r"3 of 64 entries are NaN or Inf"):
        codec().encode(x, **KEY)


def test_encode_rejects_int_and_fp16_overflow() -> None:
    with pytest.raises(TensorError, match="floating-point"):
        codec().encode(torch.ones(4, dtype=torch.int64), **KEY)
    with pytest.raises(TensorError, match="fp16 range"):
        codec(0.0, "fp16").encode(torch.full((4,), 1e6), **KEY)


def _msg(c: MaskCodec | None = None, shape: tuple[int, ...] = (2, 8, 32)) -> pb.TensorPayload:
    return (c or codec(0.9, "fp16")).encode(torch.randn(shape), **KEY)


def test_decode_rejects_truncated_payload() -> None:
    msg = _msg()
    n = len(msg.payload)
    msg.payload = msg.payload[:-2]
    with pytest.raises(WireError, match=rf"payload: {n - 2} bytes, expected {n}"):
        codec(0.9, "fp16").decode(msg)
    msg.payload = b""
    with pytest.raises(WireError, match="payload: 0 bytes"):
        codec(0.9, "fp16").decode(msg)


def test_decode_refuses_implausible_size_before_regenerating_the_mask() -> None:
    msg = _msg()
    msg.shape[:] = [2**28]  # a 2**28-element claim with a 1 KiB payload: refused without hashing 2**28 indices
    with pytest.raises(
        WireError, match=r"payload: \d+ bytes, expected about 5368709\d \(268435456 elements at drop=0.9"
    ):
        codec(0.9, "fp16").decode(msg)


def test_decode_rejects_int8_truncated_and_bad_scales() -> None:
    c = codec(0.9, "int8")
    msg = _msg(c)
    good = msg.payload
    msg.payload = good[:-1]
    with pytest.raises(WireError, match="float32 scales"):
        c.decode(msg)
    msg.payload = good[:-4] + struct.pack("<f", float("nan"))
    with pytest.raises(WireError, match=r"int8 scales\): 1 of"):
        c.decode(msg)
    msg.payload = good[:-4] + struct.pack("<f", -1.0)
    with pytest.raises(WireError, match="negative"):
        c.decode(msg)
    msg.payload = b"\x80" + good[1:]
    with pytest.raises(WireError, match="-128"):
        c.decode(msg)
    msg.payload = good
    msg.compression.block_size = 0
    with pytest.raises(WireError, match="Compression.block_size=0"):
        c.decode(msg)


def test_decode_rejects_wrong_drop_seed_and_key() -> None:
    msg = _msg()
    with pytest.raises(WireError, match=r"Compression.drop=0.9: this peer masks with drop=0.95"):
        codec(0.95, "fp16").decode(msg)
    with pytest.raises(WireError, match="Compression.mask_seed=0: this run's mask seed is 9"):
        codec(0.9, "fp16", seed=9).decode(msg)
    with pytest.raises(WireError, match="Compression.step=7: the header says 8"):
        codec(0.9, "fp16").decode(msg, step=8)
    codec(0.9, "fp16").decode(msg, boundary=1, step=7, micro_batch=3)


def test_decode_rejects_wrong_shape_and_fields() -> None:
    c = codec(0.9, "fp16")
    with pytest.raises(WireError, match=r"TensorPayload.shape=\[2, 8, 32\]: expected \[2, 8, 16\]"):
        c.decode(_msg(), expect_shape=(2, 8, 16))
    msg = _msg()
    msg.shape[1] = -8
    with pytest.raises(WireError, match=r"shape\[1\]=-8"):
        c.decode(msg)
    msg = _msg()
    msg.shape[:] = [2**20, 2**20]
    with pytest.raises(WireError, match="exceed max_numel"):
        c.decode(msg)
    msg = _msg()
    msg.shape[2] = 31  # a different shape regenerates a different kept count
    with pytest.raises(WireError, match="payload"):
        c.decode(msg)
    msg = _msg()
    msg.compression.values = pb.INT64
    with pytest.raises(WireError, match="Compression.values=INT64"):
        c.decode(msg)
    msg = _msg()
    msg.compression.kind = 7
    with pytest.raises(WireError, match="compression.kind=7"):
        c.decode(msg)
    msg = _msg()
    msg.dtype = pb.INT32
    with pytest.raises(WireError, match="TensorPayload.dtype=INT32"):
        c.decode(msg)
    with pytest.raises(TensorError, match="fill.shape"):
        c.decode(_msg(), fill=torch.zeros(3))


def test_decode_rejects_nonfinite_values() -> None:
    c = codec(0.9, "fp32")
    msg = _msg(c)
    msg.payload = struct.pack("<f", float("inf")) + msg.payload[4:]
    with pytest.raises(WireError, match=r"payload: 1 of \d+ values are NaN or Inf"):
        c.decode(msg)


# ---- TokenPrior ----------------------------------------------------------------------------------
def test_token_prior_learns_table_from_masked_samples() -> None:
    torch.manual_seed(0)
    vocab, hidden = 64, 32
    table = torch.randn(vocab, hidden)
    prior = TokenPrior(vocab, hidden, momentum=0.99)
    c = codec(0.9)
    for step in range(80):
        tok = torch.randint(0, vocab, (8, 64))
        h = table[tok] + 0.05 * torch.randn(8, 64, hidden)
        keep = c.keep_mask(h.shape, boundary=0, step=step, micro_batch=0)
        prior.observe(tok, c.decode(c.encode(h, boundary=0, step=step, micro_batch=0)), keep)
    all_tokens = torch.arange(vocab)[None]
    rel = float((prior.fill(all_tokens)[0] - table).norm() / table.norm())
    assert rel < 0.05, rel

    tok = torch.randint(0, vocab, (8, 64))
    h = table[tok] + 0.05 * torch.randn(8, 64, hidden)
    keep = c.keep_mask(h.shape, boundary=0, step=999, micro_batch=0)
    zero_fill = c.decode(c.encode(h, boundary=0, step=999, micro_batch=0))
    prior_fill = c.decode(c.encode(h, boundary=0, step=999, micro_batch=0), fill=prior.fill(tok))
    err_prior = float((prior_fill - h)[~keep].norm())
    err_zero = float((zero_fill - h)[~keep].norm())
    assert err_prior < 0.1 * err_zero, (err_prior, err_zero)


def test_token_prior_running_average_then_fallback() -> None:
    prior = TokenPrior(4, 2, momentum=0.9)
    assert torch.equal(prior.fill(torch.tensor([[0, 3]])), torch.zeros(1, 2, 2))  # nothing observed yet
    tok = torch.tensor([[1]])
    for v in (1.0, 2.0, 3.0):  # early observations: plain running average, no bias towards 0
        prior.observe_dense(tok, torch.full((1, 1, 2), v))
    assert torch.allclose(prior.fill(tok), torch.full((1, 1, 2), 2.0))
    keep = torch.tensor([[[True, False]]])
    prior.observe(torch.tensor([[2]]), torch.tensor([[[10.0, 99.0]]]), keep)
    filled = prior.fill(torch.tensor([[2, 0]]))
    assert filled[0, 0, 0] == 10.0  # seen entry
    assert filled[0, 0, 1] == pytest.approx(2.0)  # channel 1 of token 2 never kept: channel mean
    assert filled[0, 1, 0] == pytest.approx(4.0)  # token 0 unseen: channel mean (1+2+3+10)/4
    # many observations: EMA with momentum 0.9 forgets old values
    for _ in range(200):
        prior.observe_dense(tok, torch.full((1, 1, 2), 7.0))
    assert torch.allclose(prior.fill(tok), torch.full((1, 1, 2), 7.0), atol=1e-4)


def test_token_prior_validation_and_state() -> None:
    prior = TokenPrior(8, 4)
    with pytest.raises(TensorError, match=r"token id 8 out of range \[0, 8\)"):
        prior.fill(torch.tensor([[1, 8]]))
    with pytest.raises(TensorError, match="token id -1"):
        prior.observe_dense(torch.tensor([[-1]]), torch.zeros(1, 1, 4))
    with pytest.raises(TensorError, match=r"values.shape=\[1, 1, 3\]: expected \[1, 1, 4\]"):
        prior.observe_dense(torch.tensor([[1]]), torch.zeros(1, 1, 3))
    with pytest.raises(TensorError, match=r"keep.shape"):
        prior.observe(torch.tensor([[1]]), torch.zeros(1, 1, 4), torch.ones(1, 1, 3, dtype=torch.bool))
    with pytest.raises(TensorError, match="token_ids.shape"):
        prior.fill(torch.tensor([1, 2]))
    with pytest.raises(TensorError, match="1 of 4 entries are NaN"):
        prior.observe_dense(torch.tensor([[1]]), torch.tensor([[[0.0, float("nan"), 0.0, 0.0]]]))
    prior.observe_dense(torch.tensor([[1, 2]]), torch.randn(1, 2, 4))
    other = TokenPrior(8, 4)
    other.load_state_dict(prior.state_dict())
    tok = torch.tensor([[1, 2, 3]])
    assert torch.equal(other.fill(tok), prior.fill(tok))
    with pytest.raises(TensorError, match="hidden_size=4"):
        TokenPrior(8, 5).load_state_dict(prior.state_dict())
    bad = prior.state_dict()
    bad["mean"][0, 0] = float("inf")
    with pytest.raises(TensorError, match="mean"):
        other.load_state_dict(bad)
    with pytest.raises(ConfigError, match="momentum"):
        TokenPrior(8, 4, momentum=1.0)
